"""Speculative decoding with the MTP module as the draft against plain greedy decoding, CPU.

A model with one multi-token-prediction module (configs/default.py with
`model.mtp_depth=1`, weight 0.3: 4 layers, d_model 128, 8 adaptive-gated experts) trains
with `jaxmoe train` on the embedded corpus; then, for prompts cut from the corpus's eval
split (one prompt per request, batch 1), plain greedy decoding (decode.Generator) and
`--speculative mtp` (speculative.MTPGenerator) generate the same number of new tokens in
turns (order alternating per prompt, EOS ignored so every request runs its full length).
Reported: that the tokens are identical, the drafts' acceptance rate (drafts accepted /
loop steps, all prompts), new tokens per loop step, and the decode time per new token of
each (prefill and compilation not counted) with its ratio, and the 1-minute load average.

    flock /tmp/jaxmoe-heavy.lock python -m benchmarks mtp_speculative --json
    python -m benchmarks mtp_speculative --steps 30 --prompts 2 --new_tokens 16   # smoke
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.results import add_json_flag, markdown_table, write_json

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["model.mtp_depth=1", "data.curriculum=none"]


def train(workdir: Path, args) -> dict:
    """`jaxmoe train` of the MTP model; its last train and eval lines of metrics.jsonl."""
    overrides = [f"--config.{kv}" for kv in [*MODEL, f"train.steps={args.steps}", *args.set]]
    config = str(ROOT / "configs" / "default.py")
    command = [sys.executable, "-m", "jaxmoe.cli", "train", "--config", config,
               "--workdir", str(workdir), *overrides]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT)
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    last = {split: [x for x in lines if x.get("split") == split][-1] for split in ("train", "eval")}
    return {"train_wall_s": round(time.perf_counter() - started, 1), **last}


def prompts_from_eval(config, tokenizer, count: int, length: int) -> list[list[int]]:
    """The first `length` tokens of the first `count` eval examples that long."""
    from jaxmoe.data.pipeline import build_data

    data = build_data(config.data, config.train)
    rows = [row for batch in data.eval_batches for row in np.asarray(batch["inputs"])]
    out = [list(map(int, row[:length])) for row in rows if np.count_nonzero(row) >= length]
    if len(out) < count:
        raise ValueError(f"only {len(out)} eval examples of {length}+ tokens")
    del tokenizer
    return out[:count]


def measure(checkpoint: str, args) -> dict:
    from jaxmoe.inference.decode import Generator
    from jaxmoe.inference.speculative import MTPGenerator
    from jaxmoe.inference.trained_model import TrainedModel

    model = TrainedModel.open(checkpoint)
    cfg, params, mesh = model.config.model, model.params, model.mesh
    plain = Generator(cfg, params, mesh, spec=model.spec, eos_id=-1)
    drafted = MTPGenerator(cfg, params, mesh, spec=model.spec, eos_id=-1)
    prompts = prompts_from_eval(model.config, model.tokenizer, args.prompts, args.prompt_len)
    for generator in (plain, drafted):  # compile both programs before any timing
        generator.generate(prompts[:1], args.new_tokens)
    per = {"plain": [], "mtp": []}
    accepted = steps = 0
    identical = True
    loads = [os.getloadavg()[0]]
    for i, prompt in enumerate(prompts):
        order = [("plain", plain), ("mtp", drafted)]
        results = {}
        for name, generator in order if i % 2 == 0 else order[::-1]:
            results[name] = generator.generate([prompt], args.new_tokens)
            per[name].append(results[name].decode_s / results[name].num_new_tokens)
        identical &= results["plain"].tokens == results["mtp"].tokens
        accepted += results["mtp"].accepted
        steps += results["mtp"].steps
    loads.append(os.getloadavg()[0])
    plain_ms = 1e3 * float(np.median(per["plain"]))
    mtp_ms = 1e3 * float(np.median(per["mtp"]))
    return {
        "identical_tokens": bool(identical),
        "acceptance_rate": accepted / max(steps, 1),
        # The first new token comes from the prefill; each loop step emits 1 + accepted.
        "new_tokens_per_step": (steps + accepted) / max(steps, 1),
        "plain_ms_per_token": plain_ms,
        "mtp_ms_per_token": mtp_ms,
        "mtp_over_plain": mtp_ms / plain_ms,
        "prompts": len(prompts),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "load_average_1min": loads,
        "per_prompt_ms": {k: [1e3 * v for v in vs] for k, vs in per.items()},
    }


def table(report: dict) -> str:
    m = report["decode"]
    loads = m["load_average_1min"]
    rows = [[
        f"default + 1 MTP module, {report['steps']} steps",
        f"{report['train']['eval']['loss']:.3f}",
        f"{report['train']['train'].get('mtp_loss', float('nan')):.3f}",
        "yes" if m["identical_tokens"] else "NO", f"{m['acceptance_rate']:.3f}",
        f"{m['new_tokens_per_step']:.2f}", f"{m['plain_ms_per_token']:.2f}",
        f"{m['mtp_ms_per_token']:.2f}", f"{m['mtp_over_plain']:.3f}x",
        f"{min(loads):.1f}-{max(loads):.1f}",
    ]]  # fmt: skip
    header = [
        "model", "eval loss", "train MTP loss", "tokens identical", "acceptance",
        "tokens / step", "plain ms/token", "MTP ms/token", "MTP / plain", "load",
    ]  # fmt: skip
    return markdown_table(header, rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="training steps")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt_len", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--workdir", type=Path, help="keep the trained model here")
    parser.add_argument("--set", nargs="*", default=[], help="more KEY=VALUE overrides")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp) / "run"
        trained = train(workdir, args)
        checkpoints = sorted((workdir / "checkpoints").iterdir(), key=lambda p: int(p.name))
        report = {
            "config": "configs/default.py",
            "overrides": [*MODEL, *args.set],
            "steps": args.steps,
            "train": trained,
            "decode": measure(str(checkpoints[-1]), args),
            "cpu_count": os.cpu_count(),
        }
    print(table(report), flush=True)
    write_json("mtp_speculative", report, args.json)
    return 0 if report["decode"]["identical_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
