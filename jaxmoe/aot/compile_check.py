"""`jaxmoe compile`: compile the real train step for a TPU pod or a GPU cluster, ahead of
time, anywhere.

The same model_spec / state_shardings / train_step that `jaxmoe train` jits are lowered with
abstract inputs (ShapeDtypeStructs carrying their shardings) on a mesh of compile-only
devices (libtpu's for TPU topologies, JAX's CUDA plugin's for GPU clusters), and compiled
by that platform's compiler on this host: no TPU or GPU is needed. The report says whether
one step fits in device memory and what it costs, before the machines are allocated.

    jaxmoe compile --config configs/t5_1_1_xxl_gqa8.py --topology v5p-128 [--num_slices 2]
        [--step_time 1.5] [--json] [--config.mesh.fsdp=32 ...]
    jaxmoe compile --config configs/mixtral_8x7b_adaptive.py:top2 --topology h100-32

Exit status: 0 the step fits, 2 it does not (out of memory) or the check failed.
"""

import contextlib
import math
import re
import time

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jaxmoe.aot.cost_estimate import count_while_loops, pallas_kernels, step_time_estimate
from jaxmoe.aot.gpu_topologies import GpuTopology, software_versions
from jaxmoe.aot.hlo_reading import (
    all_to_all_bytes,
    collectives_across,
    count_collectives,
    count_dcn_transfers,
    count_dot_types,
    gpu_kernels,
)
from jaxmoe.aot.topologies import Topology, parse_target, target_devices
from jaxmoe.errors import ConfigError
from jaxmoe.models.attention import AUTO
from jaxmoe.models.attention_kernel import fallback_counts
from jaxmoe.models.flops import train_flops_per_step
from jaxmoe.models.spec import model_spec
from jaxmoe.parallel.device_memory import state_bytes_per_device
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.parallel.sharding import batch_spec, data_parallel_size
from jaxmoe.training.lora_run import LoraSplit, lora_options
from jaxmoe.training.optimizer import make_optimizer
from jaxmoe.training.state import state_shardings
from jaxmoe.training.steps import jit_train_step, step_fns


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


def for_platform(config, platform: str):
    """A copy of `config` with what `jaxmoe train` decides at run time fixed as on
    `platform` ("tpu" or "gpu")."""
    model = config.model.replace(vocab_size=model_vocab_size(config))
    moe = model.moe
    if moe.num_experts and moe.dispatch == "auto":
        # "auto" picks by the default backend, which here is this host's CPU.
        from jaxmoe.models.moe.dispatch import resolve_dispatch

        dispatch = resolve_dispatch("auto", moe.capacity_factor, backend=platform)
        model = model.replace(moe=moe.replace(dispatch=dispatch))
    if model.attention_block == AUTO:
        model = model.replace(attention_block=0)  # what AUTO picks off CPU: dense attention
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
    """The jitted train step of `config` on `mesh`, state donated, with the model spec, the
    abstract state and batch it lowers for and its further arguments (a LoRA run's frozen
    base, training/lora_run.py: `step.lower(state, batch, *args)`); nothing is allocated."""
    lora = lora_options(config)
    spec = model_spec(config.model, mesh, lora=lora)
    trained, args = spec, ()
    if lora is not None:  # the state holds the adapters; the base is an argument
        split = LoraSplit.of(spec, lora, config.train.trainable, config.model, mesh)
        trained, args = split.trained_spec, ({"base": split.base_in_memory()},)
    optimizer, schedule = make_optimizer(config.optimizer, config.train.steps, trained.param_axes)
    abstract_state, shardings = state_shardings(mesh, trained, optimizer)
    batch = abstract_batch(config, mesh)
    fns = step_fns(config.train, config.optimizer, config.model, spec, optimizer, schedule)
    step = jit_train_step(
        fns,
        shardings,
        jax.tree.map(lambda b: b.sharding, batch),
        jax.tree.map(lambda a: a.sharding, args[0]) if args else None,
    )
    return step, spec, abstract_state, batch, args


