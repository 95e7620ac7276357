"""The training loop behind `jaxmoe train --config C --workdir W`.

Re-running with the same workdir resumes from the latest checkpoint, including the data
iterator's position. Metrics are fetched one step late so the host never stalls the device.
"""

import contextlib
import functools
import logging
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from jax.experimental.multihost_utils import process_allgather
from jax.sharding import NamedSharding

from jaxmoe.checkpoints.manager import TrainCheckpoints, restore_opt_state, restore_params
from jaxmoe.checkpoints.trees import join
from jaxmoe.config.schema import JobConfig
from jaxmoe.config.stored import inherit_tokenizer
from jaxmoe.data.routing_record import routing_shape
from jaxmoe.errors import ConfigError
from jaxmoe.models.flops import train_flops_per_step
from jaxmoe.models.spec import model_spec
from jaxmoe.models.stack import layer_layouts
from jaxmoe.parallel.chips import device_peak_flops
from jaxmoe.parallel.device_memory import state_bytes_per_device
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.parallel.sharding import batch_spec, data_parallel_size
from jaxmoe.storage.disk_full import no_space_left, quiet_disk_full
from jaxmoe.storage.paths import absolute_path
from jaxmoe.training.curves import CURVES_FILE, write_curves
from jaxmoe.training.dpo_run import dpo_evaluation, dpo_reference
from jaxmoe.training.freezing import frozen_tree, with_frozen
from jaxmoe.training.goodput import Goodput
from jaxmoe.training.lora_run import LoraRun, lora_options
from jaxmoe.training.metrics import MetricsWriter, wandb_options
from jaxmoe.training.optimizer import make_optimizer
from jaxmoe.training.profiling import ProfileWindow
from jaxmoe.training.state import init_state, state_shardings
from jaxmoe.training.step_memory import check_step_fits
from jaxmoe.training.steps import eval_metrics, eval_step, jit_train_step, step_fns
from jaxmoe.training.workdir import WorkdirLock, check_workdir

log = logging.getLogger("jaxmoe")


def to_global(batch: dict, shardings: dict) -> dict:
    """Assemble this process's rows into global arrays sharded over the batch axes."""
    return {
        key: jax.make_array_from_process_local_data(shardings[key], np.asarray(value))
        for key, value in batch.items()
        if key in shardings
    }


class Evaluator:
    """Jitted evaluation over a fixed list of batches; one device->host fetch at the end."""

    def __init__(
        self,
        spec,
        mesh,
        batches: list[dict],
        param_shardings,
        batch_shardings,
        step=None,
        summarize=eval_metrics,
    ):
        """`step(params, batch) -> sums` (default steps.eval_step) and `summarize(totals)
        -> metrics` (default steps.eval_metrics): DPO's are dpo.py's."""
        self.mesh, self.batches, self.batch_shardings = mesh, batches, batch_shardings
        self.summarize = summarize
        self.fn = jax.jit(
            step or functools.partial(eval_step, graphdef=spec.graphdef, rest=spec.rest),
            in_shardings=(param_shardings, batch_shardings),
        )

    def __call__(self, params, batches: list[dict] | None = None) -> dict:
        """Metrics over `batches` (default: the evaluator's own)."""
        totals = None
        with jax.set_mesh(self.mesh):
            for batch in self.batches if batches is None else batches:
                sums = self.fn(params, to_global(batch, self.batch_shardings))
                sums = {k: v for k, v in sums.items() if not k.endswith("per_example")}
                totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
        return self.summarize(jax.device_get(totals))


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
    return count, state_bytes_per_device(abstract_state, shardings)


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


# What decides the examples and their order: a change makes a saved data position void.
_DATA_KEYS = ("train.seq_len", "train.batch_size", "train.seed")
_DATA_IGNORED = ("tokenizer", "cache_dir", "data_dir", "prefetch", "workers")


