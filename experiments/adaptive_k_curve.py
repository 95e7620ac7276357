"""Eval loss vs share of expert assignments kept: fixed top-k, top-p and adaptive_k (issue 27).

A stand-in, NOT the converted Qwen3-MoE model the issue asks for (adaptive_k_uptrain.py
measures that, uptraining with each gate): this trains a tiny jaxmoe model from scratch,
Qwen3-MoE-style in its gate (16 experts, top-4, norm_topk_prob: model.moe.renormalize with
single_weight=one), on the embedded corpus for --steps steps per seed. Each final model is
then evaluated on the embedded validation split with every evaluation gate of EVAL_GATES
(model.moe.eval_gating; the trained parameters unchanged: the gate is swapped at inference,
nothing is trained with it). For each gate it
records the eval loss and the share of expert assignments kept: the mean number of experts a
real token runs in an MoE layer divided by the training top-k (4), so 1.0 is the original
model and top-8 is 2.0. Writes into --out:
  adaptive_k_curve.json   every number per seed and gate, and mean / std over seeds
  adaptive_k_curve.png    eval loss against share kept (one marker per gate, mean of seeds)
and with --json also docs/results/YYYY-MM-DD-adaptive-k-curve.json; --figure copies the plot.

    python -m experiments adaptive_k_curve --out runs/akc --json \
        --figure docs/figures/adaptive_k_curve.png
    python -m experiments adaptive_k_curve --quick --out /tmp/akc        # ~2 min smoke test

The eval loss is computed by this module's own step (the model plus a probe that counts the
kept slots); for the training gate it is checked against `jaxmoe.inference.evaluate` and
both numbers are stored (`check`).
"""

import argparse
import json
import os
import shutil
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

from benchmarks.results import add_json_flag, write_json

ROOT = Path(__file__).resolve().parents[1]
TRAIN_K = 4
MODEL = [
    "model.num_layers=2",
    "model.d_model=64",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.head_dim=16",
    "model.moe.num_experts=16",
    "model.moe.ffn_dim=64",
    "model.moe.gating=topk",
    f"model.moe.top_k={TRAIN_K}",
    "model.moe.renormalize=true",  # Qwen3-MoE's norm_topk_prob
    "model.moe.single_weight=one",  # a lone expert gets p / p = 1, as norm_topk_prob gives
    "model.moe.dispatch=dense",  # the quickest program to compile; same output (tested)
    "train.batch_size=16",
    "train.seq_len=128",
    "data.source=embedded",
]
QUICK = ["model.d_model=32", "model.head_dim=8", "train.batch_size=8", "train.seq_len=32"]


def _gate(gating: str, **options) -> list[str]:
    return [f"model.moe.eval_gating={gating}"] + [f"model.moe.{k}={v}" for k, v in options.items()]


EVAL_GATES = {
    **{f"top{k}": _gate("topk", top_k=k) for k in (1, 2, 4, 8)},
    **{f"top_p{p}": _gate("top_p", top_p=p, max_k=8) for p in (0.3, 0.5, 0.7, 0.9)},
    **{
        f"adaptive_k{TRAIN_K}_T{t}": _gate("adaptive_k", threshold=t, max_k=TRAIN_K)
        for t in (0.1, 0.2, 0.3, 0.5, 0.7)
    },
    **{f"adaptive_k8_T{t}": _gate("adaptive_k", threshold=t, max_k=8) for t in (0.3, 0.5)},
}
QUICK_GATES = ("top1", "top4", "top_p0.5", f"adaptive_k{TRAIN_K}_T0.3")


def train_config(args, seed: int):
    from jaxmoe.config.loading import load_config

    overrides = [*MODEL, *(QUICK if args.quick else [])]
    overrides += [
        f"train.steps={args.steps}",
        f"train.eval_every={args.steps}",
        f"train.checkpoint_every={args.steps}",
        "train.max_to_keep=1",
        f"train.seed={seed}",
        f"optimizer.warmup_steps={max(1, args.steps // 10)}",
    ]
    return load_config(str(ROOT / "configs" / "default.py"), overrides)


def probe_class():
    """The probe module (built here so that listing the experiments imports no framework)."""
    from flax import nnx

    class Probe(nnx.Module):
        """An MoE layer whose aux also holds kept_sum (kept slots over real tokens) and
        real_sum (real tokens), counted with the gate the layer runs (its eval gate)."""

        def __init__(self, moe):
            self.moe = moe

        def __call__(self, x_BLD, *, train: bool, token_mask_BL=None):
            import jax.numpy as jnp

            y_BLD, aux = self.moe(x_BLD, train=train, token_mask_BL=token_mask_BL)
            _, _, routing = self.moe.route(x_BLD, train=False)  # the layer's own eval routing
            real_T = token_mask_BL.reshape(-1).astype(jnp.float32)
            kept = jnp.sum(jnp.sum(routing.mask, axis=-1) * real_T)
            return y_BLD, {**aux, "kept_sum": kept, "real_sum": jnp.sum(real_T)}

    return Probe


