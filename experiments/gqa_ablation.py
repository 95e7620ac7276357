"""The GQA paper's conversion ablation on a small model: mean vs first vs random KV heads.

Per seed (the MHA model's initialisation and data order, and the random method's draw):
1. Train a small multi-head (MHA) decoder on the embedded corpus (`jaxmoe.training.loop.train`).
2. Convert it (`convert_gqa`) to GQA and to MQA with each method: mean / first / random.
3. Score every variant on the validation split (`jaxmoe.inference.evaluate.evaluate`) as converted
   (alpha = 0), and after uptraining for alpha x the original steps with the original recipe
   (configs/uptrain_gqa.py). The MHA model continued for the same steps is the control:
   what the extra steps alone buy.
Then over seeds: each cell's mean and spread, in how many seeds the paper's ordering
(mean < first < random) holds, each variant's gap to the MHA control, and the share of the
alpha-0 gap that uptraining closed (the recipe's claims: GQA usable as converted, 5%
uptraining recovering most of the gap).
4. Write ablation.md, ablation.json and ablation.png into --out (with --json also
   docs/results/YYYY-MM-DD-gqa_ablation.json).

    python -m experiments gqa_ablation --out runs/gqa_ablation --json   # 3 seeds
    python -m experiments gqa_ablation --out /tmp/quick --steps 60 --alphas 0.1 --seeds 0  # smoke

Compiled programs are cached on disk under --out, so variants of one shape compile once.
"""

import argparse
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks.peer_harness import is_quiet, load_average
from benchmarks.results import add_json_flag, write_json
from jaxmoe.config.defaults import base_config
from jaxmoe.config.loading import apply_overrides
from jaxmoe.config.validation import validate
from jaxmoe.conversions.surgery import METHODS, convert_gqa
from jaxmoe.inference.evaluate import evaluate
from jaxmoe.training.loop import train

ROOT = Path(__file__).resolve().parents[1]


def mha_config(args, cache_dir: str, seed: int):
    config = base_config()
    apply_overrides(
        config,
        [
            "model.moe.num_experts=0",
            f"model.num_layers={args.num_layers}",
            f"model.d_model={args.d_model}",
            f"model.num_heads={args.num_heads}",
            f"model.num_kv_heads={args.num_heads}",
            f"model.head_dim={args.head_dim}",
            f"model.ffn_dim={4 * args.d_model}",
            f"train.steps={args.steps}",
            f"train.seed={seed}",
            f"train.batch_size={args.batch_size}",
            f"train.seq_len={args.seq_len}",
            "train.eval_every=0",
            "train.checkpoint_every=0",
            "train.log_every=50",
            f"optimizer.warmup_steps={max(1, args.steps // 10)}",
            f"data.cache_dir={cache_dir}",
        ],
    )
    return validate(config)