def _data_keys_changed(step_dir, config) -> list[str]:
    """'train.seq_len 32 -> 64' for each key shaping the data that differs from the config
    saved in `step_dir` (where the data is stored and how fast it is read aside)."""
    from jaxmoe.config.stored import read_config

    try:
        saved = read_config(str(step_dir), tokenizer=False).to_dict()
    except ValueError:
        return []
    now_config = config.to_dict()
    keys = [*_DATA_KEYS, *(f"data.{k}" for k in now_config["data"] if k not in _DATA_IGNORED)]
    changed = []
    for key in keys:
        section, leaf = key.split(".")
        before, now = saved[section][leaf], now_config[section][leaf]
        if before != now:
            changed.append(f"{key} {before!r} -> {now!r}")
    return changed


def _train(
    config: JobConfig,
    workdir_path,
    lock: WorkdirLock,
    goodput: Goodput,
    progress: bool,
    closers: list,
) -> dict:
    mesh = make_mesh(config.mesh)
    dp = data_parallel_size(mesh)
    if config.train.batch_size % dp:
        raise ConfigError(
            f"train.batch_size={config.train.batch_size} is not divisible by the "
            f"data-parallel size {dp} (mesh {dict(mesh.shape)})"
        )
    from jaxmoe.data.batch_fields import check_batch
    from jaxmoe.data.pipeline import build_data
    from jaxmoe.parallel.distributed import barrier
    from jaxmoe.training.curriculum_hooks import make_curriculum

    config = inherit_tokenizer(config)  # a train.init_from checkpoint's own, unless named
    data = build_data(
        config.data,
        config.train,
        spans=config.span_corruption,
        routing=routing_shape(config.model),
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        barrier=barrier,
    )
    model = config.model.with_vocab(data.vocab_size)
    # Stored with the checkpoints: decode refuses longer prompts.
    config = config.replace(model=model.replace(max_len=max(model.max_len, config.train.seq_len)))

    lora = lora_options(config)
    spec = model_spec(config.model, mesh, lora=lora)
    total_steps = config.train.steps
    # train.lora: the state holds the adapters, the frozen base comes beside it (lora_run.py).
    lora_run = LoraRun(config, spec, mesh, lora) if lora is not None else None
    trained_spec = lora_run.trained_spec if lora_run else spec
    optimizer, schedule = make_optimizer(config.optimizer, total_steps, trained_spec.param_axes)
    frozen = None
    if lora_run is None:
        frozen = frozen_tree(spec.abstract_params, config.train.freeze, config.train.trainable)
    optimizer = with_frozen(optimizer, frozen)  # train.freeze: no state, no update
    abstract_state, shardings = state_shardings(mesh, trained_spec, optimizer)
    base_shardings = lora_run.base_shardings() if lora_run else None
    if lora_run:
        check_step_fits(
            config.model,
            config.train,
            mesh,
            {**abstract_state, "base": lora_run.split.base_in_memory()},
            {**shardings, "base": base_shardings},
        )
    else:
        check_step_fits(config.model, config.train, mesh, abstract_state, shardings)
    check_batch(data.eval_batches[0])
    batch_shardings = {
        key: NamedSharding(mesh, batch_spec(mesh, np.ndim(value), config.train.batch_size))
        for key, value in data.eval_batches[0].items()
    }
    # Installs its epoch order before set_state below; None (no hooks) for curriculum none.
    curriculum = make_curriculum(config, str(workdir_path), data.train, batch_shardings)

    checkpoints = TrainCheckpoints(
        str(workdir_path),
        config.train.max_to_keep,
        tokenizer=data.tokenizer,
        chat_template=config.data.chat_template,
    )
    closers.append(checkpoints.close)
    if lora_run:
        lora_run.load_base(layer_layouts(config.model))
    restored = checkpoints.restore_latest(abstract_state)
    if restored is not None:
        start, state, meta = restored
        checkpoints.check_same_tokenizer(start)  # resumed on the ids it was trained with
        if lora_run:  # resumed on the base its adapters were trained on
            lora_run.check_resumed(meta, checkpoints.directory / str(start))
        try:
            data.train.set_state(meta["data"])
        except ValueError as error:  # name the keys that changed, not only the symptom
            changed = _data_keys_changed(checkpoints.directory / str(start), config)
            if not changed:
                raise
            raise ConfigError(
                f"{error}; changed since checkpoint {start}: {', '.join(changed)}; resume "
                f"with the values it was saved with, or start a new --workdir"
            ) from None
        if start >= total_steps:  # finished: nothing to compile, train or evaluate again
            checkpoints.close()
            if hasattr(data.train, "close"):
                data.train.close()  # stops the prefetch thread
            return {
                "step": start,
                "eval": None,
                "stopped": "finished",
                "checkpoints": str(checkpoints.directory),
                "tensorboard": str(workdir_path / "tensorboard"),
                "metrics": str(workdir_path / "metrics.jsonl"),
                "curves": None,
            }
    elif lora_run:
        start = 0
        state = lora_run.init_state(config.train.seed, optimizer, shardings)
    else:
        start = 0
        state = init_state(config.model, config.train.seed, optimizer, shardings, mesh)
        if config.train.init_from:
            layouts = layer_layouts(config.model)  # either layer layout restores
            params = restore_params(config.train.init_from, abstract_state["params"], layouts)
            if config.train.init_optimizer:
                opt_state = restore_opt_state(config.train.init_from, abstract_state["opt_state"])
            else:
                with jax.set_mesh(mesh):
                    init = jax.jit(optimizer.init, out_shardings=shardings["opt_state"])
                    opt_state = init(params)
            state = {"step": state["step"], "params": params, "opt_state": opt_state}

    # What the step reads and never trains: a LoRA run's base, DPO's reference (dpo.py).
    constants, constant_shardings = {}, {}
    if lora_run:
        constants["base"], constant_shardings["base"] = lora_run.base, base_shardings
    if config.train.objective == "dpo":
        layouts = layer_layouts(config.model)
        constants["reference"] = dpo_reference(config, lora_run, abstract_state, layouts)
        constant_shardings["reference"] = shardings["params"]
    fns = step_fns(config.train, config.optimizer, config.model, spec, optimizer, schedule, frozen)
    step_fn = jit_train_step(fns, shardings, batch_shardings, constant_shardings or None)
    base_args = (constants,) if constants else ()

    def model_params(trained):  # the whole model's parameters (a LoRA run: base + adapters)
        return lora_run.full(trained) if lora_run else trained

    eval_batches = data.eval_batches
    # A mixture is also evaluated source by source (`loss/<name>`), each limited alike.
    eval_sets = {name: b[: config.train.eval_batches or None] for name, b in data.eval_sets.items()}
    if eval_sets:
        eval_batches = [batch for batches in eval_sets.values() for batch in batches]
    elif config.train.eval_batches:
        eval_batches = eval_batches[: config.train.eval_batches]
    param_shardings = shardings["params"]
    if lora_run:
        param_shardings = join(base_shardings, shardings["params"])
    if config.train.objective == "dpo":  # policy and reference, scored on held-out pairs
        reference = model_params(constants["reference"])
        evaluator = Evaluator(
            spec, mesh, eval_batches, (param_shardings, param_shardings), batch_shardings,
            *dpo_evaluation(spec, config),
        )  # fmt: skip
        evaluator_params = lambda params: (params, reference)
    else:
        evaluator = Evaluator(spec, mesh, eval_batches, param_shardings, batch_shardings)
        evaluator_params = lambda params: params

    writer = MetricsWriter(
        str(workdir_path), total_steps, start, progress=progress, wandb=wandb_options(config)
    )
    closers.append(writer.close)
    count, per_device = describe_memory(abstract_state, shardings)
    writer.print(
        f"jaxmoe: {count / 1e6:.2f}M parameters; params+optimizer {per_device / 2**20:.1f} MiB "
        f"per device on mesh {dict(mesh.shape)}; {data.num_train_examples} train sequences "
        f"of {config.train.seq_len} tokens; starting at step {start} of {total_steps}"
    )
    step_log = _StepLog(config, writer, data.eval_batches[0], goodput)
    profile = ProfileWindow(
        config.train.profile_steps, workdir_path / "profile", report=writer.print
    )
    preemption = _Preemption()
    pending = None  # (step, metrics) of the last dispatched step, read one step late
    save_due = False  # a checkpoint waits for the end of a run of skipped steps
    compiled = None
    last_eval = None
    stop_reason = None

    def save(step, state, force=False):
        with goodput.phase("checkpoint"):
            writer.flush()  # rows up to `step` are stored before its checkpoint exists
            if curriculum:
                curriculum.before_save(step)
            data_state = data.train.get_state()
            if hasattr(data.train, "gather_state"):  # a stream: each process has its lanes
                data_state = data.train.gather_state(data_state, process_allgather)
            meta = {"step": step, "data": data_state, **(lora_run.record() if lora_run else {})}
            checkpoints.save(step, state, meta, config, force=force)

    def evaluate(step):
        with goodput.phase("eval"):
            params = evaluator_params(model_params(state["params"]))
            result = evaluator(params)
            for name, batches in eval_sets.items():
                result[f"loss/{name}"] = evaluator(params, batches)["loss"]
        writer.write(step, "eval", result)
        return result

    with jax.set_mesh(mesh):
        step = start
        while step < total_steps:
            with goodput.phase("data"):
                if curriculum:
                    curriculum.before_batch(model_params(state["params"]))  # the next epoch
                host_batch = next(data.train)
                if compiled is None:  # the fields every data path must give (batch_fields.py)
                    check_batch(host_batch)
                batch = to_global(host_batch, batch_shardings)
            if compiled is None:
                with goodput.phase("compile"):
                    compiled = step_fn.lower(state, batch, *base_args).compile()
                step_log.timer.reset()  # the first interval's speed excludes compiling
            profile.before_step(step)
            with goodput.phase("step"):
                state, metrics = compiled(state, batch, *base_args)
            if curriculum:
                curriculum.observe(batch, metrics)  # records the previous step's routing
            step += 1
            step_log.timer.count()
            profile.after_step(step, state)
            if pending is not None:
                stop_reason = step_log.check(pending)
                if stop_reason:
                    break
            pending = (step, metrics)
            lock.heartbeat()
            if config.train.eval_every and step % config.train.eval_every == 0:
                last_eval = evaluate(step)
            preempted = preemption.reached(step)
            if (
                preempted
                or save_due
                or (config.train.checkpoint_every and step % config.train.checkpoint_every == 0)
            ):
                # Never save a state produced by a non-finite step.
                stop_reason = step_log.check(pending)
                pending = None
                if stop_reason:
                    break
                # In a run of skipped steps (nonfinite=skip) the save waits for a step that
                # trains: if the run goes on until it stops, the last checkpoint predates it.
                save_due = step_log.skipped_in_a_row > 0 and not preempted
                if not save_due:
                    stop_reason = nonfinite_params(step, state)
                    if stop_reason:
                        break
                    save(step, state)
            if preempted:
                stop_reason = "preempted"
                break
        if pending is not None and not stop_reason:
            stop_reason = step_log.check(pending, force=True)
        profile.stop(state)
        if stop_reason in (None, "preempted") and checkpoints.latest_step() != step:
            stop_reason = nonfinite_params(step, state) or stop_reason
            if stop_reason in (None, "preempted"):
                save(step, state, force=True)
        with goodput.phase("checkpoint"):
            checkpoints.wait()
        if stop_reason is None and (last_eval is None or step % max(config.train.eval_every, 1)):
            last_eval = evaluate(step)
    preemption.restore()
    checkpoints.close()
    if hasattr(data.train, "close"):
        data.train.close()  # stops the prefetch thread
    time_spent = goodput.summary()
    writer.write_summary(step, "goodput", time_spent)
    writer.print(Goodput.describe(time_spent))
    summary = {
        "step": step,
        "eval": last_eval,
        "stopped": stop_reason,
        "checkpoints": str(checkpoints.directory),
        "tensorboard": writer.tb_dir,
        "metrics": str(writer.path),
    }
    writer.close()
    if jax.process_index() == 0:
        summary["curves"] = _draw_curves(workdir_path)
    if stop_reason and stop_reason != "preempted":
        raise RuntimeError(stop_reason)
    return summary


def _draw_curves(workdir_path) -> str | None:
    """WORKDIR/curves.png from the metrics just written; a picture that cannot be drawn is
    a warning, never the run's failure."""
    try:
        return write_curves(workdir_path)
    except Exception as error:
        log.warning("could not draw %s/%s: %s", workdir_path, CURVES_FILE, error)
        return None


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