def compile_for_topology(
    config, topology: str, num_slices: int = 1, step_time_s: float | None = None
) -> dict:
    """Compile one train step of `config` for `topology` (e.g. "v5p-128", "h100-32"); a
    report dict.

    `verdict` is "fits" or "oom"; memory figures are per device (one chip or GPU).
    Configuration mistakes raise ConfigError / ValueError; other compiler errors propagate.
    """
    topo = parse_target(topology, num_slices)
    started = time.perf_counter()
    devices, slice_ids = target_devices(topo)
    mesh = make_mesh(config.mesh, devices, slice_ids)
    dp = data_parallel_size(mesh)
    if config.train.batch_size % (dp * config.train.grad_accum):
        raise ConfigError(
            f"train.batch_size={config.train.batch_size} is not divisible by the data-parallel "
            f"size {dp} times train.grad_accum={config.train.grad_accum} (mesh {dict(mesh.shape)})"
        )
    config = for_platform(config, topo.platform)

    step, spec, abstract_state, batch, args = jitted_train_step(config, mesh)
    fallbacks_before = fallback_counts()
    with jax.set_mesh(mesh), _tracing_for(topo):
        lowered = step.lower(abstract_state, batch, *args)
    lowered_s = time.perf_counter() - started

    hbm = topo.hbm_bytes
    result = _describe(config, topo, mesh, spec, abstract_state, batch, step_time_s)
    if args:  # train.lora: the frozen base, beside the trained adapters' state
        result["frozen_base_bytes_per_device"] = state_bytes_per_device(args[0]["base"])
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
    cost = (cost[0] if isinstance(cost, list) else cost) or {}  # None: the CUDA plugin
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
        "hlo_flops_per_device": float(cost["flops"]) if "flops" in cost else None,
        **_estimate(result, cost, hlo_text, topo),
        "collectives": count_collectives(hlo_text),
        "dot_types": count_dot_types(hlo_text),
        "all_to_all_bytes": all_to_all_bytes(hlo_text),
        "dcn_transfers": count_dcn_transfers(hlo_text),
        **(_gpu_program(hlo_text, mesh, devices, slice_ids) if topo.platform == "gpu" else {}),
        "attention_fallbacks": sorted(
            reason for reason, n in fallback_counts().items() if n > fallbacks_before.get(reason, 0)
        ),
        "lower_s": lowered_s,
        "compile_s": time.perf_counter() - started - lowered_s,
    }
    return result


def _estimate(result: dict, cost: dict, hlo_text: str, topo: Topology | GpuTopology) -> dict:
    """The compiler's step-time estimate and its MFU, where it can be trusted
    (cost_estimate.py); `estimate_note` says why not otherwise."""
    seconds, note = step_time_estimate(cost, hlo_text)
    if not cost:
        note = "the compiler gives no cost analysis for these compile-only devices"
    peak = topo.num_chips * topo.peak_bf16_flops
    return {
        "optimal_seconds": cost.get("optimal_seconds"),
        "while_loops": count_while_loops(hlo_text),
        "pallas_kernels": pallas_kernels(hlo_text),
        "estimated_step_s": seconds,
        "estimated_mfu": result["model_flops_per_step"] / (seconds * peak) if seconds else None,
        "estimate_note": note,
    }


def _tracing_for(topo):
    """Where the trace asks the local device what a kernel takes, answers for the target:
    jax's cuDNN attention checks the GPU's compute capability (compat/private_apis.py)."""
    if not isinstance(topo, GpuTopology):
        return contextlib.nullcontext()
    from jaxmoe.compat.private_apis import cudnn_attention_for

    return cudnn_attention_for(topo.gpu.compute_capability)


def _gpu_facts(topo: GpuTopology) -> dict:
    """The GPU compiled for, the cluster's shape and the CUDA libraries compiled with."""
    gpu = topo.gpu
    return {
        "device_kind": gpu.device_kind,
        "compute_capability": ".".join(map(str, gpu.compute_capability)),
        "memory_bytes": gpu.memory_bytes,
        "memory_fraction": topo.memory_fraction,
        "hosts": topo.num_hosts,
        "gpus_per_host": topo.gpus_per_host,
        "nvlink_domains": topo.domains,
        **{name: ".".join(map(str, v)) for name, v in software_versions().items()},
    }


def _gpu_program(hlo_text: str, mesh: Mesh, devices: list, slice_ids: list[int]) -> dict:
    """cuDNN attention and grouped GEMMs in the program, and its collectives that leave a
    host (process) or an NVLink domain."""
    domain_of = {device.id: domain for device, domain in zip(devices, slice_ids, strict=True)}
    placed = list(mesh.devices.flat)  # SPMD partition i runs on placed[i]
    return {
        "gpu_kernels": gpu_kernels(hlo_text),
        "collectives_across_hosts": collectives_across(
            hlo_text, [device.process_index for device in placed]
        ),
        "collectives_across_domains": collectives_across(
            hlo_text, [domain_of[device.id] for device in placed]
        ),
    }


def _describe(
    config, topo: Topology | GpuTopology, mesh, spec, abstract_state, batch, step_time_s
) -> dict:
    """The parts of the report known before compiling: sizes, shardings, model FLOPs."""
    t = config.train
    length, enc_len = batch_lengths(config)
    flops = train_flops_per_step(config.model, t.batch_size, length, enc_len)
    peak_flops = topo.num_chips * topo.peak_bf16_flops
    params = jax.tree.leaves(spec.abstract_params)
    where = {"libtpu_topology": topo.device_topology}
    if isinstance(topo, GpuTopology):
        where = {"cuda_topology": topo.device_topology, "gpu": _gpu_facts(topo)}
    return {
        "platform": topo.platform,
        "topology": topo.name,
        "num_slices": topo.num_slices,
        "num_chips": topo.num_chips,
        **where,
        "mesh": dict(mesh.shape),
        "moe_dispatch": config.model.moe.dispatch if config.model.moe.num_experts else None,
        "moe_grouping": moe_grouping(config, mesh, length, topo.platform),
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


def moe_grouping(config, mesh, length: int, platform: str = "tpu") -> str | None:
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
        resolve_dispatch(moe.dispatch, moe.capacity_factor, backend=platform),
        tokens=max(tokens, 1),
        slots=num_slots(moe.gate),
        num_experts=moe.num_experts,
        block_size=moe.block_size,
        platform=platform,
    )
