"""Metrics out: WORKDIR/metrics.jsonl, TensorBoard event files and a console progress bar.

Only process 0 writes. Values arrive as host numbers (the loop fetches them one step late).

A resumed run continues the file: rows after the restored step (written by the run that was
interrupted, and trained again now) are dropped first, so each step has one row, and so are
damaged lines (a torn write), with one warning. Object stores (gs://) cannot append: there
the file is rewritten whole, prior rows included, by `flush()` (the loop calls it before
each checkpoint, so every row up to a checkpoint's step is stored before the checkpoint is)
and at most every `REMOTE_FLUSH_S` seconds.
"""

import hashlib
import json
import logging
import math
import re
import time

import jax
from etils import epath

from jaxmoe.compat.optional import require
from jaxmoe.storage.paths import is_remote

log = logging.getLogger("jaxmoe")

REMOTE_FLUSH_S = 30.0


def kept_rows(data: bytes, last_step: int) -> tuple[str, int]:
    """The lines of a metrics file whose step is <= `last_step`, and how many lines were
    damaged (not a JSON row with an integer step: a line torn by a kill, bytes of a torn
    write) and dropped."""
    kept, damaged = [], 0
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            step = json.loads(raw.decode("utf-8"))["step"]
        except (ValueError, TypeError, KeyError, IndexError):
            step = None
        if not isinstance(step, int) or isinstance(step, bool):
            damaged += 1
        elif step <= last_step:
            kept.append(raw.decode("utf-8") + "\n")
    return "".join(kept), damaged


def wandb_options(config) -> dict | None:
    """`train.wandb` = PROJECT[/RUN_NAME] turns on Weights & Biases logging ("" = off)."""
    if not config.train.wandb:
        return None
    project, _, name = config.train.wandb.partition("/")
    return {"project": project, "name": name or None, "config": config.to_dict()}


class MetricsWriter:
    def __init__(
        self,
        workdir: str,
        total_steps: int,
        start_step: int,
        progress: bool = True,
        wandb: dict | None = None,
    ):
        self.enabled = jax.process_index() == 0
        self.path = epath.Path(workdir) / "metrics.jsonl"
        self.tb_dir = str(epath.Path(workdir) / "tensorboard")
        self._tb = None
        self._bar = None
        self._wandb = None
        if not self.enabled:
            return
        if wandb is not None:
            self._wandb = _start_wandb(workdir, wandb)
        SummaryWriter = require("tensorboardX", "TensorBoard metrics").SummaryWriter

        # purge_step: TensorBoard hides the interrupted run's events after the restored step.
        self._tb = SummaryWriter(self.tb_dir, purge_step=start_step + 1 if start_step else None)
        prior = self._prior_rows(start_step)
        self._remote = is_remote(workdir)
        if self._remote:
            self._rows, self._stored = [prior], True
            self._last_upload = time.monotonic()
        else:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(prior)
            tmp.replace(self.path)
            self._file = self.path.open("a")
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                unit="step",
                dynamic_ncols=True,
                smoothing=0.1,
            )

    def _prior_rows(self, start_step: int) -> str:
        """The rows a resumed run keeps; damaged lines go with one warning."""
        if not start_step or not self.path.exists():
            return ""
        prior, damaged = kept_rows(self.path.read_bytes(), start_step)
        if damaged:
            log.warning(
                "%s: dropped %d damaged line%s (a torn write), kept its rows up to step %d",
                self.path,
                damaged,
                "" if damaged == 1 else "s",
                start_step,
            )
        return prior

    def write(self, step: int, split: str, values: dict) -> None:
        if not self.enabled:
            return
        clean = {
            k: (float(v) if not isinstance(v, str) else v)
            for k, v in sorted(values.items(), key=lambda item: natural_key(item[0]))
        }
        line = json.dumps({"step": step, "split": split, **clean}, allow_nan=True) + "\n"
        self._append(line)
        finite = {
            f"{split}/{key}": value
            for key, value in clean.items()
            if isinstance(value, float) and math.isfinite(value)
        }
        for tag, value in finite.items():
            self._tb.add_scalar(tag, value, step)
        if self._wandb is not None:
            self._wandb.log(finite, step=step)

    def _append(self, line: str) -> None:
        if self._remote:
            self._rows.append(line)
            self._stored = False
            if time.monotonic() - self._last_upload >= REMOTE_FLUSH_S:
                self.flush()
        else:
            self._file.write(line)
            self._file.flush()

    def write_summary(self, step: int, name: str, values: dict) -> None:
        """One `{"step", "split": name, name: {...}}` line (e.g. the run's goodput)."""
        if not self.enabled:
            return
        record = {"step": step, "split": name, name: {k: float(v) for k, v in values.items()}}
        self._append(json.dumps(record) + "\n")
        for key, value in values.items():
            self._tb.add_scalar(f"{name}/{key}", float(value), step)
        if self._wandb is not None:
            self._wandb.summary.update({f"{name}/{k}": float(v) for k, v in values.items()})

    def flush(self) -> None:
        """Store every row written so far (and the TensorBoard events)."""
        if not self.enabled:
            return
        self._tb.flush()
        if self._remote and not self._stored:
            self._rows = ["".join(self._rows)]
            self.path.write_text(self._rows[0])  # one object, replaced whole
            self._stored, self._last_upload = True, time.monotonic()

    def progress(self, step: int, loss: float, tokens_per_s: float, mfu: float | None = None):
        if self._bar is not None:
            self._bar.n = step
            shown = {"loss": f"{loss:.3f}", "tok_s": f"{tokens_per_s:,.0f}"}
            if mfu is not None:
                shown["mfu"] = f"{mfu:.1%}"
            self._bar.set_postfix(shown, refresh=False)
            self._bar.refresh()

    def print(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        self.flush()
        self._tb.close()
        if not self._remote:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def _start_wandb(workdir: str, options: dict):
    """A W&B run tied to the workdir: a resumed job continues the same W&B run."""
    try:
        import wandb
    except ImportError as error:
        raise ValueError(
            "train.wandb is set but the wandb package is not installed (pip install wandb)"
        ) from error
    run_id = hashlib.sha1(str(workdir).encode()).hexdigest()[:16]
    local = None if is_remote(workdir) else str(workdir)
    return wandb.init(
        project=options["project"],
        name=options["name"],
        id=run_id,
        resume="allow",
        config=options["config"],
        dir=local,
    )


def natural_key(name: str) -> tuple:
    """Sort key with digit runs compared as numbers: layer_2 before layer_10.

    Metrics come out of jit with their keys sorted as strings (jax flattens dicts that way).
    """
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))
