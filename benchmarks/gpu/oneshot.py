"""One process on one GPU: does jaxmoe run there, is it right, and how fast is it against
PyTorch + transformers on the same models. Started by run.sh (benchmarks/gpu/run.sh), which
installs jaxmoe and the packages the image lacks into a private folder first.

    python oneshot.py --out gpu_oneshot.json [--dry-run] [--budget_s 450]

Parts, each with its own time budget inside the whole run's (a part that would start
after its share is spent is recorded as skipped, never half-run):
  1. jax sees a GPU;
  2. 5 training steps of a tiny model on the GPU and on the CPU: same seed, f32 with the
     highest matmul precision; the losses' largest relative difference must be < 1e-3;
  3. tokens/s and MFU, bf16 compute (f32 parameters and AdamW, full remat), of a dense
     Llama-style model and Mixtral-style top-2 and adaptive MoE models of ~2.4B parameters;
  4. the same models' step in PyTorch + transformers (SDPA attention, bf16 autocast,
     gradient checkpointing): eager, then torch.compile; the faster one is the peer.
  With each model of 3, the preflight checked: `jaxmoe compile`'s prediction for one GPU
  of the kind found (compiled for compile-only devices from jaxmoe's description of it,
  aot/gpu_topologies.py) against the peak memory the GPU measured (memory_stats()).
  Before 3, the attention kernel check: one bf16 attention of the dense model's shape
  through model.attention_kernel=auto (cuDNN flash attention on GPU) against jaxmoe's XLA
  path, outputs, gradients and forward + backward time. The models run with `auto`.
MFU = model FLOPs (jaxmoe/models/flops.py: forward + backward matmuls, no recompute) per
second over the GPU's peak dense bf16 FLOP/s (H100/H200: 989e12). `--dry-run` does all of it
but the GPU: imports, the CPU side of part 2, each size's config and FLOP count, one tiny
PyTorch step on the CPU, and the table.
"""

import argparse
import functools
import gc
import json
import math
import os
import signal
import sys
import time
import traceback

PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}
EQUALITY_STEPS, RTOL = 5, 1e-3
DRY_RUN_GPU = "NVIDIA H200 141GB HBM3e"  # the preflight the dry run checks: the image's GPU
WARMUP, TIMED = 2, 5

# Models of ~2.4B parameters that fill an H200 with AdamW state (16 bytes a parameter).
COMMON = {
    "model.vocab_size": 32768,
    "model.num_heads": 16,
    "model.num_kv_heads": 4,
    "model.head_dim": 128,
    "model.activation": "silu",
    "model.rope_theta": 10000.0,
    "model.tie_embeddings": False,
    "model.dtype": "bfloat16",
    "model.remat": "full",
    "model.attention_kernel": "auto",  # cuDNN flash attention on GPU (attention_kernel.py)
    "train.seq_len": 4096,
    "train.batch_size": 8,
    "optimizer.name": "adamw",
}
DENSE = {"model.d_model": 2560, "model.num_layers": 32, "model.ffn_dim": 6912}
MOE = {
    "model.d_model": 2048,
    "model.num_layers": 8,
    "model.moe.num_experts": 8,
    "model.moe.every": 1,
    "model.moe.ffn_dim": 5632,
    "model.moe.renormalize": True,
    "model.moe.single_weight": "one",
    "model.moe.capacity_factor": 0.0,
    "model.moe.balance_loss_weight": 0.01,
    "model.moe.z_loss_weight": 0.0,
}
MODELS = {
    "dense": {**COMMON, **DENSE, "model.moe.num_experts": 0},
    "top2": {**COMMON, **MOE, "model.moe.gating": "top2"},
    "adaptive": {**COMMON, **MOE, "model.moe.gating": "adaptive"},
}
# HF has no adaptive gate: its peer is Mixtral top-1, its cheaper bound (as train_throughput).
PEER_TOP_K = {"dense": 0, "top2": 2, "adaptive": 1}
# The tiny model of the equality check (and of the dry run's PyTorch step).
TINY = {
    **COMMON,
    **MOE,
    "model.vocab_size": 512,
    "model.d_model": 64,
    "model.num_layers": 2,
    "model.num_heads": 4,
    "model.num_kv_heads": 2,
    "model.head_dim": 16,
    "model.moe.ffn_dim": 128,
    "model.moe.num_experts": 4,
    "model.moe.gating": "top2",
    "model.dtype": "float32",
    "model.remat": "none",
    "train.seq_len": 64,
    "train.batch_size": 4,
}
# Seconds each part may start within (from the run's start); the whole run must end < 8 min.
SHARE = {"equality": 0.15, "aot": 0.45, "jaxmoe": 0.55, "torch": 0.95}


