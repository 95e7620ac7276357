"""One process of an expert-parallel training run across processes (`launch/local.sh`).

    launch/local.sh 2 --devices_per_process 1 --module experiments.ep_worker -- \\
        --out DIR --variant adaptive_T0.1 --seed 0 --steps 600

starts two of these, one CPU device each, each pinned to its own core and joined over
127.0.0.1 (Gloo). The mesh's expert axis spans the processes: each holds half the experts
and half of every batch, and every MoE layer sends each token's rows to the process holding
its experts and the outputs back (`jax.lax.all_to_all`). A process computes its experts on
the rows they received, so the process whose experts received more rows finishes later and
the other waits for it in the exchange. experiments/ep_time_to_quality.py drives it.

Each step is timed on each process from dispatch until its new state is ready (the wall
time of the step, waiting included). Outside that timed region, per step: the routing the
step used (with --probe, the rows each expert received from each example in each MoE layer,
computed by a forward pass under the training gate on the parameters the step trains: no
router jitter or dropout, so the same routing), the curriculum's bookkeeping, and every
--eval_every steps the eval loss with the training gate and with top-1 gating plus the
share of tokens concentrated on their top-1 expert. In the --profile windows a jax.profiler
trace gives each process's time inside the train step's collectives, per step: all-to-all
(the expert exchange) and the rest (parameter all-gathers, gradient reductions).

Writes DIR/process_I.json; process 0 also DIR/steps.npz (per step: example ids, the
step's per-example top-2 fractions, and with --probe the rows per expert).
"""

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")
# The "concentrated on the top-1 expert" criteria (Li et al. 2023: at least 55% of tokens).
P1_CONCENTRATED = 0.5  # the top-1 expert holds at least half the router's probability
GAP_CONCENTRATED = 0.1  # the adaptive rule's normalised gap (time_to_target's criterion)


def overrides(args) -> list[str]:
    """The run's config: time_to_target's model at --layers MoE layers, the expert axis over
    the processes, a constant learning rate after warmup (a gate's loss curve then does not
    depend on how long it is trained: each gate can be trained until it reaches a target)."""
    from experiments.time_to_target import MODEL, VARIANTS

    return [
        *MODEL,
        *VARIANTS[args.variant],
        f"model.num_layers={args.layers}",
        "mesh.data=1",
        "mesh.expert=-1",  # every device: one expert group per process
        "optimizer.schedule=constant",
        f"optimizer.warmup_steps={args.warmup_steps}",
        f"train.steps={args.steps}",
        f"train.seed={args.seed}",
        f"data.curriculum={args.curriculum}",
        *args.set,
    ]


def probe_fn(spec, mesh, batch_shardings, param_shardings):
    """jitted (params, batch) -> (rows_MBE int32: kept assignments per example and expert under
    the training gate, p1_MBL: the top-1 router probability), replicated on every process."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxmoe.models.moe.layer import MoE
    from jaxmoe.models.spec import merge_model
    from jaxmoe.models.stack import stack_modules

    class RowsProbe(nnx.Module):
        def __init__(self, moe: MoE):
            self.moe = moe

        def __call__(self, x_BLD, *, train: bool, token_mask_BL=None):
            y_BLD, aux = self.moe(x_BLD, train=train, token_mask_BL=token_mask_BL)
            batch, length, _ = x_BLD.shape
            _, scores_TE, routing = self.moe.route(x_BLD, train=False, gate_cfg=self.moe.train_gate)
            kept_TKE = jax.nn.one_hot(routing.indices, self.moe.num_experts, dtype=jnp.int32)
            kept_TE = jnp.sum(kept_TKE * routing.mask[..., None], axis=1)
            rows_BE = jnp.sum(kept_TE.reshape(batch, length, -1), axis=1)
            p1_BL = jnp.max(scores_TE, axis=-1).reshape(batch, length)
            return y_BLD, {**aux, "rows_BE": rows_BE, "p1_BL": p1_BL}

    def probe(params, batch):
        model = merge_model(spec.graphdef, params, spec.rest)
        for block in stack_modules(model.layers):
            if isinstance(block.ffn, MoE):
                block.ffn = RowsProbe(block.ffn)
        packed = {}  # packed rows route as training routes them
        if "segment_ids" in batch:
            packed = {
                "segment_ids_BL": batch["segment_ids"],
                "positions_BL": batch.get("positions"),
            }
        _, aux = model(batch["inputs"], train=False, **packed)
        layers = list(aux)
        rows = jnp.stack([aux[i]["rows_BE"] for i in layers])
        return rows, jnp.stack([aux[i]["p1_BL"] for i in layers])

    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(probe, in_shardings=(param_shardings, batch_shardings), out_shardings=replicated)


def collective_ops(hlo_text: str) -> dict[str, str]:
    """{instruction name: collective kind} of a compiled program's collectives."""
    from benchmarks.step_profile import hlo_instructions

    instructions, _ = hlo_instructions(hlo_text)
    kinds = {}
    for name, (opcode, *_) in instructions.items():
        base = opcode.removesuffix("-start").removesuffix("-done")
        if base in COLLECTIVES:
            kinds[name] = "all-to-all" if base == "all-to-all" else "other"
    return kinds


