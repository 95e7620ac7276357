"""Where a training run's wall time goes: steps, compile, data, checkpoints, evaluation.

Host-side accounting, no device syncs of its own: the loop already waits for each step's
scalars one step late, and that wait is counted as step time. Goodput is the share of the
run's wall time spent in steps.
"""

import contextlib
import time

PHASES = ("step", "compile", "data", "checkpoint", "eval")


class Goodput:
    def __init__(self):
        self.started = time.perf_counter()
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def phase(self, name: str):
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - begin

    def summary(self) -> dict:
        wall = time.perf_counter() - self.started
        other = max(wall - sum(self.seconds.values()), 0.0)
        return {
            "goodput": self.seconds["step"] / wall if wall > 0 else 0.0,
            "wall_s": wall,
            **{f"{name}_s": value for name, value in self.seconds.items()},
            "other_s": other,  # start-up: data preparation, initialisation, restoring
        }

    @staticmethod
    def describe(summary: dict) -> str:
        parts = ", ".join(f"{name} {summary[f'{name}_s']:.1f} s" for name in (*PHASES[1:], "other"))
        return (
            f"goodput: {summary['goodput']:.1%} of {summary['wall_s']:.1f} s in steps "
            f"({summary['step_s']:.1f} s); {parts}"
        )
