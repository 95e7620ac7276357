"""Where a CPU train step's time goes, in jaxmoe and in transformers, by kind of work.

jaxmoe's step (the train_throughput worker's, jitted as `jaxmoe train` jits it) is traced
with `jax.profiler`; every op event of the trace is matched to its instruction in the
compiled HLO, whose metadata names the jaxmoe source file and the JAX operation it came
from. transformers' step (the same model, batch and AdamW as train_throughput's peer) is
traced with `torch.profiler`; every ATen op's own CPU time is counted. Both are sorted
into the same kinds: matrix products, attention kernels, gathers and scatters, copies and
layout changes, the optimizer, and the remaining elementwise ops and reductions; jaxmoe's
time is further split by source module, forward and backward. Each system runs in its own
process (`--worker jax|torch`, never importing the other), one after the other.

Op times are summed over threads, so on 2 cores a step's op time can exceed its wall time;
"outside ops" is the wall time in which no op ran at all (the union of the ops' intervals
taken from the step time): dispatch, thread hand-offs, Python.
Shares are the useful numbers; a run under load changes them little but its times a lot.

    python -m benchmarks step_profile --variant top2
    python -m benchmarks step_profile --variant dense --steps 5 --json
"""

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict

from benchmarks.peer_harness import is_quiet, load_average, run_worker
from benchmarks.results import add_json_flag, markdown_table, publish
from benchmarks.worker_protocol import emit, imported_frameworks

KINDS = ("matmul", "attention kernel", "gather/scatter", "copy/layout", "optimizer", "other")
PEER_OF = {"top2": "top2", "top1": "top1", "adaptive": "top1", "dense": "dense",
           "fine_grained": "fine_grained"}  # fmt: skip

# ATen ops by kind (self CPU time); anything else is "other" (elementwise, reductions).
TORCH_MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm",
                "aten::addbmm", "aten::dot", "aten::mv"}  # fmt: skip
TORCH_GATHER = ("index", "gather", "scatter", "nonzero", "where", "sort", "topk", "one_hot",
                "masked", "embedding", "take", "histc", "bincount")  # fmt: skip
TORCH_COPY = ("copy_", "contiguous", "clone", "cat", "stack", "to_copy", "fill_", "zero_",
              "empty", "resize_", "pad")  # fmt: skip


OPTIMIZER_PREFIX = "AdamW.step/"


def torch_kind(name: str) -> str:
    if name.startswith(OPTIMIZER_PREFIX):
        return "optimizer"
    if name in TORCH_MATMUL:
        return "matmul"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention kernel"
    if "_foreach_" in name or "fused_adam" in name:
        return "optimizer"
    bare = name.removeprefix("aten::")
    if any(word in bare for word in TORCH_GATHER):
        return "gather/scatter"
    if any(bare.startswith(word) or bare == word for word in TORCH_COPY):
        return "copy/layout"
    return "other"


def torch_worker(args) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.throughput_hf import HFRunner

    spec = json.loads(args.spec)
    runner = HFRunner(spec, PEER_OF[args.variant], args.steps + args.warmup, args.threads)
    for _ in range(args.warmup):
        runner.step()
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        walls = [runner.step() for _ in range(args.steps)]
    events = trace.events()
    # torch's AdamW on the CPU runs plain per-tensor ops (mul_, lerp_, sqrt, ...): they are
    # the optimizer's when they run inside the profiler's `Optimizer.step#AdamW.step` range.
    steps = [e.time_range for e in events if e.name.startswith("Optimizer.step")]
    by_op, threads, spans = defaultdict(float), set(), []
    for event in events:
        if event.name.startswith("aten::") and event.self_cpu_time_total > 0:
            start, end = event.time_range.start, event.time_range.end
            in_optimizer = any(r.start <= start and end <= r.end for r in steps)
            name = f"{OPTIMIZER_PREFIX}{event.name}" if in_optimizer else event.name
            by_op[name] += event.self_cpu_time_total / 1e6
            threads.add(event.thread)
            spans.append((start / 1e6, end / 1e6))
    per_step = {name: t / args.steps for name, t in by_op.items()}
    result = summary("hf", walls, per_step, torch_kind, len(threads), {"torch": torch.__version__})
    result["outside_ops_s"] = max(result["wall_s"] - covered(spans) / args.steps, 0.0)
    emit(result | {"imported": imported_frameworks()})