# The least time left in which a part is started (first compile and steps of a 2.4B model).
NEEDS_S = {"equality": 30.0, "aot": 90.0, "jaxmoe": 60.0, "torch": 45.0}


class TimeUp(Exception):
    """The run's hard deadline passed (SIGALRM): the part under way is abandoned."""


class Clock:
    """The run's time guard: parts start only within their share of the budget and with
    NEEDS_S left; past budget + grace, SIGALRM interrupts whatever runs (torch.compile's
    Python, or between device steps), so the JSON is still written in time."""

    def __init__(self, budget_s: float, grace_s: float = 20.0):
        self.start, self.budget = time.monotonic(), budget_s
        if hasattr(signal, "SIGALRM"):
            signal.signal(signal.SIGALRM, self._time_up)
            signal.alarm(int(budget_s + grace_s))

    @staticmethod
    def _time_up(signum, frame):
        raise TimeUp("stopped by the time guard")

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def allows(self, part: str) -> bool:
        now = self.elapsed()
        return now < SHARE[part] * self.budget and self.budget - now > NEEDS_S[part]

    def stop(self) -> None:
        if hasattr(signal, "SIGALRM"):
            signal.alarm(0)


def make_config(settings: dict):
    from jaxmoe.config.defaults import base_config
    from jaxmoe.config.loading import apply_overrides
    from jaxmoe.config.validation import validate

    config = base_config()
    apply_overrides(config, [f"{key}={value}" for key, value in settings.items()])
    return validate(config)


def parameter_count(config) -> int:
    from jaxmoe.checkpoints.trees import flatten
    from jaxmoe.models.spec import abstract_params
    from jaxmoe.models.stack import unrolled_config

    tree = abstract_params(unrolled_config(config.model))
    return sum(math.prod(leaf.shape) for leaf in flatten(tree).values())


def flops_per_step(config, top2_fraction: float | None) -> float:
    """Model FLOPs of a step; adaptive counted at its measured share of two-expert tokens."""
    from jaxmoe.models.flops import train_flops_per_step

    m, t = config.model, config.train
    if not m.moe.num_experts or m.moe.gate.gating != "adaptive":
        return train_flops_per_step(m, t.batch_size, t.seq_len)
    one, two = (m.replace(moe=m.moe.replace(gating=g)) for g in ("top1", "top2"))
    share = 1.0 if top2_fraction is None else top2_fraction
    low = train_flops_per_step(one, t.batch_size, t.seq_len)
    return low + share * (train_flops_per_step(two, t.batch_size, t.seq_len) - low)


