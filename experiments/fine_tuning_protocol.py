"""The adaptive-gating paper's fine-tuning protocol: dense -> 16 random experts -> fine-tune.

Li et al. 2023 (their Table 3) take pretrained dense models, turn every FFN into a 16-expert
MoE layer with randomly initialised experts, fine-tune each task with top-2, top-1 and
adaptive (T = 0.1) gating, and report the training time until each reaches top-2's quality
(normalised to top-2) and the final quality. The same here, on a scale a 2-core CPU runs:

1. pretrain a dense decoder on the embedded corpus (`jaxmoe train`): the stand-in for the
   paper's pretrained Hugging Face models;
2. `convert upcycle --init random --num_experts 16` (every FFN; experts and routers drawn
   from the seed), once per seed;
3. fine-tune every variant from its checkpoint through the fine-tuning path
   (`train.init_from`, `data.format=prompt_completion`, whole examples packed with segment
   ids, the loss on the completions): `dense` (the pretrained model itself), `top2`, `top1`
   and `adaptive_T0.1`, side by side in this process, one step each in turns on the same
   batch (experiments.time_to_target: every variant sees the same load);
4. time to top-2's final completion loss on the validation split: wall and CPU seconds,
   steps (interpolated between evaluations), and their ratio to top-2's;
5. quality on the test split with the variant's own gate and with every eval gate (the
   paper evaluated with top-1): the exact match of the greedy completion, computed from one
   teacher-forced pass (greedy decoding reproduces a completion, EOS included, exactly when
   every teacher-forced argmax is the completion's token); accuracy for the classification
   task;
6. the share of tokens sent to two experts while training.

Tasks, generated from a fixed seed (OUT/data/TASK/{train,test}.jsonl):
- `sentiment` (classification, accuracy): "review: the plot was not dull, but the music was
  flat" -> " negative". A clause's polarity is its adjective's, flipped by "not"; "it is not
  true that ..." flips it again; with two clauses joined by "but" the second decides.
- `translate` (generation, exact match): "translate: red cat sleeps\nfrench:" -> " fasa
  kozo zora" (2-5 words), a fixed word-for-word dictionary of 48 words into made-up
  two-syllable words (a model must store the dictionary: what experts add).

    python -m experiments fine_tuning_protocol --out runs/ftp --json   # 3 seeds, ~1 h on 2 cores
    python -m experiments fine_tuning_protocol --out /tmp/ftp --quick  # smoke test (~3 min)

Writes OUT/fine_tuning_protocol.json; with --json docs/results/YYYY-MM-DD-fine_tuning_protocol.json.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.results import add_json_flag, markdown_table, write_json
from experiments.adaptive_vs_fixed import GSHARD_BALANCE
from experiments.time_to_target import (
    MODEL,
    SharedData,
    Variant,
    _ms,
    seed_results,
    summarize,
    train_side_by_side,
)

ROOT = Path(__file__).resolve().parents[1]
EXPERTS = 16
VARIANTS = {
    "dense": [],  # the pretrained model itself (the paper's dense column)
    "top2": ["model.moe.gating=top2", *GSHARD_BALANCE],
    "top1": ["model.moe.gating=top1", *GSHARD_BALANCE],
    "adaptive_T0.1": ["model.moe.gating=adaptive", "model.moe.threshold=0.1"],
}
EVAL_GATES = ("top1", "top2", "adaptive")
REFERENCE = "top2"
# The dense model the experts come from: time_to_target's shape (2 layers, d 64, FFN 256,
# each expert's width), pretrained on the embedded corpus.
DENSE = [
    "model.moe.num_experts=0",
    *(o for o in MODEL if o.startswith(("model.num_", "model.d_model", "model.head_dim",
                                        "model.ffn_dim"))),
    "data.source=embedded",
    "train.batch_size=16",
    "train.seq_len=64",
]  # fmt: skip
QUICK_DENSE = ["model.ffn_dim=64", "model.d_model=32", "model.head_dim=8"]
FINE_TUNING = [
    "data.format=prompt_completion",
    "data.validation_fraction=0.1",
    "data.prefetch=0",
    "train.batch_size=16",
    "model.moe.block_size=32",  # dropless blocks of 32 rows: cost follows the routing
    "model.moe.z_loss_weight=0.0",  # the paper uses no router z-loss
]
TASKS = {"sentiment": "accuracy", "translate": "exact match"}
SEQ_LEN = {"sentiment": 64, "translate": 128}  # a few whole examples per window
# Li et al. 2023, Table 3 (time to top-2's quality relative to top-2 / quality).
PAPER = {
    "sentiment": ("SST-2, BERT-base (acc)", ["0.88x / 0.912", "1x / 0.918", "0.99x / 0.902",
                                             "0.77x / 0.919"]),
    "translate": ("WMT19, FSMT (BLEU)", ["0.87x / 40.9", "1x / 41.1", "1.04x / 39.5",
                                         "0.79x / 41.1"]),
}  # fmt: skip

SUBJECTS = ["the film", "the plot", "the acting", "the music", "the ending", "the cast",
            "the script", "the pacing"]  # fmt: skip
POSITIVE = ["good", "great", "fine", "lovely", "clever", "moving", "fresh", "gripping"]
NEGATIVE = ["bad", "dull", "awful", "weak", "boring", "clumsy", "stale", "flat"]
WORDS = ["red", "blue", "green", "small", "big", "old", "new", "quick", "cat", "dog", "bird",
         "fish", "house", "tree", "river", "road", "man", "woman", "child", "king", "sleeps",
         "runs", "eats", "sees", "finds", "loves", "the", "a", "near", "under", "over", "with",
         "bread", "water", "stone", "light", "night", "day", "sun", "moon", "door", "boat",
         "sings", "walks", "reads", "writes", "apple", "book"]  # fmt: skip
SYLLABLES = ["ko", "ra", "mi", "tu", "ve", "sa", "lo", "ni", "pe", "du", "ga", "ri", "zo", "fa"]


def dictionary() -> dict[str, str]:
    """The made-up translation of every word (fixed: seeded by nothing but this list)."""
    rng = np.random.default_rng(4444)
    out, used = {}, set()
    for word in WORDS:
        while (made := "".join(rng.choice(SYLLABLES, rng.integers(2, 3)))) in used:
            pass
        used.add(made)
        out[word] = made
    return out


def sentiment_record(rng) -> dict:
    def clause():
        subject, positive = rng.choice(SUBJECTS), bool(rng.integers(2))
        adjective = rng.choice(POSITIVE if positive else NEGATIVE)
        negated = rng.random() < 0.4
        text = f"{subject} was {'not ' if negated else ''}{adjective}"
        polarity = positive != negated
        if rng.random() < 0.2:
            text, polarity = f"it is not true that {text}", not polarity
        return text, polarity

    text, polarity = clause()
    if rng.random() < 0.5:
        second, polarity = clause()
        text = f"{text}, but {second}"
    label = "positive" if polarity else "negative"
    return {"prompt": f"review: {text}\nsentiment:", "completion": f" {label}"}


def translate_record(rng, words: dict[str, str]) -> dict:
    phrase = list(rng.choice(WORDS, rng.integers(2, 6)))
    target = " ".join(words[w] for w in phrase)
    return {"prompt": f"translate: {' '.join(phrase)}\nfrench:", "completion": f" {target}"}


def write_task(folder: Path, task: str, train: int, test: int) -> None:
    """The task's train and test jsonl (the test records are drawn apart from the train's)."""
    folder.mkdir(parents=True, exist_ok=True)
    words = dictionary()
    for split, n, seed in (("train", train, 1), ("test", test, 2)):
        rng = np.random.default_rng([seed, len(task)])
        draw = sentiment_record if task == "sentiment" else (lambda r: translate_record(r, words))
        rows = [draw(rng) for _ in range(n)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def pretrain(out: Path, args, log) -> Path:
    """The dense checkpoint (trained once, then reused)."""
    from etils import epath

    from jaxmoe.config.loading import load_config
    from jaxmoe.storage.paths import finished_steps
    from jaxmoe.training.loop import train

    workdir = out / "dense"
    if not finished_steps(epath.Path(workdir) / "checkpoints"):
        overrides = [
            *DENSE,
            *(QUICK_DENSE if args.quick else []),
            f"train.steps={args.pretrain_steps}",
            f"data.cache_dir={out / 'cache'}",
            "train.eval_every=0",
            "train.max_to_keep=1",
            "optimizer.warmup_steps=20",
        ]
        log(f"== pretraining the dense model ({args.pretrain_steps} steps)")
        summary = train(load_config(str(ROOT / "configs" / "default.py"), overrides), str(workdir),
                        progress=False)  # fmt: skip
        log(f"   dense eval loss {summary['eval']['loss']:.3f}")
    return workdir


def upcycled(out: Path, dense: Path, seed: int) -> Path:
    from jaxmoe.conversions.surgery import convert_upcycle

    path = out / f"moe{EXPERTS}_seed{seed}"
    if not path.exists():
        convert_upcycle(str(dense), str(path), EXPERTS, every=1, gating="top2", seed=seed,
                        init="random")  # fmt: skip
    return path


def variant_config(name: str, checkpoint: Path, task_dir: Path, out: Path, args, seed: int):
    from jaxmoe.training.init_from import config_from_checkpoint

    overrides = [
        f"train.init_from={checkpoint}",
        f"train.seq_len={SEQ_LEN[task_dir.name]}",
        f"data.source=jsonl:{task_dir / 'train.jsonl'}",
        f"data.cache_dir={out / 'cache'}",
        *FINE_TUNING,
        *([] if name == "dense" else VARIANTS[name]),
        f"train.steps={args.steps}",
        f"train.seed={seed}",
        f"optimizer.learning_rate={args.learning_rate}",
        f"optimizer.warmup_steps={args.warmup_steps}",
        *args.set,
    ]
    if name == "dense":  # no MoE key may be set on the dense model
        overrides = [o for o in overrides if not o.startswith("model.moe.")]
    return config_from_checkpoint(overrides)


class FineTuned(Variant):
    """A time_to_target Variant that starts from its seed's checkpoint (train.init_from)."""

    def __init__(self, name, config, mesh, data, args, checkpoints: dict):
        super().__init__(name, config, mesh, data, args)
        self.checkpoints = checkpoints  # seed -> checkpoint

    def start(self, seed: int, first_batch) -> None:
        import jax
        import jax.numpy as jnp

        from jaxmoe.checkpoints.manager import restore_params
        from jaxmoe.models.spec import model_spec
        from jaxmoe.models.stack import layer_layouts
        from jaxmoe.training.state import state_shardings

        spec = model_spec(self.config.model, self.mesh)
        abstract, _ = state_shardings(self.mesh, spec, self.optimizer)
        layouts = layer_layouts(self.config.model)
        params = restore_params(str(self.checkpoints[seed]), abstract["params"], layouts)
        with jax.set_mesh(self.mesh):
            init = jax.jit(self.optimizer.init, out_shardings=self.shardings["opt_state"])
            opt_state = init(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), self.shardings["step"])
        self.state = {"step": step, "params": params, "opt_state": opt_state}
        if self.compiled is None:
            with jax.set_mesh(self.mesh):
                self.compiled = self.step.lower(self.state, first_batch).compile()


