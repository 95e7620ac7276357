"""Time to equal loss in seconds: dense, top-1, top-2 and adaptive (T 0.05-0.4), side by side.

The paper's headline (Li et al. 2023, Table 3) is wall time until every model reaches the
same loss. On a shared machine runs trained one after another see different load, so here
every variant trains in this one process, step by step in turns (order rotated each step)
on the same batch: each variant's step times are measured under the same load, and the
load average is recorded next to them. Per variant and seed:

- eval loss over training with the model's own gate and with top-1 gating;
- seconds, FLOPs and steps until the eval loss first reaches the target (linear
  interpolation between evaluations; experiments.adaptive_vs_fixed.reach);
- the share of tokens whose router is concentrated on its top-1 expert (normalised gap
  p1 - p2 at least T = 0.1, what the paper's adaptive gate sends to one expert), per MoE
  layer at each evaluation, for every MoE model (the paper: at least 55%);
- for adaptive models, each training example's per-layer top-2 fractions as trained
  (routing.npz: what experiments.stragglers simulates data-parallel steps with).

Target rule, fixed before the runs: a pilot dense model trained with another seed (--pilot_seed)
for the same steps; target = initial - TARGET_FRACTION x (initial - final) of its eval loss.

    python -m experiments time_to_target --out runs/ttt --json    # 3 seeds, ~40 min on 2 cores
    python -m experiments time_to_target --out /tmp/ttt --quick   # tiny smoke test (~3 min)

Writes OUT/time_to_target.json (everything), OUT/routing.npz, OUT/loss_vs_*.png, with
--json docs/results/YYYY-MM-DD-time_to_target.json, and with --figures DIR the plots there.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.results import add_json_flag, markdown_table, write_json
from experiments.adaptive_vs_fixed import GSHARD_BALANCE, reach, step_flops

ROOT = Path(__file__).resolve().parents[1]
THRESHOLDS = (0.1, 0.05, 0.2, 0.3, 0.4)  # the paper's main value, then its ablation
VARIANTS = {
    "dense": ["model.moe.num_experts=0"],  # one FFN of one expert's width
    "top1": ["model.moe.gating=top1", *GSHARD_BALANCE],
    "top2": ["model.moe.gating=top2", *GSHARD_BALANCE],
} | {
    f"adaptive_T{t}": ["model.moe.gating=adaptive", f"model.moe.threshold={t}"] for t in THRESHOLDS
}
# Small enough that 8 variants x 3 seeds x 2 epochs fit ~40 minutes of a 2-core host, with
# the MoE FFNs most of a step's FLOPs so that the routing shows in the step time.
MODEL = [
    "model.num_layers=2",
    "model.d_model=64",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.head_dim=16",
    "model.ffn_dim=256",
    "model.moe.ffn_dim=256",
    "model.moe.block_size=32",  # dropless blocks of 32 rows: cost follows the routing
    "model.moe.z_loss_weight=0.0",  # the paper uses no router z-loss
    "train.batch_size=16",
    "train.seq_len=64",
    "data.source=embedded",
    "data.curriculum=none",  # same batches for every variant (the curriculum: stragglers.py)
    "data.prefetch=0",
]
QUICK = ["model.moe.ffn_dim=64", "model.ffn_dim=64", "model.d_model=32", "train.seq_len=32"]
TARGET_FRACTION = 0.95
CONCENTRATION_T = 0.1  # gap threshold of the "concentrated on the top-1 expert" share
REFERENCE = "top2"
# Li et al. 2023, Table 3: time to equal quality relative to top-2, over their six tasks.
PAPER_TIME = {
    "dense": "0.82-0.89x",
    "top1": "0.93-1.14x",
    "top2": "1x",
    "adaptive_T0.1": "0.77-0.89x",
}


def target_from_pilot(initial_loss: float, final_loss: float, fraction: float) -> float:
    """The loss after `fraction` of the pilot's drop from `initial_loss` to `final_loss`."""
    if not 0 < fraction <= 1:
        raise ValueError(f"--target_fraction={fraction}: expected a value in (0, 1]")
    return initial_loss - fraction * (initial_loss - final_loss)