def uptrain_config(checkpoint: str, alpha: float):
    spec = importlib.util.spec_from_file_location("uptrain_gqa", ROOT / "configs/uptrain_gqa.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(checkpoint)
    config.uptrain.alpha = alpha
    module.finalize(config)
    return validate(config)


def score(checkpoint: str) -> dict:
    result = evaluate(checkpoint, "embedded")
    return {"loss": round(result["loss"], 4), "accuracy": round(result["accuracy"], 4)}


def run_seed(args, seed: int, out: Path) -> dict:
    """One seed: the MHA model, its conversions, their scores before and after uptraining."""
    work = out / "work" / f"seed{seed}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    start = time.perf_counter()
    base = mha_config(args, args.cache_dir or str(out / "data_cache"), seed)
    train(base, str(work / "mha"), progress=False)
    groups = [g for g in (args.gqa_groups, 1) if g < args.num_heads]
    variants = [("MHA", "-", str(work / "mha"))]
    for g in groups:
        for method in METHODS:
            name = f"GQA-{g}" if g > 1 else "MQA"
            path = str(work / f"{name}_{method}")
            convert_gqa(str(work / "mha"), path, g, method=method, seed=seed)
            variants.append((name, method, path))
    rows = []
    for name, method, path in variants:
        row = {"variant": name, "method": method, "alpha_0": score(path)}
        for alpha in args.alphas:
            up_dir = f"{path}_up{alpha}"
            train(uptrain_config(path, alpha), up_dir, progress=False)
            row[f"alpha_{alpha}"] = score(up_dir)
        rows.append(row)
        print(json.dumps({"seed": seed, **row}), flush=True)
    shutil.rmtree(work, ignore_errors=True)  # checkpoints: the scores are what is kept
    return {"rows": rows, "seconds": round(time.perf_counter() - start, 1), "config": base}


def run(args) -> dict:
    out = Path(args.out).absolute()
    jax.config.update("jax_compilation_cache_dir", str(out / "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    start = time.perf_counter()
    loads = [load_average()]
    seeds = {}
    for seed in args.seeds:
        seeds[str(seed)] = run_seed(args, seed, out)
        loads.append(load_average())
    base = seeds[str(args.seeds[0])].pop("config")
    for result in seeds.values():
        result.pop("config", None)
    alphas = [0.0, *args.alphas]
    return {
        "setup": {
            "model": base.model.to_dict(),
            "train": {k: getattr(base.train, k) for k in ("steps", "batch_size", "seq_len")},
            "optimizer": base.optimizer.to_dict(),
            "alphas": args.alphas,
            "uptrain_steps": {str(a): max(1, round(a * args.steps)) for a in args.alphas},
            "seeds": args.seeds,
            "seconds": round(time.perf_counter() - start, 1),
            # 1-minute load average before and after each seed; losses do not depend on it
            "load_average_1min": loads,
            "quiet": is_quiet(loads, own_threads=2),
        },
        "seeds": seeds,
        "summary": summarize(seeds, alphas),
    }


def alpha_key(alpha: float) -> str:
    return "alpha_0" if alpha == 0 else f"alpha_{alpha}"


def summarize(seeds: dict, alphas: list[float]) -> dict:
    """Over seeds, per variant and method: each alpha's loss (mean, std, per seed), its gap
    to the MHA control at the same alpha, the share of the alpha-0 gap closed by each
    alpha; per variant and alpha: the seeds in which mean < first < random holds."""
    per_seed = [{(r["variant"], r["method"]): r for r in s["rows"]} for s in seeds.values()]
    cells = {}
    for key in per_seed[0]:
        cell = {}
        for alpha in alphas:
            losses = [rows[key][alpha_key(alpha)]["loss"] for rows in per_seed]
            gaps = [
                rows[key][alpha_key(alpha)]["loss"] - rows[("MHA", "-")][alpha_key(alpha)]["loss"]
                for rows in per_seed
            ]
            cell[alpha_key(alpha)] = {
                "loss_mean": float(np.mean(losses)),
                "loss_std": float(np.std(losses, ddof=1)) if len(losses) > 1 else None,
                "losses": losses,
                "gap_to_mha_mean": float(np.mean(gaps)),
                "gaps_to_mha": gaps,
            }
        for alpha in alphas[1:]:
            start, now = cell["alpha_0"]["gaps_to_mha"], cell[alpha_key(alpha)]["gaps_to_mha"]
            closed = [1 - b / a for a, b in zip(start, now, strict=True) if a > 0]
            cell[alpha_key(alpha)]["gap_closed"] = closed
        cells[f"{key[0]} {key[1]}"] = cell
    ordering = {}
    for variant in sorted({v for v, m in per_seed[0] if m != "-"}):
        ordering[variant] = {}
        for alpha in alphas:
            holds, first_beats_mean = 0, 0
            for rows in per_seed:
                mean, first, rand = (rows[(variant, m)][alpha_key(alpha)]["loss"]
                                     for m in ("mean", "first", "random"))  # fmt: skip
                holds += mean < first < rand
                first_beats_mean += first < mean
            ordering[variant][alpha_key(alpha)] = {
                "mean<first<random": holds,
                "first<mean": first_beats_mean,
                "seeds": len(per_seed),
            }
    return {"cells": cells, "ordering": ordering}


def markdown(result: dict) -> str:
    alphas = result["setup"]["alphas"]
    steps = result["setup"]["uptrain_steps"]
    keys = ["alpha_0"] + [alpha_key(a) for a in alphas]
    head = ["variant", "method", "alpha 0"] + [f"alpha {a} ({steps[str(a)]} steps)" for a in alphas]
    head += [f"gap closed at alpha {a}" for a in alphas]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, cell in result["summary"]["cells"].items():
        cells = name.split(" ", 1)
        for key in keys:
            c = cell[key]
            std = "" if c["loss_std"] is None else f" ± {c['loss_std']:.3f}"
            gap = "" if name.startswith("MHA") else f" (+{c['gap_to_mha_mean']:.3f})"
            cells.append(f"{c['loss_mean']:.3f}{std}{gap}")
        for key in keys[1:]:
            closed = cell[key].get("gap_closed")
            cells.append("-" if not closed else f"{np.mean(closed):.0%}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| variant | " + " | ".join(f"alpha {k.split('_', 1)[1]}" for k in keys) + " |",
              "|---|" + "---|" * len(keys)]  # fmt: skip
    for variant, by_alpha in result["summary"]["ordering"].items():
        cells = [
            f"{o['mean<first<random']}/{o['seeds']} (first < mean: {o['first<mean']})"
            for o in by_alpha.values()
        ]
        lines.append(f"| {variant}: mean < first < random | " + " | ".join(cells) + " |")
    m, t = result["setup"]["model"], result["setup"]["train"]
    lines.append(
        f"\nValidation loss on the embedded corpus, mean ± std over seeds "
        f"{result['setup']['seeds']} (in brackets: the gap to the MHA control at the same "
        f"alpha). MHA: {m['num_layers']} layers, d_model {m['d_model']}, {m['num_heads']} "
        f"heads of {m['head_dim']}, trained {t['steps']} steps (batch {t['batch_size']} x "
        f"{t['seq_len']} tokens). The MHA row's alpha columns continue the MHA model itself "
        f"for the same steps (the control). Gap closed: 1 - gap(alpha) / gap(0), mean over "
        f"seeds. Total run time {result['setup']['seconds']:.0f} s."
    )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alphas = [0.0, *result["setup"]["alphas"]]
    keys = ["alpha_0"] + [alpha_key(a) for a in result["setup"]["alphas"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    styles = {"mean": "-", "first": "--", "random": ":", "-": "-"}
    for name, cell in result["summary"]["cells"].items():
        variant, method = name.split(" ", 1)
        color = "black" if variant == "MHA" else ("C0" if variant != "MQA" else "C3")
        ax.errorbar(
            alphas,
            [cell[k]["loss_mean"] for k in keys],
            yerr=[cell[k]["loss_std"] or 0.0 for k in keys],
            fmt=styles[method],
            marker="o",
            capsize=2,
            color=color,
            label=name if method != "-" else variant,
        )
    ax.set_xlabel("uptraining fraction alpha (of the original steps)")
    ax.set_ylabel("validation loss")
    ax.set_title("KV-head conversion: mean vs first vs random")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for the report and runs")
    parser.add_argument("--steps", type=int, default=300, help="MHA pre-training steps")
    parser.add_argument("--alphas", default="0.05,0.1", help="uptraining fractions")
    parser.add_argument("--num_heads", type=int, default=8)
    parser.add_argument("--gqa_groups", type=int, default=4, help="G of the GQA variant")
    parser.add_argument("--head_dim", type=int, default=16)
    parser.add_argument("--d_model", type=int, default=64)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument(
        "--seeds", default="0,1,2", help="MHA initialisation and data order, random's draw"
    )
    parser.add_argument("--cache_dir", default="", help="data.cache_dir (default: under --out)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    args.alphas = [float(a) for a in args.alphas.split(",") if a]
    args.seeds = [int(x) for x in args.seeds.split(",") if x]
    result = run(args)
    out = Path(args.out)
    (out / "ablation.json").write_text(json.dumps(result, indent=1))
    (out / "ablation.md").write_text(markdown(result))
    plot(result, out / "ablation.png")
    print(markdown(result))
    write_json("gqa_ablation", result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