def probe_step(params, batch, graphdef, rest):
    """Sums over one batch: weighted NLL, target weight, kept slots and real tokens (all MoE
    layers together)."""
    import jax.numpy as jnp

    from jaxmoe.models.moe.layer import MoE
    from jaxmoe.models.spec import merge_model
    from jaxmoe.models.stack import stack_modules
    from jaxmoe.training.steps import token_nll

    model = merge_model(graphdef, params, rest)
    probe = probe_class()
    for block in stack_modules(model.layers):
        if isinstance(block.ffn, MoE):
            block.ffn = probe(block.ffn)
    weights = batch["weights"]
    logits, aux = model(batch["inputs"], train=False, token_mask_BL=weights > 0)
    nll = token_nll(logits, batch["targets"])
    kept = sum(jnp.sum(a["kept_sum"]) for a in aux.values())
    real = sum(jnp.sum(a["real_sum"]) for a in aux.values())
    return {"nll_sum": jnp.sum(nll * weights), "weight_sum": jnp.sum(weights), "kept": kept,
            "real": real}  # fmt: skip


def evaluate_gate(workdir: Path, overrides: list[str], train_k: int = TRAIN_K) -> dict:
    """Eval loss and kept experts of the checkpoint in `workdir` on the embedded validation
    split, opened with `overrides` (a gate swapped in, say); share kept is over `train_k`."""
    import jax
    from jax.sharding import NamedSharding

    from jaxmoe.inference.evaluate import packed_batches
    from jaxmoe.inference.trained_model import TrainedModel
    from jaxmoe.parallel.sharding import batch_spec

    model = TrainedModel.open(str(workdir), overrides=overrides)
    batches = packed_batches(model.config, "embedded", model.tokenizer)
    mesh, spec = model.mesh, model.spec
    step = jax.jit(partial(probe_step, graphdef=spec.graphdef, rest=spec.rest))
    totals = dict.fromkeys(("nll_sum", "weight_sum", "kept", "real"), 0.0)
    with jax.set_mesh(mesh):
        for batch in batches:
            put = {
                k: jax.device_put(v, NamedSharding(mesh, batch_spec(mesh, v.ndim, v.shape[0])))
                for k, v in batch.items()
            }
            out = jax.device_get(step(model.params, put))
            for key in totals:
                totals[key] += float(out[key])
    return {
        "eval_loss": totals["nll_sum"] / max(totals["weight_sum"], 1.0),
        "experts_per_token": totals["kept"] / max(totals["real"], 1.0),
        "share_kept": totals["kept"] / max(totals["real"], 1.0) / train_k,
        "eval_tokens": int(totals["weight_sum"]),
    }


def run_seed(args, seed: int, gates_to_run: list[str]) -> dict:
    from jaxmoe.inference.evaluate import evaluate
    from jaxmoe.training.loop import train

    workdir = Path(args.out) / "runs" / f"seed{seed}"
    if workdir.exists():
        shutil.rmtree(workdir)  # a fresh run: the numbers come from this invocation
    config = train_config(args, seed)
    load = [os.getloadavg()[0]]
    start = time.perf_counter()
    train(config, str(workdir), progress=False)
    train_s = time.perf_counter() - start
    results = {}
    for name in gates_to_run:
        results[name] = evaluate_gate(workdir, EVAL_GATES[name])
        print(f"seed {seed} {name:16s} {results[name]}", flush=True)
    official = evaluate(str(workdir), "embedded")["loss"]  # the training gate, top-4
    load.append(os.getloadavg()[0])
    return {
        "train_wall_s": train_s,
        "load_average_1min": load,
        "gates": results,
        "check": {"evaluate_loss_train_gate": official, "probe_loss_top4": results.get("top4")},
    }


def summarize(per_seed: dict, gates_to_run: list[str]) -> dict:
    out = {}
    for name in gates_to_run:
        rows = [s["gates"][name] for s in per_seed.values()]
        out[name] = {
            key: {"mean": float(np.mean([r[key] for r in rows])),
                  "std": float(np.std([r[key] for r in rows]))}
            for key in ("eval_loss", "share_kept", "experts_per_token")
        }  # fmt: skip
    return out