def variant_config(name: str, args, seed: int):
    from jaxmoe.config.loading import load_config

    overrides = [*MODEL, *(QUICK if args.quick else []), *VARIANTS[name]]
    overrides += [
        f"train.steps={args.steps}",
        f"train.seed={seed}",
        f"optimizer.warmup_steps={args.warmup_steps}",
        *args.set,
    ]
    return load_config(str(ROOT / "configs" / "default.py"), overrides)


class Variant:
    """One variant's compiled train step, evaluators and state (one seed at a time)."""

    def __init__(self, name: str, config, mesh, data, args):
        import jax

        from jaxmoe.models.spec import model_spec
        from jaxmoe.training.evaluator import Evaluator
        from jaxmoe.training.optimizer import make_optimizer
        from jaxmoe.training.state import state_shardings
        from jaxmoe.training.steps import jit_train_step, step_fns

        config = config.replace(model=config.model.with_vocab(data.vocab_size))
        self.name, self.config, self.mesh = name, config, mesh
        moe = config.model.moe
        self.gating = moe.gate.gating if moe.num_experts else "dense"
        spec = model_spec(config.model, mesh)
        self.optimizer, schedule = make_optimizer(
            config.optimizer, config.train.steps, spec.param_axes
        )
        _, self.shardings = state_shardings(mesh, spec, self.optimizer)
        self.batch_shardings = data.batch_shardings
        eval_batches = data.eval_batches
        params = self.shardings["params"]
        self.evaluators = {"own": Evaluator(spec, mesh, eval_batches, params, data.batch_shardings)}
        self.concentration = None
        if moe.num_experts:
            if self.gating != "top1":
                top1 = self._spec(mesh, eval_gating="top1")
                self.evaluators["top1"] = Evaluator(
                    top1, mesh, eval_batches, params, data.batch_shardings
                )
            self.concentration = self._concentration_fn(mesh, params)
        # One program for every seed: the seed in StepFns only keys router jitter and
        # dropout, both off here.
        fns = step_fns(config.train, config.optimizer, config.model, spec, self.optimizer, schedule)
        self.step = jit_train_step(fns, self.shardings, data.batch_shardings)
        self.compiled = None
        self.state = None
        del jax

    def _spec(self, mesh, **moe_overrides):
        from jaxmoe.config.loading import with_overrides
        from jaxmoe.models.spec import model_spec

        overrides = [f"model.moe.{key}={value}" for key, value in moe_overrides.items()]
        return model_spec(with_overrides(self.config, overrides).model, mesh)

    def _concentration_fn(self, mesh, param_shardings):
        """jitted (params, batch) -> {layer: [concentrated tokens, valid tokens]} under an
        adaptive gate at CONCENTRATION_T (the model's own weights, any training gate)."""
        import jax
        import jax.numpy as jnp

        from jaxmoe.inference.routing_probe import routing_masks

        spec = self._spec(mesh, eval_gating="adaptive", threshold=CONCENTRATION_T)

        def counts(params, batch):
            masks = routing_masks(params, batch, spec.graphdef, "eval", spec.rest)
            valid_BL = batch["weights"] > 0
            return {
                name: jnp.stack([jnp.sum(~m & valid_BL), jnp.sum(valid_BL)])
                for name, m in masks.items()
            }

        return jax.jit(counts, in_shardings=(param_shardings, self.batch_shardings))

    def start(self, seed: int, first_batch) -> None:
        import jax

        from jaxmoe.training.state import init_state

        self.state = init_state(self.config.model, seed, self.optimizer, self.shardings, self.mesh)
        if self.compiled is None:
            with jax.set_mesh(self.mesh):
                self.compiled = self.step.lower(self.state, first_batch).compile()

    def evaluate(self, eval_batches) -> dict:
        import jax

        from jaxmoe.training.evaluator import to_global

        out = {
            f"loss_{gate}": ev(self.state["params"])["loss"] for gate, ev in self.evaluators.items()
        }
        if self.concentration is not None:
            totals = None
            with jax.set_mesh(self.mesh):
                for batch in eval_batches:
                    got = self.concentration(
                        self.state["params"], to_global(batch, self.batch_shardings)
                    )
                    got = jax.device_get(got)
                    totals = got if totals is None else {k: totals[k] + got[k] for k in got}
            out["concentrated"] = {
                k: float(v[0]) / max(float(v[1]), 1.0) for k, v in totals.items()
            }
        out.setdefault("loss_top1", out["loss_own"])
        return out


