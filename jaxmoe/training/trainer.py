"""The trainer: a run's state and what acts on it; loop.py decides when each action runs.

`step` dispatches one train step (compiled once, for the first batch's shapes), `log` reads
a dispatched step's scalars, which the loop does one step late so that the host never waits
on the device, `evaluate` scores the held-out batches and `save` checkpoints the state.
"""

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.multihost_utils import process_allgather

from jaxmoe.checkpoints.trees import join
from jaxmoe.data.batch_fields import check_batch
from jaxmoe.models.flops import train_flops_per_step
from jaxmoe.models.stack import layer_layouts
from jaxmoe.parallel.chips import device_peak_flops
from jaxmoe.parallel.device_memory import state_bytes_per_device
from jaxmoe.training.dpo_run import dpo_evaluation, dpo_reference
from jaxmoe.training.evaluator import Evaluator, to_global
from jaxmoe.training.goodput import Goodput
from jaxmoe.training.metrics import MetricsWriter, wandb_options
from jaxmoe.training.profiling import ProfileWindow
from jaxmoe.training.run_setup import RunSetup
from jaxmoe.training.steps import jit_train_step, step_fns

log = logging.getLogger("jaxmoe")


class Trainer:
    """The train state of a run set up by run_setup.set_up_run, and its step, log,
    evaluate and save. `steps_done` is the step the state is at (a host int: reading it
    never waits on the device)."""

    def __init__(
        self, setup: RunSetup, workdir_path, goodput: Goodput, progress: bool, closers: list
    ):
        config = self.config = setup.config
        self.mesh, self.data, self.goodput = setup.mesh, setup.data, goodput
        self.curriculum, self.checkpoints = setup.curriculum, setup.checkpoints
        self.lora_run, self.batch_shardings = setup.lora_run, setup.batch_shardings
        self.state, self.steps_done = setup.state, setup.start
        self.compiled = None  # the train step, compiled on the first batch
        self.last_eval: dict | None = None
        constants, constant_shardings = _constants(setup)
        fns = step_fns(
            config.train, config.optimizer, config.model, setup.spec, setup.optimizer,
            setup.schedule, setup.frozen,
        )  # fmt: skip
        self.step_fn = jit_train_step(
            fns, setup.shardings, setup.batch_shardings, constant_shardings or None
        )
        self.base_args = (constants,) if constants else ()
        self._set_up_evaluation(setup, constants.get("reference"))

        self.writer = MetricsWriter(
            str(workdir_path),
            config.train.steps,
            setup.start,
            progress=progress,
            wandb=wandb_options(config),
        )
        closers.append(self.writer.close)
        count, per_device = describe_memory(setup.abstract_state, setup.shardings)
        self.writer.print(
            f"jaxmoe: {count / 1e6:.2f}M parameters; params+optimizer "
            f"{per_device / 2**20:.1f} MiB per device on mesh {dict(self.mesh.shape)}; "
            f"{self.data.num_train_examples} train sequences of {config.train.seq_len} tokens; "
            f"starting at step {setup.start} of {config.train.steps}"
        )
        self.step_log = _StepLog(config, self.writer, self.data.eval_batches[0], goodput)
        self.profile = ProfileWindow(
            config.train.profile_steps, workdir_path / "profile", report=self.writer.print
        )

    def _set_up_evaluation(self, setup: RunSetup, reference: dict | None) -> None:
        """The evaluator of the held-out batches (DPO's: the policy against `reference`,
        the trained parameters of its reference model, on held-out pairs)."""
        config, shardings = setup.config, setup.shardings
        eval_batches = self.data.eval_batches
        # A mixture is also evaluated source by source (`loss/<name>`), each limited alike.
        limit = config.train.eval_batches or None
        self.eval_sets = {name: b[:limit] for name, b in self.data.eval_sets.items()}
        if self.eval_sets:
            eval_batches = [batch for batches in self.eval_sets.values() for batch in batches]
        elif config.train.eval_batches:
            eval_batches = eval_batches[: config.train.eval_batches]
        param_shardings = shardings["params"]
        if setup.lora_run:
            param_shardings = join(setup.base_shardings, shardings["params"])
        self.reference = None  # the whole reference model's parameters (DPO)
        if reference is not None:
            self.reference = self.model_params(reference)
            self.evaluator = Evaluator(
                setup.spec, self.mesh, eval_batches, (param_shardings, param_shardings),
                setup.batch_shardings, *dpo_evaluation(setup.spec, config),
            )  # fmt: skip
        else:
            self.evaluator = Evaluator(
                setup.spec, self.mesh, eval_batches, param_shardings, setup.batch_shardings
            )

    def model_params(self, trained: dict) -> dict:
        """The whole model's parameters (a LoRA run's: base + adapters)."""
        return self.lora_run.full(trained) if self.lora_run else trained

    def step(self) -> dict:
        """Dispatches a train step on the next batch; returns its metrics, still on the
        device (reading them waits for the step: `log` does, one step late)."""
        with self.goodput.phase("data"):
            if self.curriculum:  # the next epoch's order
                self.curriculum.before_batch(self.model_params(self.state["params"]))
            host_batch = next(self.data.train)
            if self.compiled is None:  # the fields every data path must give (batch_fields.py)
                check_batch(host_batch)
            batch = to_global(host_batch, self.batch_shardings)
        if self.compiled is None:
            with self.goodput.phase("compile"):
                self.compiled = self.step_fn.lower(self.state, batch, *self.base_args).compile()
            self.step_log.timer.reset()  # the first interval's speed excludes compiling
        self.profile.before_step(self.steps_done)
        with self.goodput.phase("step"):
            self.state, metrics = self.compiled(self.state, batch, *self.base_args)
        if self.curriculum:
            self.curriculum.observe(batch, metrics)  # records the previous step's routing
        self.steps_done += 1
        self.step_log.timer.count()
        self.profile.after_step(self.steps_done, self.state)
        return metrics

    def log(self, pending: tuple[int, dict], force: bool = False) -> str | None:
        """Reads the (step, metrics) of a dispatched step, waiting for it, and writes its
        scalars every train.log_every steps (`force`: now); returns why the run must stop
        (a non-finite step), or None."""
        return self.step_log.check(pending, force)

    @property
    def skipping(self) -> bool:
        """Whether the step logged last was skipped (nonfinite=skip)."""
        return self.step_log.skipped_in_a_row > 0

    def evaluate(self) -> dict:
        """Held-out metrics of the state, written as its step's "eval" row."""
        with self.goodput.phase("eval"):
            params = self.model_params(self.state["params"])
            if self.reference is not None:
                params = (params, self.reference)
            result = self.evaluator(params)
            for name, batches in self.eval_sets.items():
                result[f"loss/{name}"] = self.evaluator(params, batches)["loss"]
        self.writer.write(self.steps_done, "eval", result)
        self.last_eval = result
        return result

    def save(self, force: bool = False) -> str | None:
        """Checkpoints the state with the data's position (asynchronously), or says why not:
        its parameters are not finite. `force`: even between train.checkpoint_every steps."""
        refused = nonfinite_params(self.steps_done, self.state)
        if refused:
            return refused
        step = self.steps_done
        with self.goodput.phase("checkpoint"):
            self.writer.flush()  # rows up to `step` are stored before its checkpoint exists
            if self.curriculum:
                self.curriculum.before_save(step)
            data_state = self.data.train.get_state()
            if hasattr(self.data.train, "gather_state"):  # a stream: each process has its lanes
                data_state = self.data.train.gather_state(data_state, process_allgather)
            record = self.lora_run.record() if self.lora_run else {}
            meta = {"step": step, "data": data_state, **record}
            self.checkpoints.save(step, self.state, meta, self.config, force=force)
        return None

    @property
    def saved(self) -> bool:
        """Whether the latest checkpoint is of the state's step."""
        return self.checkpoints.latest_step() == self.steps_done

    def stop_profile(self) -> None:
        """Ends a profile window the run stopped inside."""
        self.profile.stop(self.state)

    def wait_for_checkpoints(self) -> None:
        with self.goodput.phase("checkpoint"):
            self.checkpoints.wait()

    def close(self, stop_reason: str | None) -> dict:
        """Closes the checkpoints, the data and the metrics (after the goodput summary);
        returns the run's summary."""
        self.checkpoints.close()
        if hasattr(self.data.train, "close"):
            self.data.train.close()  # stops the prefetch thread
        time_spent = self.goodput.summary()
        self.writer.write_summary(self.steps_done, "goodput", time_spent)
        self.writer.print(Goodput.describe(time_spent))
        summary = {
            "step": self.steps_done,
            "eval": self.last_eval,
            "stopped": stop_reason,
            "checkpoints": str(self.checkpoints.directory),
            "tensorboard": self.writer.tb_dir,
            "metrics": str(self.writer.path),
        }
        self.writer.close()
        return summary