class JaxSteps:
    """jaxmoe's train step on one device, jitted with the state's shardings and donation."""

    def __init__(self, config, device, seed: int = 0):
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec

        from jaxmoe.models.spec import model_spec
        from jaxmoe.parallel.mesh import make_mesh
        from jaxmoe.training.optimizer import make_optimizer
        from jaxmoe.training.state import init_state, state_shardings
        from jaxmoe.training.steps import step_fns, train_step

        self.jax, self.config = jax, config
        self.mesh = make_mesh(config.mesh, devices=[device])
        spec = model_spec(config.model, self.mesh)
        optimizer, schedule = make_optimizer(config.optimizer, config.train.steps, spec.param_axes)
        _, shardings = state_shardings(self.mesh, spec, optimizer)
        self.state = init_state(config.model, seed, optimizer, shardings, self.mesh)
        fns = step_fns(config.train, config.optimizer, config.model, spec, optimizer, schedule)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        self.step_fn = jax.jit(
            functools.partial(train_step, fns=fns),
            in_shardings=(shardings, replicated),
            out_shardings=(shardings, None),
            donate_argnums=0,
        )
        b, l, v = config.train.batch_size, config.train.seq_len, config.model.vocab_size
        # The batches come from numpy (the same ints on every backend), then go to the device.
        import numpy as np

        rng = np.random.default_rng(seed + 1)
        self.batches = []
        for _ in range(3):
            tokens = rng.integers(0, v, (b, l + 1), dtype=np.int32)
            batch = {
                "inputs": tokens[:, :-1],
                "targets": tokens[:, 1:],
                "weights": np.ones((b, l), np.float32),
            }
            self.batches.append(jax.device_put({k: jnp.asarray(x) for k, x in batch.items()}))
        self.count, self.metrics = 0, None

    def step(self) -> float:
        batch = self.batches[self.count % len(self.batches)]
        self.count += 1
        start = time.perf_counter()
        with self.jax.set_mesh(self.mesh):
            self.state, self.metrics = self.step_fn(self.state, batch)
        loss = float(self.metrics["loss"])  # waits for the step
        self.last_loss = loss
        return time.perf_counter() - start


def equality(device_kind: str) -> dict:
    """5 f32 steps of the tiny model on CPU and (unless dry) on `device_kind`: losses."""
    import jax

    config = make_config(TINY)
    losses = {}
    kinds = ["cpu"] if device_kind == "cpu" else [device_kind, "cpu"]
    with jax.default_matmul_precision("highest"):  # no TF32 on the GPU side
        for kind in kinds:
            steps = JaxSteps(config, jax.devices(kind)[0])
            losses[kind] = []
            for _ in range(EQUALITY_STEPS):
                steps.step()
                losses[kind].append(steps.last_loss)
    result = {"steps": EQUALITY_STEPS, "losses": losses, "parameters": parameter_count(config)}
    if len(kinds) == 2:
        pairs = zip(losses[device_kind], losses["cpu"], strict=True)
        worst = max(abs(a - b) / abs(b) for a, b in pairs)
        result |= {"max_rel_diff": worst, "passed": worst < RTOL}
    return result


# The attention check: bf16 q [B, L, H, d] and k/v [B, L, K, d] of the dense model (dry run:
# a small one on the CPU); outputs and gradients within ATTENTION_RTOL of the max |XLA|.
ATTENTION_SHAPE = {"gpu": (2, 4096, 16, 4, 128), "cpu": (1, 256, 4, 2, 64)}
ATTENTION_RTOL = 3e-2


