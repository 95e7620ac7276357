"""Orbax checkpoints: `WORKDIR/checkpoints/<step>/{params, opt_state, meta, config, tokenizer}`.

`params` and `opt_state` are separate items so that evaluation, conversion and
`train.init_from` restore parameters without touching optimizer state (unless
`train.init_optimizer`). A converted checkpoint (from T5X, HF, GQA pooling...) is a directory
with just `params`, `config` and `tokenizer` (plus `opt_state` from `convert t5x
--keep_optimizer`). Each holds its tokenizer (tokenizer_item.py), and its stored
`data.tokenizer` names that copy relative to the checkpoint.
Orbax writes each step into a temporary directory and renames it when complete, so an
interrupted save is never mistaken for a checkpoint.
"""

import contextlib
import copy
import json
import logging
import os
from typing import Protocol

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jaxmoe.checkpoints.safe_paths import check_no_symlink_out
from jaxmoe.checkpoints.tokenizer_item import (
    TOKENIZER_DIR,
    TokenizerFilesSave,
    check_tokenizer_fits,
    stored_name,
    tokenizer_files,
    write_tokenizer_files,
)
from jaxmoe.data.chat_template import BUILT_IN
from jaxmoe.data.tokenizer_files import CHAT_TEMPLATE_FILE
from jaxmoe.errors import CheckpointError, ConfigError
from jaxmoe.storage.paths import absolute_path, finished_steps, is_remote
from jaxmoe.storage.received import read_text

log = logging.getLogger(__name__)


class StorableConfig(Protocol):
    """What checkpoints store of a config: its keys as nested plain dicts (a JobConfig, or
    the ConfigDict a converter builds; jaxmoe/config reads them back, typed)."""

    def to_dict(self) -> dict: ...


class CheckpointMismatch(CheckpointError):
    """A readable checkpoint of another model (tensor names or shapes differ): never treated
    as damage, since setting it aside would silently restart the run from step 0."""


def _args_save(state, meta: dict, config: dict, tokenizer: dict | None):
    items = {
        "params": ocp.args.StandardSave(state["params"]),
        "opt_state": ocp.args.StandardSave(state["opt_state"]),
        "meta": ocp.args.JsonSave(meta),
        "config": ocp.args.JsonSave(config),
    }
    if tokenizer:
        items["tokenizer"] = TokenizerFilesSave(tokenizer)
    return ocp.args.Composite(**items)


