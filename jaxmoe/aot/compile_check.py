"""`jaxmoe compile`: compile the real train step for a TPU topology, ahead of time, anywhere.

The same model_spec / state_shardings / train_step that `jaxmoe train` jits are lowered with
abstract inputs (ShapeDtypeStructs carrying their shardings) on a mesh of libtpu's
compile-only devices, and compiled by the TPU compiler on this host: no TPU is needed. The
report says whether one step fits in HBM and what it costs, before a pod is allocated.

    jaxmoe compile --config configs/t5_1_1_xxl_gqa8.py --topology v5p-128 [--num_slices 2]
        [--step_time 1.5] [--json] [--config.mesh.fsdp=32 ...]

Exit status: 0 the step fits, 2 it does not (out of memory) or the check failed.
"""

import functools
import math
import re
import time

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jaxmoe.aot.cost_estimate import count_while_loops, pallas_kernels, step_time_estimate
from jaxmoe.aot.topologies import Topology, parse_topology, topology_devices
from jaxmoe.errors import ConfigError
from jaxmoe.models.attention import AUTO
from jaxmoe.models.flops import train_flops_per_step
from jaxmoe.models.spec import model_spec
from jaxmoe.parallel.chips import GiB
from jaxmoe.parallel.device_memory import state_bytes_per_device
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.parallel.sharding import batch_spec, data_parallel_size
from jaxmoe.training.optimizer import make_optimizer
from jaxmoe.training.state import state_shardings
from jaxmoe.training.steps import step_fns, train_step

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",  # the expert-parallel exchange sized to the routing
    "collective-permute",
)


def model_vocab_size(config) -> int:
    """model.vocab_size, or (0) what `jaxmoe train` would take from the tokenizer."""
    if config.model.vocab_size:
        return config.model.vocab_size
    from jaxmoe.data.pipeline import model_vocab
    from jaxmoe.data.seq2seq import EXTRA_IDS

    if config.data.tokenizer:
        from jaxmoe.data.tokenizer import open_tokenizer

        tokenizer = open_tokenizer(config.data.tokenizer)
        return model_vocab(tokenizer, spans=config.span_corruption)
    # The size of the SentencePiece model train would fit, and span corruption's sentinels.
    return config.data.vocab_size + (EXTRA_IDS if config.span_corruption else 0)


def for_tpu(config):
    """A copy of `config` with what `jaxmoe train` decides at run time fixed as on a TPU."""
    model = config.model.replace(vocab_size=model_vocab_size(config))
    moe = model.moe
    if moe.num_experts and moe.dispatch == "auto":
        # "auto" picks by the default backend, which here is this host's CPU.
        from jaxmoe.models.moe.dispatch import resolve_dispatch

        dispatch = resolve_dispatch("auto", moe.capacity_factor, backend="tpu")
        model = model.replace(moe=moe.replace(dispatch=dispatch))
    if model.attention_block == AUTO:
        model = model.replace(attention_block=0)  # what AUTO picks on a TPU: dense attention
    return config.replace(model=model)


def batch_lengths(config) -> tuple[int, int | None]:
    """(decoder tokens, encoder tokens or None) per sequence of the pipeline's batches."""
    t = config.train
    if config.model.arch != "encoder_decoder":
        return t.seq_len, None
    # Span corruption (data/seq2seq.py): the encoder reads train.seq_len tokens and the
    # decoder length follows from the noise settings, computed as the pipeline does.
    from jaxmoe.data.seq2seq import corrupted_lengths, raw_length_for

    density = config.data.noise_density
    span = config.data.mean_noise_span
    return corrupted_lengths(raw_length_for(t.seq_len, density, span), density, span)[1], t.seq_len


