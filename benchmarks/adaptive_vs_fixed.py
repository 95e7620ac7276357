"""The paper's Table 3 on this machine: is adaptive gating worth it? (Li et al. 2023)

Trains the default model (configs/default.py) as dense, top-1, top-2 and adaptive
(T = 0.1, 0.2) variants on the embedded corpus, with the same seed and data order, and
records for each: training wall-clock time and training FLOPs until a common target eval
loss (the paper's measure; linear interpolation between evaluations), the share of tokens
sent to two experts, and the final eval loss. Writes into --out:
  adaptive_vs_fixed.json   every number, per variant (time and FLOPs also relative to top-2)
  adaptive_vs_fixed.md     the table, next to the paper's numbers
  loss_vs_time.png         eval loss against training time and against training FLOPs

    python benchmarks/adaptive_vs_fixed.py --out runs/adaptive_vs_fixed           # ~8 min
    python benchmarks/adaptive_vs_fixed.py --quick --out /tmp/avf                 # ~1 min

Training time is the sum of the logged per-step wall times (train.log_every = 1), where the
steps that also carry a compilation (step 1) or an evaluation are counted at the run's median
step time: evaluation is not training. FLOPs come from jaxmoe.models.flops (matmuls, forward +
backward); for adaptive gating each step is counted with its measured share f of tokens sent
to two experts: FLOPs(top-1) + f * (FLOPs(top-2) - FLOPs(top-1)). The target loss is the
worst final eval loss among the MoE variants unless --target_loss is given; a variant that
never reaches it has no time to target. Variants run one after another: on a shared machine,
load from other processes changes step times between them (FLOPs are unaffected).
"""

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a fresh clone without installing
    sys.path.insert(0, str(ROOT))

from jaxmoe.config.loading import load_config  # noqa: E402
from jaxmoe.models.flops import train_flops_per_step  # noqa: E402

# name -> config overrides on top of configs/default.py
VARIANTS = {
    "dense": ["model.moe.num_experts=0"],
    "top1": ["model.moe.gating=top1"],
    "top2": ["model.moe.gating=top2"],
    "adaptive_T0.1": ["model.moe.gating=adaptive", "model.moe.threshold=0.1"],
    "adaptive_T0.2": ["model.moe.gating=adaptive", "model.moe.threshold=0.2"],
}
REFERENCE = "top2"
QUICK = [
    "model.num_layers=1",
    "model.d_model=32",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.head_dim=8",
    "model.ffn_dim=64",
    "model.moe.ffn_dim=32",
    "model.moe.dispatch=dense",  # the quickest MoE program to compile
    "train.batch_size=8",
    "train.seq_len=16",
    "train.eval_batches=1",
    "data.vocab_size=512",
]
# Li et al. 2023, Table 3, the LM task (GPT-2 on wikitext): time to equal loss relative to
# top-2 / final perplexity.
PAPER_ROW = {"dense": "0.84x / 16.3", "top2": "1x / 17.8", "top1": "1.14x / 16.5"}
PAPER_ROW |= {"adaptive_T0.1": "0.89x / 17.5"}


def variant_config(name: str, args):
    """configs/default.py with the variant's gate and the run's size/budget settings."""
    overrides = [*VARIANTS[name], *(QUICK if args.quick else [])]
    overrides += [
        f"train.steps={args.steps}",
        f"train.eval_every={args.eval_every}",
        "train.log_every=1",
        f"train.checkpoint_every={args.steps}",  # one checkpoint, at the end
        "train.max_to_keep=1",
        f"train.seed={args.seed}",
        f"optimizer.warmup_steps={args.warmup_steps}",
        "data.source=embedded",
    ]
    if args.eval_batches:
        overrides.append(f"train.eval_batches={args.eval_batches}")
    if args.cache_dir:
        overrides.append(f"data.cache_dir={args.cache_dir}")
    return load_config(str(ROOT / "configs" / "default.py"), [*overrides, *args.set])


