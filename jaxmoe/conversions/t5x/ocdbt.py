"""Read T5X checkpoints written by T5X's Orbax checkpoint manager, through Orbax.

T5X's `OrbaxCheckpointManagerInterface` saves step S as `checkpoint_S/` holding
`_CHECKPOINT_METADATA` and one item per part: `state/` (an Orbax PyTree written with
`use_ocdbt=True`: `_METADATA`, `manifest.ocdbt`, `ocdbt.process_*/`, `d/`) and, when the
input pipeline is checkpointed, `dataset/`. The `state` tree is T5X's train-state dict:
`{'target': params, 'state': {'step', 'param_states': ...}}` (plus `flax_mutables` for
models that have any). Orbax names each array by its '.'-joined key path inside the OCDBT
store (`target.encoder.layers_0.attention.key.kernel`).

Arrays are restored one at a time with Orbax's partial restore, as host numpy arrays in
their stored dtype. Paths: the `state` item and every file below it must resolve inside the
checkpoint directory (no symlink out), and every tree key must be a plain name, checked before
Orbax opens anything; TensorStore's file store itself refuses OCDBT data-file references with
`..` or absolute components ("Invalid key"), so the OCDBT manifest cannot lead outside either.
"""

import json
import os
from pathlib import Path

import numpy as np

from jaxmoe.checkpoints.manager import describe_error, quiet_orbax
from jaxmoe.checkpoints.safe_paths import resolve_inside

STATE_ITEM = "state"  # T5X's item name for the train state
# Files that mark a directory as an Orbax PyTree item (new metadata, or an OCDBT store).
_ITEM_MARKERS = ("_METADATA", "manifest.ocdbt")


def orbax_item(path: Path) -> Path | None:
    """The Orbax `state` item of T5X checkpoint directory `path` (`checkpoint_S/state`, or
    `path` itself when it is the item), or None for a msgpack-indexed checkpoint."""
    for candidate in (STATE_ITEM, None):
        item = resolve_inside(path, candidate) if candidate else path.resolve()
        if item.is_dir() and any((item / marker).is_file() for marker in _ITEM_MARKERS):
            return item
    return None


class OrbaxLeaf:
    """One array of an Orbax PyTree item, restored on `read` (alone: partial restore)."""

    def __init__(self, item: Path, keys: tuple[str, ...], shape, dtype):
        self._item, self._keys = item, keys
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)

    def read(self) -> np.ndarray:
        import orbax.checkpoint as ocp

        def nest(leaf):
            for key in reversed(self._keys):
                leaf = {key: leaf}
            return leaf

        args = ocp.args.PyTreeRestore(
            item=nest(0),
            restore_args=nest(ocp.RestoreArgs(restore_type=np.ndarray)),
            partial_restore=True,
        )
        name = "/".join(self._keys)
        try:
            with quiet_orbax(), ocp.PyTreeCheckpointer() as checkpointer:
                tree = checkpointer.restore(self._item, args=args)
        except Exception as e:  # TensorStore and Orbax raise plain Exceptions on bad data
            raise ValueError(
                f"tensor {name}: Orbax could not read it from {self._item}: {describe_error(e)}"
            ) from None
        for key in self._keys:
            tree = tree[key]
        array = np.array(tree)  # a fresh, writable copy
        if array.shape != self.shape or array.dtype != self.dtype:
            raise ValueError(
                f"tensor {name}: metadata says {list(self.shape)} {self.dtype} but the data "
                f"is {list(array.shape)} {array.dtype}"
            )
        return array


def read_orbax_tree(item: Path, root: Path) -> dict[tuple[str, ...], OrbaxLeaf]:
    """{key path: leaf} of every array in the Orbax PyTree `item`, from its metadata only,
    after the path checks of the module docstring (`root`: the checkpoint directory)."""
    import jax
    import orbax.checkpoint as ocp

    _check_files_inside(item, root)
    _check_metadata_keys(item)
    try:
        with quiet_orbax():
            metadata = ocp.PyTreeCheckpointer().metadata(item)
    except Exception as e:
        raise ValueError(f"{item}: unreadable Orbax metadata: {describe_error(e)}") from None
    tree = getattr(metadata, "item_metadata", metadata)
    tree = getattr(tree, "tree", tree)
    if not isinstance(tree, dict):
        raise ValueError(f"{item}: Orbax found no readable tree metadata (damaged _METADATA?)")
    leaves = {}
    flat = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))
    for path, leaf in flat:
        keys = tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        _check_names(item, keys)
        if hasattr(leaf, "dtype") and leaf.dtype is not None:
            leaves[keys] = OrbaxLeaf(item, keys, leaf.shape, leaf.dtype)
    return leaves


def _check_metadata_keys(item: Path) -> None:
    """The key paths of `_METADATA`, checked before Orbax opens any array by their names."""
    file = item / "_METADATA"
    if not file.is_file():
        return  # an older item: its msgpack index is checked after Orbax parsed it
    try:
        entries = json.loads(file.read_bytes()).get("tree_metadata", {})
        paths = [[str(k["key"]) for k in e["key_metadata"]] for e in entries.values()]
    except (ValueError, AttributeError, KeyError, TypeError) as e:
        raise ValueError(f"{file}: not Orbax tree metadata: {describe_error(e)}") from None
    for keys in paths:
        _check_names(item, keys)


def _check_names(item: Path, keys) -> None:
    for key in keys:
        if not key or "/" in key or "\x00" in key or key in (".", ".."):
            raise ValueError(f"{item}: key {key!r} in {'/'.join(keys)} is not a name")
    resolve_inside(item, ".".join(keys))  # a non-OCDBT item keeps arrays under this name


def _check_files_inside(item: Path, root: Path) -> None:
    """Refuses an item with a symlink (file or directory) that leads outside `root`."""
    for folder, dirs, files in os.walk(item):
        for name in dirs + files:
            relative = os.path.relpath(os.path.join(folder, name), root)
            try:
                resolve_inside(root, relative)
            except ValueError as e:
                raise ValueError(f"{item}: refused: {e}") from None