class SharedData:
    """The seed's training batches (one order for every variant) and the eval batches."""

    def __init__(self, config, eval_batches: int):
        from jax.sharding import NamedSharding

        from jaxmoe.data.pipeline import build_data
        from jaxmoe.parallel.mesh import make_mesh
        from jaxmoe.parallel.sharding import batch_spec

        self.mesh = make_mesh(config.mesh)
        bundle = build_data(config.data, config.train)
        self.train, self.vocab_size = bundle.train, bundle.vocab_size
        self.steps_per_epoch = bundle.train.steps_per_epoch
        self.eval_batches = bundle.eval_batches[: eval_batches or None]
        self.batch_shardings = {
            key: NamedSharding(
                self.mesh, batch_spec(self.mesh, np.ndim(v), config.train.batch_size)
            )
            for key, v in bundle.eval_batches[0].items()
        }


def train_side_by_side(variants: dict, data: SharedData, args, seed: int, log) -> dict:
    """Train every variant for args.steps steps in turns on the same batches; curves."""
    import jax

    from jaxmoe.training.evaluator import to_global

    names = list(variants)
    first = to_global(next(data.train), data.batch_shardings)
    for v in variants.values():
        v.start(seed, first)
    times = {n: [] for n in names}
    cpu_times = {n: [] for n in names}  # process CPU time: the work, whatever the load
    shares = {n: [] for n in names}
    curves = {n: [] for n in names}
    routing = {n: {"step": [], "example_ids": [], "top2_BM": []} for n in names}
    loads = [os.getloadavg()[0]]

    def evaluate(step):
        for n in names:
            curves[n].append({"step": step, **variants[n].evaluate(data.eval_batches)})

    evaluate(0)
    batch, host_batch = first, None
    for step in range(1, args.steps + 1):
        if step > 1:
            host_batch = next(data.train)
            batch = to_global(host_batch, data.batch_shardings)
        shift = step % len(names)
        for n in names[shift:] + names[:shift]:
            v = variants[n]
            with jax.set_mesh(v.mesh):
                start, start_cpu = time.perf_counter(), time.process_time()
                v.state, metrics = v.compiled(v.state, batch)
                jax.block_until_ready(v.state)
                times[n].append(time.perf_counter() - start)
                cpu_times[n].append(time.process_time() - start_cpu)
            if v.gating != "dense":
                shares[n].append(float(metrics["top2_fraction"]))
            if v.gating == "adaptive":
                rec = routing[n]
                rec["step"].append(step)
                rec["example_ids"].append(np.asarray(jax.device_get(batch["example_ids"])))
                rec["top2_BM"].append(np.asarray(jax.device_get(metrics["routing_BM"])))
        if step % args.eval_every == 0 or step == args.steps:
            loads.append(os.getloadavg()[0])
            evaluate(step)
            log(f"   seed {seed} step {step}: " + ", ".join(
                f"{n} {1e3 * np.median(times[n]):.0f} ms {curves[n][-1]['loss_own']:.3f}"
                for n in names
            ))  # fmt: skip
    return {
        "times": times,
        "cpu_times": cpu_times,
        "shares": shares,
        "curves": curves,
        "routing": routing,
        "loads": loads,
    }


