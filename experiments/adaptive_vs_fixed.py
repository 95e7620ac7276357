"""The paper's Table 3 on this machine: is adaptive gating worth it? (Li et al. 2023)

Trains dense, top-1, top-2 and adaptive variants on the embedded corpus, with the same seeds
and data order, and records for each: training wall-clock time and training FLOPs until a
common target eval loss (the paper's measure; linear interpolation between evaluations),
the share of tokens sent to two experts, and the final eval loss. Two settings:

  paper (default)  as the paper ran it: a 2-layer model whose MoE FFNs are most of a step's
                   FLOPs (printed), adaptive T = 0.1 trained with the routing curriculum
                   (data.curriculum=paper), top-1 evaluation for every MoE model
                   (model.moe.eval_gating=top1), no router z-loss, top-2 balanced on top-1
                   choices (GShard), a dense FFN of one expert's width (`dense`) and one of
                   two experts' width (`dense_x2`, compute-matched to top-2); seeds 0, 1, 2
  plain            configs/default.py as is (4 layers, training gate at evaluation)

After training, the variants' final models take turns on the same batches in this one
process (experiments.interleaved_steps): their step-time ratios are what load on a shared
machine changes least. Writes into --out:
  adaptive_vs_fixed.json   every number, per seed and variant, and mean / std over seeds
  adaptive_vs_fixed.md     the table, next to the paper's numbers
  loss_vs_time.png         eval loss against training time and against training FLOPs
and with --json also docs/results/YYYY-MM-DD-adaptive_vs_fixed.json.

    python -m experiments adaptive_vs_fixed --out runs/avf                 # paper, 3 seeds
    python -m experiments adaptive_vs_fixed --out runs/avf --variants adaptive_T0.1_gap_none
    python -m experiments adaptive_vs_fixed --setting plain --seeds 0 --out runs/avf_plain
    python -m experiments adaptive_vs_fixed --quick --out /tmp/avf        # ~2 min smoke test

Training time is the sum of the logged per-step wall times (train.log_every = 1), where the
steps that also carry a compilation (step 1) or an evaluation are counted at the run's median
step time: evaluation is not training. FLOPs come from jaxmoe.models.flops (matmuls, forward +
backward); for adaptive gating each step is counted with its measured share f of tokens sent
to two experts: FLOPs(top-1) + f * (FLOPs(top-2) - FLOPs(top-1)). The target loss of a seed
is the worst final eval loss among its main MoE variants (ablations excluded) unless
--target_loss is given; a variant that never reaches it has no time to target. A finished
run under --workdir is reused (its result is kept in the run's avf_result.json), so
ablations can be added to a finished benchmark.
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.results import add_json_flag, write_json
from jaxmoe.config.loading import load_config
from jaxmoe.models.flops import ffn_macs_per_token, train_flops_per_step
from jaxmoe.models.layer_kinds import is_moe_layer

ROOT = Path(__file__).resolve().parents[1]

ADAPTIVE = ["model.moe.gating=adaptive", "model.moe.threshold=0.1"]
CURRICULUM = ["data.curriculum=paper"]
# GShard's implementation (and the paper's baselines) count top-2's balance loss on top-1.
GSHARD_BALANCE = ["model.moe.balance_fractions=top1"]
SETTINGS = {
    "paper": {
        "model": [
            "model.num_layers=2",
            "model.moe.ffn_dim=512",
            # Finer expert blocks: the dropless CPU dispatch pads each expert's rows to a
            # block, so with 256-row blocks a 20% top-2 share already costs top-2's blocks.
            "model.moe.block_size=64",
            "model.moe.z_loss_weight=0.0",  # the paper uses no router z-loss
            "model.moe.eval_gating=top1",  # the paper evaluates every model with top-1
        ],
        "variants": {
            "dense": ["model.moe.num_experts=0"],  # FFN of one expert's width (below)
            "dense_x2": ["model.moe.num_experts=0"],  # FFN of two experts' width
            "top1": ["model.moe.gating=top1", *GSHARD_BALANCE],
            "top2": ["model.moe.gating=top2", *GSHARD_BALANCE],
            "adaptive_T0.1": [*ADAPTIVE, *CURRICULUM],
        },
        # Option choices the paper leaves open, one change each from the main variants.
        "ablations": {
            "adaptive_T0.1_no_curriculum": ADAPTIVE,
            "adaptive_T0.1_gap_none": [*ADAPTIVE, *CURRICULUM, "model.moe.gap_normalization=none"],
            "adaptive_T0.1_balance_chosen": [
                *ADAPTIVE,
                *CURRICULUM,
                "model.moe.balance_fractions=chosen",
            ],
            "adaptive_T0.1_renormalize": [*ADAPTIVE, *CURRICULUM, "model.moe.renormalize=true"],
            "top2_balance_chosen": ["model.moe.gating=top2", "model.moe.balance_fractions=chosen"],
        },
        "seeds": "0,1,2",
        "steps": 312,  # 4 epochs of the embedded corpus: the curriculum orders epochs 2 to 4
    },
    "plain": {
        "model": [],
        "variants": {
            "dense": ["model.moe.num_experts=0"],
            "top1": ["model.moe.gating=top1"],
            "top2": ["model.moe.gating=top2"],
            "adaptive_T0.1": ADAPTIVE,
            "adaptive_T0.2": ["model.moe.gating=adaptive", "model.moe.threshold=0.2"],
        },
        "ablations": {},
        "seeds": "0",
        "steps": 100,
    },
}
# Dense FFN width in experts' widths (model.moe.ffn_dim), where a setting fixes it.
DENSE_WIDTH = {("paper", "dense"): 1, ("paper", "dense_x2"): 2}
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
# top-2 / final perplexity. Their dense model is the original GPT-2 (one FFN, one expert's
# width).
PAPER_ROW = {"dense": "0.84x / 16.3", "top2": "1x / 17.8", "top1": "1.14x / 16.5"}
PAPER_ROW |= {"adaptive_T0.1": "0.89x / 17.5"}


def all_variants(setting: str) -> dict:
    return SETTINGS[setting]["variants"] | SETTINGS[setting]["ablations"]


def variant_config(name: str, args, seed: int):
    """The setting's model with the variant's gate and the run's size/budget settings."""
    overrides = [*SETTINGS[args.setting]["model"], *all_variants(args.setting)[name]]
    overrides += QUICK if args.quick else []
    overrides += [
        f"train.steps={args.steps}",
        f"train.eval_every={args.eval_every}",
        "train.log_every=1",
        f"train.checkpoint_every={args.steps}",  # one checkpoint, at the end
        "train.max_to_keep=1",
        f"train.seed={seed}",
        f"optimizer.warmup_steps={args.warmup_steps}",
        "data.source=embedded",
    ]
    if args.eval_batches:
        overrides.append(f"train.eval_batches={args.eval_batches}")
    if args.cache_dir:
        overrides.append(f"data.cache_dir={args.cache_dir}")
    config = load_config(str(ROOT / "configs" / "default.py"), [*overrides, *args.set])
    width = DENSE_WIDTH.get((args.setting, name))
    if width:
        model = config.model
        config = config.replace(model=model.replace(ffn_dim=width * model.moe.ffn_dim))
    return config


