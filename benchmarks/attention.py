"""Causal self-attention, forward + backward: dense vs query blocks (model.attention_block).

Times jaxmoe's `grouped_attention` on one device for the dense path and for blocked causal
attention at several block sizes, with the tiny Mixtral's heads (8 query heads, 2 KV heads
of 32) unless told otherwise. Each variant is compiled once; the variants are then timed in
turns (`--rounds` of `--repeats` calls each), so a changing machine load hits all alike.

    python -m benchmarks attention                         # L=256, batch 8
    python -m benchmarks attention --length 1024 --batch 2 --blocks 32 64 128 --json
"""

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.results import add_json_flag, publish, table_of_dicts
from jaxmoe.models.attention import grouped_attention, resolve_causal_block


def attention_grad(block: int):
    """d/d(q, k, v) of <attention(q, k, v), cotangent>, jitted: one training step's work."""

    def loss(q, k, v, cotangent):
        mask = jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool))[None]
        out = grouped_attention(q, k, v, mask=mask, scale=q.shape[-1] ** -0.5, causal_block=block)
        return jnp.sum(out * cotangent)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv_heads", type=int, default=2)
    parser.add_argument("--head_dim", type=int, default=32)
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=5)
    add_json_flag(parser)
    args = parser.parse_args(argv)

    keys = jax.random.split(jax.random.key(0), 4)
    b, n, h, k, d = args.batch, args.length, args.heads, args.kv_heads, args.head_dim
    q = jax.random.normal(keys[0], (b, n, h, d))
    kv = [jax.random.normal(key, (b, n, k, d)) for key in keys[1:3]]
    cotangent = jax.random.normal(keys[3], (b, n, h, d))
    inputs = (q, *kv, cotangent)

    variants = {"dense": attention_grad(0)}
    for block in args.blocks:
        if resolve_causal_block(block, n):
            variants[f"block {block}"] = attention_grad(block)
    reference = variants["dense"](*inputs)
    for name, fn in variants.items():  # compiles, and checks every variant's gradients
        for got, want in zip(fn(*inputs), reference, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-4, err_msg=name)

    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            for _ in range(args.repeats):
                jax.block_until_ready(fn(*inputs))
            times[name].append((time.perf_counter() - start) / args.repeats)
    dense = statistics.median(times["dense"])
    rows = [
        {"variant": name, "ms": 1e3 * statistics.median(t), "speedup": dense / statistics.median(t)}
        for name, t in times.items()
    ]
    auto = resolve_causal_block(-1, n)
    shape = {k: v for k, v in vars(args).items() if k != "json"}
    result = {"shape": shape, "auto_block": auto, "rows": rows}
    table = f"{table_of_dicts(rows)}\n\nauto block (model.attention_block=-1): {auto}"
    publish("attention", result, table, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