def module_name(hlo_text: str) -> str:
    """'HloModule jit_train_step, ...' -> 'jit_train_step'."""
    first = hlo_text.split("\n", 1)[0].split()
    return first[1].rstrip(",") if len(first) > 1 else ""


def collective_seconds(events: list[dict], module: str, kinds: dict[str, str]) -> list[dict]:
    """Per execution of `module` in a trace (its run_id, in time order): seconds inside its
    all-to-all ops and inside its other collectives, and the execution's span."""
    runs = {}
    for event in events:
        event_args = event.get("args") or {}
        if event_args.get("hlo_module") != module:
            continue
        run = runs.setdefault(event_args.get("run_id"), {"all-to-all": 0.0, "other": 0.0})
        start, end = event["ts"] / 1e6, (event["ts"] + event.get("dur", 0.0)) / 1e6
        run["start"] = min(run.get("start", start), start)
        run["end"] = max(run.get("end", end), end)
        kind = kinds.get(event_args.get("hlo_op", ""))
        if kind:
            run[kind] += event.get("dur", 0.0) / 1e6
    ordered = sorted(runs.values(), key=lambda run: run["start"])
    return [
        {"all_to_all_s": r["all-to-all"], "other_collectives_s": r["other"],
         "span_s": r["end"] - r["start"]}
        for r in ordered
    ]  # fmt: skip


def parse_windows(text: str) -> list[tuple[int, int]]:
    """'100:8,300:8' -> [(100, 8), (300, 8)]: profile steps 101..108 and 301..308."""
    windows = []
    for part in filter(None, text.split(",")):
        start, _, count = part.partition(":")
        windows.append((int(start), int(count or 8)))
    return windows