def moe_flops_share(model_cfg, batch_size: int, seq_len: int) -> float:
    """Share of a training step's model FLOPs spent in the MoE FFN layers (router included)."""
    moe_macs = sum(
        ffn_macs_per_token(model_cfg, i)
        for i in range(model_cfg.num_layers)
        if is_moe_layer(model_cfg, i)
    )
    return (
        6 * batch_size * seq_len * moe_macs / train_flops_per_step(model_cfg, batch_size, seq_len)
    )


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
    gating = model_cfg.moe.gate.gating if model_cfg.moe.num_experts else "dense"
    if gating not in ("adaptive", "top_p"):
        return np.full(len(top2_share_S), train_flops_per_step(model_cfg, batch_size, seq_len))
    one, two = (model_cfg.replace(moe=model_cfg.moe.replace(gating=g)) for g in ("top1", "top2"))
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


def run_variant(name: str, args, seed: int, workdir: Path) -> dict | None:
    """Train one variant (or reuse its finished run); its curve and totals (None: not run,
    under --report_only)."""
    from jaxmoe.training.loop import train

    config = variant_config(name, args, seed)
    saved = workdir / "avf_result.json"
    if saved.exists():
        result = json.loads(saved.read_text())
        if result["steps"] == config.train.steps and result["overrides"] == args.set:
            print(f"   reusing {workdir}", flush=True)
            result["_config"] = config
            return result
        raise ValueError(f"--workdir: {workdir} holds a run with other settings; pass another")
    if args.report_only:
        return None
    if (workdir / "metrics.jsonl").exists():
        raise ValueError(f"--workdir: {workdir} holds an unfinished run; remove it or pass another")
    load_before = os.getloadavg()[0]
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
    result = {
        "variant": name,
        "seed": seed,
        "steps": config.train.steps,
        "overrides": args.set,
        "gating": moe.gate.gating if moe.num_experts else "dense",
        "eval_gating": (moe.eval_gating or moe.gate.gating) if moe.num_experts else "dense",
        "curriculum": config.data.curriculum,
        "threshold": moe.gate.threshold if moe.gate.gating == "adaptive" else None,
        "final_eval_loss": final["loss"],
        "final_eval_perplexity": final["perplexity"],
        "top2_share": None if not moe.num_experts else float(np.mean(share_S)),
        "top2_share_last_10pct": None if not moe.num_experts else float(np.mean(tail)),
        "train_time_s": float(cum_time[-1]),
        "median_step_s": float(np.median(times_S)),
        "wall_s": wall,
        "load_average_1min": [load_before, os.getloadavg()[0]],
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
        "cumulative_time_s": cum_time.tolist(),
        "cumulative_flops": cum_flops.tolist(),
    }
    saved.write_text(json.dumps(result))
    result["_config"] = config
    return result


