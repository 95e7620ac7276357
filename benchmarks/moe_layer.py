"""The paper's Table 1 on this machine: MoE-layer time against the share of one-expert tokens.

One MoE layer (N = 4096 tokens as 16 sequences of 256, D = 256, F = 1024, 8 SwiGLU experts,
float32), forward + backward (gradients of the parameters and the input). The router is
set so that a chosen share of the tokens has a clear top-1 expert (the adaptive gate sends
them to one expert) and the rest a near tie (two experts); every token's two best experts
are drawn at random, so expert loads are balanced as under a trained, balanced router.
Times are normalised to the same layer and inputs under top-2 gating; the compute ratio is
the share of (token, expert) assignments left. Also: jaxmoe's dropless top-2 layer against
a GShard-style fixed-capacity (factor 1.25) top-2 layer.

    python -m benchmarks moe_layer           # table
    python -m benchmarks moe_layer --json    # + docs/results/DATE-moe_layer.json
    python -m benchmarks moe_layer --suite fine_grained --json
        # E=64 / E=128 top-8 layers against the dense FFN of the same active width
        # (moe_layer_fine_grained.py): docs/results/DATE-moe_layer_fine_grained.json
Each variant is compiled first, then timed in rounds, each run between two runs of the top-2
layer; a ratio is the median over rounds of the run's time over the mean of its two
neighbours (robust to the drifting load of a shared machine); times are minima.
"""

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from ml_collections import ConfigDict

from benchmarks import moe_layer_fine_grained
from benchmarks.results import add_json_flag, markdown_table, publish
from jaxmoe.config import typed
from jaxmoe.config.loading import load_config
from jaxmoe.models.moe.layer import MoE

SHARES = (1.0, 0.8, 0.5, 0.2, 0.0)
BATCH, LENGTH, D_MODEL, FFN, EXPERTS = 16, 256, 256, 1024, 8
CLEAR_GAP, NEAR_TIE = 1.5, 0.02  # logit gaps top-1 - top-2: adaptive gap 0.64 / 0.01


@dataclass(frozen=True)
class LayerShape:
    """The timed layer's sizes (default: the Table 1 layer above; stragglers.py times a
    data-parallel shard of its own model)."""

    batch: int = BATCH
    length: int = LENGTH
    d_model: int = D_MODEL
    ffn: int = FFN
    experts: int = EXPERTS


TABLE1 = LayerShape()


def model_config(gating: str, dispatch: str, capacity_factor: float, block_size: int, shape=TABLE1):
    root = Path(__file__).resolve().parents[1]
    cfg = ConfigDict(load_config(str(root / "configs" / "default.py")).model.to_dict())
    cfg.d_model = shape.d_model
    cfg.activation = "silu"
    moe = cfg.moe
    moe.num_experts, moe.ffn_dim, moe.gating, moe.threshold = shape.experts, shape.ffn, gating, 0.1
    moe.gap_normalization, moe.capacity_factor, moe.jitter = "top2", capacity_factor, 0.0
    moe.dispatch, moe.block_size = dispatch, block_size
    return typed({"model": cfg}).model


def forced_inputs(share: float, seed: int = 0, shape=TABLE1):
    """x_BLD whose first E features are the router logits (the router reads them 1:1)."""
    rng = np.random.default_rng(seed)
    tokens, experts = shape.batch * shape.length, shape.experts
    first = rng.integers(0, experts, tokens)
    second = (first + rng.integers(1, experts, tokens)) % experts
    single = rng.permutation(tokens) < round(share * tokens)
    logits = np.zeros((tokens, experts), np.float32)
    logits[np.arange(tokens), first] = 3.0
    logits[np.arange(tokens), second] = 3.0 - np.where(single, CLEAR_GAP, NEAR_TIE)
    x = rng.normal(size=(tokens, shape.d_model)).astype(np.float32)
    x[:, :experts] = logits
    return jnp.asarray(x.reshape(shape.batch, shape.length, shape.d_model))


def make_layer(cfg, shape=TABLE1):
    """(jitted fwd+bwd step, params): the router is the identity on the first E features."""
    model = MoE.of_model(cfg, rngs=nnx.Rngs(0))
    router = np.zeros((shape.d_model, shape.experts), np.float32)
    router[: shape.experts] = np.eye(shape.experts)
    model.router[...] = jnp.asarray(router)
    graphdef, params = nnx.split(model)
    moe = cfg.moe
    cotangent = jax.random.normal(jax.random.key(1), (shape.batch, shape.length, shape.d_model))

    @jax.jit
    def step(params, x):
        def loss(params, x):
            y, aux = nnx.merge(graphdef, params)(x, train=True)
            aux_loss = moe.balance_loss_weight * aux["balance_loss"]
            return jnp.sum(y * cotangent) + aux_loss + moe.z_loss_weight * aux["router_z_loss"], aux

        return jax.grad(loss, argnums=(0, 1), has_aux=True)(params, x)

    return step, params