class TrainCheckpoints:
    """Periodic, asynchronous, atomic checkpoints of a training run."""

    def __init__(self, workdir: str, max_to_keep: int, tokenizer=None, chat_template: str = ""):
        """`tokenizer`: the run's (an opened Tokenizer or HFTokenizer), copied into every
        step so that the checkpoint is whole; None only for runs without one (tests).
        `chat_template`: data.chat_template; a .jinja file is copied in beside the tokenizer
        (as chat_template.jinja, which the stored config then names as the tokenizer's own).
        `workdir`: absolute or remote (`train` makes it so, once)."""
        if not (is_remote(workdir) or os.path.isabs(workdir)):
            raise ValueError(f"TrainCheckpoints: workdir {workdir!r} is not absolute")
        self.directory = epath.Path(workdir) / "checkpoints"
        self._tokenizer = tokenizer_files(tokenizer) if tokenizer is not None else None
        self._template_file = bool(self._tokenizer) and chat_template not in ("", *BUILT_IN)
        if self._template_file:
            self._tokenizer[CHAT_TEMPLATE_FILE] = epath.Path(chat_template).read_bytes()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, enable_async_checkpointing=True
        )
        self.manager = ocp.CheckpointManager(
            self.directory,
            item_names=("params", "opt_state", "meta", "config", "tokenizer"),
            options=options,
        )
        self._warn_partial()

    def _warn_partial(self) -> None:
        if jax.process_index() != 0 or not self.directory.exists():
            return
        finished = set(finished_steps(self.directory))
        for child in self.directory.iterdir():
            # On object stores a save cut short is `N/` without Orbax's commit marker.
            if "tmp" in child.name or (child.name.isdigit() and int(child.name) not in finished):
                log.warning("ignoring partial checkpoint %s (an interrupted save)", child)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, meta: dict, config: StorableConfig, force: bool = False):
        stored = config.to_dict()
        if self._tokenizer:  # the copy saved with the step, not the path it came from
            stored["data"] = stored["data"] | {"tokenizer": stored_name(self._tokenizer)}
            if self._template_file:
                stored["data"]["chat_template"] = ""  # the copy beside the tokenizer
        self.manager.save(step, args=_args_save(state, meta, stored, self._tokenizer), force=force)

    def restore(self, step: int, abstract_state) -> tuple[dict, dict]:
        """(state with the shardings of `abstract_state`, meta dict) of checkpoint `step`."""
        step_dir = self.directory / str(step)
        for item in ("params", "opt_state", "meta"):
            if not (step_dir / item).exists():
                raise CheckpointError(
                    f"checkpoint {str(step_dir)!r}: item {item!r} is missing (a damaged "
                    f"checkpoint: move it away to resume from an earlier one)"
                )
        check_params_match(step_dir, abstract_state["params"])  # the config changed since?
        check_opt_state_match(step_dir, abstract_state["opt_state"])
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(abstract_state["params"]),
                opt_state=ocp.args.StandardRestore(abstract_state["opt_state"]),
                meta=ocp.args.JsonRestore(),
            ),
        )
        meta = restored["meta"]
        if not isinstance(meta, dict) or not {"step", "data"} <= meta.keys():
            raise CheckpointError(
                f"checkpoint {str(step_dir)!r}: item 'meta' lacks 'step' or 'data' ({meta!r:.80})"
            )
        state = {
            "step": jax.device_put(
                jax.numpy.asarray(meta["step"], jax.numpy.int32), abstract_state["step"].sharding
            ),
            "params": restored["params"],
            "opt_state": restored["opt_state"],
        }
        return state, meta

    def restore_latest(self, abstract_state) -> tuple[int, dict, dict] | None:
        """(step, state, meta) of the newest checkpoint that restores, or None if there is
        none. A damaged one (truncated file, missing item) is set aside as
        `<step>.damaged` with one warning line, and the next older one is tried: a run
        must never be blocked, nor its checkpoints deleted, by one bad save."""
        complete = set(finished_steps(self.directory))  # never a save cut short on gs://
        for step in sorted(set(self.manager.all_steps()) & complete, reverse=True):
            try:
                state, meta = self.restore(step, abstract_state)
            except CheckpointMismatch as error:
                raise CheckpointMismatch(
                    f"{error}; resume with the config this run was started with, or start "
                    f"a new --workdir (train.init_from=<checkpoint> loads its weights, with a "
                    f"fresh optimizer state)"
                ) from None
            except Exception as error:  # any reader failure means this step is unusable
                log.warning(
                    "checkpoint step %d is damaged (%s); moved to %s and trying the one before",
                    step,
                    describe_error(error),
                    self._set_aside(step),
                )
                continue
            return step, state, meta
        return None

    def check_same_tokenizer(self, step: int) -> None:
        """ConfigError when this run's tokenizer is not the one checkpoint `step` holds: a
        resumed run whose data.* now gives another tokenizer (its training file edited, a
        different data.tokenizer) would go on with other ids, silently."""
        folder = self.directory / str(step) / TOKENIZER_DIR
        if not self._tokenizer or not folder.exists():
            return  # a checkpoint from before checkpoints held their tokenizer
        for name, data in self._tokenizer.items():
            stored = folder / name
            if not stored.exists() or stored.read_bytes() != data:
                main = folder / next(iter(self._tokenizer))
                raise ConfigError(
                    f"checkpoint {str(folder.parent)!r} was trained with another tokenizer "
                    f"than data.* gives now ({name} differs): resume with the data it was "
                    f"started with, or a copy of {str(main)!r} as --config.data.tokenizer, or "
                    f"start a new --workdir"
                )

    def _set_aside(self, step: int) -> str:
        """Rename a damaged step out of Orbax's sight, so the resumed run can save that step
        number again; the files stay for inspection."""
        source = self.directory / str(step)
        target = self.directory / f"{step}.damaged"
        if jax.process_index() == 0:
            suffix = 1
            while target.exists():
                target = self.directory / f"{step}.damaged-{suffix}"
                suffix += 1
            source.rename(target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"jaxmoe_set_aside_{step}")
        self.manager.reload()
        return str(target)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