class Run:
    """This process's share of the run: data, mesh, compiled step, evaluators, probe."""

    def __init__(self, args):
        import jax
        from jax.sharding import NamedSharding

        from experiments.time_to_target import Variant
        from jaxmoe.config.loading import load_config
        from jaxmoe.data.pipeline import build_data
        from jaxmoe.parallel.distributed import barrier
        from jaxmoe.parallel.mesh import make_mesh
        from jaxmoe.parallel.sharding import batch_spec
        from jaxmoe.training.curriculum_hooks import make_curriculum

        self.args = args
        config = load_config(str(ROOT / "configs" / "default.py"), overrides(args))
        self.mesh = make_mesh(config.mesh)
        self.data = build_data(
            config.data,
            config.train,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
            barrier=barrier,
        )
        config = config.replace(model=config.model.with_vocab(self.data.vocab_size))
        self.config = config
        self.eval_batches = self.data.eval_batches[: args.eval_batches or None]
        self.batch_shardings = {
            key: NamedSharding(
                self.mesh, batch_spec(self.mesh, np.ndim(v), config.train.batch_size)
            )
            for key, v in self.data.eval_batches[0].items()
        }
        shared = argparse.Namespace(
            vocab_size=self.data.vocab_size,
            eval_batches=self.eval_batches,
            batch_shardings=self.batch_shardings,
        )
        self.variant = Variant(args.variant, config, self.mesh, shared, None)
        self.moe = config.model.moe.num_experts > 0
        self.probe = None
        if self.moe:
            params = self.variant.shardings["params"]
            spec = self.variant._spec(self.mesh)
            self.probe = probe_fn(spec, self.mesh, self.batch_shardings, params)
        workdir = Path(args.out) / "workdir"
        self.curriculum = make_curriculum(
            config, str(workdir), self.data.train, self.batch_shardings
        )

    def global_batch(self, host_batch: dict) -> dict:
        from jaxmoe.training.evaluator import to_global

        return to_global(host_batch, self.batch_shardings)

    def evaluate(self, p1: bool = False) -> dict:
        """Eval loss (training gate, top-1 gate) and the concentrated shares per layer (with
        `p1` also the top-1 probability criterion's, an extra pass: at start and end)."""
        import jax

        out = self.variant.evaluate(self.eval_batches)
        if p1 and self.probe is not None:  # the top-1 probability criterion, real tokens
            above, total = None, 0.0
            with jax.set_mesh(self.mesh):
                for host_batch in self.eval_batches:
                    _, p1_MBL = self.probe(
                        self.variant.state["params"], self.global_batch(host_batch)
                    )
                    valid_BL = allgather(host_batch["weights"]) > 0
                    p1_MBL = np.asarray(p1_MBL)
                    counts = np.sum((p1_MBL >= P1_CONCENTRATED) & valid_BL, axis=(1, 2))
                    above = counts if above is None else above + counts
                    total += float(valid_BL.sum())
            out["p1_concentrated"] = {f"layer_{m}": float(c) / total for m, c in enumerate(above)}
        return out


def allgather(local: np.ndarray) -> np.ndarray:
    """This process's rows of a batch array -> the global batch's rows on every process."""
    import jax
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return np.asarray(local)
    return np.asarray(multihost_utils.process_allgather(np.asarray(local), tiled=True))


def train(run: Run, args, log) -> dict:
    import jax
    from jax.experimental import multihost_utils

    from jaxmoe.parallel.distributed import barrier

    windows = parse_windows(args.profile)
    first = run.global_batch(next(run.data.train))
    run.variant.start(args.seed, first)
    compiled = run.variant.compiled
    # Gloo connects the processes at their first collective and gives up after a while: a
    # process still compiling on a loaded core would make the other's connection time out.
    barrier("ep_worker_compiled", 1800)
    hlo = compiled.as_text()
    module, kinds = module_name(hlo), collective_ops(hlo)
    walls, cpus, evals, profiled = [], [], [], []
    record = {"example_ids": [], "routing_BM": [], "rows_MBE": []}
    curriculum_s = 0.0
    with jax.set_mesh(run.mesh):
        evals.append({"step": 0, **run.evaluate(p1=True)})
        batch, host_batch = first, None
        trace_dir, window = None, None
        for step in range(1, args.steps + 1):
            if step > 1:
                started = time.perf_counter()
                if run.curriculum:
                    run.curriculum.before_batch(run.variant.state["params"])
                curriculum_s += time.perf_counter() - started
                host_batch = next(run.data.train)
                batch = run.global_batch(host_batch)
            if args.probe and run.probe is not None:
                rows_MBE, _ = run.probe(run.variant.state["params"], batch)
                record["rows_MBE"].append(np.asarray(rows_MBE, np.int16))
            window = next((w for w in windows if w[0] < step <= w[0] + w[1]), None)
            if window and trace_dir is None:
                trace_dir = Path(args.out) / f"trace_{jax.process_index()}_{step}"
                jax.profiler.start_trace(str(trace_dir), create_perfetto_trace=True)
            start, start_cpu = time.perf_counter(), time.process_time()
            run.variant.state, metrics = compiled(run.variant.state, batch)
            jax.block_until_ready(run.variant.state)
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - start_cpu)
            if trace_dir is not None and step == window[0] + window[1]:
                jax.profiler.stop_trace()
                profiled.append(profile_window(trace_dir, module, kinds, window))
                trace_dir = None
            started = time.perf_counter()
            if run.curriculum:
                run.curriculum.observe(batch, metrics)
            curriculum_s += time.perf_counter() - started
            if run.moe:
                got = multihost_utils.process_allgather(
                    {"ids": batch["example_ids"], "routing": metrics["routing_BM"]}, tiled=True
                )
                record["example_ids"].append(np.asarray(got["ids"], np.int32))
                record["routing_BM"].append(np.asarray(got["routing"], np.float32))
            if step % args.eval_every == 0 or step == args.steps:
                evals.append({"step": step, **run.evaluate(p1=step == args.steps)})
                last, ms = evals[-1], 1e3 * np.median(walls[-args.eval_every :])
                log(f"step {step}: {ms:.0f} ms/step, eval loss {last['loss_own']:.4f} "
                    f"(top-1 {last['loss_top1']:.4f})")  # fmt: skip
    return {
        "walls": walls,
        "cpus": cpus,
        "evals": evals,
        "profile": profiled,
        "curriculum_host_s": curriculum_s,
        "record": record,
        "steps_per_epoch": int(run.data.train.steps_per_epoch),
        "collective_ops": len(kinds),
    }