def seed_results(variants: dict, trained: dict, target: float) -> dict:
    """Per variant: seconds / FLOPs / steps to target on each eval curve, and summaries."""
    out = {}
    for n, v in variants.items():
        times_S = np.asarray(trained["times"][n])
        times_S[0] = np.median(times_S)  # the first call of a program also warms it up
        cpu_S = np.asarray(trained["cpu_times"][n])
        cpu_S[0] = np.median(cpu_S)
        cum_cpu = np.concatenate([[0.0], np.cumsum(cpu_S)])
        cfg = v.config
        share_S = trained["shares"][n] or [np.nan] * len(times_S)
        flops_S = step_flops(cfg.model, cfg.train.batch_size, cfg.train.seq_len, share_S)
        cum_t = np.concatenate([[0.0], np.cumsum(times_S)])
        cum_f = np.concatenate([[0.0], np.cumsum(flops_S)])
        curve = trained["curves"][n]
        steps = [p["step"] for p in curve]
        row = {
            "gating": v.gating,
            "median_step_s": float(np.median(times_S)),
            "median_step_cpu_s": float(np.median(cpu_S)),
            "train_time_s": float(cum_t[-1]),
            "train_flops": float(cum_f[-1]),
            "top2_share": float(np.mean(share_S)) if v.gating != "dense" else None,
            "final_loss_own": curve[-1]["loss_own"],
            "final_loss_top1": curve[-1]["loss_top1"],
        }
        for gate in ("own", "top1"):
            losses = [p[f"loss_{gate}"] for p in curve]
            at_t = reach(steps, losses, cum_t, target)
            at_f = reach(steps, losses, cum_f, target)
            at_c = reach(steps, losses, cum_cpu, target)
            row[f"cpu_seconds_to_target_{gate}"] = None if at_c is None else at_c[1]
            row[f"steps_to_target_{gate}"] = None if at_t is None else at_t[0]
            row[f"seconds_to_target_{gate}"] = None if at_t is None else at_t[1]
            row[f"flops_to_target_{gate}"] = None if at_f is None else at_f[1]
        row["curve"] = [
            {
                **p,
                "time_s": float(cum_t[p["step"]]),
                "cpu_s": float(cum_cpu[p["step"]]),
                "flops": float(cum_f[p["step"]]),
            }
            for p in curve
        ]
        out[n] = row
    add_ratios(out)
    return out


def add_ratios(rows: dict) -> None:
    """X_vs_top2_<gate> of every variant of one seed (None where either missed the target)."""
    ref = rows.get(REFERENCE)
    for row in rows.values():
        for gate in ("own", "top1"):
            for what in ("seconds", "cpu_seconds", "flops", "steps"):
                key = f"{what}_to_target_{gate}"
                base = ref and ref[key]
                ratio = row[key] / base if row[key] is not None and base else None
                row[f"{what}_vs_top2_{gate}"] = ratio


def summarize(per_seed: dict) -> dict:
    """{variant: {key: {mean, std, values, reached}}} over seeds (std with ddof 1)."""
    keys = [
        f"{w}_{g}"
        for g in ("own", "top1")
        for w in (
            "seconds_to_target",
            "seconds_vs_top2",
            "cpu_seconds_to_target",
            "cpu_seconds_vs_top2",
            "flops_vs_top2",
            "steps_to_target",
        )
    ]
    keys += [
        "median_step_s",
        "median_step_cpu_s",
        "top2_share",
        "final_loss_own",
        "final_loss_top1",
    ]
    names = list(dict.fromkeys(n for s in per_seed.values() for n in s))
    out = {}
    for n in names:
        rows = [s[n] for s in per_seed.values() if n in s]
        out[n] = {}
        for key in keys:
            values = [r[key] for r in rows if r.get(key) is not None]
            out[n][key] = {
                "mean": float(np.mean(values)) if values else None,
                "std": float(np.std(values, ddof=1)) if len(values) > 1 else None,
                "values": values,
                "reached": len(values),
                "seeds": len(rows),
            }
    return out


def _ms(stat, fmt="{:.2f}", suffix="") -> str:
    if stat["mean"] is None:
        return "not reached"
    text = fmt.format(stat["mean"]) + suffix
    text = text if stat["std"] is None else f"{text} ± {fmt.format(stat['std'])}"
    if stat["reached"] < stat["seeds"]:
        text += f" ({stat['reached']}/{stat['seeds']})"
    return text


