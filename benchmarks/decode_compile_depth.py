"""Compile time of the KV-cache decode program against depth, scanned vs unrolled layers.

A tiny-width decoder-only model (d_model 64, 4 heads / 2 KV heads of 16, dense FFN 128,
vocab 256) at each depth and stack layout, through `jaxmoe.inference.decode.Generator` on one
CPU device: the prefill and the decode loop (a `lax.while_loop` of model calls) are
AOT-compiled once each; reported are their compile seconds (trace + lower + XLA compile),
the decode program's size (lines of optimised HLO) and, for context, ms per decoded token
(min over rounds). Scanned stacks decode under the training scan with their caches
stacked along the layer axis, so their program should not grow with depth.

    python -m benchmarks.decode_compile_depth [--layers 4,48] [--json PATH]
Compile-time ratios hold under load; the absolute seconds and ms/token do not.
"""

import argparse
import sys
import time

import jax
from flax import nnx

from benchmarks.results import add_json_flag, markdown_table, publish
from jaxmoe.config import typed
from jaxmoe.config.defaults import base_config
from jaxmoe.inference.decode import Generator, Sampling
from jaxmoe.models import build_model
from jaxmoe.models.spec import model_params
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.parallel.options import MeshOptions

PROMPT_LEN, NEW_TOKENS = 16, 32


def model_config(num_layers: int, scan: bool):
    cfg = base_config().model
    cfg.vocab_size, cfg.d_model, cfg.num_layers = 256, 64, num_layers
    cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim = 4, 2, 16, 128
    cfg.moe.num_experts = 0
    cfg.scan_layers = scan
    return typed({"model": cfg}).model


def measure(num_layers: int, scan: bool, rounds: int, mesh) -> dict:
    cfg = model_config(num_layers, scan)
    _, params = model_params(build_model(cfg, rngs=nnx.Rngs(0)))
    generator = Generator(cfg, params, mesh, eos_id=-1)  # never stops early
    prompts = [list(range(3, 3 + PROMPT_LEN))]
    ms_per_token, compile_s = [], {}
    for round_index in range(rounds + 1):  # round 0 compiles
        state, _, prefill_compile = generator.prefill(prompts, NEW_TOKENS)
        jax.block_until_ready(state)
        start = time.perf_counter()
        _, steps, decode_compile = generator.decode(state, 1, NEW_TOKENS, Sampling())
        elapsed = time.perf_counter() - start - decode_compile
        if round_index == 0:
            compile_s = {"prefill": prefill_compile, "decode": decode_compile}
        else:
            ms_per_token.append(1e3 * elapsed / (steps - 1))
    programs = generator.compiled_programs()
    decode_program = next(c for key, c in programs.items() if key[0] == "decode")
    return {
        "layers": num_layers,
        "layout": "scanned" if scan else "unrolled",
        "prefill_compile_s": compile_s["prefill"],
        "decode_compile_s": compile_s["decode"],
        "decode_hlo_lines": len(decode_program.as_text().splitlines()),
        "ms_per_token": min(ms_per_token),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="4,48", help="comma-separated depths")
    parser.add_argument("--rounds", type=int, default=3, help="timed decode rounds")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    mesh = make_mesh(MeshOptions(data=1, fsdp=1, tensor=1, expert=1), jax.devices()[:1])
    rows = [
        measure(int(n), scan, args.rounds, mesh)
        for n in args.layers.split(",")
        for scan in (False, True)
    ]
    by = {(r["layers"], r["layout"]): r for r in rows}
    depths = sorted({r["layers"] for r in rows})
    deep, shallow = depths[-1], depths[0]
    growth = {
        layout: by[deep, layout]["decode_compile_s"] / by[shallow, layout]["decode_compile_s"]
        for layout in ("unrolled", "scanned")
    }
    result = {
        "model": "d_model 64, 4 heads / 2 KV of 16, dense FFN 128, vocab 256, float32",
        "prompt_len": PROMPT_LEN,
        "new_tokens": NEW_TOKENS,
        "device": str(jax.devices()[0]),
        "rows": rows,
        f"decode_compile_growth_{depths[0]}_to_{depths[-1]}_layers": growth,
        "note": "measured on a shared, loaded CPU: compare ratios, not absolute seconds",
    }
    header = list(rows[0])
    table = markdown_table(header, [[r[k] for k in header] for r in rows])
    table += f"\n\ndecode compile growth {depths[0]} -> {depths[-1]} layers: {growth}"
    publish("decode_compile_depth", result, table, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