# Orbax writes a step (and each item) under `<name>.orbax-checkpoint-tmp...` until complete.
ORBAX_TMP = ".orbax-checkpoint-tmp"


def _item_dir(path: epath.Path, item: str) -> epath.Path | None:
    candidate = path / item
    return candidate if candidate.exists() else None


def resolve_checkpoint(path: str) -> epath.Path:
    """A step directory: `path` itself, or the newest step under `path[/checkpoints]`.

    The newest step is used or refused, never silently passed over: a damaged one (its
    `params` missing) is an error naming it and the step before it. Nothing in the step
    may be a symlink leading out of it (safe_paths.py)."""
    root = epath.Path(absolute_path(path))
    if not root.exists():
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    if not root.is_dir():
        raise CheckpointError(
            f"checkpoint {path!r} is a file, not a directory (a checkpoint is a step "
            f"directory or a training workdir)"
        )
    step_dir = root if _item_dir(root, "params") else _newest_step(root, path)
    if any(ORBAX_TMP in part for part in step_dir.parts):
        raise CheckpointError(
            f"checkpoint {str(step_dir)!r} is an unfinished save (Orbax writes a step under "
            f"a temporary name until it is complete): name a finished step"
        )
    if not is_remote(step_dir):
        try:
            check_no_symlink_out(step_dir)
        except ValueError as error:
            raise CheckpointError(f"checkpoint {str(step_dir)!r}: {error}") from None
    return step_dir


def _newest_step(root: epath.Path, path: str) -> epath.Path:
    for base in (root / "checkpoints", root):
        steps = finished_steps(base)
        if not steps:
            continue
        newest = base / str(steps[-1])
        if not is_remote(newest):
            try:
                check_no_symlink_out(newest, within=root)
            except ValueError as error:
                raise CheckpointError(f"checkpoint {str(newest)!r}: {error}") from None
        if not _item_dir(newest, "params"):
            whole = [s for s in steps if _item_dir(base / str(s), "params")]
            before = ""
            if whole:
                before = f"; name {str(base / str(whole[-1]))!r} to use step {whole[-1]}"
            raise CheckpointError(
                f"checkpoint {str(newest)!r}: item 'params' is missing (the newest step is "
                f"damaged){before}"
            )
        return newest
    raise CheckpointError(f"checkpoint {path!r}: no 'params' item found (not a jaxmoe checkpoint)")


# Where a step keeps its config: Orbax's JsonSave item in training checkpoints, a plain
# file in converted ones. Named explicitly: the directory also holds commit_success.txt,
# and listing order differs between filesystems.
CONFIG_FILES = ("config/metadata", "config/config.json")


def read_stored_config(path: str, *, tokenizer: bool = True) -> dict:
    """The config stored with a checkpoint, as stored (jaxmoe/config/stored.py completes
    and types it); its `data.tokenizer` resolved against the checkpoint's directory
    (stored_tokenizer.py), or left as stored with `tokenizer=False` (a caller that replaces
    it: --config.data.tokenizer)."""
    step_dir = resolve_checkpoint(path)
    for name in CONFIG_FILES:
        candidate = step_dir / name
        if candidate.exists():
            try:
                local = not is_remote(candidate)
                stored = json.loads(read_text(candidate, name) if local else candidate.read_text())
            except ValueError as error:
                raise CheckpointError(f"{candidate}: damaged config ({error})") from error
            if not isinstance(stored, dict):
                raise CheckpointError(f"{candidate}: damaged config (not a JSON object)")
            data = stored.get("data")
            if tokenizer and isinstance(data, dict) and data.get("tokenizer"):
                stored["data"] = data | {"tokenizer": _resolve_tokenizer(data, step_dir, candidate)}
            return stored
    raise CheckpointError(f"checkpoint {str(step_dir)!r} carries no config")


