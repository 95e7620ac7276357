"""Muon against AdamW on the default model, CPU: eval loss vs steps and vs seconds, 3 seeds.

configs/default.py as it stands (4 layers, d_model 128, 8 adaptive-gated experts, 16 x 128
tokens per step, peak learning rate 3e-3 with 50 warmup steps and cosine decay, weight
decay 0.1, the embedded corpus) trains once with `optimizer.name=adamw` and once with
`optimizer.name=muon` at the same budget: the same steps, batches, schedule, learning rate
and weight decay (Muon's update RMS is matched to AdamW's, `optimizer.muon_rms=0.2`, so one
learning rate serves both groups; docs/muon.md). The two train in this one process, step by
step in turns (time_to_target.py's harness: the same batch for both, order alternating), so
their step times are measured under the same load; the 1-minute load average is recorded
at every evaluation.

Reported per optimizer (mean and std over seeds): the final eval loss, the median step
time and its ratio to AdamW's, and the seconds (and steps) Muon needs to reach AdamW's
final eval loss of the same seed.

    flock /tmp/jaxmoe-heavy.lock python -m experiments muon_vs_adamw --json \\
        --figures docs/figures/muon      # 3 seeds x 600 steps; ~20 min on 2 cores
    python -m experiments muon_vs_adamw --steps 20 --eval_every 10 --seeds 0   # smoke test
"""

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from benchmarks.results import add_json_flag, markdown_table, write_json
from experiments.adaptive_vs_fixed import reach
from experiments.time_to_target import SharedData, Variant, train_side_by_side

ROOT = Path(__file__).resolve().parents[1]
OPTIMIZERS = {"adamw": ["optimizer.name=adamw"], "muon": ["optimizer.name=muon"]}
REFERENCE = "adamw"
# The same batches for both optimizers (the curriculum would reorder them by the model).
DATA = ["data.curriculum=none", "data.prefetch=0"]


def optimizer_config(name: str, args, seed: int):
    from jaxmoe.config.loading import load_config

    overrides = [*DATA, f"train.steps={args.steps}", f"train.seed={seed}", *OPTIMIZERS[name]]
    return load_config(str(ROOT / "configs" / "default.py"), [*overrides, *args.set])


def seed_rows(trained: dict) -> dict:
    """Per optimizer: final eval loss, step times, and the cost of reaching AdamW's final
    eval loss (this seed's) on its eval curve."""
    curves = trained["curves"]
    target = curves[REFERENCE][-1]["loss_own"]
    rows = {}
    for name, curve in curves.items():
        times_S = np.asarray(trained["times"][name])
        times_S[0] = np.median(times_S)  # the first call of a program also warms it up
        cum_t = np.concatenate([[0.0], np.cumsum(times_S)])
        steps = [p["step"] for p in curve]
        losses = [p["loss_own"] for p in curve]
        at = reach(steps, losses, cum_t, target)
        rows[name] = {
            "final_eval_loss": losses[-1],
            "median_step_s": float(np.median(times_S)),
            "train_time_s": float(cum_t[-1]),
            "steps_to_adamw_final": None if at is None else at[0],
            "seconds_to_adamw_final": None if at is None else at[1],
            "curve": [
                {"step": p["step"], "eval_loss": p["loss_own"], "time_s": float(cum_t[p["step"]])}
                for p in curve
            ],
        }
    base = rows[REFERENCE]
    for row in rows.values():
        row["step_time_vs_adamw"] = row["median_step_s"] / base["median_step_s"]
        reached = row["seconds_to_adamw_final"]
        row["seconds_to_adamw_final_vs_adamw"] = (
            None if reached is None else reached / base["train_time_s"]
        )
    return rows


def summarize(per_seed: dict) -> dict:
    keys = (
        "final_eval_loss",
        "median_step_s",
        "step_time_vs_adamw",
        "steps_to_adamw_final",
        "seconds_to_adamw_final",
        "seconds_to_adamw_final_vs_adamw",
    )
    out = {}
    for name in OPTIMIZERS:
        out[name] = {}
        for key in keys:
            values = [s[name][key] for s in per_seed.values() if s[name][key] is not None]
            out[name][key] = {
                "mean": float(np.mean(values)) if values else None,
                "std": float(np.std(values, ddof=1)) if len(values) > 1 else None,
                "values": values,
            }
    return out


