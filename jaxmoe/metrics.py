"""Metrics out: WORKDIR/metrics.jsonl, TensorBoard event files and a console progress bar.

Only process 0 writes. Values arrive as host numbers (the loop fetches them one step late).
"""

import json
import math
import re

import jax
from etils import epath


class MetricsWriter:
    def __init__(self, workdir: str, total_steps: int, start_step: int, progress: bool = True):
        self.enabled = jax.process_index() == 0
        self.path = epath.Path(workdir) / "metrics.jsonl"
        self.tb_dir = str(epath.Path(workdir) / "tensorboard")
        self._tb = None
        self._bar = None
        if not self.enabled:
            return
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
        clean = {
            k: (float(v) if not isinstance(v, str) else v)
            for k, v in sorted(values.items(), key=lambda item: natural_key(item[0]))
        }
        record = {"step": step, "split": split, **clean}
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()
        for key, value in clean.items():
            if isinstance(value, float) and math.isfinite(value):
                self._tb.add_scalar(f"{split}/{key}", value, step)

    def progress(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
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


def natural_key(name: str) -> tuple:
    """Sort key with digit runs compared as numbers: layer_2 before layer_10.

    Metrics come out of jit with their keys sorted as strings (jax flattens dicts that way).
    """
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))