def exact_matches(variant: FineTuned, test_batches: list, num_examples: int) -> dict:
    """{gate: (share of test examples whose greedy completion is exact, token accuracy)}
    with the variant's own gate and, for an MoE, every EVAL_GATES gate."""
    import jax
    import jax.numpy as jnp

    from jaxmoe.training.steps import forward

    gates = {"own": {}} | ({} if variant.gating == "dense" else
                           {g: {"eval_gating": g} for g in EVAL_GATES})  # fmt: skip
    out = {}
    for gate, moe in gates.items():
        spec = variant._spec(variant.mesh, **moe) if moe else variant._spec(variant.mesh)

        def matches(params, batch, spec=spec):
            logits, _ = forward(spec.graphdef, params, batch, train=False, rest=spec.rest)
            weights = batch["weights"] > 0
            right = jnp.argmax(logits, -1) == batch["targets"]
            return jnp.all(right | ~weights, -1), jnp.sum(right & weights), jnp.sum(weights)

        fn = jax.jit(matches)
        exact, right, total = [], 0.0, 0.0
        with jax.set_mesh(variant.mesh):
            for batch in test_batches:
                e, r, t = jax.device_get(fn(variant.state["params"], batch))
                exact.append(e)
                right, total = right + float(r), total + float(t)
        out[gate] = {
            "exact_match": float(np.mean(np.concatenate(exact)[:num_examples])),
            "token_accuracy": right / max(total, 1.0),
        }
    return out


