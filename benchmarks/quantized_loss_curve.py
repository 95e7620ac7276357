"""Quantized training against bf16 on CPU: the default model's train loss curve with
model.quantization = none | int8 | fp8, same seed, data and dispatch, and the largest gap.

Each run is `jaxmoe train --config configs/default.py` with model.dtype=bfloat16 and
model.moe.dispatch=ragged (the dispatch the quantized experts use, so the runs differ in
the quantization alone), in its own process, one after another. The gap at a logged step is
|loss(quantized) - loss(bf16)|; the curve's tolerance is on the mean of the last `--tail`
logged losses, where one step's batch noise is averaged out.

    flock /tmp/jaxmoe-heavy.lock python -m benchmarks quantized_loss_curve --json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.results import add_json_flag, markdown_table, publish

KINDS = ("none", "int8", "fp8")


def train_losses(kind: str, steps: int, log_every: int, workdir: Path) -> dict:
    """{step: train loss} of one run, and its wall and CPU seconds."""
    command = [
        sys.executable,
        "-m",
        "jaxmoe.cli",
        "train",
        "--config",
        "configs/default.py",
        "--workdir",
        str(workdir),
        f"--config.train.steps={steps}",
        f"--config.train.log_every={log_every}",
        "--config.train.eval_every=0",
        f"--config.train.checkpoint_every={steps}",
        "--config.model.dtype=bfloat16",
        "--config.model.moe.dispatch=ragged",
        f"--config.model.quantization={kind}",
    ]
    start, cpu_start = time.time(), os.times()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    cpu_end = os.times()
    losses = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("split") == "train":
            losses[record["step"]] = record["loss"]
    cpu_s = cpu_end.children_user + cpu_end.children_system
    cpu_s -= cpu_start.children_user + cpu_start.children_system
    return {"losses": losses, "wall_s": time.time() - start, "cpu_s": cpu_s}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--tail", type=int, default=5, help="logged losses averaged at the end")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    runs = {}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            runs[kind] = train_losses(kind, args.steps, args.log_every, Path(tmp) / kind)
            load.append(os.getloadavg()[0])
    base = runs["none"]["losses"]
    steps = sorted(base)
    rows, summary = [], {}
    for step in steps:
        rows.append([step, *(runs[k]["losses"][step] for k in KINDS)])
    for kind in KINDS[1:]:
        gaps = [abs(runs[kind]["losses"][s] - base[s]) for s in steps]
        tail = steps[-args.tail :]
        mean_gap = sum(runs[kind]["losses"][s] - base[s] for s in tail) / len(tail)
        summary[kind] = {
            "max_abs_gap": max(gaps),
            "tail_mean_gap": mean_gap,
            "final_loss": runs[kind]["losses"][steps[-1]],
            "wall_s": runs[kind]["wall_s"],
            "cpu_s": runs[kind]["cpu_s"],
        }
    summary["none"] = {
        "final_loss": base[steps[-1]],
        "wall_s": runs["none"]["wall_s"],
        "cpu_s": runs["none"]["cpu_s"],
    }
    table = markdown_table(["step", *(f"loss {k}" for k in KINDS)], rows)
    table += "\n\n" + json.dumps(summary, indent=1)
    result = {
        "protocol": "jaxmoe train configs/default.py, bf16 compute, dispatch ragged, "
        f"{args.steps} steps, train loss every {args.log_every}",
        "losses": {k: runs[k]["losses"] for k in KINDS},
        "summary": summary,
        "load_average": load,
    }
    publish("quantized_loss_curve", result, table, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