def profile_window(trace_dir: Path, module: str, kinds: dict, window: tuple[int, int]) -> dict:
    """The window's per-step collective seconds (the trace folder is removed afterwards)."""
    from benchmarks.step_profile import trace_events

    try:
        steps = collective_seconds(trace_events(str(trace_dir)), module, kinds)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    return {"first_step": window[0] + 1, "steps": steps[-window[1] :]}


def parse_args(argv):
    from experiments.time_to_target import VARIANTS
    from jaxmoe.cli.flags import add_distributed_flags

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="this run's directory")
    p.add_argument("--variant", required=True, choices=list(VARIANTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--layers", type=int, default=6, help="decoder layers, every one MoE")
    p.add_argument("--warmup_steps", type=int, default=20)
    p.add_argument("--eval_every", type=int, default=20)
    p.add_argument("--eval_batches", type=int, default=3)
    p.add_argument("--curriculum", default="none", help="data.curriculum: none | paper | magnitude")
    p.add_argument("--probe", action="store_true", help="record the rows per expert every step")
    p.add_argument("--profile", default="", help="START:COUNT,...: profiled step windows")
    p.add_argument("--compile_cache", default="", help="JAX compilation cache directory")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    add_distributed_flags(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import jax

    from jaxmoe.cli.flags import initialize_from_flags
    from jaxmoe.parallel.host_memory import retain_freed_host_memory

    initialize_from_flags(args)
    retain_freed_host_memory()  # what `jaxmoe train` does on the CPU
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    index = jax.process_index()

    def log(message):
        if index == 0:
            print(f"{args.variant} seed {args.seed}: {message}", flush=True)

    run = Run(args)
    started = time.time()
    result = train(run, args, log)
    record = result.pop("record")
    m = run.config.model
    result |= {
        "process": index,
        "processes": jax.process_count(),
        "variant": args.variant,
        "gating": run.variant.gating,
        "seed": args.seed,
        "curriculum": args.curriculum,
        "cpu_affinity": sorted(os.sched_getaffinity(0)),
        "mesh": dict(run.mesh.shape),
        "model": f"{m.num_layers} layers, d {m.d_model}, {m.num_heads} heads / "
        f"{m.num_kv_heads} KV, {m.moe.num_experts} experts of {m.moe.ffn_dim}",
        "batch": f"{run.config.train.batch_size} x {run.config.train.seq_len} tokens",
        "wall_s": time.time() - started,
    }
    (out / f"process_{index}.json").write_text(json.dumps(result))
    if index == 0 and record["example_ids"]:
        arrays = {k: np.stack(v) for k, v in record.items() if v}
        np.savez_compressed(out / "steps.npz", **arrays)
    return 0


if __name__ == "__main__":
    sys.exit(main())