def table(report: dict) -> str:
    header = [
        "variant", "s to target (own gate)", "vs top-2", "s to target (top-1 eval)", "vs top-2",
        "CPU s vs top-2 (own)", "FLOPs vs top-2 (own)", "median step", "tokens to 2 experts",
        "final loss own / top-1",
        "paper: wall time to top-2's quality vs top-2 (Table 3, 8 GPUs)",
    ]  # fmt: skip
    rows = []
    for n, s in report["summary"].items():
        share = s["top2_share"]
        rows.append([
            n, _ms(s["seconds_to_target_own"], "{:.1f}"), _ms(s["seconds_vs_top2_own"], suffix="x"),
            _ms(s["seconds_to_target_top1"], "{:.1f}"), _ms(s["seconds_vs_top2_top1"], suffix="x"),
            _ms(s["cpu_seconds_vs_top2_own"], suffix="x"), _ms(s["flops_vs_top2_own"], suffix="x"),
            _ms(s["median_step_s"], "{:.3f}", " s"),
            "-" if share["mean"] is None else _ms(share, "{:.1%}"),
            f"{s['final_loss_own']['mean']:.3f} / {s['final_loss_top1']['mean']:.3f}",
            PAPER_TIME.get(n, "-"),
        ])  # fmt: skip
    return markdown_table(header, rows)


def _color(name: str) -> str:
    return f"C{list(VARIANTS).index(name) % 10}" if name in VARIANTS else "k"


