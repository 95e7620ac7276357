"""Read T5X checkpoints one tensor at a time.

Two layouts:
- legacy: `checkpoint_<step>/checkpoint`, a flax msgpack file
  `{'version': 3, 'optimizer': {'target': params, 'state': {'step', 'param_states'}}}`
  (or that file alone, renamed). A leaf is inline (flax ext type 1 ndarray, 2 complex,
  3 numpy scalar; or a plain number) or a TensorStore zarr spec whose `kvstore.path` is
  relative to the checkpoint directory.
- Orbax era: `<step>/checkpoint`, a msgpack tree under `_optimizer/{target,state}` whose
  array leaves are `PLACEHOLDER://<dir>`; `<dir>` is a zarr v2 array with its `.zarray`.
- T5X's Orbax manager: `checkpoint_<step>/state/`, an OCDBT PyTree item read through Orbax
  (ocdbt.py).

The msgpack file is parsed once; inline leaves keep their raw bytes and decode in `read`,
zarr leaves are read through TensorStore in `read` (both: leaves.py). A conversion
therefore holds one decoded tensor at a time (plus the msgpack file itself when arrays are
inline).

Every path a checkpoint names goes through `safe_paths.resolve_inside` first: a crafted
checkpoint cannot make this module open anything outside its own directory.
"""

import mmap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import tensorstore as ts

from jaxmoe.checkpoints.safe_paths import resolve_inside
from jaxmoe.conversions.t5x.leaves import Ext, Leaf, LeafMaker, is_leaf_dict, one_line
from jaxmoe.conversions.t5x.ocdbt import orbax_item, read_orbax_tree


def open_t5x(path: str | Path) -> "T5xCheckpoint":
    """Opens a T5X checkpoint: a `checkpoint_<step>/` or Orbax-era `<step>/` directory,
    or a bare msgpack file. Parses the msgpack index only; tensors are read on demand."""
    path = Path(path)
    if path.is_dir() and (item := orbax_item(path)) is not None:
        return _build_orbax(path, item)
    if path.is_dir() and not (path / "checkpoint").exists() and (path / "state").is_dir():
        path = resolve_inside(path, "state")  # an older Orbax manager: msgpack index in there
    if path.is_dir():
        # The same gate as every path the checkpoint names: a `checkpoint` symlink that
        # leads out of the directory is refused.
        file = resolve_inside(path, "checkpoint")
        if not file.is_file():
            raise ValueError(f"{path}: no `checkpoint` msgpack file in this directory")
    elif path.is_file():
        file = path
    else:
        raise ValueError(f"{path}: no such checkpoint file or directory")
    tree = _parse_msgpack(file)
    return _build(file, tree)


class TensorTable:
    """Named tensors of one subtree (parameters, or optimizer state); `read` decodes one."""

    def __init__(self, leaves: dict[str, "Leaf"], source: Path, prefix: str):
        self._leaves = leaves
        self._source = source
        self._prefix = prefix  # where the subtree sits in the file, for error messages

    def names(self) -> list[str]:
        return sorted(self._leaves)

    def __contains__(self, name: str) -> bool:
        return name in self._leaves

    def __len__(self) -> int:
        return len(self._leaves)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._leaf(name).shape

    def dtype(self, name: str) -> np.dtype:
        return self._leaf(name).dtype

    def read(self, name: str) -> np.ndarray:
        """The whole tensor as a fresh, writable numpy array of `shape(name)`."""
        return self._leaf(name).read()

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        """(name, array) in name order, decoding one tensor per step."""
        for name in self.names():
            yield name, self.read(name)

    def _leaf(self, name: str) -> "Leaf":
        try:
            return self._leaves[name]
        except KeyError:
            raise KeyError(
                f"{self._source}: no tensor {name!r} under {self._prefix} "
                f"({len(self._leaves)} tensors there)"
            ) from None