def test_batches(config, path: Path, batch_size: int):
    """One test example per row (evaluate.batch_examples), with the format's weights."""
    from jaxmoe.data.sources import load_tokenizer
    from jaxmoe.inference.evaluate import batch_examples, read_format_jsonl

    examples = read_format_jsonl(str(path), config.data, load_tokenizer(config.data))
    return batch_examples(examples, batch_size, False), len(examples)


def run_task(task: str, out: Path, dense: Path, args, log) -> dict:
    task_dir = out / "data" / task
    write_task(task_dir, task, args.train_examples, args.test_examples)
    checkpoints = {seed: upcycled(out, dense, seed) for seed in args.seeds}
    seeds, per_seed, variants = {}, {}, {}
    for seed in args.seeds:
        configs = {
            n: variant_config(n, dense if n == "dense" else checkpoints[seed], task_dir, out, args,
                              seed)
            for n in args.variants
        }  # fmt: skip
        data = SharedData(configs[args.variants[0]], args.eval_batches)
        for n in args.variants:
            if n not in variants:
                log(f"== {task}: compiling {n}")
                chosen = {s: (dense if n == "dense" else checkpoints[s]) for s in args.seeds}
                variants[n] = FineTuned(n, configs[n], data.mesh, data, args, chosen)
            variants[n].batch_shardings = data.batch_shardings
        log(f"== {task}, seed {seed}: {len(variants)} variants side by side, {args.steps} steps")
        trained = train_side_by_side(variants, data, args, seed, log)
        target = trained["curves"][REFERENCE][-1]["loss_own"]  # top-2's final quality
        rows = seed_results(variants, trained, target)
        batches, count = test_batches(configs[args.variants[0]], task_dir / "test.jsonl", 32)
        for n, v in variants.items():
            rows[n]["quality"] = exact_matches(v, batches, count)
        per_seed[seed] = rows
        seeds[seed] = {"variants": rows, "target_loss": target,
                       "load_average_1min": trained["loads"]}  # fmt: skip
        log("   " + ", ".join(f"{n} {rows[n]['quality']['own']['exact_match']:.3f}"
                              for n in variants))  # fmt: skip
    summary = summarize(per_seed)
    for n in variants:
        for gate in ("own", *EVAL_GATES):
            values = [s[n]["quality"][gate]["exact_match"] for s in per_seed.values()
                      if gate in s[n]["quality"]]  # fmt: skip
            if values:
                summary[n][f"quality_{gate}"] = {
                    "mean": float(np.mean(values)),
                    "std": float(np.std(values, ddof=1)) if len(values) > 1 else None,
                    "values": values, "reached": len(values), "seeds": len(values),
                }  # fmt: skip
    return {"metric": TASKS[task], "seeds": seeds, "summary": summary,
            "examples": {"train": args.train_examples, "test": args.test_examples}}  # fmt: skip


