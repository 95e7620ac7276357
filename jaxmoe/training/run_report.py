"""What `jaxmoe train` prints when it stops: the eval result, what the workdir now holds and
what to run next, or, for a run already finished, that there was nothing to train."""

import os
import shlex

from jaxmoe.storage.paths import is_remote
from jaxmoe.training.curves import read_rows


def shown(path: str) -> str:
    """`path` as a user would type it here: relative to the current directory when inside
    it, else as it is (absolute, gs://)."""
    if is_remote(path):
        return path
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def eval_line(ev: dict | None) -> str:
    if not ev:
        return "no evaluation"
    loss, ppl, acc = (ev.get(k, float("nan")) for k in ("loss", "perplexity", "accuracy"))
    return f"eval loss {loss:.4f} (perplexity {ppl:.2f}, accuracy {acc:.3f})"


def last_eval(metrics_path: str) -> dict | None:
    """The last eval row of a metrics file (what a finished run reports), or None."""
    if not os.path.exists(metrics_path) and not is_remote(metrics_path):
        return None
    rows = [row for row in read_rows(metrics_path) if row.get("split") == "eval"]
    return rows[-1] if rows else None


def report(summary: dict, workdir: str, config) -> list[str]:
    """The closing lines of `jaxmoe train` for `summary` (training.loop.train's)."""
    step, run = summary["step"], shown(workdir)
    if summary["stopped"] == "finished":
        ev = last_eval(summary["metrics"])
        where = f", step {ev['step']}" if ev else ""
        lines = [
            f"{run} is finished: step {step} of train.steps={config.train.steps}, nothing "
            f"left to train (--config.train.steps=N with N > {step} trains on from it); "
            f"its last {eval_line(ev)}{where}"
        ]
    else:
        lines = []
        if summary["stopped"] == "preempted":
            lines.append(f"preempted at step {step}: checkpoint saved; rerun to resume")
        lines.append(f"done: step {step}, {eval_line(summary['eval'])}")
    held = [
        (f"checkpoints/{step}/", "the model, optimizer state, config and tokenizer"),
        ("metrics.jsonl", "a JSON row per logged step and evaluation"),
    ]
    if summary.get("curves") or _exists(os.path.join(workdir, "curves.png")):
        held.append(("curves.png", "the loss curves"))
    tensorboard = shown(summary["tensorboard"])
    held.append(("tensorboard/", f"tensorboard --logdir {tensorboard}"))
    lines.append(f"{run}/ holds:")
    lines += [f"  {name:<16} {what}" for name, what in held]
    lines.append("next:")
    lines += [f"  {command}" for command in next_commands(run, config)]
    return lines


def next_commands(run: str, config) -> list[str]:
    """Commands that use the run just trained (the README's walkthrough goes on from them)."""
    source = config.data.source
    data = "jsonl:FILE"  # a glob or another kind of source: the user names a file
    if source == "embedded":
        data = "embedded"
    elif source.startswith("jsonl:") and not any(c in source for c in "*?["):
        data = shlex.quote("jsonl:" + shown(source.removeprefix("jsonl:")))
    run_arg = shlex.quote(run)
    commands = [
        f"jaxmoe eval --checkpoint {run_arg} --data {data}",
        f'jaxmoe decode --checkpoint {run_arg} --prompt "The" --max_new_tokens 32',
    ]
    if config.model.arch == "decoder":
        exported = shlex.quote(f"exported/{os.path.basename(run.rstrip('/')) or 'run'}")
        commands.append(f"jaxmoe export hf {run_arg} {exported}")
    else:
        commands.append(f"jaxmoe export t5x {run_arg} t5x_out")
    return commands


def _exists(path: str) -> bool:
    return not is_remote(path) and os.path.exists(path)