def attention_check(platform: str) -> dict:
    """model.attention_kernel=auto vs jaxmoe's XLA path on one causal GQA attention."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxmoe.models import attention_kernel as ak
    from jaxmoe.models.attention import query_chunked_attention

    b, length, h, kv, d = ATTENTION_SHAPE[platform]
    logged_before = set(ak.fallbacks())
    kernel = ak.resolve_attention_kernel("auto", "gpu")  # what the GPU runs; CPU: XLA's lowering
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, length, h, d), jnp.bfloat16)
    k, v = (jax.random.normal(key, (b, length, kv, d), jnp.bfloat16) for key in keys[1:3])
    weights = jax.random.normal(keys[3], (b, length, h, d), jnp.float32)
    causal_1LS = jnp.tril(jnp.ones((length, length), bool))[None]

    def with_kernel(q, k, v):
        out = ak.kernel_attention(
            q, k, v, mask=None, causal=True, window=0, scale=d**-0.5, platform=platform
        )
        return query_chunked_attention(q, k, v, causal_1LS, scale=d**-0.5) if out is None else out

    def with_xla(q, k, v):
        return query_chunked_attention(q, k, v, causal_1LS, scale=d**-0.5)

    results, times = {}, {}
    for name, fn in (("kernel", with_kernel), ("xla", with_xla)):
        step = jax.jit(
            jax.value_and_grad(
                lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32) * weights),
                argnums=(0, 1, 2),
            )
        )
        jax.block_until_ready(step(q, k, v))  # compile
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            results[name] = jax.block_until_ready(step(q, k, v))
            runs.append(time.perf_counter() - start)
        times[name] = sorted(runs)[2]
    diffs = {}
    for part, got, want in zip("qkv", results["kernel"][1], results["xla"][1], strict=True):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        diffs[f"d{part}"] = float(np.abs(got - want).max() / np.abs(want).max())
    out_kernel, out_xla = (
        np.asarray(with_fn(q, k, v), np.float32)
        for with_fn in (jax.jit(with_kernel), jax.jit(with_xla))
    )
    diffs["out"] = float(np.abs(out_kernel - out_xla).max() / np.abs(out_xla).max())
    return {
        "shape_BLHKd": [b, length, h, kv, d],
        "kernel": kernel,
        "implementation": ak.implementation(platform) or "xla",
        "fallbacks": sorted(set(ak.fallbacks()) - logged_before),
        "max_rel_diff": diffs,
        "passed": max(diffs.values()) < ATTENTION_RTOL,
        "fwd_bwd_ms": {name: round(1e3 * t, 2) for name, t in times.items()},
    }


def aot_prediction(config, device_kind: str) -> dict:
    """What `jaxmoe compile` predicts for this step on one GPU of `device_kind`, compiled
    for a compile-only device (JAX's CUDA plugin, jaxmoe's description of the GPU)."""
    from jaxmoe.aot.gpu_topologies import cuda_plugin_installed
    from jaxmoe.parallel.chips import gpu_of_kind

    gpu = gpu_of_kind(device_kind)
    if gpu is None:
        return {"skipped": f"jaxmoe/parallel/chips.py does not describe {device_kind!r}"}
    if not cuda_plugin_installed():
        return {"skipped": "JAX's CUDA plugin is not installed"}
    from jaxmoe.aot.compile_check import compile_for_topology

    report = compile_for_topology(config, f"{gpu.name}-1")
    keys = ("verdict", "peak_hbm_bytes", "argument_bytes", "temp_bytes", "hbm_bytes")
    return {"topology": report["topology"], **{key: report[key] for key in keys}} | {
        "gpu_kernels": report["gpu_kernels"],
        "compile_s": round(report["lower_s"] + report["compile_s"], 1),
    }


def memory_check(predicted: dict, before: dict, after: dict) -> dict:
    """The GPU's measured peak (memory_stats) against the prediction. The peak counter never
    resets: it is this model's own only where it rose during this model's steps."""
    peak = after.get("peak_bytes_in_use", 0)
    result = {
        "measured_peak_bytes": peak,
        "peak_set_here": peak > before.get("peak_bytes_in_use", 0),
    }
    if "peak_hbm_bytes" in predicted and peak:
        result["measured_over_predicted"] = round(peak / predicted["peak_hbm_bytes"], 3)
    return result


def jaxmoe_throughput(name: str, peak: float, clock: Clock | None = None) -> dict:
    import jax

    from jaxmoe.models import attention_kernel

    config = make_config(MODELS[name])
    device = jax.devices("gpu")[0]
    predicted = {"skipped": "time budget spent"}
    if clock is None or clock.allows("aot"):
        try:
            predicted = aot_prediction(config, device.device_kind)
        except Exception as error:  # recorded: the run itself still tells what the step does
            predicted = {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    logged_before = set(attention_kernel.fallbacks())
    memory_before = device.memory_stats() or {}
    steps = JaxSteps(config, device)
    compile_s = steps.step()
    for _ in range(WARMUP - 1):
        steps.step()
    times = sorted(steps.step() for _ in range(TIMED))
    memory = memory_check(predicted, memory_before, device.memory_stats() or {})
    fraction = None
    if config.model.moe.num_experts:
        fraction = float(steps.metrics["top2_fraction"])
    del steps
    return timing_row(config, times, flops_per_step(config, fraction), peak) | {
        "first_step_s": round(compile_s, 1),
        "top2_fraction": fraction,
        "attention_kernel": attention_kernel.resolve_attention_kernel(
            config.model.attention_kernel, "gpu"
        ),
        "attention_fallbacks": sorted(set(attention_kernel.fallbacks()) - logged_before),
        "aot_prediction": predicted,
        "memory": memory,
    }


def timing_row(config, times: list[float], flops: float, peak: float) -> dict:
    median = times[len(times) // 2]
    tokens = config.train.batch_size * config.train.seq_len
    return {
        "step_s": round(median, 4),
        "tokens_per_s": round(tokens / median),
        "tflops_per_s": round(flops / median / 1e12, 1),
        "mfu": round(flops / median / peak, 4) if peak else None,
    }


def hf_model(config, top_k: int):
    """transformers' Llama (top_k 0) or Mixtral of the same sizes, SDPA attention."""
    import transformers

    m = config.model
    common = dict(
        vocab_size=m.vocab_size,
        hidden_size=m.d_model,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        max_position_embeddings=config.train.seq_len,
        rms_norm_eps=m.norm_eps,
        tie_word_embeddings=m.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        use_cache=False,
        attn_implementation="sdpa",
    )
    if top_k == 0:
        return transformers.LlamaForCausalLM(
            transformers.LlamaConfig(intermediate_size=m.ffn_dim, **common)
        )
    return transformers.MixtralForCausalLM(
        transformers.MixtralConfig(
            intermediate_size=m.moe.ffn_dim,
            num_local_experts=m.moe.num_experts,
            num_experts_per_tok=top_k,
            output_router_logits=m.moe.balance_loss_weight > 0,
            router_aux_loss_coef=m.moe.balance_loss_weight,
            **common,
        )
    )


