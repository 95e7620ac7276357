"""The routing-complexity curriculum on the default adaptive-MoE job: none vs paper vs magnitude.

    python -m experiments curriculum --out runs/bench_curriculum            # 3 epochs each
    python -m experiments curriculum --out DIR --steps 600 --devices 8 --config.train.seed=1
    python -m experiments curriculum --out DIR --policies magnitude --source scoring_pass

Each policy trains configs/default.py from scratch (same seed, data and number of tokens;
only `data.curriculum` differs) through `jaxmoe.training.loop.train` with train.log_every=1, so
metrics.jsonl holds every step's wall time: the trainer reads step N's metrics after
dispatching step N+1, so the interval between two logged steps is one step of device time
plus the host work between them (the curriculum's fetch and, once per epoch, its ordering).
Evaluation and checkpoints happen only at the end, outside the timed steps. Step 1 holds
the compile and is left out; epoch 0 is the default shuffle under every policy, so the
"curriculum epochs" columns (epoch >= 1) are where the policies differ.

Also counted: XLA compilations of the train step per run (jax_log_compiles). jaxmoe's
dropless MoE runs its expert blocks in loops whose trip counts are traced values, so one
executable serves batches of any top-2 share: a bucketed-capacity layer would instead
compile once per capacity bucket the curriculum visits.

Writes DIR/curriculum.md (a table for docs/moe.md) and DIR/curriculum.json; with --json
also docs/results/YYYY-MM-DD-curriculum.json.
"""

import argparse
import json
import logging
import os
import re
import shutil
import sys
import time
from pathlib import Path

from benchmarks.results import add_json_flag, write_json

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("none", "paper", "magnitude")


class CompileCounter(logging.Handler):
    """Counts "Finished XLA compilation of jit(NAME)" log records per NAME."""

    PATTERN = re.compile(r"Finished XLA compilation of jit\((\w+)\)")

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.counts: dict[str, int] = {}

    def emit(self, record):
        match = self.PATTERN.search(record.getMessage())
        if match:
            self.counts[match.group(1)] = self.counts.get(match.group(1), 0) + 1


def percentile(values, q):
    import numpy as np

    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarize(times_s: list[float]) -> dict:
    import numpy as np

    times = np.asarray(times_s)
    return {
        "steps": int(times.size),
        "mean_ms": float(times.mean() * 1e3),
        "std_ms": float(times.std() * 1e3),
        "p10_ms": percentile(times, 10) * 1e3,
        "p50_ms": percentile(times, 50) * 1e3,
        "p90_ms": percentile(times, 90) * 1e3,
        "max_ms": float(times.max() * 1e3),
        "total_s": float(times.sum()),
    }


def run_policy(policy: str, args, overrides: list[str], counter: CompileCounter) -> dict:
    from jaxmoe.config.loading import load_config
    from jaxmoe.training.loop import train

    workdir = Path(args.out) / "runs" / policy
    shutil.rmtree(workdir, ignore_errors=True)
    config = load_config(
        str(ROOT / "configs" / "default.py"),
        [
            *overrides,
            f"data.curriculum={policy}",
            f"train.steps={args.steps}",
            "train.log_every=1",
            "train.eval_every=0",
            "train.checkpoint_every=0",
            f"data.curriculum_source={args.source}",
        ],
    )
    counter.counts.clear()
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    summary = train(config, str(workdir), progress=False)
    wall = time.perf_counter() - start
    return {
        "policy": policy,
        **analyze(workdir, args.steps_per_epoch, config.train.batch_size * config.train.seq_len),
        "wall_s": wall,
        "train_step_compiles": counter.counts.get("train_step", 0),
        "final_eval_loss": summary["eval"]["loss"],
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
    }