def read_metrics(path: Path) -> tuple[dict, dict]:
    """({step: train line}, {step: eval line}) of a metrics.jsonl."""
    train, evals = {}, {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record["split"] in ("train", "eval"):  # not the run's goodput summary
            (train if record["split"] == "train" else evals)[record["step"]] = record
    return train, evals


def clean_step_times(times_S: np.ndarray, noisy_S: np.ndarray) -> np.ndarray:
    """Per-step times with the noisy ones (compile, evaluation) set to the others' median."""
    quiet = times_S[~noisy_S]
    median = float(np.median(quiet if quiet.size else times_S))
    return np.where(noisy_S, median, times_S)


def step_flops(model_cfg, batch_size: int, seq_len: int, top2_share_S) -> np.ndarray:
    """Training FLOPs of each step; adaptive / top-p counted at their measured top-2 share."""
    gating = model_cfg.moe.gating if model_cfg.moe.num_experts else "dense"
    if gating not in ("adaptive", "top_p"):
        return np.full(len(top2_share_S), train_flops_per_step(model_cfg, batch_size, seq_len))
    one, two = copy.deepcopy(model_cfg), copy.deepcopy(model_cfg)
    one.moe.gating, two.moe.gating = "top1", "top2"
    f1 = train_flops_per_step(one, batch_size, seq_len)
    f2 = train_flops_per_step(two, batch_size, seq_len)
    return f1 + np.asarray(top2_share_S, float) * (f2 - f1)


def reach(eval_steps, eval_losses, cumulative_S, target: float):
    """(fractional step, cost) at which the eval loss first reaches `target`, or None.

    The loss is interpolated linearly between evaluations; the cost likewise between steps
    (cumulative_S[s] = cost of steps 1..s, cumulative_S[0] = 0). Reached at the first
    evaluation: that evaluation's step (no earlier point to interpolate from).
    """
    for k, (step, loss) in enumerate(zip(eval_steps, eval_losses, strict=True)):
        if loss > target:
            continue
        if k == 0 or eval_losses[k - 1] == loss:
            at = float(step)
        else:
            prev_step, prev_loss = eval_steps[k - 1], eval_losses[k - 1]
            at = prev_step + (prev_loss - target) / (prev_loss - loss) * (step - prev_step)
        cost = float(np.interp(at, np.arange(len(cumulative_S)), cumulative_S))
        return at, cost
    return None


def run_variant(name: str, args, workdir: Path) -> dict:
    """Train one variant; its curve of (step, eval loss, training time, FLOPs) and totals."""
    from jaxmoe.training.loop import train

    config = variant_config(name, args)
    if (workdir / "metrics.jsonl").exists():
        raise ValueError(f"--workdir: {workdir} already holds a run; pass a fresh --workdir")
    start = time.perf_counter()
    train(config, str(workdir), progress=False)  # resolves model.vocab_size in place
    wall = time.perf_counter() - start
    train_lines, eval_lines = read_metrics(workdir / "metrics.jsonl")
    steps = sorted(train_lines)
    if steps != list(range(1, config.train.steps + 1)):
        raise RuntimeError(f"{name}: expected a train line for every step, got {len(steps)}")
    times_S = np.array([train_lines[s]["step_time_s"] for s in steps])
    noisy_S = np.array([s == 1 or s in eval_lines for s in steps])
    times_S = clean_step_times(times_S, noisy_S)
    share_S = np.array([train_lines[s].get("top2_fraction", math.nan) for s in steps])
    flops_S = step_flops(config.model, config.train.batch_size, config.train.seq_len, share_S)
    eval_steps = sorted(eval_lines)
    cum_time = np.concatenate([[0.0], np.cumsum(times_S)])
    cum_flops = np.concatenate([[0.0], np.cumsum(flops_S)])
    final = eval_lines[eval_steps[-1]]
    moe = config.model.moe
    tail = share_S[-max(1, len(share_S) // 10) :]
    return {
        "variant": name,
        "gating": moe.gating if moe.num_experts else "dense",
        "threshold": float(moe.threshold) if moe.gating == "adaptive" else None,
        "final_eval_loss": final["loss"],
        "final_eval_perplexity": final["perplexity"],
        "top2_share": None if not moe.num_experts else float(np.mean(share_S)),
        "top2_share_last_10pct": None if not moe.num_experts else float(np.mean(tail)),
        "train_time_s": float(cum_time[-1]),
        "median_step_s": float(np.median(times_S)),
        "wall_s": wall,
        "train_flops": float(cum_flops[-1]),
        "curve": [
            {
                "step": s,
                "loss": eval_lines[s]["loss"],
                "time_s": float(cum_time[s]),
                "flops": float(cum_flops[s]),
            }
            for s in eval_steps
        ],
        "_cumulative": (cum_time, cum_flops),
    }


def add_targets(results: dict, target: float) -> None:
    """Time / FLOPs / steps to the target loss, and ratios to the reference variant."""
    for r in results.values():
        steps = [p["step"] for p in r["curve"]]
        losses = [p["loss"] for p in r["curve"]]
        cum_time, cum_flops = r.pop("_cumulative")
        at_time = reach(steps, losses, cum_time, target)
        at_flops = reach(steps, losses, cum_flops, target)
        r["steps_to_target"] = None if at_time is None else at_time[0]
        r["time_to_target_s"] = None if at_time is None else at_time[1]
        r["flops_to_target"] = None if at_flops is None else at_flops[1]
    ref = results.get(REFERENCE)
    for r in results.values():
        for key, ratio in (
            ("time_to_target_s", "time_vs_top2"),
            ("flops_to_target", "flops_vs_top2"),
        ):
            base = ref and ref[key]
            r[ratio] = r[key] / base if (r[key] is not None and base) else None


def _x(value) -> str:
    return "not reached" if value is None else f"{value:.2f}x"


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [
        "# Adaptive vs fixed gating (the paper's Table 3, measured here)",
        "",
        f"Default model ({s['model']}), embedded corpus, {s['steps']} steps of "
        f"{s['batch_size']} x {s['seq_len']} tokens, seed {s['seed']}, eval every "
        f"{s['eval_every']} steps, {s['device']}. Target eval loss {report['target_loss']:.4f} "
        f"({report['target_rule']}). Time and FLOPs until the target, relative to top-2.",
        "",
        "| variant | time to target | FLOPs to target | final eval loss (ppl) | tokens to two "
        "experts | train time (s) | paper (time / ppl) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in report["variants"].items():
        share = "-" if r["top2_share"] is None else f"{100 * r['top2_share']:.1f}%"
        lines.append(
            f"| {name} | {_x(r['time_vs_top2'])} | {_x(r['flops_vs_top2'])} | "
            f"{r['final_eval_loss']:.4f} ({r['final_eval_perplexity']:.1f}) | {share} | "
            f"{r['train_time_s']:.1f} | {PAPER_ROW.get(name, '-')} |"
        )
    lines += [
        "",
        "Paper: Li et al. 2023, Table 3, GPT-2 on wikitext (time to equal loss vs top-2 / "
        "perplexity); they sent 11-26% of tokens to two experts depending on the task.",
        "",
    ]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_f) = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for name, r in report["variants"].items():
        losses = [p["loss"] for p in r["curve"]]
        ax_t.plot([p["time_s"] for p in r["curve"]], losses, marker=".", label=name)
        ax_f.plot([p["flops"] / 1e12 for p in r["curve"]], losses, marker=".", label=name)
    for ax in (ax_t, ax_f):
        ax.axhline(report["target_loss"], color="gray", linestyle="--", linewidth=1)
    ax_t.set_xlabel("training time (s)")
    ax_f.set_xlabel("training FLOPs (1e12)")
    ax_t.set_ylabel("eval loss")
    ax_t.legend(fontsize=8)
    ax_t.set_title("eval loss vs time (dashed: target)", fontsize=10)
    ax_f.set_title("eval loss vs FLOPs", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the table, JSON and plot")
    p.add_argument("--workdir", default=None, help="training runs (default: OUT/runs)")
    p.add_argument("--steps", type=int, default=None, help="steps per variant (default 100)")
    p.add_argument("--warmup_steps", type=int, default=None, help="default 20 (quick: 1)")
    p.add_argument("--eval_every", type=int, default=None, help="default steps / 10")
    p.add_argument("--eval_batches", type=int, default=0, help="0: the whole validation split")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target_loss", type=float, default=None)
    p.add_argument("--cache_dir", default="", help="data.cache_dir (default ~/.cache/jaxmoe)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override"
    )
    p.add_argument(
        "--compile_cache",
        default=None,
        help="JAX persistent compilation cache (default: WORKDIR/jax_cache; 'none': off); "
        "variants that share a program (the parameter init) compile it once",
    )
    p.add_argument("--quick", action="store_true", help="tiny model, 4 steps: a smoke test")
    args = p.parse_args(argv)
    args.steps = args.steps or (4 if args.quick else 100)
    if args.warmup_steps is None:
        args.warmup_steps = 1 if args.quick else 20
    args.eval_every = args.eval_every or max(1, args.steps // (2 if args.quick else 10))
    names = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    args.variants = names
    return args


def main(argv=None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import jax

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = Path(args.workdir) if args.workdir else out / "runs"
    if args.compile_cache != "none":
        jax.config.update(
            "jax_compilation_cache_dir", args.compile_cache or str(runs / "jax_cache")
        )
    results = {}
    for name in args.variants:
        print(f"== {name}", flush=True)
        results[name] = run_variant(name, args, runs / name)
    moe_losses = [r["final_eval_loss"] for r in results.values() if r["gating"] != "dense"]
    if args.target_loss is not None:
        target, rule = args.target_loss, "--target_loss"
    else:
        losses = moe_losses or [r["final_eval_loss"] for r in results.values()]
        target, rule = max(losses), "the worst final eval loss among the MoE variants"
    add_targets(results, target)
    config = variant_config(REFERENCE, args)  # the settings every variant shares
    m = config.model
    report = {
        "target_loss": target,
        "target_rule": rule,
        "settings": {
            "steps": args.steps,
            "eval_every": args.eval_every,
            "batch_size": config.train.batch_size,
            "seq_len": config.train.seq_len,
            "seed": args.seed,
            "warmup_steps": args.warmup_steps,
            "model": (
                f"{m.num_layers} layers, d {m.d_model}, {m.num_heads} heads / {m.num_kv_heads} "
                f"KV, {m.moe.num_experts} experts of {m.moe.ffn_dim} (dense FFN {m.ffn_dim})"
            ),
            "device": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
            "quick": args.quick,
            "overrides": args.set,
        },
        "variants": results,
    }
    (out / "adaptive_vs_fixed.json").write_text(json.dumps(report, indent=1))
    (out / "adaptive_vs_fixed.md").write_text(markdown(report))
    plot(report, out / "loss_vs_time.png")
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