def torch_steps(config, top_k: int, device: str, compiled: bool, count: int) -> list[float]:
    """Seconds of `count` PyTorch steps (the first includes torch.compile's compile)."""
    import torch

    torch.manual_seed(0)
    with torch.device(device):  # parameters made on the device: 2.4B on the CPU take minutes
        model = hf_model(config, top_k)
    model.train()
    if config.model.remat != "none":
        model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    b, l = config.train.batch_size, config.train.seq_len
    tokens = torch.randint(0, config.model.vocab_size, (b, l), device=device)
    forward = torch.compile(model) if compiled else model
    dtype = torch.bfloat16 if config.model.dtype == "bfloat16" else torch.float32
    times = []
    for _ in range(count):
        start = time.perf_counter()
        with torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32):
            loss = forward(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss.detach())  # waits for the step
        times.append(time.perf_counter() - start)
    del model, optimizer, forward
    if device == "cuda":
        torch.cuda.empty_cache()
    return times


def torch_throughput(name: str, peak: float, clock: Clock) -> dict:
    config = make_config(MODELS[name])
    flops = flops_per_step(config, None if PEER_TOP_K[name] != 1 else 0.0)
    rows = {}
    for compiled in (False, True):
        mode = "compile" if compiled else "eager"
        if not clock.allows("torch"):
            rows[mode] = {"skipped": "time budget spent"}
            continue
        try:
            times = torch_steps(config, PEER_TOP_K[name], "cuda", compiled, 1 + WARMUP + TIMED)
            rows[mode] = timing_row(config, sorted(times[1 + WARMUP :]), flops, peak)
        except (Exception, TimeUp) as error:  # an OOM or a compile failure: the peer's result
            rows[mode] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    timed = {mode: row for mode, row in rows.items() if "tokens_per_s" in row}
    best = max(timed, key=lambda mode: timed[mode]["tokens_per_s"]) if timed else None
    return {"modes": rows, "best": best, **(timed[best] if best else {})}


def gpu_peak(device) -> float:
    name = getattr(device, "device_kind", str(device))
    env = os.environ.get("PEAK_FLOPS")
    if env:
        return float(env)
    return next((flops for key, flops in PEAK_BF16.items() if key in name), 0.0)


