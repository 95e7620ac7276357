"""Bytes the expert-parallel token exchange moves: worst-case all_to_all vs ragged.

Compiles one train step ahead of time for a TPU topology (libtpu, no TPU needed) twice,
with model.moe.ep_exchange=padded and =ragged, and reports per device, per MoE layer and
per exchange (one direction of one micro-batch):
- padded: the all_to_all buffer, ep * T * min(K, E_local) rows, whatever the routing (its
  shape is read from the compiled program and checked against that count);
- ragged: the rows the routing sends, T * (1 + top2_fraction) for an adaptive (or top-2)
  gate, and the receive buffer's bound ceil(ep_buffer_factor * T * K) rows;
with T the tokens a device holds per micro-batch, K the slots. Also each program's
ragged-all-to-all count, temporaries and compile time (a loaded host slows the latter).

    python -m benchmarks ep_exchange [--config configs/moe16_gpt2_medium.py]
        [--topology v5p-8] [--top2_fraction 0.25] [--config.model.num_layers=2 ...] [--json]
"""

import argparse
import math
import re
import sys

import jax

from benchmarks.results import add_json_flag, markdown_table, publish
from jaxmoe.aot import compile_check as compile_module
from jaxmoe.config.loading import load_config


def _padded_rows(hlo_text: str, dim: int) -> list[int]:
    """Rows of each all-to-all result [ep, rows, D] carrying D-wide token vectors."""
    rows = []
    for dims in re.findall(r"= \S+?\[([\d,]+)\]\S* all-to-all\(", hlo_text):
        shape = [int(d) for d in dims.split(",")]
        if len(shape) == 3 and shape[-1] == dim:
            rows.append(shape[0] * shape[1])
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/moe16_gpt2_medium.py")
    parser.add_argument("--topology", default="v5p-8")
    parser.add_argument(
        "--top2_fraction",
        type=float,
        default=0.25,
        help="share of tokens routed to two experts (0.21-0.28 when trained)",
    )
    add_json_flag(parser)
    args, rest = parser.parse_known_args(argv)
    overrides = [a.removeprefix("--config.") for a in rest]
    jax.config.update("jax_platforms", "cpu")

    texts = []
    count = compile_module.count_collectives
    compile_module.count_collectives = lambda text: texts.append(text) or count(text)
    runs = {}
    for exchange in ("padded", "ragged"):
        config = load_config(args.config, [*overrides, f"model.moe.ep_exchange={exchange}"])
        runs[exchange] = compile_module.compile_for_topology(config, args.topology)
        runs[exchange]["hlo"] = texts[-1]

    m, t, mesh = config.model, config.train, runs["ragged"]["mesh"]
    slots = {"top1": 1, "top2": 2, "adaptive": 2, "topk": m.moe.gate.top_k}.get(
        m.moe.gate.gating, m.moe.gate.max_k
    )
    ep = mesh["expert"]
    local = m.moe.num_experts // ep
    token_split = math.prod(mesh[a] for a in ("data", "fsdp", "expert", "tensor"))
    tokens = t.batch_size // t.grad_accum * t.seq_len // token_split
    itemsize = jax.numpy.dtype(m.dtype).itemsize
    row_bytes = m.d_model * itemsize
    padded_rows = ep * tokens * min(slots, local)
    found = _padded_rows(runs["padded"]["hlo"], m.d_model)
    assert found and set(found) == {padded_rows}, (found, padded_rows)
    routed_rows = tokens * (1 + args.top2_fraction)
    bound_rows = math.ceil(m.moe.ep_buffer_factor * tokens * slots)
    mib = 2**20
    result = {
        "config": args.config,
        "overrides": overrides,
        "topology": args.topology,
        "mesh": mesh,
        "tokens_per_device_per_microbatch": tokens,
        "top2_fraction": args.top2_fraction,
        "padded_rows": padded_rows,
        "padded_mib_per_exchange": padded_rows * row_bytes / mib,
        "ragged_routed_rows": routed_rows,
        "ragged_routed_mib_per_exchange": routed_rows * row_bytes / mib,
        "ragged_bound_rows": bound_rows,
        "ragged_bound_mib": bound_rows * row_bytes / mib,
        "padded_over_ragged": padded_rows / routed_rows,
    }
    for exchange, run in runs.items():
        result[exchange] = {
            "ragged_all_to_all_ops": run["collectives"]["ragged-all-to-all"],
            "all_to_all_ops": run["collectives"]["all-to-all"],
            "all_to_all_mib": run["all_to_all_bytes"] / mib,
            "temp_gib": run["temp_bytes"] / 2**30,
            "peak_hbm_gib": run["peak_hbm_bytes"] / 2**30,
            "compile_s": run["compile_s"],
        }
    publish("ep_exchange", result, table(result), args.json)
    return 0


def table(result: dict) -> str:
    header = ["exchange", "rows per exchange", "MiB per exchange", "all_to_all ops",
              "ragged_all_to_all ops", "temp GiB", "peak HBM GiB", "compile s"]  # fmt: skip
    rows = []
    for exchange, rows_key, mib_key in (
        ("padded", "padded_rows", "padded_mib_per_exchange"),
        ("ragged", "ragged_routed_rows", "ragged_routed_mib_per_exchange"),
    ):
        run = result[exchange]
        rows.append(
            [exchange, result[rows_key], result[mib_key], run["all_to_all_ops"],
             run["ragged_all_to_all_ops"], run["temp_gib"], run["peak_hbm_gib"],
             run["compile_s"]]
        )  # fmt: skip
    return (
        f"{result['config']} on {result['topology']}, mesh {result['mesh']}, "
        f"{result['tokens_per_device_per_microbatch']} tokens per device per micro-batch, "
        f"top-2 share {result['top2_fraction']}\n\n{markdown_table(header, rows)}\n\n"
        f"padded / ragged: {result['padded_over_ragged']:.2f}x; ragged receive bound "
        f"{result['ragged_bound_rows']} rows ({result['ragged_bound_mib']:.2f} MiB)"
    )


if __name__ == "__main__":
    sys.exit(main())