def summary(system, walls, op_seconds, kind_of, threads, versions, modules=None) -> dict:
    """Per step: wall time, op time by kind, the largest ops; `modules` (jaxmoe) by source."""
    kinds = defaultdict(float)
    for name, seconds in op_seconds.items():
        kinds[kind_of(name)] += seconds
    op_total = sum(op_seconds.values())
    wall = statistics.median(walls)
    top = sorted(op_seconds.items(), key=lambda item: -item[1])[:12]
    result = {
        "system": system,
        "wall_s": wall,
        "op_s": op_total,
        "op_threads": threads,
        "kinds_s": {kind: kinds.get(kind, 0.0) for kind in KINDS},
        "top_ops_s": dict(top),
        "versions": versions,
    }
    if modules is not None:
        result["modules_s"] = dict(sorted(modules.items(), key=lambda item: -item[1]))
    return result


def hlo_instructions(text: str) -> tuple[dict, dict]:
    """From compiled HLO text: instruction name -> (opcode, called computation, op_name,
    source file), and computation name -> the opcodes inside it.

    The source file is the metadata's `source_file`, or (newer jaxlibs) the file of the
    innermost frame its `stack_frame_id` names in the module's StackFrames table.
    """
    files = stack_frame_files(text)
    instructions, computations = {}, {}
    current = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.endswith("{") and "=" not in stripped.split("(", 1)[0]:
            current = stripped.split()[1 if stripped.startswith("ENTRY") else 0].lstrip("%")
            computations[current] = set()
            continue
        name, sep, rest = stripped.removeprefix("ROOT ").partition(" = ")
        if not sep:
            continue
        opcode = opcode_of(rest)
        if current is not None:
            computations[current].add(opcode)
        called = _attribute(rest, "calls=")
        op_name = _attribute(rest, 'op_name="', end='"')
        source = _attribute(rest, 'source_file="', end='"')
        if not source:
            frame = _attribute(rest, "stack_frame_id=", end="}").split()
            source = files.get(frame[0] if frame else "", "")
        instructions[name.lstrip("%")] = (opcode, called, op_name, source)
    return instructions, computations


def stack_frame_files(text: str) -> dict[str, str]:
    """Stack frame id -> its file, from the FileNames, FileLocations and StackFrames tables
    that newer jaxlibs print after the module header."""
    tables, table = defaultdict(dict), None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            table = line
        elif table is not None and line[:1].isdigit():
            key, _, value = line.partition(" ")
            tables[table][key] = value
        elif line.strip():  # the computations start: no more tables
            table = None
    files = {key: value.strip('"') for key, value in tables["FileNames"].items()}
    location_file = {
        key: files.get(_attribute(value, "file_name_id=", end=" "), "")
        for key, value in tables["FileLocations"].items()
    }
    return {
        key: location_file.get(_attribute(value, "file_location_id=", end=" "), "")
        for key, value in tables["StackFrames"].items()
    }


def opcode_of(rest: str) -> str:
    """'f32[2,3]{1,0} fusion(f32[...] %p), kind=...' -> 'fusion' (tuple shapes included)."""
    depth = 0
    for index, char in enumerate(rest):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == " " and depth == 0:
            return rest[index + 1 :].split("(", 1)[0]
    return ""


def _attribute(text: str, key: str, end: str = ",") -> str:
    start = text.find(key)
    if start < 0:
        return ""
    value = text[start + len(key) :]
    stop = value.find(end)
    return (value if stop < 0 else value[:stop]).strip("%} ")


MATMUL_OPS = {"dot", "convolution"}
GATHER_OPS = {"gather", "scatter", "dynamic-slice", "dynamic-update-slice", "sort"}
LAYOUT_OPS = {"copy", "transpose", "bitcast", "reshape", "broadcast", "parameter", "tuple",
              "get-tuple-element", "slice", "concatenate", "pad"}  # fmt: skip


def jax_kind(instruction, computations) -> str:
    opcode, called, op_name, source = instruction
    inside = computations.get(called, set()) | {opcode}
    if "optax" in source or "optimizer" in source or "adam" in op_name.lower():
        return "optimizer"
    if inside & MATMUL_OPS:
        return "matmul"
    if inside & GATHER_OPS:
        return "gather/scatter"
    if inside <= LAYOUT_OPS | {"fusion"}:
        return "copy/layout"
    return "other"


def jax_place(instruction) -> str:
    """'grouped_ffn.py backward': the op's jaxmoe (or library) source file and its pass."""
    _, _, op_name, source = instruction
    where = os.path.basename(source) or "(no source)"
    return f"{where} {'backward' if 'transpose(' in op_name else 'forward'}"


