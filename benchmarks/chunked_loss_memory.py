"""Compiled temporary memory of the CPU train step with and without train.loss_chunk.

jaxmoe's real train step (steps.train_step, what `jaxmoe train` jits) is lowered for one CPU
device with abstract inputs and compiled once per `train.loss_chunk` value; XLA's memory
analysis gives each program's temporaries, next to the bytes of the f32 logits [B, L, V]
that the unchunked loss holds. Nothing is run, so the load changes only the compile times.

    python -m benchmarks chunked_loss_memory [--chunks 0 256 64] [--set model.vocab_size=65536]
        [--json]
"""

import argparse
import os
import sys
import time

import jax

from benchmarks.results import add_json_flag, markdown_table, publish
from jaxmoe.aot.compile_check import jitted_train_step
from jaxmoe.config.loading import load_config
from jaxmoe.parallel.mesh import make_mesh

# A mid-size dense decoder whose output layer dominates: logits f32 [8, 1024, 32768] = 1 GiB.
MODEL = (
    "model.moe.num_experts=0",
    "model.vocab_size=32768",
    "model.num_layers=2",
    "model.d_model=256",
    "model.num_heads=4",
    "model.num_kv_heads=4",
    "model.head_dim=64",
    "model.ffn_dim=1024",
    "model.remat=full",
    "train.batch_size=8",
    "train.seq_len=1024",
    "mesh.data=1",
)


def compiled_memory(config) -> dict:
    """Memory analysis (bytes) and compile seconds of one train step of `config`."""
    mesh = make_mesh(config.mesh, jax.devices()[:1])
    step, _, abstract_state, batch, _ = jitted_train_step(config, mesh)
    started = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = step.lower(abstract_state, batch).compile()
    memory = compiled.memory_analysis()
    return {
        "temp_bytes": memory.temp_size_in_bytes,
        "argument_bytes": memory.argument_size_in_bytes,
        "output_bytes": memory.output_size_in_bytes,
        "alias_bytes": memory.alias_size_in_bytes,
        "compile_s": round(time.perf_counter() - started, 1),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 256, 64])
    parser.add_argument("--set", action="append", default=[], help="config override k=v")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    rows = []
    for chunk in args.chunks:
        config = load_config("configs/default.py", [*MODEL, *args.set, f"train.loss_chunk={chunk}"])
        t, m = config.train, config.model
        rows.append(
            {
                "loss_chunk": chunk,
                "logits_f32_bytes": t.batch_size * t.seq_len * m.vocab_size * 4,
                **compiled_memory(config),
            }
        )
    base = rows[0]["temp_bytes"]
    table = [
        [
            r["loss_chunk"],
            f"{r['temp_bytes'] / 2**20:.0f}",
            f"{r['temp_bytes'] / base:.2f}",
            f"{r['logits_f32_bytes'] / 2**20:.0f}",
            r["compile_s"],
        ]
        for r in rows
    ]
    headers = ["loss_chunk", "temp MiB", "vs first", "full f32 logits MiB", "compile s"]
    result = {"overrides": [*MODEL, *args.set], "rows": rows, "load": os.getloadavg()}
    publish("chunked_loss_memory", result, markdown_table(headers, table), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