def plot(report: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for x_key, label, scale, fname in (
        ("time_s", "training wall time (s)", 1.0, "loss_vs_seconds.png"),
        ("cpu_s", "training CPU time (s, process_time)", 1.0, "loss_vs_cpu_seconds.png"),
        ("flops", "training FLOPs (1e12)", 1e-12, "loss_vs_flops.png"),
    ):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for ax, gate in zip(axes, ("own", "top1"), strict=True):
            for k, seed in enumerate(report["seeds"].values()):
                for n, r in seed["variants"].items():
                    pts = [p for p in r["curve"] if p["step"] > 0]
                    ax.plot(
                        [scale * p[x_key] for p in pts], [p[f"loss_{gate}"] for p in pts],
                        color=_color(n), alpha=0.8, linewidth=1, label=n if k == 0 else None,
                    )  # fmt: skip
            ax.axhline(report["target_loss"], color="gray", linestyle="--", linewidth=1)
            ax.set_xlabel(label)
            ax.set_title(f"eval loss, {'own gate' if gate == 'own' else 'top-1 gate'}", fontsize=10)
        axes[0].set_ylabel("eval loss (dashed: target)")
        axes[0].legend(fontsize=7)
        lows = [p["loss_own"] for s in report["seeds"].values() for r in s["variants"].values()
                for p in r["curve"]]  # fmt: skip
        axes[0].set_ylim(min(lows) - 0.05, report["target_loss"] + 1.0)
        fig.tight_layout()
        path = out / fname
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_concentration(report: dict, out: Path) -> Path | None:
    """Share of tokens concentrated on their top-1 expert, per MoE layer, over training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = next(iter(report["seeds"].values()))["variants"]
    layers = sorted(
        {k for r in first.values() for p in r["curve"] for k in p.get("concentrated", {})}
    )
    fig, axes = plt.subplots(1, len(layers), figsize=(5 * len(layers), 3.8), sharey=True)
    for ax, layer in zip(np.atleast_1d(axes), layers, strict=True):
        for n, r in first.items():
            pts = [p for p in r["curve"] if layer in p.get("concentrated", {})]
            if pts:
                ax.plot([p["step"] for p in pts], [p["concentrated"][layer] for p in pts],
                        color=_color(n), label=n)  # fmt: skip
        ax.axhline(0.55, color="gray", linestyle="--", linewidth=1)
        ax.set_xlabel("training step")
        ax.set_title(f"{layer}: gap >= {CONCENTRATION_T} (dashed: paper's 55%)", fontsize=10)
    np.atleast_1d(axes)[0].set_ylabel("share of eval tokens on one expert")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.tight_layout()
    path = out / "concentration.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def concentration_table(report: dict) -> str:
    """Mean over seeds of the concentrated share per layer at a few points of training."""
    seeds = list(report["seeds"].values())
    names = [n for n, r in seeds[0]["variants"].items() if r["gating"] != "dense"]
    if not names:
        return ""
    steps = [p["step"] for p in seeds[0]["variants"][names[0]]["curve"]]
    picks = sorted({steps[0], steps[len(steps) // 4], steps[len(steps) // 2], steps[-1]})
    layers = sorted(seeds[0]["variants"][names[0]]["curve"][0]["concentrated"])
    rows = []
    for n in names:
        for layer in layers:
            cells = []
            for step in picks:
                vals = [
                    p["concentrated"][layer]
                    for s in seeds
                    if n in s["variants"]
                    for p in s["variants"][n]["curve"]
                    if p["step"] == step
                ]
                cells.append(f"{np.mean(vals):.0%}")
            rows.append([n, layer, *cells])
    return markdown_table(["variant", "layer", *(f"step {k}" for k in picks)], rows)


def merge(paths: list[str], args) -> int:
    """One report from runs of other seeds (one process each, same settings and target)."""
    reports = [json.loads(Path(path).read_text()) for path in paths]
    first = reports[0]
    for path, other in zip(paths[1:], reports[1:], strict=True):
        if abs(other["target_loss"] - first["target_loss"]) > 1e-6:
            raise SystemExit(f"--merge: {path} has target {other['target_loss']}, not "
                             f"{first['target_loss']} (another pilot or settings)")  # fmt: skip
    seeds = {}  # runs may split seeds, variants or both
    for r in reports:
        for k, v in r["seeds"].items():
            seed = seeds.setdefault(k, {"variants": {}, "load_average_1min": []})
            seed["variants"] |= v["variants"]
            seed["load_average_1min"] += v["load_average_1min"]
    for seed in seeds.values():
        add_ratios(seed["variants"])
    merged = {**first, "seeds": seeds, "merged_from": paths}
    merged["summary"] = summarize({k: v["variants"] for k, v in seeds.items()})
    merged["settings"]["wall_s"] = [r["settings"]["wall_s"] for r in reports]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "time_to_target.json").write_text(json.dumps(merged, indent=1))
    report_only(str(out / "time_to_target.json"), args.figures)
    write_json("time_to_target", merged, args.json)
    return 0


def report_only(path: str, figures: str) -> int:
    """Re-render the table and plots of a finished run's time_to_target.json."""
    report = json.loads(Path(path).read_text())
    out = Path(figures) if figures else Path(path).parent
    out.mkdir(parents=True, exist_ok=True)
    plot(report, out)
    plot_concentration(report, out)
    print(table(report), "", concentration_table(report), sep="\n", flush=True)
    return 0


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the JSON, routing.npz and plots")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--pilot_seed", type=int, default=100, help="seed of the pilot dense run")
    p.add_argument("--steps", type=int, default=None, help="default 314 (2 epochs); quick 12")
    p.add_argument("--eval_every", type=int, default=None, help="default 16; quick 4")
    p.add_argument("--eval_batches", type=int, default=3, help="validation batches (0: all)")
    p.add_argument("--warmup_steps", type=int, default=None, help="default 20; quick 2")
    p.add_argument("--target_fraction", type=float, default=TARGET_FRACTION)
    p.add_argument(
        "--target_loss",
        type=float,
        default=None,
        help="skip the pilot: the target an earlier pilot (same settings) fixed",
    )
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--compile_cache", default="", help="JAX compilation cache (OUT/jax_cache)")
    p.add_argument("--figures", default="", help="also copy the plots into this directory")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--quick", action="store_true", help="tiny model, 12 steps: a smoke test")
    p.add_argument("--report", default="", help="train nothing: re-render this JSON's tables/plots")
    p.add_argument(
        "--merge",
        default="",
        help="train nothing: comma-separated time_to_target.json of single-seed runs, into one",
    )
    add_json_flag(p)
    args = p.parse_args(argv)
    args.steps = args.steps or (12 if args.quick else 314)
    args.eval_every = args.eval_every or (4 if args.quick else 16)
    if args.warmup_steps is None:
        args.warmup_steps = 2 if args.quick else 20
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    try:
        args.seeds = [int(x) for x in args.seeds.split(",") if x]
    except ValueError:
        p.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    if args.pilot_seed in args.seeds:
        p.error(f"--pilot_seed={args.pilot_seed} must differ from --seeds {args.seeds}")
    target_from_pilot(1.0, 0.0, args.target_fraction)  # the range check, before any work
    return args