def add_train_gate_loss(result: dict, workdir: Path) -> None:
    """The final model's validation loss with its training gate (top-2 / adaptive), next to
    the evaluation gate's; kept in the run's avf_result.json."""
    if result["gating"] in ("dense", result["eval_gating"]):
        result["final_eval_loss_train_gate"] = result["final_eval_loss"]
        return
    if "final_eval_loss_train_gate" not in result:
        from jaxmoe.inference.evaluate import evaluate

        gate = [f"model.moe.eval_gating={result['gating']}"]
        result["final_eval_loss_train_gate"] = evaluate(str(workdir), "embedded", overrides=gate)[
            "loss"
        ]
        saved = {k: v for k, v in result.items() if not k.startswith("_")}
        (workdir / "avf_result.json").write_text(json.dumps(saved))


def add_targets(results: dict, target: float) -> None:
    """Time / FLOPs / steps to the target loss, and ratios to the reference variant."""
    for r in results.values():
        steps = [p["step"] for p in r["curve"]]
        losses = [p["loss"] for p in r["curve"]]
        at_time = reach(steps, losses, np.asarray(r["cumulative_time_s"]), target)
        at_flops = reach(steps, losses, np.asarray(r["cumulative_flops"]), target)
        r["steps_to_target"] = None if at_time is None else at_time[0]
        r["time_to_target_s"] = None if at_time is None else at_time[1]
        r["flops_to_target"] = None if at_flops is None else at_flops[1]
    ref = results.get(REFERENCE)
    for r in results.values():
        for key, ratio in (
            ("time_to_target_s", "time_vs_top2"),
            ("flops_to_target", "flops_vs_top2"),
            ("steps_to_target", "steps_vs_top2"),
        ):
            base = ref and ref[key]
            r[ratio] = r[key] / base if (r[key] is not None and base) else None


SUMMARY_KEYS = (
    "time_vs_top2",
    "flops_vs_top2",
    "steps_vs_top2",
    "steps_to_target",
    "final_eval_loss",
    "final_eval_loss_train_gate",
    "top2_share",
    "train_time_s",
)


