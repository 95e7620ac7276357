"""What a training run starts from: its mesh, data, model spec, optimizer and state.

The state is fresh, a `train.init_from` checkpoint's parameters, or the workdir's latest
checkpoint resumed with the data iterator's position (trainer.py trains from it).
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from jaxmoe.checkpoints.manager import TrainCheckpoints, restore_opt_state, restore_params
from jaxmoe.config.schema import JobConfig
from jaxmoe.config.stored import inherit_tokenizer
from jaxmoe.data.routing_record import routing_shape
from jaxmoe.errors import ConfigError
from jaxmoe.models.spec import ModelSpec, model_spec
from jaxmoe.models.stack import layer_layouts
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.parallel.sharding import batch_spec, data_parallel_size
from jaxmoe.training.freezing import frozen_tree, with_frozen
from jaxmoe.training.lora_run import LoraRun, lora_options
from jaxmoe.training.optimizer import make_optimizer
from jaxmoe.training.state import init_state, state_shardings
from jaxmoe.training.step_memory import check_step_fits

if TYPE_CHECKING:
    from jaxmoe.data.batches import DataBundle
    from jaxmoe.training.curriculum_hooks import Curriculum


@dataclass
class RunSetup:
    """The pieces a Trainer is built from (set_up_run)."""

    config: JobConfig  # completed: the data's vocabulary, max_len at least train.seq_len
    mesh: Mesh
    data: "DataBundle"
    spec: ModelSpec  # the whole model's
    lora_run: LoraRun | None  # train.lora: the adapters trained, the base frozen beside them
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    frozen: dict | None  # train.freeze: True where a parameter is frozen
    abstract_state: dict
    shardings: dict  # the state's
    base_shardings: dict | None  # a LoRA run's base
    batch_shardings: dict
    curriculum: "Curriculum | None"  # None (no hooks) for data.curriculum none
    checkpoints: TrainCheckpoints
    start: int  # the step the state is at
    state: dict

    @property
    def finished(self) -> bool:
        """Resumed at train.steps: nothing to compile, train or evaluate again."""
        return self.start >= self.config.train.steps

    def close(self) -> None:
        """Closes the checkpoints and the data (a run that ends without a Trainer)."""
        self.checkpoints.close()
        if hasattr(self.data.train, "close"):
            self.data.train.close()  # stops the prefetch thread


def set_up_run(config: JobConfig, workdir_path, closers: list) -> RunSetup:
    """Builds the run's pieces and its state: resumed from `workdir_path`'s latest
    checkpoint when it has one. What must be closed if the run fails joins `closers`."""
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
    # train.lora: the state holds the adapters, the frozen base comes beside it (lora_run.py).
    lora_run = LoraRun(config, spec, mesh, lora) if lora is not None else None
    trained_spec = lora_run.trained_spec if lora_run else spec
    optimizer, schedule = make_optimizer(
        config.optimizer, config.train.steps, trained_spec.param_axes
    )
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
    return RunSetup(
        config=config,
        mesh=mesh,
        data=data,
        spec=spec,
        lora_run=lora_run,
        optimizer=optimizer,
        schedule=schedule,
        frozen=frozen,
        abstract_state=abstract_state,
        shardings=shardings,
        base_shardings=base_shardings,
        batch_shardings=batch_shardings,
        curriculum=curriculum,
        checkpoints=checkpoints,
        start=start,
        state=state,
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
