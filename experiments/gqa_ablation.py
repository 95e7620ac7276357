"""The GQA paper's conversion ablation on a small model: mean vs first vs random KV heads.

1. Train a small multi-head (MHA) decoder on the embedded corpus (`jaxmoe.training.loop.train`).
2. Convert it (`convert_gqa`) to GQA and to MQA with each method: mean / first / random.
3. Score every variant on the validation split (`jaxmoe.inference.evaluate.evaluate`) as converted
   (alpha = 0), and after uptraining for alpha x the original steps with the original recipe
   (configs/uptrain_gqa.py). The MHA model continued for the same steps is the control:
   what the extra steps alone buy.
4. Write ablation.md, ablation.json and ablation.png into --out (with --json also
   docs/results/YYYY-MM-DD-gqa_ablation.json).

    python -m experiments gqa_ablation --out runs/gqa_ablation
    python -m experiments gqa_ablation --out /tmp/quick --steps 60 --alphas 0.1  # smoke run

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

from benchmarks.results import add_json_flag, write_json
from jaxmoe.config.defaults import base_config
from jaxmoe.config.loading import apply_overrides
from jaxmoe.config.validation import validate
from jaxmoe.conversions.surgery import METHODS, convert_gqa
from jaxmoe.inference.evaluate import evaluate
from jaxmoe.training.loop import train

ROOT = Path(__file__).resolve().parents[1]


def mha_config(args, cache_dir: str):
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


def run(args) -> dict:
    out = Path(args.out).absolute()
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    jax.config.update("jax_compilation_cache_dir", str(out / "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    start = time.perf_counter()
    base = mha_config(args, args.cache_dir or str(out / "data_cache"))
    train(base, str(work / "mha"), progress=False)
    groups = [g for g in (args.gqa_groups, 1) if g < args.num_heads]
    variants = [("MHA", "-", str(work / "mha"))]
    for g in groups:
        for method in METHODS:
            name = f"GQA-{g}" if g > 1 else "MQA"
            path = str(work / f"{name}_{method}")
            convert_gqa(str(work / "mha"), path, g, method=method, seed=args.seed)
            variants.append((name, method, path))
    rows = []
    for name, method, path in variants:
        row = {"variant": name, "method": method, "alpha_0": score(path)}
        for alpha in args.alphas:
            up_dir = f"{path}_up{alpha}"
            train(uptrain_config(path, alpha), up_dir, progress=False)
            row[f"alpha_{alpha}"] = score(up_dir)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {
        "setup": {
            "model": base.model.to_dict(),
            "train": {k: getattr(base.train, k) for k in ("steps", "batch_size", "seq_len")},
            "optimizer": base.optimizer.to_dict(),
            "alphas": args.alphas,
            "uptrain_steps": {str(a): max(1, round(a * args.steps)) for a in args.alphas},
            "seconds": round(time.perf_counter() - start, 1),
        },
        "rows": rows,
    }


def markdown(result: dict) -> str:
    alphas = result["setup"]["alphas"]
    steps = result["setup"]["uptrain_steps"]
    head = ["variant", "method", "alpha 0"] + [f"alpha {a} ({steps[str(a)]} steps)" for a in alphas]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result["rows"]:
        cells = [row["variant"], row["method"]]
        for key in ["alpha_0"] + [f"alpha_{a}" for a in alphas]:
            cells.append(f"{row[key]['loss']:.3f} / {row[key]['accuracy']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    m, t = result["setup"]["model"], result["setup"]["train"]
    lines.append(
        f"\nValidation loss / next-token accuracy on the embedded corpus. MHA: {m['num_layers']} "
        f"layers, d_model {m['d_model']}, {m['num_heads']} heads of {m['head_dim']}, trained "
        f"{t['steps']} steps (batch {t['batch_size']} x {t['seq_len']} tokens). The MHA row's "
        f"alpha columns continue the MHA model itself for the same steps (the control). "
        f"Total run time {result['setup']['seconds']:.0f} s."
    )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alphas = [0.0, *result["setup"]["alphas"]]
    keys = ["alpha_0"] + [f"alpha_{a}" for a in result["setup"]["alphas"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    styles = {"mean": "-", "first": "--", "random": ":", "-": "-"}
    for row in result["rows"]:
        label = row["variant"] + ("" if row["method"] == "-" else f" {row['method']}")
        color = "black" if row["variant"] == "MHA" else ("C0" if row["variant"] != "MQA" else "C3")
        ax.plot(
            alphas,
            [row[k]["loss"] for k in keys],
            styles[row["method"]],
            marker="o",
            color=color,
            label=label,
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
    parser.add_argument("--alphas", default="0.05,0.25", help="uptraining fractions")
    parser.add_argument("--num_heads", type=int, default=8)
    parser.add_argument("--gqa_groups", type=int, default=2, help="G of the GQA variant")
    parser.add_argument("--head_dim", type=int, default=16)
    parser.add_argument("--d_model", type=int, default=64)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="for --method=random")
    parser.add_argument("--cache_dir", default="", help="data.cache_dir (default: under --out)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    args.alphas = [float(a) for a in args.alphas.split(",") if a]
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