def _constants(setup: RunSetup) -> tuple[dict, dict]:
    """What the step reads and never trains, and their shardings: a LoRA run's base,
    DPO's reference (dpo.py)."""
    constants, shardings = {}, {}
    if setup.lora_run:
        constants["base"], shardings["base"] = setup.lora_run.base, setup.base_shardings
    if setup.config.train.objective == "dpo":
        layouts = layer_layouts(setup.config.model)
        constants["reference"] = dpo_reference(
            setup.config, setup.lora_run, setup.abstract_state, layouts
        )
        shardings["reference"] = setup.shardings["params"]
    return constants, shardings


def describe_memory(abstract_state, shardings) -> tuple[int, float]:
    """(parameter count, bytes of state held by the most loaded device)."""
    params = jax.tree.leaves(abstract_state["params"])
    count = sum(int(np.prod(p.shape)) for p in params)
    return count, state_bytes_per_device(abstract_state, shardings)


@jax.jit
def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def nonfinite_params(step: int, state: dict) -> str | None:
    """Why the state after `step` must not be saved (non-finite parameters), or None.

    A step whose loss and gradient are finite can still overflow in its update; once per
    save, one reduction over the parameters keeps such a state out of every checkpoint.
    """
    if bool(jax.device_get(_all_finite(state["params"]))):
        return None
    return (
        f"non-finite parameters after the update of step {step} (lower "
        f"optimizer.learning_rate); stopped without saving them (the last completed "
        f"checkpoint is intact)"
    )


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