def trace_events(directory: str) -> list[dict]:
    """The complete ('X') events of the perfetto trace jax.profiler wrote under `directory`."""
    import glob
    import gzip

    paths = glob.glob(os.path.join(directory, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise RuntimeError(f"no perfetto_trace.json.gz under {directory}")
    with gzip.open(max(paths, key=os.path.getmtime)) as handle:
        trace = json.load(handle)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X"]


def jax_worker(args) -> None:
    import tempfile

    import jax
    import jaxlib

    from benchmarks.throughput_jaxmoe import JaxRunner, peer_spec, variant_config
    from jaxmoe.parallel.host_memory import retain_freed_host_memory
    from jaxmoe.parallel.platforms import skip_absent_tpu

    skip_absent_tpu()
    retain_freed_host_memory()
    config = variant_config(args.variant, [])
    runner = JaxRunner(config, args.steps + args.warmup)
    for _ in range(args.warmup):
        runner.step()
    with jax.set_mesh(runner.mesh):
        compiled = runner.step_fn.lower(runner.state, runner.batches[0]).compile()
    instructions, computations = hlo_instructions(compiled.as_text())
    with tempfile.TemporaryDirectory() as directory:
        jax.profiler.start_trace(directory, create_perfetto_trace=True)
        walls = [runner.step() for _ in range(args.steps)]
        jax.profiler.stop_trace()
        events = trace_events(directory)
    by_op, places, threads, spans = defaultdict(float), defaultdict(float), set(), []
    for event in events:
        name = (event.get("args") or {}).get("hlo_op") or event["name"]
        instruction = instructions.get(name)
        if instruction is None:
            continue
        seconds = event["dur"] / 1e6 / args.steps
        by_op[name] += seconds
        places[jax_place(instruction)] += seconds
        threads.add((event.get("pid"), event.get("tid")))
        spans.append((event["ts"] / 1e6, (event["ts"] + event["dur"]) / 1e6))
    kinds = {name: jax_kind(instructions[name], computations) for name in by_op}
    versions = {"jax": jax.__version__, "jaxlib": jaxlib.__version__}
    result = summary("jaxmoe", walls, by_op, kinds.get, len(threads), versions, places)
    # Time in which no op ran at all (thread hand-offs, the runtime between thunks).
    result["outside_ops_s"] = max(result["wall_s"] - covered(spans) / args.steps, 0.0)
    result["spec"] = peer_spec(config)
    emit(result | {"imported": imported_frameworks()})


def covered(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def run(args) -> dict:
    loads = [load_average()]
    common = [f"--variant={args.variant}", f"--steps={args.steps}", f"--warmup={args.warmup}"]
    (jax_result,) = run_worker("step_profile", ["--worker=jax", *common])
    loads.append(load_average())
    spec = json.dumps(jax_result.pop("spec"))
    torch_args = ["--worker=torch", f"--spec={spec}", f"--threads={args.threads}", *common]
    (torch_result,) = run_worker("step_profile", torch_args)
    loads.append(load_average())
    for result, expected in ((jax_result, ["jax", "jaxmoe"]), (torch_result, ["torch"])):
        if result.pop("imported") != expected:
            raise RuntimeError(f"{result['system']} worker imported the other framework")
    cores = os.cpu_count() or 1
    return {
        "variant": args.variant,
        "peer": PEER_OF[args.variant],
        "steps": args.steps,
        "systems": [jax_result, torch_result],
        "load_average_1min": {"before": loads[0], "during": loads[1:]},
        "quiet": is_quiet(loads, own_threads=max(cores, args.threads)),
    }


def table(result: dict) -> str:
    jax_result, torch_result = result["systems"]
    rows = []
    for kind in KINDS:
        row = [kind]
        for system in (jax_result, torch_result):
            seconds = system["kinds_s"][kind]
            row += [f"{seconds * 1e3:.1f}", f"{seconds / system['op_s']:.0%}"]
        rows.append(row)
    for label, key in (("all ops (thread time)", "op_s"), ("outside ops", "outside_ops_s"),
                       ("wall", "wall_s")):  # fmt: skip
        rows.append(
            [label, f"{jax_result[key] * 1e3:.1f}", None, f"{torch_result[key] * 1e3:.1f}", None]
        )
    header = ["kind (per step)", "jaxmoe ms", "share", f"HF {result['peer']} ms", "share"]
    lines = [markdown_table(header, rows), ""]
    places = list(jax_result["modules_s"].items())[:12]
    lines.append(markdown_table(["jaxmoe source, pass", "ms per step"],
                                [[p, f"{s * 1e3:.1f}"] for p, s in places]))  # fmt: skip
    lines.append("")
    top = [[name, f"{s * 1e3:.1f}"] for name, s in torch_result["top_ops_s"].items()]
    lines.append(markdown_table(["HF ATen op (self time)", "ms per step"], top))
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="top2", choices=list(PEER_OF))
    parser.add_argument("--steps", type=int, default=5, help="traced steps")
    parser.add_argument("--warmup", type=int, default=3, help="untraced steps first")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    parser.add_argument("--worker", choices=("jax", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    add_json_flag(parser)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker == "jax":
        jax_worker(args)
    elif args.worker == "torch":
        torch_worker(args)
    else:
        result = run(args)
        publish(f"step_profile-{args.variant}", result, table(result), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
