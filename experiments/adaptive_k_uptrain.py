"""Eval loss vs share of expert assignments kept after uptraining a converted Qwen3-MoE (issue 27).

The measurement issue 27 asks for, on a model that was not born in jaxmoe:
  1. pretrain: a tiny transformers Qwen3MoeForCausalLM (32 experts, top-8, norm_topk_prob,
     per-head QK-norm), trained in PyTorch with its own top-8 routing for --pretrain_steps
     steps on jaxmoe's batches of the embedded corpus (experiments/qwen3_moe_pretrain.py);
     saved with save_pretrained beside jaxmoe's SentencePiece tokenizer;
  2. convert: `jaxmoe convert hf` (convert_hf); the converted model's top-8 eval loss on the
     whole embedded validation split must equal transformers' (asserted, 1e-4 relative:
     the link between the two frameworks);
  3. before uptraining: the converted model evaluated with each gate swapped in
     (model.moe.eval_gating), for context;
  4. uptrain: from the converted checkpoint (train.init_from, fresh optimizer) with each gate
     of GATES as the training gate, for --uptrain_steps steps (default 10% of pretraining;
     the pretraining recipe, --schedule restart: same AdamW, peak LR, warmup share and cosine,
     over the uptraining steps; --schedule continue: the pretraining schedule continued past
     its end, as configs/uptrain_gqa.py does, i.e. its floor of min_lr_ratio x peak), seeds
     0, 1, 2 (the uptraining data order; nothing new is initialised);
  5. evaluate each uptrained model on the embedded validation split with the gate it was
     trained with: eval loss, and the share kept = mean experts a real token runs per MoE
     layer / 8 (the original k).
Writes into --out: adaptive_k_uptrain.json, adaptive_k_uptrain.png (loss mean +- std over
seeds against share kept, the pre-uptraining swap curve faint); --figure copies the plot,
--json also writes docs/results/YYYY-MM-DD-adaptive-k-uptrain.json.

    nice -n 5 python -m experiments adaptive_k_uptrain --out /tmp/akup --json \
        --figure docs/figures/adaptive_k_uptrain.png
    python -m experiments adaptive_k_uptrain --quick --out /tmp/akup_quick   # smoke test
"""

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.results import add_json_flag, markdown_table, write_json
from experiments.adaptive_k_curve import _gate as eval_gate
from experiments.adaptive_k_curve import evaluate_gate, plot, seed_list, summarize

ROOT = Path(__file__).resolve().parents[1]
ORIGINAL_K = 8
SIZE = {
    "num_layers": 2,
    "d_model": 64,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "num_experts": 32,
    "top_k": ORIGINAL_K,
    "expert_dim": 32,
    "aux_loss_coef": 0.01,  # transformers' router_aux_loss_coef; convert maps it to jaxmoe's
    "seq_len": 128,
}
DATA = ["data.source=embedded", "train.batch_size=16", f"train.seq_len={SIZE['seq_len']}"]
QUICK_DATA = ["data.source=embedded", "train.batch_size=4", "train.seq_len=32"]
EVAL = ["model.moe.dispatch=dense"]  # the quickest program to compile on CPU; same output
LINK_RTOL = 1e-4

# name -> (gating, options). The names are adaptive_k_curve's, so its plot groups them.
GATES = {
    **{f"top{k}": ("topk", {"top_k": k}) for k in (2, 4, 8)},
    **{f"top_p{p}": ("top_p", {"top_p": p, "max_k": ORIGINAL_K}) for p in (0.2, 0.3)},
    **{
        f"adaptive_k{ORIGINAL_K}_T{t}": ("adaptive_k", {"threshold": t, "max_k": ORIGINAL_K})
        for t in (0.1, 0.2, 0.3, 0.4)
    },
}
QUICK_GATES = ("top2", "top8", "adaptive_k8_T0.3")


def train_gate(name: str) -> list[str]:
    """Overrides that make gate `name` the training (and evaluation) gate."""
    gating, options = GATES[name]
    return [f"model.moe.gating={gating}"] + [f"model.moe.{k}={v}" for k, v in options.items()]


def swapped_gate(name: str) -> list[str]:
    """Overrides that swap gate `name` in at evaluation only (eval_gating)."""
    gating, options = GATES[name]
    return eval_gate(gating, **options)


def data_config(data: list[str]):
    from jaxmoe.config.loading import load_config

    return load_config(str(ROOT / "configs" / "default.py"), data)


def optimizer_recipe(config, steps: int) -> dict:
    """jaxmoe's AdamW recipe of `config` (what uptraining runs), warmup 10% of `steps`."""
    keys = ("learning_rate", "b1", "b2", "eps", "weight_decay", "min_lr_ratio", "grad_clip_norm")
    return {**{k: getattr(config.optimizer, k) for k in keys}, "warmup_steps": warmup(steps)}