def describe_nonfinite(loss: float, grad_norm: float) -> str:
    """What was non-finite in a step: its loss, else its gradient."""
    if not np.isfinite(loss):
        return f"non-finite loss ({float(loss)})"
    return f"non-finite gradient (norm {float(grad_norm)}; the loss, {float(loss):.4f}, is finite)"


class _StepLog:
    """Reads a finished step's scalars (one step late), logs them with speed and MFU, and
    says when to stop: a non-finite step (nonfinite=stop), or `train.max_skipped_steps`
    skipped in a row (nonfinite=skip)."""

    def __init__(self, config, writer: MetricsWriter, example_batch: dict, goodput: Goodput):
        self.config, self.writer, self.goodput = config, writer, goodput
        self.timer = _IntervalTimer()
        targets = example_batch["targets"]
        encoder = example_batch.get("encoder_inputs")
        self.tokens_per_step = config.train.batch_size * config.train.seq_len
        self.flops_per_step = train_flops_per_step(
            config.model,
            config.train.batch_size,
            targets.shape[1],
            None if encoder is None else encoder.shape[1],
        )
        peak = device_peak_flops(override=config.train.peak_flops)
        self.peak_total = peak * jax.device_count() if peak else None
        self.skipped_in_a_row = 0  # of the steps checked last (nonfinite=skip)

    def check(self, pending, force: bool = False) -> str | None:
        step, metrics = pending
        with self.goodput.phase("step"):  # waits for the device to finish that step
            loss, grad_norm, finite = jax.device_get(
                (metrics["loss"], metrics["grad_norm"], metrics["finite"])
            )
        if not finite:
            stop = self._nonfinite(step, describe_nonfinite(loss, grad_norm))
            if stop:
                return stop
        else:
            self.skipped_in_a_row = 0
        if step % self.config.train.log_every == 0 or force:
            scalars = jax.device_get(
                {k: v for k, v in metrics.items() if k != "routing_BM" and jnp.ndim(v) == 0}
            )
            scalars.pop("finite", None)
            step_time = self.timer.step_time()
            self.timer.reset()
            scalars |= {
                "step_time_s": step_time,
                "tokens_per_s": self.tokens_per_step / step_time,
            }
            if self.peak_total:
                scalars["mfu"] = self.flops_per_step / (step_time * self.peak_total)
            self.writer.write(step, "train", scalars)
            self.writer.progress(step, float(loss), scalars["tokens_per_s"], scalars.get("mfu"))
        return None

    def _nonfinite(self, step: int, what: str) -> str | None:
        """Stops on a non-finite step (nonfinite=stop); counts and logs one skipped step
        (nonfinite=skip), stopping at train.max_skipped_steps in a row."""
        if self.config.train.nonfinite == "stop":
            return (
                f"{what} at step {step}; stopped without saving it (the last completed "
                f"checkpoint is intact; --config.train.nonfinite=skip skips such steps instead)"
            )
        self.skipped_in_a_row += 1
        limit = self.config.train.max_skipped_steps
        log.warning(
            "step %d skipped: %s; %d of train.max_skipped_steps=%d in a row",
            step,
            what,
            self.skipped_in_a_row,
            limit,
        )
        if self.skipped_in_a_row < limit:
            return None
        first = step - self.skipped_in_a_row + 1
        steps = f"step {step} was" if first == step else f"steps {first} to {step} were all"
        return (
            f"{steps} skipped, the last for a {what}: train.max_skipped_steps={limit} in a "
            f"row, so the model no longer trains; stopped without saving any of them (the "
            f"last completed checkpoint, if any, predates them; lower optimizer.learning_rate)"
        )