def run(rounds: int, dispatch: str, block_size: int) -> dict:
    inputs = {share: forced_inputs(share) for share in SHARES}
    adaptive, params = make_layer(model_config("adaptive", dispatch, 0.0, block_size))
    top2, _ = make_layer(model_config("top2", dispatch, 0.0, block_size))
    capacity, _ = make_layer(model_config("top2", "capacity", 1.25, block_size))
    variants = {("adaptive", s): (adaptive, inputs[s]) for s in SHARES}
    variants["top2"] = (top2, inputs[0.0])
    variants["capacity"] = (capacity, inputs[0.0])
    observed = {}
    for name, (step, x) in variants.items():  # compile, and check the forced routing
        _, aux = jax.block_until_ready(step(params, x))
        observed[name] = {k: float(aux[k]) for k in ("top2_fraction", "dropped_fraction")}
    # Every variant is timed right between two runs of the top-2 layer and divided by their
    # mean: on a shared machine the load drifts, and this pairing cancels what drifts slowly.
    best = dict.fromkeys(variants, float("inf"))
    ratios = {name: [] for name in variants if name != "top2"}

    def timed(name):
        step, x = variants[name]
        start = time.perf_counter()
        jax.block_until_ready(step(params, x))
        elapsed = time.perf_counter() - start
        best[name] = min(best[name], elapsed)
        return elapsed

    for _ in range(rounds):
        before = timed("top2")
        for name in ratios:
            elapsed = timed(name)
            after = timed("top2")
            ratios[name].append(elapsed / (0.5 * (before + after)))
            before = after
    ratio = {name: float(np.median(values)) for name, values in ratios.items()}
    rows = []
    for share in SHARES:
        got = observed["adaptive", share]["top2_fraction"]
        if abs(got - (1 - share)) > 1 / (BATCH * LENGTH):
            raise RuntimeError(f"forced routing failed: share {share} gave top2_fraction {got}")
        rows.append(
            {
                "single_expert_share": share,
                "compute_ratio": 1 - share / 2,
                "time_ratio": ratio["adaptive", share],
                "time_s": best["adaptive", share],
            }
        )
    return {
        "rows": rows,
        "dropless_top2_vs_capacity": 1 / ratio["capacity"],
        "top2_time_s": best["top2"],
        "capacity_time_s": best["capacity"],
        "capacity_dropped_fraction": observed["capacity"]["dropped_fraction"],
        "setup": {
            "tokens": BATCH * LENGTH,
            "d_model": D_MODEL,
            "ffn_dim": FFN,
            "experts": EXPERTS,
            "dtype": "float32",
            "dispatch": dispatch,
            "block_size": block_size,
            "backend": jax.default_backend(),
            "rounds": rounds,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_json_flag(parser)
    parser.add_argument(
        "--suite", choices=("adaptive", "fine_grained"), default="adaptive", help="which layers"
    )
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per variant")
    parser.add_argument("--dispatch", default="auto", help="auto | blocks | ragged | dense")
    parser.add_argument("--block_size", type=int, default=256, help="model.moe.block_size")
    args = parser.parse_args(argv)
    if args.suite == "fine_grained":
        result = moe_layer_fine_grained.run(args.rounds, args.dispatch)
        table_text = moe_layer_fine_grained.table(result)
        publish("moe_layer_fine_grained", result, table_text, args.json)
        return 0
    result = run(args.rounds, args.dispatch, args.block_size)
    publish("moe_layer", result, table(result), args.json)
    return 0


def table(result: dict) -> str:
    header = ["single-expert tokens", "compute", "MoE-layer time (fwd+bwd)", "vs top-2"]
    rows = [
        [f"{row['single_expert_share']:.0%}", f"{row['compute_ratio']:.2f}",
         f"{row['time_s'] * 1e3:.1f} ms", f"{row['time_ratio']:.2f}x"]
        for row in result["rows"]
    ]  # fmt: skip
    return (
        f"{markdown_table(header, rows)}\n\n"
        f"dropless top-2 {result['top2_time_s'] * 1e3:.1f} ms vs fixed capacity 1.25 "
        f"{result['capacity_time_s'] * 1e3:.1f} ms (drops "
        f"{result['capacity_dropped_fraction']:.1%}): {result['dropless_top2_vs_capacity']:.2f}x"
    )


if __name__ == "__main__":
    sys.exit(main())