def table3(report: dict) -> str:
    """The paper's Table 3 layout: per task, time to top-2's quality vs top-2 / quality."""
    paper = "paper (their task): dense; top-2; top-1; adaptive"
    header = ["task (metric)", *args_variants(report), paper]
    rows = []
    for task, result in report["tasks"].items():
        cells = []
        for n in args_variants(report):
            s = result["summary"].get(n)
            if s is None:
                cells.append("-")
                continue
            cells.append(f"{_ms(s['seconds_vs_top2_own'], suffix='x')} / "
                         f"{_ms(s['quality_own'], '{:.3f}')}")  # fmt: skip
        paper_task, paper = PAPER[task]
        rows.append([f"{task} ({result['metric']})", *cells, f"{paper_task}: {'; '.join(paper)}"])
    return markdown_table(header, rows)


def detail_table(report: dict) -> str:
    header = ["task", "variant", "wall s vs top-2", "CPU s vs top-2", "steps to target",
              "tokens to 2 experts", "final loss", "quality own", "top-1 eval", "top-2 eval",
              "adaptive eval"]  # fmt: skip
    rows = []
    for task, result in report["tasks"].items():
        for n, s in result["summary"].items():
            share = s["top2_share"]
            rows.append([
                task, n, _ms(s["seconds_vs_top2_own"], suffix="x"),
                _ms(s["cpu_seconds_vs_top2_own"], suffix="x"),
                _ms(s["steps_to_target_own"], "{:.0f}"),
                "-" if share["mean"] is None else _ms(share, "{:.1%}"),
                _ms(s["final_loss_own"], "{:.3f}"),
                *(_ms(s[f"quality_{g}"], "{:.3f}") if f"quality_{g}" in s else "-"
                  for g in ("own", *EVAL_GATES)),
            ])  # fmt: skip
    return markdown_table(header, rows)