class T5xCheckpoint(TensorTable):
    """An opened T5X checkpoint. As a `TensorTable` it holds the model parameters
    ('/'-joined, e.g. `decoder/layers_0/self_attention/key/kernel`); `optimizer_state`
    holds the rest (`step`, `param_states/.../v_row`, ...)."""

    def __init__(
        self,
        file: Path,
        layout: str,
        version: int | None,
        params: dict[str, "Leaf"],
        params_prefix: str,
        optimizer_state: TensorTable,
    ):
        super().__init__(params, file, params_prefix)
        self.file = file  # the msgpack index
        self.directory = file.parent  # relative array paths resolve (only) inside this
        self.layout = layout  # "legacy" | "orbax" | "ocdbt"
        self.version = version  # T5X format version (3 since 2021), None in Orbax era
        self.optimizer_state = optimizer_state

    def optimizer_state_names(self) -> list[str]:
        return self.optimizer_state.names()

    @property
    def step(self) -> int | None:
        """The training step stored in the optimizer state, or None if there is none."""
        if "step" not in self.optimizer_state:
            return None
        value = self.optimizer_state.read("step")
        if value.size != 1:
            raise ValueError(f"{self.file}: step has shape {value.shape}, expected a scalar")
        return int(value.reshape(()))

    def __repr__(self) -> str:
        return (
            f"T5xCheckpoint({str(self.file)!r}, layout={self.layout}, "
            f"{len(self)} params, {len(self.optimizer_state)} optimizer-state tensors)"
        )


# --- Parsing the msgpack index ---


def _parse_msgpack(file: Path) -> Any:
    """The msgpack tree, with ext values as `Ext`. The file is memory-mapped so that the
    only private copy of inline arrays is the per-leaf payloads kept for `read`."""
    try:
        with file.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:21] == b"model_checkpoint_path":
                raise ValueError("a TensorFlow checkpoint index, not a T5X msgpack file")
            return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=Ext)
    except Exception as e:  # OSError, mmap's ValueError on empty files, msgpack's own types
        raise ValueError(
            f"{file}: not a readable T5X msgpack checkpoint (truncated or corrupt?): "
            f"{type(e).__name__}: {one_line(e)}"
        ) from None


def _build(file: Path, tree: Any) -> T5xCheckpoint:
    if not isinstance(tree, dict):
        raise ValueError(f"{file}: msgpack top level is {type(tree).__name__}, not a dict")
    if isinstance(tree.get("optimizer"), dict):
        layout, top = "legacy", "optimizer"
        optimizer = tree["optimizer"]
    elif isinstance(tree.get("_optimizer"), dict):
        layout, top = "orbax", "_optimizer"
        optimizer = tree["_optimizer"]
    elif "target" in tree:  # version-0 checkpoint: a bare flax optimizer state dict
        layout, top, optimizer = "legacy", "", tree
    else:
        raise ValueError(
            f"{file}: no optimizer/target or _optimizer/target in this msgpack file "
            f"(top-level keys {sorted(map(str, tree))})"
        )
    version = tree.get("version") if layout == "legacy" else None
    make = LeafMaker(file.parent, ts.Context())
    leaves, prefixes = {}, {}
    for part in ("target", "state"):
        prefixes[part] = f"{top}/{part}" if top else part
        leaves[part] = {}
        try:
            _flatten(optimizer.get(part, {}), prefixes[part], "", make, leaves[part])
        except RecursionError:
            raise ValueError(f"{file}: {prefixes[part]} is nested too deeply") from None
    state = TensorTable(leaves["state"], file, prefixes["state"])
    return T5xCheckpoint(file, layout, version, leaves["target"], prefixes["target"], state)


def _build_orbax(path: Path, item: Path) -> T5xCheckpoint:
    """A checkpoint of T5X's Orbax manager: the `state` PyTree item, read through Orbax."""
    tree = read_orbax_tree(item, path.resolve())
    parts = {"target": {}, "state": {}}
    for keys, leaf in tree.items():
        if keys[0] in parts and len(keys) > 1:
            parts[keys[0]]["/".join(keys[1:])] = leaf
    if not parts["target"] and not parts["state"]:
        raise ValueError(
            f"{item}: no target/... or state/... arrays in this Orbax checkpoint (top-level "
            f"keys {sorted({keys[0] for keys in tree})})"
        )
    file = item / "_METADATA"
    state = TensorTable(parts["state"], file, "state")
    return T5xCheckpoint(file, "ocdbt", None, parts["target"], "target", state)


def _flatten(node: Any, prefix: str, name: str, make: "LeafMaker", out: dict) -> None:
    """Collects tensor leaves of `node` into `out` under '/'-joined names."""
    if isinstance(node, dict) and not is_leaf_dict(node):
        children = node.items()
    elif isinstance(node, list | tuple):
        children = enumerate(node)
    else:
        leaf = make(f"{prefix}/{name}" if name else prefix, node)
        if leaf is not None:
            out[name] = leaf
        return
    for key, child in children:
        key = str(key)
        if "/" in key or not key:
            raise ValueError(f"{make.root}: key {key!r} under {prefix}/{name} is not a name")
        _flatten(child, prefix, f"{name}/{key}" if name else key, make, out)