def run_pilot(args, log) -> tuple[float, str, list]:
    """The pilot: dense, another seed, same budget; it fixes the target before the runs."""
    cfg = variant_config("dense", args, args.pilot_seed)
    data = SharedData(cfg, args.eval_batches)
    pilot = {"dense": Variant("dense", cfg, data.mesh, data, args)}
    log(f"== pilot: dense, seed {args.pilot_seed}")
    curve = train_side_by_side(pilot, data, args, args.pilot_seed, log)["curves"]["dense"]
    target = target_from_pilot(curve[0]["loss_own"], curve[-1]["loss_own"], args.target_fraction)
    rule = (
        f"pilot dense model (seed {args.pilot_seed}, same steps): initial eval loss "
        f"{curve[0]['loss_own']:.4f} minus {args.target_fraction:.0%} of its drop to "
        f"{curve[-1]['loss_own']:.4f}"
    )
    return target, rule, curve


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.report:
        return report_only(args.report, args.figures)
    if args.merge:
        return merge([x for x in args.merge.split(",") if x], args)
    import jax

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", args.compile_cache or str(out / "jax_cache"))

    def log(msg):
        print(msg, flush=True)

    started = time.time()
    if args.target_loss is None:
        target, rule, curve = run_pilot(args, log)
    else:
        target, curve = args.target_loss, []
        rule = f"--target_loss {target} (an earlier pilot dense run's, seed {args.pilot_seed})"
    variants, per_seed, seeds, routing = {}, {}, {}, {}
    for seed in args.seeds:
        data = SharedData(variant_config("dense", args, seed), args.eval_batches)
        for n in args.variants:
            if n not in variants:
                log(f"== compiling {n}")
                variants[n] = Variant(n, variant_config(n, args, seed), data.mesh, data, args)
            variants[n].batch_shardings = data.batch_shardings
        log(f"== seed {seed}: {len(variants)} variants side by side, {args.steps} steps")
        trained = train_side_by_side(variants, data, args, seed, log)
        per_seed[seed] = seed_results(variants, trained, target)
        seeds[seed] = {"variants": per_seed[seed], "load_average_1min": trained["loads"]}
        for n, rec in trained["routing"].items():
            if rec["step"]:
                routing[f"seed{seed}/{n}/step"] = np.asarray(rec["step"])
                routing[f"seed{seed}/{n}/example_ids"] = np.stack(rec["example_ids"])
                routing[f"seed{seed}/{n}/top2_BM"] = np.stack(rec["top2_BM"])
        routing[f"seed{seed}/steps_per_epoch"] = np.asarray(data.steps_per_epoch)
        routing["seq_len"] = np.asarray(variants[args.variants[0]].config.train.seq_len)
        np.savez_compressed(out / "routing.npz", **routing)
        # Written after every seed: a run cut short keeps its finished seeds.
        cfg = next(iter(variants.values())).config
        m = cfg.model
        report = {
            "target_loss": target,
            "target_rule": rule,
            "pilot_curve": curve,
            "settings": {
                "model": f"{m.num_layers} layers, d {m.d_model}, {m.num_heads} heads / "
                f"{m.num_kv_heads} KV, {m.moe.num_experts} experts of {m.moe.ffn_dim}, "
                f"block {m.moe.block_size}; dense FFN {m.ffn_dim}",
                "batch": f"{cfg.train.batch_size} x {cfg.train.seq_len} tokens",
                "steps": args.steps,
                "eval_every": args.eval_every,
                "eval_batches": args.eval_batches,
                "warmup_steps": args.warmup_steps,
                "steps_per_epoch": int(data.steps_per_epoch),
                "device": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
                "cpu_count": os.cpu_count(),
                "concentration_threshold": CONCENTRATION_T,
                "quick": args.quick,
                "overrides": args.set,
                "wall_s": time.time() - started,
            },
            "seeds": seeds,
            "summary": summarize(per_seed),
        }
        (out / "time_to_target.json").write_text(json.dumps(report, indent=1))
    for path in [*plot(report, out), plot_concentration(report, out)]:
        if path and args.figures:
            Path(args.figures).mkdir(parents=True, exist_ok=True)
            (Path(args.figures) / path.name).write_bytes(path.read_bytes())
    print(table(report), "", concentration_table(report), sep="\n", flush=True)
    write_json("time_to_target", report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