def stored_config_origin(path: str) -> str:
    """The file a checkpoint's config is read from (names it in messages)."""
    step_dir = resolve_checkpoint(path)
    for name in CONFIG_FILES:
        if (step_dir / name).exists():
            return str(step_dir / name)
    return str(step_dir)


def read_meta(path: str) -> dict:
    """The `meta` item of a training checkpoint (its step, data position and, for a LoRA
    run, the base it belongs to); {} for a checkpoint without one (converted ones)."""
    step_dir = resolve_checkpoint(path)
    candidate = step_dir / "meta" / "metadata"
    if not candidate.exists():
        return {}
    try:
        text = read_text(candidate, "meta") if not is_remote(candidate) else candidate.read_text()
        meta = json.loads(text)
    except ValueError as error:
        raise CheckpointError(f"{candidate}: damaged meta item ({error})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{candidate}: damaged meta item (not a JSON object)")
    return meta


def _resolve_tokenizer(data: dict, step_dir, culprit) -> str:
    from jaxmoe.checkpoints.stored_tokenizer import resolve_stored_tokenizer

    try:
        return resolve_stored_tokenizer(step_dir, data["tokenizer"])
    except ValueError as error:
        raise CheckpointError(
            f"{culprit}: data.tokenizer: {error}; a checkpoint's tokenizer must lie inside "
            f"it (--config.data.tokenizer=FILE names one)"
        ) from None


def describe_error(error: BaseException) -> str:
    """One line for a failed read: the innermost cause (TensorStore names the file and the
    byte range there; Orbax's wrappers around it do not), cut to a readable length."""
    while error.__cause__ is not None:
        error = error.__cause__
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    return text if len(text) <= 400 else text[:397] + "..."


@contextlib.contextmanager
def quiet_orbax():
    """Orbax's absl warnings about its own metadata files ("Metadata file does not exist",
    "ArrayMetadata persistence is disabled") say nothing a jaxmoe user can act on."""
    absl_log = logging.getLogger("absl")
    level = absl_log.level
    absl_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl_log.setLevel(level)


def _stored_shapes(params_dir: epath.Path) -> dict[str, tuple[int, ...]]:
    """'a.b.c' -> shape of every array in an Orbax `params` item, from its metadata only."""
    try:
        with quiet_orbax():
            metadata = ocp.PyTreeCheckpointer().metadata(params_dir)
    except (OSError, ValueError, KeyError) as error:
        raise CheckpointError(
            f"checkpoint {str(params_dir)!r} is damaged: unreadable parameter metadata ({error})"
        ) from None
    tree = getattr(metadata, "item_metadata", metadata)
    tree = getattr(tree, "tree", tree)
    shapes = {_dotted(path): tuple(leaf.shape) for path, leaf in _leaves(tree)}
    if not shapes:  # Orbax logs and returns None when the OCDBT index cannot be read
        raise CheckpointError(
            f"checkpoint {str(params_dir)!r} is damaged: Orbax finds no arrays in it "
            f"(its OCDBT index or _METADATA file is truncated or missing)"
        )
    return shapes


def _leaves(tree):
    return jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))