def args_variants(report: dict) -> list[str]:
    return report["settings"]["variants"]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="directory for checkpoints, data and the JSON")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--pretrain_steps", type=int, default=None, help="default 800; quick 20")
    p.add_argument(
        "--steps", type=int, default=None, help="fine-tuning steps; default 200, quick 8"
    )
    p.add_argument("--eval_every", type=int, default=None, help="default 20; quick 4")
    p.add_argument("--eval_batches", type=int, default=4, help="validation batches (0: all)")
    p.add_argument("--warmup_steps", type=int, default=10)
    p.add_argument("--learning_rate", type=float, default=3e-3)
    p.add_argument("--train_examples", type=int, default=None, help="default 4000; quick 200")
    p.add_argument("--test_examples", type=int, default=None, help="default 400; quick 32")
    p.add_argument("--compile_cache", default="", help="JAX compilation cache (OUT/jax_cache)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--quick", action="store_true", help="tiny model, a few steps: a smoke test")
    p.add_argument("--report", default="", help="train nothing: print this JSON's tables")
    add_json_flag(p)
    args = p.parse_args(argv)
    args.pretrain_steps = args.pretrain_steps or (20 if args.quick else 800)
    args.steps = args.steps or (8 if args.quick else 200)
    args.eval_every = args.eval_every or (4 if args.quick else 20)
    args.train_examples = args.train_examples or (200 if args.quick else 4000)
    args.test_examples = args.test_examples or (32 if args.quick else 400)
    args.seeds = [int(x) for x in args.seeds.split(",") if x]
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.variants = [v for v in args.variants.split(",") if v]
    for flag, chosen, known in (("--tasks", args.tasks, TASKS), ("--variants", args.variants,
                                                                 VARIANTS)):  # fmt: skip
        unknown = sorted(set(chosen) - set(known))
        if unknown:
            p.error(f"{flag}: unknown {unknown}; choose from {list(known)}")
    if REFERENCE not in args.variants:
        p.error(f"--variants must include {REFERENCE}: the time is to its final quality")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.report:
        report = json.loads(Path(args.report).read_text())
        print(table3(report), "", detail_table(report), sep="\n")
        return 0
    import jax

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", args.compile_cache or str(out / "jax_cache"))

    def log(msg):
        print(msg, flush=True)

    started, loads = time.time(), [os.getloadavg()[0]]
    dense = pretrain(out, args, log)
    report = {
        "settings": {
            "dense": DENSE + (QUICK_DENSE if args.quick else []),
            "fine_tuning": FINE_TUNING,
            "experts": EXPERTS,
            "variants": args.variants,
            "pretrain_steps": args.pretrain_steps,
            "steps": args.steps,
            "eval_every": args.eval_every,
            "learning_rate": args.learning_rate,
            "warmup_steps": args.warmup_steps,
            "quick": args.quick,
            "overrides": args.set,
            "device": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
            "cpu_count": os.cpu_count(),
            "command": "python -m experiments fine_tuning_protocol "
            + " ".join(sys.argv[1:] if argv is None else argv),
        },
        "tasks": {},
    }
    for task in args.tasks:
        report["tasks"][task] = run_task(task, out, dense, args, log)
        loads.append(os.getloadavg()[0])
        report["settings"]["wall_s"] = time.time() - started
        report["load_average_1min"] = loads
        (out / "fine_tuning_protocol.json").write_text(json.dumps(report, indent=1))
    print(table3(report), "", detail_table(report), sep="\n", flush=True)
    write_json("fine_tuning_protocol", report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
