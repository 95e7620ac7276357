"""Decode time per token against Hugging Face transformers, each system in its own process.

The same decoder-only model (random weights, f32) in jaxmoe (`jaxmoe.inference.decode.Generator`: a
compiled prefill and while_loop with the KV cache updated in place) and in transformers
(`generate`, greedy, dynamic and static cache, the faster one kept), for MHA, GQA-8 and
MQA at batch 1 and 8 after a `--prompt_len` prompt, and an MoE variant (Mixtral-style FFNs)
with top-2 and adaptive gating (jaxmoe only: transformers has no adaptive gate). Per token =
(time of N new tokens - time of 1) / (N - 1), the best of two calls after a warm-up, so the
prompt's prefill and compiles drop out. The two systems' workers (decode_jaxmoe.py,
decode_hf.py) take turns for `--rounds` rounds; each case keeps its fastest round. The
1-minute load average is sampled around every worker; a run with more than half the cores
of load from elsewhere is flagged `"quiet": false`.

    python benchmarks/decode_peer.py --peer hf            # table
    python benchmarks/decode_peer.py --peer hf --json     # one JSON object
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from worker_protocol import NOT_QUIET, is_quiet, report  # noqa: E402

SPEC = {
    "vocab": 8192, "d_model": 1024, "layers": 4, "heads": 16, "head_dim": 64, "ffn": 2816,
    "rope_theta": 10000.0, "max_len": 2048, "experts": 8, "threshold": 0.1,
}  # fmt: skip
KV_HEADS = {"MHA": 16, "GQA-8": 8, "MQA": 1}


def cases(batches) -> list[dict]:
    dense = [{"kv_heads": k, "batch": b} for k in KV_HEADS.values() for b in batches]
    moe = [{"kv_heads": KV_HEADS["GQA-8"], "batch": batches[-1], "gating": "top2"}]
    return dense + moe


def run_worker(script: str, argv: list[str]) -> list[dict]:
    result = subprocess.run(
        [sys.executable, str(HERE / script), *argv], capture_output=True, text=True, check=False
    )
    if result.returncode:
        raise RuntimeError(f"{script} failed: {result.stderr.strip().splitlines()[-1:]}")
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def key(case: dict) -> tuple:
    return case["kv_heads"], case["batch"], case.get("gating", "")


def run(args) -> dict:
    common = [f"--spec={json.dumps(SPEC)}", f"--prompt_len={args.prompt_len}",
              f"--new_tokens={args.new_tokens}"]  # fmt: skip
    dense_and_top2 = cases(args.batches)
    jax_cases = [*dense_and_top2, {**dense_and_top2[-1], "gating": "adaptive"}]
    loads = [os.getloadavg()[0]]
    best: dict[tuple, dict] = {}
    for _ in range(args.rounds):
        plans = [("jaxmoe", "decode_jaxmoe.py", jax_cases, [])]
        if args.peer == "hf":
            plans.append(("hf", "decode_hf.py", dense_and_top2, [f"--threads={args.threads}"]))
        for system, script, todo, extra in plans:
            for row in run_worker(script, [*common, f"--cases={json.dumps(todo)}", *extra]):
                expected = ["jax"] if system == "jaxmoe" else ["torch"]
                if row.pop("imported") != expected:
                    raise RuntimeError(f"{system} worker imported the other framework")
                slot = (system, *key(row))
                if slot not in best or row["ms_per_token"] < best[slot]["ms_per_token"]:
                    best[slot] = {"system": system, **row}
            loads.append(os.getloadavg()[0])
    rows = sorted(best.values(), key=lambda r: (key(r), r["system"]))
    ratios = {}
    for row in rows:
        peer = best.get(("hf", *key(row)))
        if row["system"] == "jaxmoe" and peer:
            ratios[name_of(row)] = row["ms_per_token"] / peer["ms_per_token"]
    moe = ("jaxmoe", KV_HEADS["GQA-8"], args.batches[-1])
    top2, adaptive = best[(*moe, "top2")], best[(*moe, "adaptive")]
    cores = os.cpu_count() or 1
    return {
        "rows": rows,
        "jaxmoe_over_hf_ms_per_token": ratios,
        "adaptive_over_top2": adaptive["ms_per_token"] / top2["ms_per_token"],
        "load_average_1min": {"before": loads[0], "during": loads[1:]},
        "quiet": is_quiet(loads, own_threads=max(cores, args.threads)),
        "spec": SPEC,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
    }


def name_of(row: dict) -> str:
    heads = {v: k for k, v in KV_HEADS.items()}.get(row["kv_heads"], f"KV-{row['kv_heads']}")
    gating = f" MoE {row['gating']}" if row.get("gating") else ""
    return f"{heads}{gating} batch {row['batch']}"


def print_table(result: dict) -> None:
    print(f"{'case':28} {'system':7} {'ms/token':>9} {'prefill s':>10}")
    for r in result["rows"]:
        cache = f"  ({r['cache']} cache)" if "cache" in r else ""
        print(
            f"{name_of(r):28} {r['system']:7} {r['ms_per_token']:9.2f} {r['prefill_s']:10.3f}"
            f"{cache}"
        )
    for name, value in result["jaxmoe_over_hf_ms_per_token"].items():
        print(f"{name}: jaxmoe / hf ms per token = {value:.2f}")
    print(f"adaptive / top-2 ms per token (jaxmoe): {result['adaptive_over_top2']:.2f}")
    if not result["quiet"]:
        print(NOT_QUIET)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", choices=("none", "hf"), default="hf")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt_len", type=int, default=1024)
    # Enough steps that the decode time dwarfs the run-to-run noise of a batch-8 prefill.
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report(run(args), args.json, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
