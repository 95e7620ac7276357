"""The training loop: `jaxmoe train --config C --workdir W` (or `python -m jaxmoe.train`).

Re-running with the same workdir resumes from the latest checkpoint, including the data
iterator's position. Metrics are fetched one step late so the host never stalls the device.
"""

import functools
import logging
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from jax.sharding import NamedSharding

from jaxmoe.checkpoints.manager import TrainCheckpoints, restore_params
from jaxmoe.metrics import MetricsWriter
from jaxmoe.optim import make_optimizer
from jaxmoe.parallel.sharding import (
    ConfigError,
    batch_spec,
    data_parallel_size,
    make_mesh,
)
from jaxmoe.steps import eval_step, step_fns, train_step
from jaxmoe.train_state import init_state, model_spec, state_shardings

log = logging.getLogger("jaxmoe")


def check_workdir(workdir: str) -> epath.Path:
    """Fail before any compile if the workdir cannot be written."""
    path = epath.Path(workdir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write_probe_{jax.process_index()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as error:
        raise ConfigError(f"--workdir {workdir!r} is not writable: {error}") from error
    return path


def resolve_vocab(config, data) -> None:
    """model.vocab_size = 0 takes the tokenizer's size; a smaller explicit size is an error."""
    with config.unlocked():
        if config.model.vocab_size == 0:
            config.model.vocab_size = data.vocab_size
    if config.model.vocab_size < data.vocab_size:
        raise ConfigError(
            f"model.vocab_size={config.model.vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({data.vocab_size})"
        )


def to_global(batch: dict, shardings: dict) -> dict:
    """Assemble this process's rows into global arrays sharded over the batch axes."""
    return {
        key: jax.make_array_from_process_local_data(shardings[key], np.asarray(value))
        for key, value in batch.items()
        if key in shardings
    }


class Evaluator:
    """Jitted evaluation over a fixed list of batches; one device->host fetch at the end."""

    def __init__(self, spec, mesh, batches: list[dict], param_shardings, batch_shardings):
        self.mesh, self.batches, self.batch_shardings = mesh, batches, batch_shardings
        self.fn = jax.jit(
            functools.partial(eval_step, graphdef=spec.graphdef, rest=spec.rest),
            in_shardings=(param_shardings, batch_shardings),
        )

    def __call__(self, params) -> dict:
        totals = None
        with jax.set_mesh(self.mesh):
            for batch in self.batches:
                sums = self.fn(params, to_global(batch, self.batch_shardings))
                sums = {k: v for k, v in sums.items() if not k.endswith("per_example")}
                totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
        totals = jax.device_get(totals)
        weight = max(float(totals["weight_sum"]), 1.0)
        loss = float(totals["nll_sum"]) / weight
        return {
            "loss": loss,
            "perplexity": float(np.exp(min(loss, 50.0))),
            "accuracy": float(totals["correct_sum"]) / weight,
            "num_tokens": int(weight),
        }


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


def describe_memory(abstract_state, shardings) -> tuple[int, float]:
    """(parameter count, bytes of state held by the most loaded device)."""
    params = jax.tree.leaves(abstract_state["params"])
    count = sum(int(np.prod(p.shape)) for p in params)
    per_device = 0.0
    for leaf, sharding in zip(
        jax.tree.leaves(abstract_state), jax.tree.leaves(shardings), strict=True
    ):
        shard = sharding.shard_shape(leaf.shape)
        per_device += float(np.prod(shard)) * leaf.dtype.itemsize
    return count, per_device


def train(config, workdir: str, *, progress: bool = True) -> dict:
    """Train (or resume) according to `config`; returns a summary dict."""
    workdir_path = check_workdir(workdir)
    mesh = make_mesh(config.mesh)
    dp = data_parallel_size(mesh)
    if config.train.batch_size % dp:
        raise ConfigError(
            f"train.batch_size={config.train.batch_size} is not divisible by the "
            f"data-parallel size {dp} (mesh {dict(mesh.shape)})"
        )
    from jaxmoe.data.curriculum_hooks import make_curriculum
    from jaxmoe.data.pipeline import build_data

    data = build_data(config, jax.process_index(), jax.process_count())
    resolve_vocab(config, data)

    spec = model_spec(config.model, mesh)
    total_steps = config.train.steps
    optimizer, schedule = make_optimizer(config.optimizer, total_steps)
    abstract_state, shardings = state_shardings(mesh, spec, optimizer)
    batch_shardings = {
        key: NamedSharding(mesh, batch_spec(mesh, np.ndim(value), config.train.batch_size))
        for key, value in data.eval_batches[0].items()
    }
    # Installs its epoch order before set_state below; None (no hooks) for curriculum none.
    curriculum = make_curriculum(config, str(workdir_path), data.train, batch_shardings)

    checkpoints = TrainCheckpoints(str(workdir_path), config.train.max_to_keep)
    start = checkpoints.latest_step()
    if start is not None:
        state, meta = checkpoints.restore(start, abstract_state)
        data.train.set_state(meta["data"])
    else:
        start = 0
        state = init_state(config.model, config.train.seed, optimizer, shardings, mesh)
        if config.train.init_from:
            params = restore_params(config.train.init_from, abstract_state["params"], config.model)
            with jax.set_mesh(mesh):
                opt_state = jax.jit(optimizer.init, out_shardings=shardings["opt_state"])(params)
            state = {"step": state["step"], "params": params, "opt_state": opt_state}

    fns = step_fns(config, spec, optimizer, schedule)
    step_fn = jax.jit(
        functools.partial(train_step, fns=fns),
        in_shardings=(shardings, batch_shardings),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )
    eval_batches = data.eval_batches
    if config.train.eval_batches:
        eval_batches = eval_batches[: config.train.eval_batches]
    evaluator = Evaluator(spec, mesh, eval_batches, shardings["params"], batch_shardings)

    writer = MetricsWriter(str(workdir_path), total_steps, start, progress=progress)
    count, per_device = describe_memory(abstract_state, shardings)
    writer.print(
        f"jaxmoe: {count / 1e6:.2f}M parameters; params+optimizer {per_device / 2**20:.1f} MiB "
        f"per device on mesh {dict(mesh.shape)}; {data.num_train_examples} train sequences "
        f"of {config.train.seq_len} tokens; starting at step {start} of {total_steps}"
    )
    tokens_per_step = config.train.batch_size * config.train.seq_len
    preemption = _Preemption()
    pending = None  # (step, metrics) of the last dispatched step, read one step late
    timer = _IntervalTimer()
    last_eval = None
    stop_reason = None

    def save(step, state, force=False):
        if curriculum:
            curriculum.before_save(step)
        checkpoints.save(
            step, state, {"step": step, "data": data.train.get_state()}, config, force=force
        )

    with jax.set_mesh(mesh):
        step = start
        while step < total_steps:
            if curriculum:
                curriculum.before_batch(state["params"])  # orders the next epoch at its start
            batch = to_global(next(data.train), batch_shardings)
            state, metrics = step_fn(state, batch)
            if curriculum:
                curriculum.observe(batch, metrics)  # records the previous step's routing
            step += 1
            timer.count()
            if pending is not None:
                stop_reason = _check_and_log(pending, config, writer, tokens_per_step, timer)
                if stop_reason:
                    break
            pending = (step, metrics)
            if config.train.eval_every and step % config.train.eval_every == 0:
                last_eval = evaluator(state["params"])
                writer.write(step, "eval", last_eval)
            preempted = preemption.reached(step)
            if preempted or (
                config.train.checkpoint_every and step % config.train.checkpoint_every == 0
            ):
                # Never save a state produced by a non-finite step.
                stop_reason = _check_and_log(pending, config, writer, tokens_per_step, timer)
                pending = None
                if stop_reason:
                    break
                save(step, state)
            if preempted:
                stop_reason = "preempted"
                break
        if pending is not None and not stop_reason:
            stop_reason = _check_and_log(
                pending, config, writer, tokens_per_step, timer, force=True
            )
        if stop_reason in (None, "preempted") and checkpoints.latest_step() != step:
            save(step, state, force=True)
        checkpoints.wait()
        if stop_reason is None and (last_eval is None or step % max(config.train.eval_every, 1)):
            last_eval = evaluator(state["params"])
            writer.write(step, "eval", last_eval)
    preemption.restore()
    checkpoints.close()
    summary = {
        "step": step,
        "eval": last_eval,
        "stopped": stop_reason,
        "checkpoints": str(checkpoints.directory),
        "tensorboard": writer.tb_dir,
        "metrics": str(writer.path),
    }
    writer.close()
    if stop_reason and stop_reason != "preempted":
        raise RuntimeError(stop_reason)
    return summary


class _IntervalTimer:
    """Wall time and steps since the last logged step (for tokens_per_s, step_time_s)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.start, self.steps = time.perf_counter(), 0

    def count(self):
        self.steps += 1

    def step_time(self) -> float:
        return (time.perf_counter() - self.start) / max(self.steps, 1)


def _check_and_log(pending, config, writer, tokens_per_step, timer, force=False):
    """Read a finished step's scalars; log them; return a stop reason on a non-finite loss."""
    step, metrics = pending
    loss, finite = jax.device_get((metrics["loss"], metrics["finite"]))
    if not finite and config.train.nonfinite == "stop":
        return (
            f"non-finite loss ({float(loss)}) at step {step}; stopped without saving it "
            f"(the last completed checkpoint is intact; --config.train.nonfinite=skip "
            f"skips such steps instead)"
        )
    if step % config.train.log_every == 0 or force:
        scalars = jax.device_get(
            {k: v for k, v in metrics.items() if k != "routing_BM" and jnp.ndim(v) == 0}
        )
        scalars.pop("finite", None)
        step_time = timer.step_time()
        timer.reset()
        scalars |= {"step_time_s": step_time, "tokens_per_s": tokens_per_step / step_time}
        writer.write(step, "train", scalars)
        writer.progress(step, float(loss), scalars["tokens_per_s"])
    return None


def main(argv: list[str] | None = None) -> int:
    from jaxmoe.cli import main as cli_main

    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