def _stat(stat: dict, fmt: str) -> str:
    if stat["mean"] is None:
        return "not reached"
    text = fmt.format(stat["mean"])
    return text if stat["std"] is None else f"{text} ± {fmt.format(stat['std'])}"


def table(report: dict) -> str:
    header = [
        "optimizer", "final eval loss", "median step (ms)", "step time vs AdamW",
        "steps to AdamW's final loss", "seconds to it vs AdamW's run",
    ]  # fmt: skip
    rows = []
    for name, s in report["summary"].items():
        rows.append([
            name, _stat(s["final_eval_loss"], "{:.4f}"),
            _stat({k: v and 1e3 * v for k, v in s["median_step_s"].items() if k != "values"},
                  "{:.1f}"),
            _stat(s["step_time_vs_adamw"], "{:.3f}x"), _stat(s["steps_to_adamw_final"], "{:.0f}"),
            _stat(s["seconds_to_adamw_final_vs_adamw"], "{:.3f}x"),
        ])  # fmt: skip
    loads = report["load_average_1min"]
    return (
        markdown_table(header, rows) + f"\n1-minute load average {min(loads):.1f}-{max(loads):.1f}"
    )


def plot(report: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, x_key, label in zip(
        axes, ("step", "time_s"), ("training step", "training wall time (s, interleaved)"),
        strict=True,
    ):  # fmt: skip
        for k, seed in enumerate(report["seeds"].values()):
            for i, (name, row) in enumerate(seed.items()):
                pts = [p for p in row["curve"] if p["step"] > 0]
                ax.plot([p[x_key] for p in pts], [p["eval_loss"] for p in pts], color=f"C{i}",
                        alpha=0.8, linewidth=1, label=name if k == 0 else None)  # fmt: skip
        ax.set_xlabel(label)
    axes[0].set_ylabel("eval loss (mean NLL per token)")
    axes[0].legend()
    lows = [p["eval_loss"] for s in report["seeds"].values() for r in s.values()
            for p in r["curve"] if p["step"] > 0]  # fmt: skip
    axes[0].set_ylim(min(lows) - 0.05, min(lows) + 2.5)
    fig.suptitle("configs/default.py, Muon vs AdamW, same budget (3 seeds)", fontsize=10)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "muon_vs_adamw.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="the default config's steps")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--eval_every", type=int, default=50)
    parser.add_argument("--eval_batches", type=int, default=8, help="0 = the whole split")
    parser.add_argument("--set", nargs="*", default=[], help="more KEY=VALUE overrides")
    parser.add_argument("--figures", type=Path, help="write muon_vs_adamw.png there")
    add_json_flag(parser)
    args = parser.parse_args(argv)

    def log(line):
        print(line, file=sys.stderr, flush=True)

    variants, per_seed, loads = None, {}, []
    for seed in args.seeds:
        data = SharedData(optimizer_config(REFERENCE, args, seed), args.eval_batches)
        if variants is None:  # one compiled step per optimizer, every seed
            variants = {
                name: Variant(name, optimizer_config(name, args, seed), data.mesh, data, args)
                for name in OPTIMIZERS
            }
        trained = train_side_by_side(variants, data, args, seed, log)
        loads += trained["loads"]
        per_seed[str(seed)] = seed_rows(trained)
    report = {
        "config": "configs/default.py",
        "steps": args.steps,
        "overrides": [*DATA, *args.set],
        "load_average_1min": loads,
        "cpu_count": os.cpu_count(),
        "summary": summarize(per_seed),
        "seeds": per_seed,
    }
    print(table(report), flush=True)
    if args.figures:
        log(f"muon_vs_adamw: wrote {plot(report, args.figures)}")
    write_json("muon_vs_adamw", report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
