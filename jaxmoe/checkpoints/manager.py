"""Orbax checkpoints: `WORKDIR/checkpoints/<step>/{params, opt_state, meta, config}`.

`params` and `opt_state` are separate items so that evaluation, conversion and
`train.init_from` restore parameters without touching optimizer state. A converted
checkpoint (from T5X, HF, GQA pooling...) is a directory with just `params` and `config`.
Orbax writes each step into a temporary directory and renames it when complete, so an
interrupted save is never mistaken for a checkpoint.
"""

import json
import logging

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from ml_collections import ConfigDict

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    pass


def _args_save(state, meta: dict, config: ConfigDict):
    return ocp.args.Composite(
        params=ocp.args.StandardSave(state["params"]),
        opt_state=ocp.args.StandardSave(state["opt_state"]),
        meta=ocp.args.JsonSave(meta),
        config=ocp.args.JsonSave(config.to_dict()),
    )


class TrainCheckpoints:
    """Periodic, asynchronous, atomic checkpoints of a training run."""

    def __init__(self, workdir: str, max_to_keep: int):
        self.directory = epath.Path(workdir) / "checkpoints"
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, enable_async_checkpointing=True
        )
        self.manager = ocp.CheckpointManager(
            self.directory, item_names=("params", "opt_state", "meta", "config"), options=options
        )
        self._warn_partial()

    def _warn_partial(self) -> None:
        if jax.process_index() != 0 or not self.directory.exists():
            return
        for child in self.directory.iterdir():
            if "tmp" in child.name:
                log.warning("ignoring partial checkpoint %s (an interrupted save)", child)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, meta: dict, config: ConfigDict, force: bool = False):
        self.manager.save(step, args=_args_save(state, meta, config), force=force)

    def restore(self, step: int, abstract_state) -> tuple[dict, dict]:
        """(state with the shardings of `abstract_state`, meta dict) of checkpoint `step`."""
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(abstract_state["params"]),
                opt_state=ocp.args.StandardRestore(abstract_state["opt_state"]),
                meta=ocp.args.JsonRestore(),
            ),
        )
        meta = restored["meta"]
        state = {
            "step": jax.device_put(
                jax.numpy.asarray(meta["step"], jax.numpy.int32), abstract_state["step"].sharding
            ),
            "params": restored["params"],
            "opt_state": restored["opt_state"],
        }
        return state, meta

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def _item_dir(path: epath.Path, item: str) -> epath.Path | None:
    candidate = path / item
    return candidate if candidate.exists() else None


def resolve_checkpoint(path: str) -> epath.Path:
    """A step directory: `path` itself, or the latest step under `path[/checkpoints]`."""
    root = epath.Path(path)
    if not root.exists():
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    if _item_dir(root, "params"):
        return root
    for base in (root / "checkpoints", root):
        if not base.exists():
            continue
        steps = sorted(
            int(child.name)
            for child in base.iterdir()
            if child.name.isdigit() and _item_dir(child, "params")
        )
        if steps:
            return base / str(steps[-1])
    raise CheckpointError(f"checkpoint {path!r}: no 'params' item found (not a jaxmoe checkpoint)")


def read_config(path: str) -> ConfigDict:
    """The model/run config stored with a checkpoint."""
    step_dir = resolve_checkpoint(path)
    config_dir = step_dir / "config"
    files = list(config_dir.iterdir()) if config_dir.exists() else []
    if not files:
        raise CheckpointError(f"checkpoint {str(step_dir)!r} carries no config")
    return merge_into_defaults(json.loads(files[0].read_text()))


def merge_into_defaults(stored: dict) -> ConfigDict:
    """The stored config on top of today's defaults, so keys added since it was written
    exist (with their defaults) and can be overridden."""
    from jaxmoe.default_config import base_config

    def merge(node: ConfigDict, values: dict) -> None:
        for key, value in values.items():
            if isinstance(value, dict) and isinstance(node.get(key), ConfigDict):
                merge(node[key], value)
            else:
                node[key] = value

    from jaxmoe.models.stack import remat_name

    model = stored.get("model", {})
    if "remat" in model:  # a bool before remat took a policy name
        stored = {**stored, "model": {**model, "remat": remat_name(model["remat"])}}
    config = base_config()
    with config.unlocked():
        merge(config, stored)
    return config


def restore_params(path: str, abstract_params, model_cfg=None) -> dict:
    """Parameters of checkpoint `path`, placed with the shardings in `abstract_params`.

    With `model_cfg`, a checkpoint in the other layer layout (per-layer vs scanned, see
    models/stack.py) is restored in its own layout and converted.
    """
    step_dir = resolve_checkpoint(path)
    try:
        return _restore_tree(step_dir, abstract_params)
    except CheckpointError:
        if model_cfg is None:
            raise
        from jaxmoe.models.stack import is_stacked, stack_layers, unstack_layers

        stacked = is_stacked(abstract_params, model_cfg)
        to_stored, back = (
            (unstack_layers, stack_layers) if stacked else (stack_layers, unstack_layers)
        )
        try:
            stored = _restore_tree(step_dir, to_stored(abstract_params, model_cfg))
        except CheckpointError:
            _restore_tree(step_dir, abstract_params)  # report the mismatch of the asked layout
            raise
        shardings = jax.tree.map(lambda a: a.sharding, abstract_params)
        return jax.device_put(back(stored, model_cfg), shardings)


def _restore_tree(step_dir, abstract_params) -> dict:
    with ocp.StandardCheckpointer() as checkpointer:
        try:
            return checkpointer.restore(step_dir / "params", abstract_params)
        except (ValueError, KeyError) as error:
            raise CheckpointError(
                f"checkpoint {str(step_dir)!r}: parameters do not match the model: "
                f"{str(error).splitlines()[0]}"
            ) from error


def save_params(path: str, params, config: ConfigDict) -> None:
    """Write a parameters-only checkpoint (what converters produce).

    Host numpy leaves are written without Orbax's defensive deep copy (the save is
    synchronous), so converting a model never holds a second copy of it in memory.
    """
    from orbax.checkpoint import type_handlers

    root = epath.Path(path)
    registry = type_handlers.create_type_handler_registry(
        (np.ndarray, type_handlers.NumpyHandler(deepcopy_host_arrays=False))
    )
    if config.model.get("scan_layers", False):
        from jaxmoe.models.stack import stack_layers

        params = stack_layers(params, config.model)  # the scanned model's checkpoint layout
    handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
    with ocp.Checkpointer(handler) as checkpointer:
        checkpointer.save(root / "params", args=ocp.args.PyTreeSave(params), force=True)
    (root / "config").mkdir(parents=True, exist_ok=True)
    (root / "config" / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