def summarize(per_seed: dict) -> dict:
    """{variant: {key: {mean, std, values}}} over seeds (std: sample std, ddof 1; None
    values, e.g. a target never reached, are left out and counted in `reached`)."""
    names = list(dict.fromkeys(n for seed in per_seed.values() for n in seed["variants"]))
    out = {}
    for name in names:
        rows = [seed["variants"][name] for seed in per_seed.values() if name in seed["variants"]]
        out[name] = {"reached": sum(r["steps_to_target"] is not None for r in rows)}
        out[name]["seeds"] = len(rows)
        for key in SUMMARY_KEYS:
            values = [r[key] for r in rows if r.get(key) is not None]
            out[name][key] = {
                "mean": float(np.mean(values)) if values else None,
                "std": float(np.std(values, ddof=1)) if len(values) > 1 else None,
                "values": values,
            }
    return out


def _ms(stat, fmt="{:.2f}", suffix="") -> str:
    """'mean ± std' of a summary entry ('-' when nothing was measured)."""
    if stat["mean"] is None:
        return "-"
    text = fmt.format(stat["mean"]) + suffix
    return text if stat["std"] is None else f"{text} ± {fmt.format(stat['std'])}"


def markdown(report: dict) -> str:
    s = report["settings"]
    seeds = ", ".join(str(k) for k in report["seeds"])
    times = report.get("step_times") or {"variants": {}}
    lines = [
        "# Adaptive vs fixed gating (FLOPs to the worst final loss, 1 CPU device)",
        "",
        f"Setting `{s['setting']}`: {s['model']}; MoE FFN share of a step's FLOPs "
        f"{s['moe_flops_share']['top1']:.0%} (top-1) / {s['moe_flops_share']['top2']:.0%} "
        f"(top-2). Embedded corpus, {s['steps']} steps of {s['batch_size']} x {s['seq_len']} "
        f"tokens, eval every {s['eval_every']} steps, seeds {seeds}, {s['device']}. Target "
        f"per seed: {report['target_rule']}. Ratios are to top-2 in the same seed; mean ± "
        "std over seeds. Step time: median per-step time of the final models taking turns on "
        "the same batches in one process, relative to top-2.",
        "",
        "| variant | FLOPs to target | time to target | steps to target | step time "
        "(interleaved) | final eval loss | same, training gate | tokens to two experts | "
        "paper, GPT-2 wikitext: wall time to top-2's quality / ppl |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["summary"].items():
        reached = "" if r["reached"] == r["seeds"] else f" ({r['reached']}/{r['seeds']} reached)"
        share = r["top2_share"]
        share = "-" if share["mean"] is None else _ms(share, "{:.1%}")
        step = times["variants"].get(name, {}).get("step_time_vs_" + REFERENCE)
        lines.append(
            f"| {name} | {_ms(r['flops_vs_top2'], suffix='x')}{reached} | "
            f"{_ms(r['time_vs_top2'], suffix='x')} | {_ms(r['steps_to_target'], '{:.0f}')} | "
            f"{'-' if step is None else f'{step:.2f}x'} | "
            f"{_ms(r['final_eval_loss'], '{:.3f}')} | "
            f"{_ms(r['final_eval_loss_train_gate'], '{:.3f}')} | {share} | "
            f"{PAPER_ROW.get(name, '-')} |"
        )
    targets = ", ".join(f"{k}: {v['target_loss']:.4f}" for k, v in report["seeds"].items())
    runs = [r for seed in report["seeds"].values() for r in seed["variants"].values()]
    loads = [x for r in runs for x in r["load_average_1min"]]
    note = (
        f"Targets (eval loss) by seed: {targets}. 1-minute load average during the training "
        f"runs {min(loads):.1f}-{max(loads):.1f}"
    )
    if times["variants"]:
        lo, hi = times["load_average_1min"]
        ms = ", ".join(
            f"{k} {1e3 * v['median_step_s']:.0f} ms" for k, v in times["variants"].items()
        )
        note += (
            f", during the interleaved timing ({times['rounds']} rounds, seed "
            f"{times['seed']}'s models) {lo:.1f}-{hi:.1f}: median step {ms}"
        )
    lines += ["", note + "."]
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
    colors = {}
    for k, seed in enumerate(report["seeds"].values()):
        for name, r in seed["variants"].items():
            color = colors.setdefault(name, f"C{len(colors) % 10}")
            losses = [p["loss"] for p in r["curve"]]
            label = name if k == 0 else None
            ax_t.plot([p["time_s"] for p in r["curve"]], losses, color=color, label=label)
            ax_f.plot([p["flops"] / 1e12 for p in r["curve"]], losses, color=color)
    for ax in (ax_t, ax_f):
        for seed in report["seeds"].values():
            ax.axhline(seed["target_loss"], color="gray", linestyle="--", linewidth=1)
    ax_t.set_xlabel("training time (s, sequential runs)")
    ax_f.set_xlabel("training FLOPs (1e12)")
    ax_t.set_ylabel("eval loss")
    ax_t.legend(fontsize=8)
    ax_t.set_title("eval loss vs time (dashed: targets)", fontsize=10)
    ax_f.set_title("eval loss vs FLOPs (one line per seed)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the table, JSON and plot")
    p.add_argument("--workdir", default=None, help="training runs (default: OUT/runs)")
    p.add_argument("--setting", choices=list(SETTINGS), default="paper")
    p.add_argument("--steps", type=int, default=None, help="steps per variant (paper: 312)")
    p.add_argument("--warmup_steps", type=int, default=None, help="default 20 (quick: 1)")
    p.add_argument("--eval_every", type=int, default=None, help="default steps / 10")
    p.add_argument("--eval_batches", type=int, default=0, help="0: the whole validation split")
    p.add_argument("--seeds", default=None, help="comma-separated (paper: 0,1,2)")
    p.add_argument("--target_loss", type=float, default=None)
    p.add_argument("--cache_dir", default="", help="data.cache_dir (default ~/.cache/jaxmoe)")
    p.add_argument(
        "--variants",
        default=None,
        help="comma-separated (default: the setting's main variants); ablations: "
        + ", ".join(SETTINGS["paper"]["ablations"]),
    )
    p.add_argument(
        "--step_rounds",
        type=int,
        default=None,
        help="interleaved timing rounds after training (default 10, quick 2; 0: none)",
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override"
    )
    p.add_argument(
        "--compile_cache",
        default=None,
        help="JAX persistent compilation cache (default: WORKDIR/jax_cache; 'none': off); "
        "variants that share a program (the parameter init) compile it once",
    )
    p.add_argument(
        "--step_times",
        default="",
        metavar="JSON",
        help="take the interleaved step times from an earlier run's adaptive_vs_fixed.json",
    )
    p.add_argument(
        "--train_gate_eval",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also evaluate each main final MoE model with its training gate (default on)",
    )
    p.add_argument(
        "--report_only",
        action="store_true",
        help="train nothing: report the finished runs under --workdir (others left out)",
    )
    p.add_argument("--quick", action="store_true", help="tiny model, 4 steps: a smoke test")
    add_json_flag(p)
    args = p.parse_args(argv)
    setting = SETTINGS[args.setting]
    args.steps = args.steps or (4 if args.quick else setting["steps"])
    if args.warmup_steps is None:
        args.warmup_steps = 1 if args.quick else 20
    args.eval_every = args.eval_every or max(1, args.steps // (2 if args.quick else 10))
    if args.step_rounds is None:
        args.step_rounds = 2 if args.quick else 10
    names = [v for v in (args.variants or ",".join(setting["variants"])).split(",") if v]
    unknown = sorted(set(names) - set(all_variants(args.setting)))
    if unknown:
        p.error(
            f"--variants: unknown {unknown} for --setting {args.setting}; choose from "
            f"{list(all_variants(args.setting))}"
        )
    args.variants = names
    try:
        args.seeds = [int(x) for x in (args.seeds or setting["seeds"]).split(",") if x]
    except ValueError:
        p.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    return args


def run_seed(args, seed: int, runs: Path) -> dict | None:
    """Every variant of one seed, with the seed's target and the ratios to top-2 (None:
    nothing finished, under --report_only)."""
    results = {}
    for name in args.variants:
        print(f"== seed {seed}: {name}", flush=True)
        result = run_variant(name, args, seed, runs / f"seed{seed}" / name)
        if result is not None:
            results[name] = result
            if args.train_gate_eval and name in SETTINGS[args.setting]["variants"]:
                add_train_gate_loss(result, runs / f"seed{seed}" / name)
    if not results:
        return None
    main_names = SETTINGS[args.setting]["variants"]
    moe_losses = [
        r["final_eval_loss"]
        for name, r in results.items()
        if r["gating"] != "dense" and name in main_names
    ]
    if args.target_loss is not None:
        target, rule = args.target_loss, "--target_loss"
    else:
        losses = moe_losses or [r["final_eval_loss"] for r in results.values()]
        target, rule = max(losses), "the worst final eval loss among the main MoE variants"
    add_targets(results, target)
    return {"target_loss": target, "target_rule": rule, "variants": results}


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import jax

    from experiments.interleaved_steps import interleaved_step_times

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = Path(args.workdir) if args.workdir else out / "runs"
    if args.compile_cache != "none":
        jax.config.update(
            "jax_compilation_cache_dir", args.compile_cache or str(runs / "jax_cache")
        )
    config = variant_config(REFERENCE, args, args.seeds[0])  # the settings every variant shares
    m = config.model.replace(vocab_size=config.data.vocab_size)  # the trained tokenizer's size
    t = config.train
    shares = {}
    for gating in ("top1", "top2"):
        one = m.replace(moe=m.moe.replace(gating=gating))
        shares[gating] = moe_flops_share(one, t.batch_size, t.seq_len)
    print(
        f"MoE FFN share of a training step's FLOPs: top-1 {shares['top1']:.1%}, "
        f"top-2 {shares['top2']:.1%}",
        flush=True,
    )
    per_seed = {}
    for seed in args.seeds:
        result = run_seed(args, seed, runs)
        if result is not None:
            per_seed[seed] = result
    if not per_seed:
        raise RuntimeError(f"--report_only: no finished run under {runs}")
    step_times = None
    if args.step_times:  # measured by an earlier invocation (its adaptive_vs_fixed.json)
        step_times = json.loads(Path(args.step_times).read_text())["step_times"]
    elif args.step_rounds:
        first = next(iter(per_seed))
        timed = {
            name: (r["_config"], str(runs / f"seed{first}" / name))
            for name, r in per_seed[first]["variants"].items()
        }
        print(f"== interleaved step times ({args.step_rounds} rounds)", flush=True)
        step_times = interleaved_step_times(timed, REFERENCE, rounds=args.step_rounds)
        step_times["seed"] = first
    for seed in per_seed.values():
        for r in seed["variants"].values():
            for key in ("_config", "cumulative_time_s", "cumulative_flops"):
                r.pop(key, None)
    report = {
        "target_rule": next(iter(per_seed.values()))["target_rule"],
        "settings": {
            "setting": args.setting,
            "steps": args.steps,
            "eval_every": args.eval_every,
            "batch_size": t.batch_size,
            "seq_len": t.seq_len,
            "seeds": args.seeds,
            "warmup_steps": args.warmup_steps,
            "model": (
                f"{m.num_layers} layers, d {m.d_model}, {m.num_heads} heads / {m.num_kv_heads} "
                f"KV, {m.moe.num_experts} experts of {m.moe.ffn_dim}"
            ),
            "moe_flops_share": shares,
            "device": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
            "quick": args.quick,
            "overrides": args.set,
        },
        "seeds": per_seed,
        "summary": summarize(per_seed),
        "step_times": step_times,
    }
    (out / "adaptive_vs_fixed.json").write_text(json.dumps(report, indent=1))
    (out / "adaptive_vs_fixed.md").write_text(markdown(report))
    plot(report, out / "loss_vs_time.png")
    print(markdown(report))
    write_json("adaptive_vs_fixed", report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
