"""`train.profile_steps = "START:END"`: trace those steps with `jax.profiler` into
WORKDIR/profile, viewable in TensorBoard's profile tab or XProf."""

import jax


def parse_profile_steps(text: str) -> tuple[int, int] | None:
    """ "10:15" -> (10, 15): steps 11 to 15 are traced (the state after step 10 onward);
    "" -> None. Raises ValueError naming the key on anything else."""
    if not text:
        return None
    start, sep, end = text.partition(":")
    try:
        window = (int(start), int(end))
    except ValueError:
        window = None
    if not sep or window is None or not 0 <= window[0] < window[1]:
        raise ValueError(
            f"train.profile_steps={text!r}: expected START:END with 0 <= START < END "
            f"(e.g. 10:15 traces steps 11 to 15)"
        )
    return window


class ProfileWindow:
    """Starts the trace before step START+1 runs and stops it once step END is done."""

    def __init__(self, spec: str, directory, report=print):
        self.window = parse_profile_steps(spec)
        self.directory = str(directory)
        self.report = report
        self.active = False

    def before_step(self, completed: int) -> None:
        if self.window and not self.active and self.window[0] <= completed < self.window[1]:
            jax.profiler.start_trace(self.directory)
            self.active = True

    def after_step(self, completed: int, state) -> None:
        if self.active and completed >= self.window[1]:
            self.stop(state)

    def stop(self, state) -> None:
        if not self.active:
            return
        jax.block_until_ready(state)  # the traced steps' device work belongs in the trace
        jax.profiler.stop_trace()
        self.active = False
        start, end = self.window
        self.report(f"profile of steps {start + 1}-{end} written to {self.directory}")
