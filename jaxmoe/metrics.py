"""Metrics out: WORKDIR/metrics.jsonl, TensorBoard event files and a console progress bar.

Only process 0 writes. Values arrive as host numbers (the loop fetches them one step late).
"""

import hashlib
import json
import math

import jax
from etils import epath


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
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(self.tb_dir)
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

    def write(self, step: int, split: str, values: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if not isinstance(v, str) else v) for k, v in values.items()}
        record = {"step": step, "split": split, **clean}
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()
        finite = {
            f"{split}/{key}": value
            for key, value in clean.items()
            if isinstance(value, float) and math.isfinite(value)
        }
        for tag, value in finite.items():
            self._tb.add_scalar(tag, value, step)
        if self._wandb is not None:
            self._wandb.log(finite, step=step)

    def write_summary(self, step: int, name: str, values: dict) -> None:
        """One `{"step", "split": name, name: {...}}` line (e.g. the run's goodput)."""
        if not self.enabled:
            return
        record = {"step": step, "split": name, name: {k: float(v) for k, v in values.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for key, value in values.items():
            self._tb.add_scalar(f"{name}/{key}", float(value), step)
        if self._wandb is not None:
            self._wandb.summary.update({f"{name}/{k}": float(v) for k, v in values.items()})

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
        self._tb.close()
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
    local = str(workdir) if "://" not in str(workdir) else None
    return wandb.init(
        project=options["project"],
        name=options["name"],
        id=run_id,
        resume="allow",
        config=options["config"],
        dir=local,
    )
