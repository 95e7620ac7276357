"""The training loop behind `jaxmoe train --config C --workdir W`.

The run is set up (run_setup.py), then its Trainer (trainer.py) steps, evaluates and saves
on this loop's schedule. Re-running with the same workdir resumes from the latest
checkpoint, including the data iterator's position. Metrics are fetched one step late so the
host never stalls the device.
"""

import contextlib
import logging
import signal

import jax
from etils import epath

from jaxmoe.config.schema import JobConfig
from jaxmoe.storage.disk_full import no_space_left, quiet_disk_full
from jaxmoe.storage.paths import absolute_path
from jaxmoe.training.curves import CURVES_FILE, write_curves
from jaxmoe.training.goodput import Goodput
from jaxmoe.training.run_setup import RunSetup, set_up_run
from jaxmoe.training.trainer import Trainer
from jaxmoe.training.workdir import WorkdirLock, check_workdir

log = logging.getLogger("jaxmoe")


class _Preemption:
    """SIGTERM (TPU maintenance, SLURM) asks for a checkpoint at the next step boundary.

    With several processes they must agree on the step, or their collective saves would
    deadlock: JAX's preemption sync point (fed by the coordination service, which also
    catches SIGTERM) gives every process the same answer for the same step.
    """

    def __init__(self):
        self.requested = False
        self.multi = jax.process_count() > 1
        self._previous = None
        if not self.multi:
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        del signum, frame
        self.requested = True

    def reached(self, step: int) -> bool:
        if self.multi:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested

    def restore(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def _first_missing(path: epath.Path) -> epath.Path | None:
    """The topmost of `path` and its parents that does not exist yet (what mkdir creates)."""
    missing = None
    while not path.exists():
        missing, parent = path, path.parent
        if parent == path:
            break
        path = parent
    return missing


def _holds_content(path: epath.Path) -> bool:
    """Whether any file below `path` has content (empty directories and files do not)."""
    for child in path.iterdir():
        if child.is_dir() and _holds_content(child):
            return True
        if not child.is_dir() and child.stat().length > 0:
            return True
    return False


def _remove_if_nothing_saved(path: epath.Path) -> None:
    """Remove `path` if it holds nothing but empty directories and files."""
    try:
        if path.exists() and not _holds_content(path):
            path.rmtree()
    except Exception as error:  # never hide the error that ended the run
        log.warning("could not remove the empty workdir %s: %s", path, error)


def train(config: JobConfig, workdir: str, *, progress: bool = True) -> dict:
    """Train (or resume) according to `config`; returns a summary dict.

    A run that fails before it wrote anything (a config or data error) leaves no empty
    workdir behind: what this call created is removed again.
    """
    workdir = absolute_path(workdir)  # the one place: `~` and relative, against the cwd now
    goodput = Goodput()
    first = jax.process_index() == 0
    created = _first_missing(epath.Path(workdir)) if first else None
    closers = []  # what _train opened, closed again if it fails
    try:
        with quiet_disk_full():
            workdir_path = check_workdir(workdir)
            with WorkdirLock(workdir_path, enabled=jax.process_index() == 0) as lock:
                return _train(config, workdir_path, lock, goodput, progress, closers)
    except BaseException as error:
        for close in reversed(closers):
            # An unclosed async checkpointer prints asyncio tracebacks at exit.
            with contextlib.suppress(Exception):
                close()
        if created is not None:
            _remove_if_nothing_saved(created)
        if no_space_left(error):
            raise RuntimeError(
                f"no space left on {workdir}: the checkpoint being written was not kept and "
                f"completed checkpoints are intact; free space and rerun to resume"
            ) from None
        raise


def _train(
    config: JobConfig,
    workdir_path,
    lock: WorkdirLock,
    goodput: Goodput,
    progress: bool,
    closers: list,
) -> dict:
    setup = set_up_run(config, workdir_path, closers)
    if setup.finished:  # nothing to compile, train or evaluate again
        setup.close()
        return _finished(setup, workdir_path)
    trainer = Trainer(setup, workdir_path, goodput, progress, closers)
    preemption = _Preemption()
    with jax.set_mesh(trainer.mesh):
        stop_reason = _run_steps(trainer, lock, preemption)
        stop_reason = _finish(trainer, stop_reason)
    preemption.restore()
    summary = trainer.close(stop_reason)
    if jax.process_index() == 0:
        summary["curves"] = _draw_curves(workdir_path)
    if stop_reason and stop_reason != "preempted":
        raise RuntimeError(stop_reason)
    return summary


def _run_steps(trainer: Trainer, lock: WorkdirLock, preemption: _Preemption) -> str | None:
    """Steps to train.steps, evaluating and saving on schedule; returns why the run must
    stop ("preempted", a non-finite step or state), or None."""
    train = trainer.config.train
    pending = None  # (step, metrics) of the last dispatched step, read one step late
    save_due = False  # a checkpoint waits for the end of a run of skipped steps
    while trainer.steps_done < train.steps:
        metrics = trainer.step()
        step = trainer.steps_done
        if pending is not None:
            stop_reason = trainer.log(pending)
            if stop_reason:
                return stop_reason
        pending = (step, metrics)
        lock.heartbeat()
        if train.eval_every and step % train.eval_every == 0:
            trainer.evaluate()
        preempted = preemption.reached(step)
        if preempted or save_due or (train.checkpoint_every and step % train.checkpoint_every == 0):
            # Never save a state produced by a non-finite step.
            stop_reason = trainer.log(pending)
            pending = None
            if stop_reason:
                return stop_reason
            # In a run of skipped steps (nonfinite=skip) the save waits for a step that
            # trains: if the run goes on until it stops, the last checkpoint predates it.
            save_due = trainer.skipping and not preempted
            if not save_due:
                stop_reason = trainer.save()
                if stop_reason:
                    return stop_reason
        if preempted:
            return "preempted"
    if pending is not None:
        return trainer.log(pending, force=True)
    return None


def _finish(trainer: Trainer, stop_reason: str | None) -> str | None:
    """The last checkpoint and evaluation of steps that ended for `stop_reason`; returns
    why the run stopped (a non-finite state found before the last save)."""
    trainer.stop_profile()
    if stop_reason in (None, "preempted") and not trainer.saved:
        stop_reason = trainer.save(force=True) or stop_reason
    trainer.wait_for_checkpoints()
    every = max(trainer.config.train.eval_every, 1)
    if stop_reason is None and (trainer.last_eval is None or trainer.steps_done % every):
        trainer.evaluate()
    return stop_reason


def _finished(setup: RunSetup, workdir_path) -> dict:
    """The summary of a run resumed at its last step."""
    return {
        "step": setup.start,
        "eval": None,
        "stopped": "finished",
        "checkpoints": str(setup.checkpoints.directory),
        "tensorboard": str(workdir_path / "tensorboard"),
        "metrics": str(workdir_path / "metrics.jsonl"),
        "curves": None,
    }


def _draw_curves(workdir_path) -> str | None:
    """WORKDIR/curves.png from the metrics just written; a picture that cannot be drawn is
    a warning, never the run's failure."""
    try:
        return write_curves(workdir_path)
    except Exception as error:
        log.warning("could not draw %s/%s: %s", workdir_path, CURVES_FILE, error)
        return None
