"""Fine-grained MoE layers against the dense FFN of the same active width (moe_layer's suite).

Two layers of today's shapes, forward + backward (gradients of the parameters and the
input), float32, 4096 tokens (16 sequences of 256), d_model 512, SwiGLU, top-8 with the
weights renormalised (Qwen3-MoE's norm_topk_prob), random router (balanced on average):
  E=64  experts of FFN 256 (OLMoE's ratio)      vs a dense SwiGLU FFN of 8 x 256 = 2048
  E=128 experts of FFN 128 (Qwen3-MoE's ratio)  vs a dense SwiGLU FFN of 8 x 128 = 1024
The routed work of each MoE layer equals its dense FFN's, so the time ratio is the price
of dispatch (layout, gathers, scatter-adds, padding) plus the router.

    python -m benchmarks moe_layer --suite fine_grained [--json] [--rounds N]
Each MoE run is timed right between two runs of its dense FFN; the ratio is the median
over rounds of the run's time over the mean of its neighbours (robust to a drifting load);
times are minima. The 1-minute load average is recorded: "measured under load" when it
exceeds half the cores.
"""

import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from ml_collections import ConfigDict

from jaxmoe.config import typed
from jaxmoe.config.loading import load_config
from jaxmoe.models.layers import GatedMLP
from jaxmoe.models.moe.gates import num_slots
from jaxmoe.models.moe.grouping import grouping_summary
from jaxmoe.models.moe.layer import MoE

BATCH, LENGTH, D_MODEL, TOP_K = 16, 256, 512, 8
LAYERS = ((64, 256), (128, 128))  # (experts, expert FFN width)


def moe_config(experts: int, ffn: int, dispatch: str):
    root = Path(__file__).resolve().parents[1]
    cfg = ConfigDict(load_config(str(root / "configs" / "default.py")).model.to_dict())
    cfg.d_model, cfg.activation = D_MODEL, "silu"
    moe = cfg.moe
    moe.num_experts, moe.ffn_dim, moe.gating, moe.top_k = experts, ffn, "topk", TOP_K
    moe.renormalize, moe.capacity_factor, moe.jitter, moe.dispatch = True, 0.0, 0.0, dispatch
    moe.z_loss_weight = 0.0
    return typed({"model": cfg}).model


def fwd_bwd(module, cotangent):
    """A jitted (params, x) -> grads of sum(y * cotangent) (+ the balance loss for MoE)."""
    graphdef, params = nnx.split(module)

    @jax.jit
    def step(params, x):
        def loss(params, x):
            y, aux = nnx.merge(graphdef, params)(x, train=True)
            return jnp.sum(y * cotangent) + 0.001 * aux.get("balance_loss", 0.0)

        return jax.grad(loss, argnums=(0, 1))(params, x)

    return step, params


def interleaved(variants: dict, baseline_of: dict, rounds: int):
    """(best time, median ratio to the baseline's neighbouring runs) per non-baseline name."""
    best = dict.fromkeys(variants, float("inf"))

    def timed(name):
        step, params, x = variants[name]
        start = time.perf_counter()
        jax.block_until_ready(step(params, x))
        elapsed = time.perf_counter() - start
        best[name] = min(best[name], elapsed)
        return elapsed

    for name in variants:  # compile and warm
        timed(name)
    best = dict.fromkeys(variants, float("inf"))
    ratios = {name: [] for name in baseline_of}
    for _ in range(rounds):
        for name, base in baseline_of.items():
            before = timed(base)
            elapsed = timed(name)
            after = timed(base)
            ratios[name].append(elapsed / (0.5 * (before + after)))
    return best, {name: float(np.median(v)) for name, v in ratios.items()}


def run(rounds: int, dispatch: str) -> dict:
    load_before = os.getloadavg()[0]
    x = jax.random.normal(jax.random.key(0), (BATCH, LENGTH, D_MODEL))
    cotangent = jax.random.normal(jax.random.key(1), (BATCH, LENGTH, D_MODEL))
    variants, baseline_of, layers = {}, {}, []
    for experts, ffn in LAYERS:
        cfg = moe_config(experts, ffn, dispatch)
        layer = MoE.of_model(cfg, rngs=nnx.Rngs(0))
        dense = GatedMLP(D_MODEL, TOP_K * ffn, "silu", rngs=nnx.Rngs(0))
        name, base = f"moe_e{experts}_f{ffn}", f"dense_f{TOP_K * ffn}"
        variants[name] = (*fwd_bwd(layer, cotangent), x)
        variants[base] = (*fwd_bwd(dense, cotangent), x)
        baseline_of[name] = base
        slots = num_slots(cfg.moe.gate)
        summary = grouping_summary(
            layer.impl,
            tokens=BATCH * LENGTH,
            slots=slots,
            num_experts=experts,
            block_size=cfg.moe.block_size,
        )
        layers.append((name, base, experts, ffn, layer.impl, summary))
    best, ratio = interleaved(variants, baseline_of, rounds)
    load_after = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    rows = [
        {
            "layer": f"E={experts} top-{TOP_K}, expert FFN {ffn}",
            "dense_ffn": TOP_K * ffn,
            "dispatch": impl,
            "grouping": summary,
            "moe_time_s": best[name],
            "dense_time_s": best[base],
            "moe_over_dense": ratio[name],
        }
        for name, base, experts, ffn, impl, summary in layers
    ]
    return {
        "suite": "fine_grained",
        "rows": rows,
        "load_average_1min": {"before": load_before, "after": load_after},
        "cores": cores,
        "under_load": max(load_before, load_after) > cores / 2,
        "setup": {
            "tokens": BATCH * LENGTH,
            "d_model": D_MODEL,
            "top_k": TOP_K,
            "dtype": "float32",
            "backend": jax.default_backend(),
            "rounds": rounds,
        },
    }


def table(result: dict) -> str:
    from benchmarks.results import markdown_table

    header = ["layer (fwd+bwd)", "dispatch", "MoE", "dense FFN", "MoE / dense"]
    rows = [
        [
            r["layer"],
            r["grouping"],
            f"{r['moe_time_s'] * 1e3:.1f} ms",
            f"{r['dense_ffn']}: {r['dense_time_s'] * 1e3:.1f} ms",
            f"{r['moe_over_dense']:.2f}x",
        ]
        for r in result["rows"]
    ]
    load = result["load_average_1min"]
    note = (
        f"load average (1 min) {load['before']:.1f} -> {load['after']:.1f} on "
        f"{result['cores']} cores" + (": measured under load" if result["under_load"] else "")
    )
    return f"{markdown_table(header, rows)}\n\n{note}"