def warmup(steps: int) -> int:
    return max(1, steps // 10)


def pretrain_and_convert(args, out: Path) -> dict:
    """Steps 1-2: the transformers model pretrained, saved, converted, and the link checked.
    Returns the converted checkpoint's path and the numbers that tie it to transformers."""
    import torch

    from experiments import qwen3_moe_pretrain as hf
    from jaxmoe.conversions.hf.importer import convert_hf
    from jaxmoe.data.batches import TrainBatches, eval_batches
    from jaxmoe.data.sources import load_tokenizer

    torch.set_num_threads(1)  # on a loaded 2-core host one thread is ~4x faster per step
    config = data_config(args.data)
    tokenizer = load_tokenizer(config.data)
    size = {**SIZE, **args.size}
    model = hf.build_model(hf.qwen3_moe_config(tokenizer.vocab_size, size), seed=0)
    start = time.perf_counter()
    losses = hf.pretrain(
        model, iter(TrainBatches(config.data, config.train, tokenizer)), args.pretrain_steps,
        optimizer_recipe(config, args.pretrain_steps),
    )  # fmt: skip
    pretrain_s = time.perf_counter() - start
    hf_loss = hf.eval_loss(model, eval_batches(config.data, config.train, tokenizer))
    src, converted = out / "hf_pretrained", out / "converted"
    for folder in (src, converted):
        shutil.rmtree(folder, ignore_errors=True)
    hf.save_with_tokenizer(model, src, tokenizer.path)
    convert_hf(str(src), str(converted), overrides=args.data)
    jax_loss = evaluate_gate(converted, EVAL, ORIGINAL_K)["eval_loss"]
    link = {"transformers_eval_loss": hf_loss, "jaxmoe_converted_eval_loss": jax_loss}
    print(f"link: transformers {hf_loss:.6f}, converted jaxmoe {jax_loss:.6f}", flush=True)
    if abs(jax_loss - hf_loss) > LINK_RTOL * abs(hf_loss):
        raise AssertionError(f"converted model's top-{ORIGINAL_K} eval loss differs: {link}")
    first, last = losses[: warmup(len(losses))], losses[-warmup(len(losses)) :]
    return {
        "converted": converted,
        "link": link,
        "pretrain_wall_s": pretrain_s,
        "pretrain_nll_first_last": [sum(first) / len(first), sum(last) / len(last)],
    }


def schedule(args) -> list[str]:
    """The uptraining learning rate: the pretraining recipe restarted over the uptraining
    steps, or continued where pretraining stopped (at its cosine's floor)."""
    if args.schedule == "restart":
        return [f"optimizer.warmup_steps={warmup(args.uptrain_steps)}"]
    done = args.pretrain_steps
    return [f"optimizer.warmup_steps={warmup(done)}", f"optimizer.start_step={done}",
            f"optimizer.schedule_steps={done}"]  # fmt: skip


def uptrain(args, converted: Path, name: str, seed: int) -> dict:
    """Step 4-5 for one gate and seed: train from the converted checkpoint, then evaluate
    with the gate it was trained with."""
    from jaxmoe.inference.trained_model import checkpoint_config
    from jaxmoe.training.loop import train

    workdir = Path(args.out) / "runs" / f"{name}_seed{seed}"
    if workdir.exists():
        shutil.rmtree(workdir)  # a fresh run: the numbers come from this invocation
    steps = args.uptrain_steps
    overrides = [*train_gate(name), *EVAL, f"train.init_from={converted}",
                 f"train.steps={steps}", f"train.seed={seed}", f"train.eval_every={steps}",
                 f"train.checkpoint_every={steps}", "train.max_to_keep=1",
                 "train.eval_batches=1", *schedule(args)]  # fmt: skip
    load = [os.getloadavg()[0]]
    start = time.perf_counter()
    train(checkpoint_config(str(converted), overrides), str(workdir), progress=False)
    result = evaluate_gate(workdir, EVAL, ORIGINAL_K)
    load.append(os.getloadavg()[0])
    print(f"seed {seed} {name:18s} {result}", flush=True)
    return {**result, "wall_s": time.perf_counter() - start, "load_average_1min": load}


# The curves an adaptive_k point is compared with at its own share. Top-p with p above the
# top-8 mass is top-8 (measured: equal losses), so top8 closes the top-p curve at share 1.
CURVES = {"top-k": ("top2", "top4", "top8"), "top-p": ("top_p0.2", "top_p0.3", "top8")}


def paired_gaps(per_seed: dict, name: str, curve: tuple[str, ...]) -> list[float | None]:
    """Per seed: gate `name`'s eval loss minus the loss of `curve` (linear in the share kept,
    same seed) at `name`'s share; None outside the curve's measured range (no extrapolation)."""
    gaps = []
    for run in per_seed.values():
        gates = run["gates"]
        if name not in gates or not all(n in gates for n in curve):
            gaps.append(None)
            continue
        points = sorted((gates[n]["share_kept"], gates[n]["eval_loss"]) for n in curve)
        xs, ys = (np.array(column) for column in zip(*points, strict=True))
        x = gates[name]["share_kept"]
        inside = xs[0] <= x <= xs[-1]
        gaps.append(float(gates[name]["eval_loss"] - np.interp(x, xs, ys)) if inside else None)
    return gaps


def table(report: dict) -> str:
    """The Markdown table of a report: per gate, after uptraining (mean +- std over seeds)
    and, for context, the converted model with the gate swapped in before uptraining."""
    rows = []
    for name, after in report["summary"].items():
        before = report["before_uptraining"][name]
        rows.append([
            name, after["experts_per_token"]["mean"], f"{after['share_kept']['mean']:.3f}",
            f"{after['eval_loss']['mean']:.4f} +- {after['eval_loss']['std']:.4f}",
            f"{before['share_kept']['mean']:.3f}", f"{before['eval_loss']['mean']:.4f}",
        ])  # fmt: skip
    header = ["gate", "experts per token", "share kept", "eval loss (seeds)",
              "share kept before", "eval loss before"]  # fmt: skip
    return markdown_table(header, rows)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the models, JSON and plot")
    p.add_argument("--pretrain_steps", type=int, default=None, help="transformers steps (400)")
    p.add_argument("--uptrain_steps", type=int, default=None, help="(10%% of pretraining)")
    p.add_argument("--seeds", default=None, help="uptraining seeds, comma-separated (0,1,2)")
    p.add_argument("--schedule", choices=("restart", "continue"), default="restart",
                   help="uptraining LR: pretraining's anew, or continued")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="tinier data, few steps, 1 seed, 3 gates")
    p.add_argument("--figure", default=None, help="also copy the plot to this path")
    add_json_flag(p)
    args = p.parse_args(argv)
    args.pretrain_steps = args.pretrain_steps or (8 if args.quick else 400)
    args.uptrain_steps = args.uptrain_steps or max(1, args.pretrain_steps // 10)
    args.seeds = seed_list(args.seeds, args.quick)
    args.data = QUICK_DATA if args.quick else DATA
    args.size = {"seq_len": 32} if args.quick else {}
    args.gates = list(QUICK_GATES if args.quick else GATES)
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start, load_start = time.perf_counter(), os.getloadavg()[0]
    base = pretrain_and_convert(args, out)
    converted = base.pop("converted")
    before = {n: evaluate_gate(converted, [*EVAL, *swapped_gate(n)], ORIGINAL_K)
              for n in args.gates}  # fmt: skip
    per_seed = {
        str(seed): {"gates": {n: uptrain(args, converted, n, seed) for n in args.gates}}
        for seed in args.seeds
    }
    summary = summarize(per_seed, args.gates)
    adaptive = [n for n in args.gates if n.startswith("adaptive_k")]
    gaps = {
        n: {c: paired_gaps(per_seed, n, names) for c, names in CURVES.items()} for n in adaptive
    }
    before_summary = summarize({"converted": {"gates": before}}, args.gates)
    report = {
        "what": "eval loss vs share of expert assignments kept, each gate uptrained from a "
        "converted transformers Qwen3-MoE pretrained with its own top-8 routing",
        "size": {**SIZE, **args.size},
        "data": args.data,
        "pretrain_steps": args.pretrain_steps,
        "uptrain_steps": args.uptrain_steps,
        "uptrain_schedule": args.schedule,
        "uptrain_schedule_overrides": schedule(args),
        "seeds": args.seeds,
        "gates": {n: train_gate(n) for n in args.gates},
        **base,
        "load_average_1min_start_end": [load_start, os.getloadavg()[0]],
        "cpu_count": os.cpu_count(),
        "measured_under_load": True,
        "wall_s": time.perf_counter() - start,
        "summary": summary,
        "before_uptraining": before_summary,
        "adaptive_minus_curve_at_equal_share": gaps,
        "per_seed": per_seed,
    }
    (out / "adaptive_k_uptrain.json").write_text(json.dumps(report, indent=1) + "\n")
    title = (f"transformers Qwen3-MoE (32 experts, top-8) pretrained {args.pretrain_steps} "
             f"steps, converted, uptrained {args.uptrain_steps} steps\nwith each gate "
             f"(LR schedule {args.schedule}), "
             f"seeds {args.seeds}; faint: gate swapped in without uptraining")  # fmt: skip
    plot(summary, out / "adaptive_k_uptrain.png", title, ORIGINAL_K, before_summary)
    if args.figure:
        shutil.copyfile(out / "adaptive_k_uptrain.png", args.figure)
    print(table(report), flush=True)
    write_json("adaptive-k-uptrain", report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
