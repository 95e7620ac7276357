"""Decode time per token against Hugging Face transformers, each system in its own process.

The same decoder-only model (random weights, f32) in jaxmoe (`jaxmoe.inference.decode.Generator`: a
compiled prefill and while_loop with the KV cache updated in place) and in transformers
(`generate`, greedy, dynamic and static cache, the faster one kept), for MHA, GQA-8 and
MQA at batch 1 and 8 after a `--prompt_len` prompt, and an MoE variant (Mixtral-style FFNs)
with top-2 and adaptive gating (jaxmoe only: transformers has no adaptive gate), and
multi-head latent attention (DeepSeek-V3's MLA, dense FFNs: jaxmoe's latent cache with
absorbed projections against transformers' DeepseekV3ForCausalLM) at each batch. Per token =
(time of N new tokens - time of 1) / (N - 1), the best of two calls after a warm-up, so the
prompt's prefill and compiles drop out. The two systems' workers (decode_jaxmoe,
decode_hf, each run to its end by peer_harness.run_worker in its own process) take turns
for `--rounds` rounds; each case keeps its fastest round. The 1-minute load average is
sampled around every worker; a run with more than half the cores of load from elsewhere is
flagged `"quiet": false`.

    python -m benchmarks decode_peer --peer hf          # table
    python -m benchmarks decode_peer --peer hf --json   # + docs/results/DATE-decode_peer.json
    python -m benchmarks decode_peer --peer hf --only mla   # the MLA rows alone
    python -m benchmarks decode_peer --peer hf --only moe   # the MoE rows alone
"""

import argparse
import json
import os
import sys

from benchmarks.peer_harness import (
    NOT_QUIET,
    is_quiet,
    load_average,
    run_worker,
)
from benchmarks.results import add_json_flag, markdown_table, publish

SPEC = {
    "vocab": 8192, "d_model": 1024, "layers": 4, "heads": 16, "head_dim": 64, "ffn": 2816,
    "rope_theta": 10000.0, "max_len": 2048, "experts": 8, "threshold": 0.1,
}  # fmt: skip
KV_HEADS = {"MHA": 16, "GQA-8": 8, "MQA": 1}


def mla_dims(spec: dict) -> dict:
    """MLA sizes in DeepSeek-V3's proportions to the head width (V3: d 128 -> latent 512,
    rotary 64), full-rank queries as DeepSeek-V2-Lite."""
    d = spec["head_dim"]
    return {"q_lora_rank": 0, "kv_lora_rank": 4 * d, "qk_rope_head_dim": d // 2,
            "qk_nope_head_dim": d, "v_head_dim": d}  # fmt: skip


def cases(batches, only: str = "all") -> list[dict]:
    mla = [{"kv_heads": SPEC["heads"], "batch": b, "attention": "mla"} for b in batches]
    if only == "mla":
        return mla
    moe = [{"kv_heads": KV_HEADS["GQA-8"], "batch": b, "gating": "top2"} for b in batches]
    if only == "moe":
        return moe
    dense = [{"kv_heads": k, "batch": b} for k in KV_HEADS.values() for b in batches]
    return dense + moe + mla


def key(case: dict) -> tuple:
    return case["kv_heads"], case["batch"], case.get("gating", ""), case.get("attention", "")


def run(args) -> dict:
    spec = {**SPEC, "mla": mla_dims(SPEC)}
    common = [f"--spec={json.dumps(spec)}", f"--prompt_len={args.prompt_len}",
              f"--new_tokens={args.new_tokens}"]  # fmt: skip
    dense_and_top2 = cases(args.batches, args.only)
    adaptive = [{**c, "gating": "adaptive"} for c in dense_and_top2 if c.get("gating")]
    jax_cases = [*dense_and_top2, *adaptive]
    loads = [load_average()]
    best: dict[tuple, dict] = {}
    for _ in range(args.rounds):
        plans = [("jaxmoe", "decode_jaxmoe", jax_cases, [])]
        if args.peer == "hf":
            plans.append(("hf", "decode_hf", dense_and_top2, [f"--threads={args.threads}"]))
        for system, module, todo, extra in plans:
            for row in run_worker(module, [*common, f"--cases={json.dumps(todo)}", *extra]):
                expected = ["jax", "jaxmoe"] if system == "jaxmoe" else ["torch"]
                if row.pop("imported") != expected:
                    raise RuntimeError(f"{system} worker imported the other framework")
                slot = (system, *key(row))
                if slot not in best or row["ms_per_token"] < best[slot]["ms_per_token"]:
                    best[slot] = {"system": system, **row}
            loads.append(load_average())
    rows = sorted(best.values(), key=lambda r: (key(r), r["system"]))
    ratios = {}
    for row in rows:
        peer = best.get(("hf", *key(row)))
        if row["system"] == "jaxmoe" and peer:
            ratios[name_of(row)] = row["ms_per_token"] / peer["ms_per_token"]
    moe = ("jaxmoe", KV_HEADS["GQA-8"], args.batches[-1])
    top2, adaptive = best.get((*moe, "top2", "")), best.get((*moe, "adaptive", ""))
    cores = os.cpu_count() or 1
    return {
        "rows": rows,
        "jaxmoe_over_hf_ms_per_token": ratios,
        "adaptive_over_top2": (
            adaptive["ms_per_token"] / top2["ms_per_token"] if adaptive and top2 else None
        ),
        "load_average_1min": {"before": loads[0], "during": loads[1:]},
        "quiet": is_quiet(loads, own_threads=max(cores, args.threads)),
        "spec": SPEC,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
    }


def name_of(row: dict) -> str:
    heads = {v: k for k, v in KV_HEADS.items()}.get(row["kv_heads"], f"KV-{row['kv_heads']}")
    if row.get("attention") == "mla":
        heads = "MLA"
    gating = f" MoE {row['gating']}" if row.get("gating") else ""
    return f"{heads}{gating} batch {row['batch']}"


def table(result: dict) -> str:
    rows = [
        [name_of(r), r["system"], f"{r['ms_per_token']:.2f}", f"{r['prefill_s']:.3f}",
         r.get("cache")]
        for r in result["rows"]
    ]  # fmt: skip
    lines = [markdown_table(["case", "system", "ms/token", "prefill s", "cache"], rows), ""]
    for name, value in result["jaxmoe_over_hf_ms_per_token"].items():
        lines.append(f"{name}: jaxmoe / hf ms per token = {value:.2f}  ")
    if result["adaptive_over_top2"] is not None:
        ratio = result["adaptive_over_top2"]
        lines.append(f"adaptive / top-2 ms per token (jaxmoe): {ratio:.2f}")
    if not result["quiet"]:
        lines.append(NOT_QUIET)
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", choices=("none", "hf"), default="hf")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt_len", type=int, default=1024)
    # Enough steps that the decode time dwarfs the run-to-run noise of a batch-8 prefill.
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", choices=("all", "mla", "moe"), default="all", help="cases to run")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    result = run(args)
    publish("decode_peer", result, table(result), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