def preflight_lines(result: dict) -> list[str]:
    """`jaxmoe compile`'s predicted peak per model against the GPU's measured one."""
    lines = []
    gib = 2**30
    for name, row in result["models"].items():
        aot, memory = row.get("jaxmoe", {}).get("aot_prediction", {}), row.get("jaxmoe", {})
        memory = memory.get("memory", {})
        if "peak_hbm_bytes" not in aot:
            if aot.get("error") or aot.get("skipped"):
                lines.append(f"preflight {name}: {aot.get('error') or aot.get('skipped')}")
            continue
        measured = memory.get("measured_peak_bytes", 0)
        own = "" if memory.get("peak_set_here") else " (an earlier model's peak)"
        lines.append(
            f"preflight {name} ({aot['topology']}): predicted {aot['peak_hbm_bytes'] / gib:.2f} "
            f"GiB, measured {measured / gib:.2f} GiB{own}"
        )
    tiny = result.get("aot_prediction_tiny", {})
    if "peak_hbm_bytes" in tiny:
        kernels = tiny["gpu_kernels"]
        lines.append(
            f"preflight of the tiny model for {tiny['topology']}: {tiny['verdict']}, "
            f"{tiny['peak_hbm_bytes'] / 2**20:.1f} MiB, cuDNN attention "
            f"{kernels['cudnn_attention_forward']} forward / "
            f"{kernels['cudnn_attention_backward']} backward"
        )
    elif tiny:
        lines.append(f"preflight of the tiny model: {tiny.get('skipped') or tiny.get('error')}")
    return lines