def _dotted(path) -> str:
    """'a.0.mu': dict keys, sequence indices and attribute names (optax's state tuples)."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def check_params_match(step_dir: epath.Path, abstract_params) -> None:
    """One CheckpointError naming the first tensor whose name or shape differs between the
    checkpoint and the model; checked on metadata before Orbax starts reading arrays (a
    mismatch found mid-restore buries its message in asyncio tracebacks)."""
    stored = _stored_shapes(step_dir / "params")
    expected = {_dotted(path): tuple(leaf.shape) for path, leaf in _leaves(abstract_params)}
    where = f"checkpoint {str(step_dir)!r}"
    for name, shape in expected.items():
        if name in stored and stored[name] != shape:
            raise CheckpointMismatch(
                f"{where}: tensor {name} has shape {stored[name]}, the model config expects "
                f"{shape} (a checkpoint of another architecture or width?)"
            )
    missing = sorted(expected.keys() - stored.keys())
    extra = sorted(stored.keys() - expected.keys())
    if missing or extra:
        parts = []
        if missing:
            name = missing[0]
            parts.append(
                f"the model's tensor {name} {expected[name]} is not in the checkpoint "
                f"({len(missing)} missing)"
            )
        if extra:
            name = extra[0]
            parts.append(
                f"the checkpoint's tensor {name} {stored[name]} is not in the model "
                f"({len(extra)} extra)"
            )
        raise CheckpointMismatch(
            f"{where}: " + "; ".join(parts) + " (a checkpoint of another architecture?)"
        )


def check_opt_state_match(step_dir: epath.Path, abstract_opt_state) -> None:
    """CheckpointMismatch when the optimizer state stored in `step_dir` is not the state of
    this run's optimizer (optimizer.name or a setting that shapes its state changed):
    checked on metadata, so an intact checkpoint is never mistaken for a damaged one."""
    stored = _stored_shapes(step_dir / "opt_state")
    expected = {_dotted(path): tuple(leaf.shape) for path, leaf in _leaves(abstract_opt_state)}
    if stored == expected:
        return
    differ = sorted(stored.keys() ^ expected.keys()) or sorted(
        name for name in stored if stored[name] != expected[name]
    )
    name = differ[0]
    have = f"{stored[name]} in the checkpoint" if name in stored else "not in the checkpoint"
    want = f"{expected[name]} in this run" if name in expected else "not in this run"
    try:
        saved_with = read_stored_config(str(step_dir), tokenizer=False)["optimizer"]["name"]
        was = f"saved with optimizer.name={saved_with}; "
    except (CheckpointError, ValueError, KeyError, AttributeError):
        was = ""
    raise CheckpointMismatch(
        f"checkpoint {str(step_dir)!r} holds the state of another optimizer than "
        f"optimizer.* of this run ({was}state {name}: {have}, {want})"
    )


def restore_params(path: str, abstract_params, layouts=()) -> dict:
    """Parameters of checkpoint `path`, placed with the shardings in `abstract_params`.

    `layouts`: the arrangements the tree may be stored in, each a function putting a tree
    (abstract or not) in any of them into its own (models.stack.layer_layouts: per-layer
    and scanned). A checkpoint stored in another one than `abstract_params` is restored in
    its own and put back into the asked one; this module knows no model's layout.
    """
    step_dir = resolve_checkpoint(path)
    try:
        check_params_match(step_dir, abstract_params)
    except CheckpointError as mismatch:
        asked = jax.tree.structure(abstract_params)
        for arrange in layouts:
            as_stored = arrange(abstract_params)
            if jax.tree.structure(as_stored) == asked:
                continue  # the asked arrangement itself
            try:
                check_params_match(step_dir, as_stored)
            except CheckpointError:
                continue
            back = next(a for a in layouts if jax.tree.structure(a(as_stored)) == asked)
            stored = _restore_tree(step_dir, as_stored)
            shardings = jax.tree.map(lambda a: a.sharding, abstract_params)
            return jax.device_put(back(stored), shardings)
        raise mismatch from None
    return _restore_tree(step_dir, abstract_params)


def _restore_tree(step_dir, abstract_params) -> dict:
    with ocp.StandardCheckpointer() as checkpointer:
        try:
            return checkpointer.restore(step_dir / "params", abstract_params)
        except (ValueError, KeyError) as error:
            raise CheckpointError(
                f"checkpoint {str(step_dir)!r}: parameters do not match the model: "
                f"{describe_error(error)}"
            ) from error
        except Exception as error:  # a damaged file: TensorStore raises plain Exceptions
            raise CheckpointError(
                f"checkpoint {str(step_dir)!r} is damaged: {describe_error(error)}"
            ) from error


def restore_opt_state(path: str, abstract_opt_state):
    """The optimizer state stored with checkpoint `path`, placed like `abstract_opt_state`.

    Moment estimates and their step counts continue; learning-rate schedule counts restart
    at 0, because the schedule of the new run is offset by `optimizer.start_step` instead.
    """
    import optax

    step_dir = resolve_checkpoint(path)
    if not _item_dir(step_dir, "opt_state"):
        raise CheckpointError(
            f"checkpoint {str(step_dir)!r} has no optimizer state (train.init_optimizer needs "
            "one: a training run's checkpoint, or `convert t5x --keep_optimizer`)"
        )
    with ocp.StandardCheckpointer() as checkpointer:
        try:
            state = checkpointer.restore(step_dir / "opt_state", abstract_opt_state)
        except (ValueError, KeyError) as error:
            raise CheckpointError(
                f"checkpoint {str(step_dir)!r}: its optimizer state does not match "
                f"optimizer.* of this run: {str(error).splitlines()[0]}"
            ) from error

    def restart(node):
        if isinstance(node, optax.ScaleByScheduleState):
            return node._replace(count=jax.numpy.zeros_like(node.count))
        return node

    return jax.tree.map(
        restart, state, is_leaf=lambda node: isinstance(node, optax.ScaleByScheduleState)
    )


def save_params(path: str, params, config: StorableConfig) -> None:
    """Write a parameters-only checkpoint (what converters produce) of the tree `params`,
    in the layer layout it has (converters of a scanned model stack theirs first:
    models.stack.stack_layers; restore_params reads either).

    Host numpy leaves are written without Orbax's defensive deep copy (the save is
    synchronous), so converting a model never holds a second copy of it in memory.
    """
    from orbax.checkpoint import type_handlers

    root = epath.Path(absolute_path(path))
    registry = type_handlers.create_type_handler_registry(
        (np.ndarray, type_handlers.NumpyHandler(deepcopy_host_arrays=False))
    )
    with quiet_orbax():
        handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
        with ocp.Checkpointer(handler) as checkpointer:
            checkpointer.save(root / "params", args=ocp.args.PyTreeSave(params), force=True)
    write_config(root, config)


def write_config(root: epath.Path, config: StorableConfig) -> None:
    """The config file of a converted checkpoint (the last of CONFIG_FILES), with the
    checkpoint's tokenizer: one named by path (`--config.data.tokenizer=FILE` at
    conversion) is copied into root/tokenizer/ and stored by that name, after it is opened
    and refused if its ids exceed the model's vocabulary."""
    from jaxmoe.data.tokenizer import open_tokenizer

    stored = copy.deepcopy(config.to_dict())
    data = stored["data"]
    path = data["tokenizer"]
    inside = not (is_remote(path) or os.path.isabs(path))
    # A copy of its own (convert hf, gqa, upcycle) is written after the parameters by the
    # converter, which checks it: only a tokenizer named by path is opened and copied here.
    if path and not inside:
        tokenizer = open_tokenizer(path, eos_token=data["eos_token"])
        check_tokenizer_fits(tokenizer, stored["model"]["vocab_size"], f"data.tokenizer={path}")
        files = tokenizer_files(tokenizer)
        write_tokenizer_files(root / TOKENIZER_DIR, files)
        data["tokenizer"] = stored_name(files)
    (root / "config").mkdir(parents=True, exist_ok=True)
    (root / "config" / "config.json").write_text(json.dumps(stored, indent=1))