def abstract_batch(config, mesh: Mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """One global batch as the data pipeline yields it, sharded over the batch axes."""
    b = config.train.batch_size
    length, encoder_length = batch_lengths(config)
    shapes = {
        "inputs": ((b, length), jnp.int32),
        "targets": ((b, length), jnp.int32),
        "weights": ((b, length), jnp.float32),
        "example_ids": ((b,), jnp.int32),
    }
    if encoder_length is not None:
        shapes["encoder_inputs"] = ((b, encoder_length), jnp.int32)
    return {
        key: jax.ShapeDtypeStruct(
            shape, dtype, sharding=NamedSharding(mesh, batch_spec(mesh, len(shape), shape[0]))
        )
        for key, (shape, dtype) in shapes.items()
    }


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Collective ops in a compiled HLO module, by kind (each op once, loops not unrolled).

    Counts plain and async (`-start`) ops, and the TPU's fused collectives (a kCustom fusion
    calling e.g. %all-reduce-scatter.3) by their fusion, not the ops inside them.
    """
    counts = dict.fromkeys(COLLECTIVES, 0)
    kind_of_name = [("all-reduce-scatter", "reduce-scatter")] + [(k, k) for k in COLLECTIVES]

    def kind(name: str) -> str | None:
        return next((k for prefix, k in kind_of_name if name.startswith(prefix)), None)

    fused_bodies = set()
    for match in re.finditer(r"^%([\w.-]+) \(", hlo_text, re.MULTILINE):
        if kind(match.group(1)):
            fused_bodies.add(match.group(1))
    body = None
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%([\w.-]+) \(", line)
        if header:
            body = header.group(1)
            continue
        if body in fused_bodies:
            continue
        called = re.search(r"\bcalls=%([\w.-]+)", line)
        if called and called.group(1) in fused_bodies:
            counts[kind(called.group(1))] += 1
            continue
        op = re.search(r"= .*?\s([a-z-]+)(?<!-done)\(", line)
        if op:
            name = op.group(1).removesuffix("-start")
            if name in counts:
                counts[name] += 1
    return counts


_DEFINITION = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = (\w+)\[", re.MULTILINE)
_TYPED = r"(?:(\w+)\[[^\]]*\](?:\{[^}]*\})? )?"  # an operand's type, where the text prints it
_DOT = re.compile(
    r"^\s*(?:ROOT )?%[\w.-]+ = (\w+)\[[^=]*? (?:dot|convolution|ragged-dot)\("
    + _TYPED
    + r"%([\w.-]+), "
    + _TYPED
    + r"%([\w.-]+)",
    re.MULTILINE,
)


def count_dot_types(hlo_text: str) -> dict[str, int]:
    """Matrix products in a compiled HLO module by operand and result types ("s8 x s8 ->
    s32": int8 products, "f8e4m3fn x f8e4m3fn -> f32": fp8 ones), fused bodies included,
    each instruction once (loops not unrolled): where model.quantization shows."""
    types = dict(_DEFINITION.findall(hlo_text))  # instruction names are unique per module
    counts: dict[str, int] = {}
    for out, lhs_type, lhs, rhs_type, rhs in _DOT.findall(hlo_text):
        lhs_type, rhs_type = lhs_type or types.get(lhs, "?"), rhs_type or types.get(rhs, "?")
        key = f"{lhs_type} x {rhs_type} -> {out}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}


def all_to_all_bytes(hlo_text: str) -> int:
    """Bytes the all-to-all ops' results hold, per device, each op once (loop bodies once).

    A padded all_to_all moves all of it whatever the routing. Ragged all-to-alls are left
    out: their output shapes only bound the rows that the routing moves at run time.
    """
    total = 0
    for result in re.findall(r"= (\(.*?\)|\S+) all-to-all(?:-start)?\(", hlo_text):
        for dtype, dims in re.findall(r"([a-z]+\d*)\[([\d,]*)\]", result):
            size = math.prod(int(d) for d in dims.split(",") if d)
            total += size * _DTYPE_BYTES.get(dtype, 8 if dtype.endswith("64") else 4)
    return total


def count_dcn_transfers(hlo_text: str) -> dict[str, int]:
    """Cross-slice (data-center network) transfers in a multislice program, by kind.

    The TPU compiler turns each slice's share of a cross-slice collective into a host
    transfer to the multislice runtime (a `send` tagged `_xla_megascale_transfer_type`,
    e.g. ALL_REDUCE); collectives inside a slice stay ordinary HLO collectives.
    """
    counts: dict[str, int] = {}
    for line in hlo_text.splitlines():
        if " send(" not in line:
            continue
        kind = re.search(r'_xla_megascale_transfer_type="(\w+)"', line)
        if kind:
            counts[kind.group(1)] = counts.get(kind.group(1), 0) + 1
    return counts


def _compile_error_numbers(message: str) -> dict:
    """Sizes named in a TPU out-of-memory message, as bytes ('95.74G' -> 95.74 GiB)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    sizes = [
        float(value) * units[unit]
        for value, unit in re.findall(r"\((\d+(?:\.\d+)?)([KMGT])\)", message)
    ]
    out = {}
    if len(sizes) >= 2:
        out = {"required_bytes": int(sizes[0]), "available_bytes": int(sizes[-1])}
    return out


def jitted_train_step(config, mesh: Mesh):
    """The jitted train step of `config` on `mesh`, state donated, with the model spec and
    the abstract state and batch it lowers for (nothing is allocated)."""
    spec = model_spec(config.model, mesh)
    optimizer, schedule = make_optimizer(config.optimizer, config.train.steps, spec.param_axes)
    abstract_state, shardings = state_shardings(mesh, spec, optimizer)
    batch = abstract_batch(config, mesh)
    step = jax.jit(
        functools.partial(
            train_step,
            fns=step_fns(config.train, config.optimizer, config.model, spec, optimizer, schedule),
        ),
        in_shardings=(shardings, jax.tree.map(lambda b: b.sharding, batch)),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )
    return step, spec, abstract_state, batch


def compile_for_topology(
    config, topology: str, num_slices: int = 1, step_time_s: float | None = None
) -> dict:
    """Compile one train step of `config` for `topology` (e.g. "v5p-128"); a report dict.

    `verdict` is "fits" or "oom"; memory figures are per device (one chip). Configuration
    mistakes raise ConfigError / ValueError; other compiler errors propagate.
    """
    topo = parse_topology(topology, num_slices)
    started = time.perf_counter()
    devices = topology_devices(topo)
    mesh = make_mesh(config.mesh, devices)
    dp = data_parallel_size(mesh)
    if config.train.batch_size % (dp * config.train.grad_accum):
        raise ConfigError(
            f"train.batch_size={config.train.batch_size} is not divisible by the data-parallel "
            f"size {dp} times train.grad_accum={config.train.grad_accum} (mesh {dict(mesh.shape)})"
        )
    config = for_tpu(config)

    step, spec, abstract_state, batch = jitted_train_step(config, mesh)
    with jax.set_mesh(mesh):
        lowered = step.lower(abstract_state, batch)
    lowered_s = time.perf_counter() - started

    hbm = topo.chip.hbm_bytes
    result = _describe(config, topo, mesh, spec, abstract_state, batch, step_time_s)
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as error:
        message = str(error)
        if "RESOURCE_EXHAUSTED" not in message:
            raise
        first = message.strip().splitlines()[0]
        numbers = _compile_error_numbers(first)
        result |= {"verdict": "oom", "error": first, "hbm_bytes": hbm, **numbers}
        result |= {"lower_s": lowered_s, "compile_s": time.perf_counter() - started - lowered_s}
        return result

    memory = compiled.memory_analysis()
    hlo_text = compiled.as_text()
    # What must be resident at the peak: inputs, outputs not aliased to (donated) inputs,
    # temporaries and the program itself.
    peak = (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
        + memory.generated_code_size_in_bytes
    )
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    result |= {
        "verdict": "fits" if peak <= hbm else "oom",
        "argument_bytes": int(memory.argument_size_in_bytes),
        "output_bytes": int(memory.output_size_in_bytes),
        "alias_bytes": int(memory.alias_size_in_bytes),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "code_bytes": int(memory.generated_code_size_in_bytes),
        "peak_hbm_bytes": int(peak),
        "hbm_bytes": hbm,
        "headroom_bytes": int(hbm - peak),
        "hlo_flops_per_device": float(cost.get("flops", 0.0)),
        **_estimate(result, cost, hlo_text, topo),
        "collectives": count_collectives(hlo_text),
        "dot_types": count_dot_types(hlo_text),
        "all_to_all_bytes": all_to_all_bytes(hlo_text),
        "dcn_transfers": count_dcn_transfers(hlo_text),
        "lower_s": lowered_s,
        "compile_s": time.perf_counter() - started - lowered_s,
    }
    return result


def _estimate(result: dict, cost: dict, hlo_text: str, topo: Topology) -> dict:
    """The compiler's step-time estimate and its MFU, where it can be trusted
    (cost_estimate.py); `estimate_note` says why not otherwise."""
    seconds, note = step_time_estimate(cost, hlo_text)
    peak = topo.num_chips * topo.chip.peak_bf16_flops
    return {
        "optimal_seconds": cost.get("optimal_seconds"),
        "while_loops": count_while_loops(hlo_text),
        "pallas_kernels": pallas_kernels(hlo_text),
        "estimated_step_s": seconds,
        "estimated_mfu": result["model_flops_per_step"] / (seconds * peak) if seconds else None,
        "estimate_note": note,
    }


def _describe(config, topo: Topology, mesh, spec, abstract_state, batch, step_time_s) -> dict:
    """The parts of the report known before compiling: sizes, shardings, model FLOPs."""
    t = config.train
    length, enc_len = batch_lengths(config)
    flops = train_flops_per_step(config.model, t.batch_size, length, enc_len)
    peak_flops = topo.num_chips * topo.chip.peak_bf16_flops
    params = jax.tree.leaves(spec.abstract_params)
    return {
        "topology": topo.name,
        "num_slices": topo.num_slices,
        "num_chips": topo.num_chips,
        "libtpu_topology": topo.libtpu_name,
        "mesh": dict(mesh.shape),
        "moe_dispatch": config.model.moe.dispatch if config.model.moe.num_experts else None,
        "moe_grouping": moe_grouping(config, mesh, length),
        "num_params": int(sum(math.prod(p.shape) for p in params)),
        "param_bytes_per_device": state_bytes_per_device(abstract_state["params"]),
        "optimizer_bytes_per_device": state_bytes_per_device(abstract_state["opt_state"]),
        "batch_bytes_per_device": state_bytes_per_device(batch),
        "tokens_per_step": t.batch_size * (length + (enc_len or 0)),
        "model_flops_per_step": flops,
        "step_time_s": step_time_s,
        "mfu": flops / (step_time_s * peak_flops) if step_time_s else None,
        # The step time at which the model FLOPs would run at the chips' bf16 peak.
        "ideal_step_time_s": flops / peak_flops,
    }


def moe_grouping(config, mesh, length: int) -> str | None:
    """How the MoE dispatch groups one device's rows (grouping.py), or None without MoE."""
    moe = config.model.moe
    if not moe.num_experts:
        return None
    from jaxmoe.models.moe.dispatch import resolve_dispatch
    from jaxmoe.models.moe.gates import num_slots
    from jaxmoe.models.moe.grouping import grouping_summary

    t = config.train
    tokens = t.batch_size * length // (data_parallel_size(mesh) * max(t.grad_accum, 1))
    return grouping_summary(
        resolve_dispatch(moe.dispatch, moe.capacity_factor, backend="tpu"),
        tokens=max(tokens, 1),
        slots=num_slots(moe.gate),
        num_experts=moe.num_experts,
        block_size=moe.block_size,
    )


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def format_report(result: dict, config_name: str = "") -> str:
    """The human-readable table `jaxmoe compile` prints."""
    mesh = " ".join(f"{axis}={size}" for axis, size in result["mesh"].items())
    slices = f" x {result['num_slices']} slices" if result["num_slices"] > 1 else ""
    rows = [
        ("config", config_name or "-"),
        (
            "topology",
            f"{result['topology']}{slices}: {result['num_chips']} chips "
            f"({result['libtpu_topology']})",
        ),
        ("mesh", mesh),
        *([("MoE grouping", result["moe_grouping"])] if result.get("moe_grouping") else []),
        ("parameters", f"{result['num_params'] / 1e9:.3f} B"),
        ("params / device", _gib(result["param_bytes_per_device"])),
        ("optimizer / device", _gib(result["optimizer_bytes_per_device"])),
        ("batch / device", _gib(result["batch_bytes_per_device"])),
    ]
    if "peak_hbm_bytes" in result:
        rows += [
            ("arguments / device", _gib(result["argument_bytes"])),
            ("temporaries / device", _gib(result["temp_bytes"])),
            (
                "peak HBM / device",
                f"{_gib(result['peak_hbm_bytes'])} of "
                f"{_gib(result['hbm_bytes'])} usable "
                f"({result['peak_hbm_bytes'] / result['hbm_bytes']:.0%})",
            ),
            ("headroom / device", _gib(result["headroom_bytes"])),
        ]
    rows.append(("model FLOPs / step", f"{result['model_flops_per_step']:.3e}"))
    if "hlo_flops_per_device" in result:
        hlo = result["hlo_flops_per_device"] * result["num_chips"]
        rows.append(("compiled FLOPs / step", f"{hlo:.3e} (loop bodies counted once)"))
    if result.get("pallas_kernels"):
        kernels = ", ".join(f"{k} {v}" for k, v in sorted(result["pallas_kernels"].items()))
        rows.append(("Pallas kernels", kernels))
    if "estimate_note" in result:
        if result["estimated_step_s"]:
            estimate = f"{result['estimated_step_s']:.3g} s (MFU {result['estimated_mfu']:.1%})"
        else:
            estimate = f"n/a: {result['estimate_note']}"
        rows.append(("compiler's step estimate", estimate))
    if result["mfu"] is not None:
        rows.append((f"MFU at {result['step_time_s']:g} s/step", f"{result['mfu']:.1%}"))
    rows.append(("step time at 100% MFU", f"{result['ideal_step_time_s']:.3g} s"))
    if "collectives" in result:
        rows.append(
            ("collectives", ", ".join(f"{k} {v}" for k, v in result["collectives"].items()))
        )
    if result.get("all_to_all_bytes"):
        size = result["all_to_all_bytes"]
        text = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.1f} KiB"
        rows.append(("all-to-all / device", text))
    if result.get("dcn_transfers"):
        transfers = ", ".join(f"{k.lower()} {v}" for k, v in result["dcn_transfers"].items())
        rows.append(("across slices (DCN)", transfers))
    if "error" in result:
        rows.append(("compiler", result["error"]))
    rows.append(("compile time", f"{result['lower_s']:.1f} s lower + {result['compile_s']:.1f} s"))
    width = max(len(name) for name, _ in rows)
    lines = [f"  {name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines) + "\n" + verdict_line(result)


def verdict_line(result: dict) -> str:
    where = f"{result['topology']}" + (
        f" x {result['num_slices']}" if result["num_slices"] > 1 else ""
    )
    if result["verdict"] == "fits":
        return (
            f"verdict: fits on {where}: peak {_gib(result['peak_hbm_bytes'])} of "
            f"{_gib(result['hbm_bytes'])} HBM per chip, headroom {_gib(result['headroom_bytes'])}"
        )
    state = result["param_bytes_per_device"] + result["optimizer_bytes_per_device"]
    need = result.get("required_bytes", result.get("peak_hbm_bytes"))
    needs = f"needs {_gib(need)}" if need else "does not fit"
    return (
        f"verdict: OUT OF MEMORY on {where}: {needs} per chip, {_gib(result['hbm_bytes'])} "
        f"usable (params+optimizer alone {_gib(state)}); shard more (mesh.fsdp / "
        f"mesh.tensor / mesh.expert), raise train.grad_accum or set model.remat=full"
    )