def analyze(workdir: Path, steps_per_epoch: int, tokens_per_step: int) -> dict:
    """Step-time statistics of a finished run from its metrics.jsonl."""
    import numpy as np

    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    train_lines = sorted((r for r in lines if r["split"] == "train"), key=lambda r: r["step"])
    timed = [r for r in train_lines if r["step"] >= 2]
    later = [r for r in timed if (r["step"] - 1) // steps_per_epoch >= 1]
    times = np.array([r["step_time_s"] for r in timed])
    top2_all = np.array([r["top2_fraction"] for r in timed])
    top2 = np.array([r["top2_fraction"] for r in later])
    # How much a batch's top-2 share moves its step time on this machine (all timed steps).
    slope, _ = np.polyfit(top2_all, times, 1) if top2_all.std() > 0 else (0.0, 0.0)
    return {
        "all_steps": summarize(times),
        "curriculum_epochs": summarize([r["step_time_s"] for r in later]) if later else None,
        "tokens_timed": tokens_per_step * len(timed),
        "tokens_per_s": tokens_per_step * len(timed) / float(times.sum()),
        "batch_top2_fraction": {
            "mean": float(top2.mean()) if top2.size else None,
            "std_over_steps": float(top2.std()) if top2.size else None,
            "min": float(top2.min()) if top2.size else None,
            "max": float(top2.max()) if top2.size else None,
        },
        "corr_step_time_top2": float(np.corrcoef(top2_all, times)[0, 1])
        if top2_all.std() > 0
        else None,
        "ms_per_0.1_top2": float(slope) * 100.0,
        "final_train_loss": train_lines[-1]["loss"],
        "prediction": predicted_vs_observed(workdir, train_lines, steps_per_epoch),
    }


def predicted_vs_observed(workdir: Path, train_lines: list[dict], steps_per_epoch: int):
    """For the last ordered epoch still on disk: does a batch's complexity as predicted by
    the stored vectors (mean over its examples) match the top-2 share it then showed?"""
    import numpy as np

    orders = sorted((workdir / "curriculum").glob("epoch_*.order.npy"))
    if not orders:
        return None
    epoch = int(orders[-1].name.split(".")[0].removeprefix("epoch_"))
    order = np.load(orders[-1])
    frozen = np.load(workdir / "curriculum" / f"epoch_{epoch:06d}.frozen.npy")
    by_step = {r["step"]: r["top2_fraction"] for r in train_lines}
    batch = len(order) // steps_per_epoch
    predicted, observed = [], []
    for position in range(steps_per_epoch):
        step = epoch * steps_per_epoch + position + 1
        ids = order[position * batch : (position + 1) * batch]
        ids = ids[frozen["seen"][ids]]
        if step in by_step and ids.size:
            predicted.append(float(frozen["top2"][ids].mean()))
            observed.append(by_step[step])
    if len(observed) < 3:
        return None
    return {
        "epoch": epoch,
        "corr_batch_predicted_observed": float(np.corrcoef(predicted, observed)[0, 1]),
        "predicted_range": [min(predicted), max(predicted)],
        "observed_range": [min(observed), max(observed)],
    }


def prediction(p: dict | None) -> str:
    if not p:
        return "-"
    (p0, p1), (o0, o1) = p["predicted_range"], p["observed_range"]
    return f"{p['corr_batch_predicted_observed']:.2f}, {p0:.3f}-{p1:.3f} vs {o0:.3f}-{o1:.3f}"


def markdown(results: list[dict], args, overrides: list[str]) -> str:
    def row(r, part):
        s = r[part]
        return f"{s['p10_ms']:.0f} / {s['p50_ms']:.0f} / {s['p90_ms']:.0f} / {s['max_ms']:.0f}"

    lines = [
        f"Default adaptive-MoE config, {args.steps} steps ({args.steps / args.steps_per_epoch:.1f} "
        f"epochs of {args.steps_per_epoch} steps), {args.devices} CPU device(s), complexities "
        f"from {args.source}, overrides: "
        f"{' '.join(overrides) or 'none'}. Step times exclude step 1 (compile).",
        "",
        "| policy | step ms p10 / p50 / p90 / max (all) | same, curriculum epochs | "
        "std ms (curr.) | timed total s | tokens/s | batch top-2 share: mean (min-max) | "
        "corr(step time, top-2 share) | predicted vs observed batch top-2: corr, ranges | "
        "train-step compiles | final eval loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        curr = r["curriculum_epochs"]
        t2 = r["batch_top2_fraction"]
        lines.append(
            f"| {r['policy']} | {row(r, 'all_steps')} | "
            f"{row(r, 'curriculum_epochs') if curr else '-'} | "
            f"{curr['std_ms']:.0f} | {r['all_steps']['total_s']:.1f} | {r['tokens_per_s']:.0f} | "
            f"{t2['mean']:.3f} ({t2['min']:.3f}-{t2['max']:.3f}) | "
            f"{r['corr_step_time_top2']:.2f} | {prediction(r['prediction'])} | "
            f"{r['train_step_compiles']} | {r['final_eval_loss']:.4f} |"
        )
    loads = ", ".join(
        f"{r['policy']} {r['load_average_before']:.1f}->{r['load_average_after']:.1f}"
        for r in results
    )
    lines += ["", f"1-minute load average during each run (machine shared): {loads}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for runs, markdown and JSON")
    parser.add_argument("--steps", type=int, default=234, help="steps per run (78 = 1 epoch)")
    parser.add_argument("--devices", type=int, default=1, help="CPU devices (data parallel)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument(
        "--source",
        default="previous_epoch",
        choices=("previous_epoch", "scoring_pass"),
        help="data.curriculum_source: where the complexities come from",
    )
    parser.add_argument(
        "--report_only",
        action="store_true",
        help="re-analyse the runs already in --out (no training) and rewrite the report",
    )
    add_json_flag(parser)
    args, rest = parser.parse_known_args(argv)
    overrides = [x.removeprefix("--") for x in rest]
    if any(not x.startswith("config.") for x in overrides):
        parser.error(f"unknown arguments {rest}; config overrides look like --config.a.b=v")
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax

    from jaxmoe.config.loading import load_config
    from jaxmoe.data.pipeline import build_data

    counter = CompileCounter()
    jax_logger = logging.getLogger("jax")
    jax_logger.addHandler(counter)
    jax_logger.propagate = False  # the counter reads the compile records; none are printed
    jax.config.update("jax_log_compiles", True)
    base = load_config(str(ROOT / "configs" / "default.py"), overrides)
    args.steps_per_epoch = build_data(base.data, base.train).train.steps_per_epoch
    if args.steps <= args.steps_per_epoch and not args.report_only:
        # The curriculum orders epochs 2 onwards: a shorter run has nothing to compare.
        parser.error(f"--steps {args.steps}: more than one epoch ({args.steps_per_epoch}) needed")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    if args.report_only:
        stored = json.loads((out / "curriculum.json").read_text())
        args.steps, args.devices, args.source = stored["steps"], stored["devices"], stored["source"]
        tokens_per_step = base.train.batch_size * base.train.seq_len
        for old in stored["results"]:
            workdir = out / "runs" / old["policy"]
            results.append({**old, **analyze(workdir, args.steps_per_epoch, tokens_per_step)})
    for policy in [] if args.report_only else args.policies.split(","):
        print(f"--- {policy}", flush=True)
        results.append(run_policy(policy, args, overrides, counter))
        print(json.dumps(results[-1]), flush=True)
    report = {
        "steps": args.steps,
        "devices": args.devices,
        "source": args.source,
        "overrides": overrides,
    }
    (out / "curriculum.json").write_text(json.dumps({**report, "results": results}, indent=1))
    text = markdown(results, args, overrides)
    (out / "curriculum.md").write_text(text)
    print(text)
    write_json("curriculum", {**report, "results": results}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