def plot(summary: dict, path: Path, title: str, train_k: int = TRAIN_K, background=None) -> None:
    """Loss against share kept, one line per gate family; `background` (a summary of the same
    gates, e.g. before uptraining) is drawn faint behind it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    families = {"top": ("fixed top-k", "o", "C0"), "top_p": ("top-p (max 8)", "s", "C1")}
    families |= {f"adaptive_k{train_k}": (f"adaptive_k, max_k={train_k}", "^", "C2")}
    families |= {"adaptive_k8": ("adaptive_k, max_k=8", "v", "C3")}
    if background:
        _draw(ax, background, families, faint=True)
    _draw(ax, summary, families, faint=False)
    ax.set_xlabel(f"share of expert assignments kept (experts per token / {train_k})")
    ax.set_ylabel("eval loss (embedded validation)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw(ax, summary: dict, families: dict, faint: bool) -> None:
    """One errorbar line per gate family of `summary`, points labelled by their knob; faint
    lines are unlabelled and dotted, for a curve drawn behind the measured one."""
    for prefix, (label, marker, color) in families.items():
        names = [n for n in summary if _family(n) == prefix]
        if not names:
            continue
        pts = sorted((summary[n]["share_kept"]["mean"], summary[n]["eval_loss"]["mean"],
                      summary[n]["eval_loss"]["std"], n) for n in names)  # fmt: skip
        xs, ys, es, ns = zip(*pts, strict=True)
        if faint:
            ax.errorbar(xs, ys, yerr=es, marker=marker, color=color, alpha=0.3, linestyle=":")
            continue
        ax.errorbar(xs, ys, yerr=es, marker=marker, color=color, label=label, capsize=2)
        for x, y, n in zip(xs, ys, ns, strict=True):
            ax.annotate(_point_label(n), (x, y), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")  # fmt: skip


def _family(name: str) -> str:
    if name.startswith("top_p"):
        return "top_p"
    if name.startswith("top"):
        return "top"
    return name.rpartition("_T")[0]


def _point_label(name: str) -> str:
    if name.startswith("top_p"):
        return "p=" + name.removeprefix("top_p")
    if name.startswith("top"):
        return "k=" + name.removeprefix("top")
    return "T=" + name.rpartition("_T")[2]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="directory for runs, JSON and plot")
    p.add_argument("--steps", type=int, default=None, help="training steps per seed (300)")
    p.add_argument("--seeds", default=None, help="comma-separated (default 0,1,2)")
    p.add_argument("--quick", action="store_true", help="tinier model, 8 steps, 1 seed, 4 gates")
    p.add_argument("--figure", default=None, help="also copy the plot to this path")
    add_json_flag(p)
    args = p.parse_args(argv)
    args.steps = args.steps or (8 if args.quick else 300)
    args.seeds = seed_list(args.seeds, args.quick)
    return args


def seed_list(text: str | None, quick: bool) -> list[int]:
    """--seeds "0,1,2" as ints; default seed 0 alone with --quick, else 0, 1 and 2."""
    return [int(s) for s in (text or ("0" if quick else "0,1,2")).split(",")]


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gates_to_run = list(QUICK_GATES if args.quick else EVAL_GATES)
    start = time.perf_counter()
    per_seed = {str(seed): run_seed(args, seed, gates_to_run) for seed in args.seeds}
    summary = summarize(per_seed, gates_to_run)
    report = {
        "what": "eval loss vs share of expert assignments kept, gates swapped at evaluation",
        "model": "tiny jaxmoe model trained from scratch, NOT the converted Qwen3-MoE model",
        "train_overrides": [*MODEL, *(QUICK if args.quick else [])],
        "train_k": TRAIN_K,
        "steps": args.steps,
        "seeds": args.seeds,
        "eval_gates": {n: EVAL_GATES[n] for n in gates_to_run},
        "cpu_count": os.cpu_count(),
        "measured_under_load": True,
        "wall_s": None,
        "summary": summary,
        "per_seed": per_seed,
    }
    report["wall_s"] = time.perf_counter() - start
    (out / "adaptive_k_curve.json").write_text(json.dumps(report, indent=1) + "\n")
    title = (f"tiny 16-expert top-{TRAIN_K} model trained {args.steps} steps, seeds {args.seeds}\n"
             "gate swapped at evaluation; a stand-in, not the converted Qwen3-MoE")  # fmt: skip
    plot(summary, out / "adaptive_k_curve.png", title)
    if args.figure:
        shutil.copyfile(out / "adaptive_k_curve.png", args.figure)
    for name, s in summary.items():
        print(f"{name:18s} loss {s['eval_loss']['mean']:.4f} +- {s['eval_loss']['std']:.4f}"
              f"  kept {s['share_kept']['mean']:.3f}")  # fmt: skip
    write_json("adaptive-k-curve", report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