def table(result: dict) -> str:
    lines = [
        "| model | params | system | tokens/s | step s | TFLOP/s | MFU | jaxmoe / torch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in result["models"].items():
        jx, pt = row.get("jaxmoe", {}), row.get("torch", {})
        ratio = ""
        if jx.get("tokens_per_s") and pt.get("tokens_per_s"):
            ratio = f"{jx['tokens_per_s'] / pt['tokens_per_s']:.2f}x"
        for system, r in (("jaxmoe", jx), (f"torch {pt.get('best') or ''}".strip(), pt)):
            mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
            note = r.get("skipped") or r.get("error") or ""
            lines.append(
                f"| {name} | {row['parameters'] / 1e9:.2f}B | {system} | "
                f"{r.get('tokens_per_s', note or '-')} | {r.get('step_s', '-')} | "
                f"{r.get('tflops_per_s', '-')} | {mfu} | {ratio if system == 'jaxmoe' else ''} |"
            )
    lines += preflight_lines(result)
    eq = result["equality"]
    if "max_rel_diff" in eq:
        verdict = "passed" if eq["passed"] else "FAILED"
        lines.append(
            f"\nGPU vs CPU, {eq['steps']} f32 steps: max relative loss difference "
            f"{eq['max_rel_diff']:.2e} ({verdict}, < {RTOL})"
        )
    elif eq.get("losses"):
        lines.append(f"\nCPU side of the equality check: losses {eq['losses']['cpu']}")
    att = result.get("attention", {})
    if "max_rel_diff" in att:
        worst = max(att["max_rel_diff"].values())
        ms = att["fwd_bwd_ms"]
        lines.append(
            f"attention {att['kernel']} ({att['implementation']}) vs jaxmoe's XLA path, "
            f"bf16 {att['shape_BLHKd']}: "
            f"max relative difference {worst:.2e} ({'passed' if att['passed'] else 'FAILED'}, "
            f"< {ATTENTION_RTOL}); forward + backward {ms['kernel']} ms vs {ms['xla']} ms"
            + (f"; fell back: {att['fallbacks']}" if att["fallbacks"] else "")
        )
    elif att.get("error"):
        lines.append(f"attention kernel check: {att['error']}")
    return "\n".join(lines)


def run(args) -> dict:
    clock = Clock(args.budget_s)
    import jax

    import jaxmoe

    result = {
        "dry_run": args.dry_run,
        "versions": {"python": sys.version.split()[0], "jax": jax.__version__},
        "jaxmoe_from": os.path.dirname(jaxmoe.__file__),
        "models": {},
        "timings_s": {},
    }
    import torch
    import transformers

    result["versions"] |= {"torch": torch.__version__, "transformers": transformers.__version__}
    if args.dry_run:
        result["devices"] = [str(d) for d in jax.devices("cpu")]
        peak = 0.0
    else:
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        if not gpus:
            raise SystemExit(f"oneshot: jax sees no GPU (devices: {jax.devices()})")
        result["devices"] = [f"{d} ({d.device_kind})" for d in gpus]
        peak = gpu_peak(gpus[0])
        result["peak_bf16_flops"] = peak
    result["equality"] = equality("cpu" if args.dry_run else "gpu")
    result["timings_s"]["equality"] = round(clock.elapsed(), 1)
    if not args.dry_run and not result["equality"]["passed"]:
        print("oneshot: GPU and CPU losses differ", file=sys.stderr)
    try:
        if clock.allows("jaxmoe"):
            result["attention"] = attention_check("cpu" if args.dry_run else "gpu")
        else:
            result["attention"] = {"skipped": "time budget spent"}
    except (Exception, TimeUp) as error:  # recorded: the model runs still tell what the step does
        result["attention"] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
        traceback.print_exc()
    result["timings_s"]["attention"] = round(clock.elapsed(), 1)
    for name, settings in MODELS.items():
        config = make_config(settings)
        row = {"parameters": parameter_count(config), "flops_per_step": flops_per_step(config, 1.0)}
        result["models"][name] = row
        if args.dry_run:
            row["jaxmoe"] = {"skipped": "dry run"}
            row["torch"] = {"skipped": "dry run"}
        elif clock.allows("jaxmoe"):
            try:
                row["jaxmoe"] = jaxmoe_throughput(name, peak, clock)
            except (Exception, TimeUp) as error:
                row["jaxmoe"] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
                traceback.print_exc()
            gc.collect()  # the state's device buffers go back to JAX's pool
        else:
            row["jaxmoe"] = {"skipped": "time budget spent"}
        result["timings_s"][f"jaxmoe_{name}"] = round(clock.elapsed(), 1)
    if args.dry_run:  # the peer's code path, on a tiny model on the CPU
        try:  # the preflight's, for the image's GPU (where its CUDA plugin is importable)
            aot = aot_prediction(make_config({**TINY, "model.dtype": "bfloat16"}), DRY_RUN_GPU)
        except Exception as error:
            aot = {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
        result["aot_prediction_tiny"] = aot
        times = torch_steps(make_config(TINY), 2, "cpu", False, 2)
        result["torch_cpu_tiny_step_s"] = round(times[-1], 4)
    else:
        for name in MODELS:
            result["models"][name]["torch"] = torch_throughput(name, peak, clock)
            result["timings_s"][f"torch_{name}"] = round(clock.elapsed(), 1)
    if not args.dry_run:
        stats = jax.devices("gpu")[0].memory_stats() or {}
        result["jax_peak_gib"] = round(stats.get("peak_bytes_in_use", 0) / 2**30, 1)
    clock.stop()
    result["timings_s"]["total"] = round(clock.elapsed(), 1)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_oneshot.json", help="the JSON result")
    parser.add_argument("--dry-run", action="store_true", help="everything but the GPU")
    parser.add_argument(
        "--budget_s", type=float, default=450.0, help="the run's time guard (8 min with margin)"
    )
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # JAX takes GPU memory as it needs it (not 75% up front), so PyTorch, which runs after
    # jaxmoe's models in this process, finds the rest; set before jax is imported.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    result = run(args)
    with open(args.out, "w") as out:
        json.dump(result, out, indent=1)
    print(table(result))
    print(f"\nwrote {args.out} ({result['timings_s']['total']} s)")
    if not args.dry_run and not result["equality"].get("passed"):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
