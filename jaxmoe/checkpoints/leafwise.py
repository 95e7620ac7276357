"""Orbax `params` items written and read one tensor slice at a time, never whole.

Converting a model larger than host RAM (Mixtral-8x7B: 93 GB in bf16) must hold about one
tensor at a time. Writing: a `LazyArray` leaf stands for an array whose values arrive from
`pieces()`, one slice over its leading axes (a layer of a scanned stack, an expert) at a
time; `save_params_leafwise` has Orbax write the tree with a type handler that writes each
piece into the array's TensorStore and awaits that write before asking for the next piece,
leaf after leaf. Storage chunks are one piece each, so no chunk is written twice (a partial
chunk would be read back and rewritten) and a reader of one piece decodes only that piece.
The result is an ordinary Orbax checkpoint (its `_METADATA` says `np.ndarray`, as
`save_params` writes), restored by `manager.restore_params` and by training alike.

Reading: `StoredParams` opens one array of an existing `params` item with TensorStore,
using Orbax's own read spec (OCDBT or per-array directories, zarr v2 or v3, as the item's
`_METADATA` says), and reads one slice of it. TensorStore decodes whole storage chunks:
reading a slice costs the chunks it touches (training checkpoints: one chunk per device
shard; `save_params`: up to the whole array; this module: one piece). A slice is read one
chunk-aligned block at a time, so at most one decoded chunk is held besides the slice. A
chunk holding several slices (a training checkpoint's kernel sharded along D holds part of
every expert) is decoded again for each slice read from it: reading is amplified, memory
is not.
"""

import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from orbax.checkpoint import future, type_handlers

from jaxmoe.checkpoints.finite import check_finite
from jaxmoe.checkpoints.manager import (
    CheckpointError,
    describe_error,
    quiet_orbax,
    resolve_checkpoint,
    write_config,
)
from jaxmoe.compat.private_apis import orbax_array_read_spec, orbax_array_write_spec
from jaxmoe.storage.paths import absolute_path

Index = tuple[int, ...]


@dataclass(frozen=True)
class LazyArray:
    """An array of `shape` and `dtype` that exists only as `pieces()`: (index, value) with
    `index` over the first `depth` axes and value shape `shape[depth:]`, together covering
    the array exactly once (pieces with depth 0: the whole array in one piece)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    depth: int
    pieces: Callable[[], Iterator[tuple[Index, np.ndarray]]]

    @property
    def piece_shape(self) -> tuple[int, ...]:
        return (1,) * self.depth + tuple(self.shape[self.depth :])

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def ndim(self) -> int:
        return len(self.shape)


class _PieceHandler(type_handlers.NumpyHandler):
    """Orbax type handler of `LazyArray`: sequential, piece by piece (see module doc)."""

    async def serialize(self, values, infos, args=None):
        args = args or [ocp.SaveArgs()] * len(values)
        return [
            future.CommitFutureAwaitingContractedSignals(
                self._write_all(values, infos, args), name="jaxmoe_leafwise"
            )
        ]

    async def _write_all(self, values, infos, args) -> None:
        for value, info, arg in zip(values, infos, args, strict=True):
            await info.await_path_creation()
            spec = orbax_array_write_spec(
                info,
                arg,
                global_shape=value.shape,
                local_shape=value.piece_shape,  # chunk (and OCDBT shard) = one piece
                dtype=value.dtype,
            )
            store = await ts.open(ts.Spec(spec), create=True, open=True, context=info.ts_context)
            written = 0
            for index, piece in value.pieces():
                if piece.shape != value.piece_shape[value.depth :]:
                    raise CheckpointError(
                        f"{info.name}{list(index)}: produced {piece.shape}, expected "
                        f"{value.piece_shape[value.depth :]}"
                    )
                # Awaited before the next piece and never modified: TensorStore may read
                # it in place instead of copying it first.
                await store[index].write(
                    piece.astype(value.dtype, copy=False),
                    can_reference_source_data_indefinitely=True,
                )
                del piece  # not alive while the next piece is produced
                written += 1
            expected = int(np.prod(value.shape[: value.depth], dtype=np.int64))
            if written != expected:
                raise CheckpointError(f"{info.name}: {written} of {expected} pieces written")


def save_params_leafwise(path: str, leaves: dict, config) -> None:
    """Write a parameters-only checkpoint (as `manager.save_params` does) whose nested
    dict `leaves` holds `LazyArray`s in the layout the model `config` restores (stacked for
    `model.scan_layers`): one piece in memory at a time."""
    root = epath.Path(absolute_path(path))
    registry = type_handlers.create_type_handler_registry((LazyArray, _PieceHandler()))
    with quiet_orbax():
        handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
        with ocp.Checkpointer(handler) as checkpointer:
            checkpointer.save(root / "params", args=ocp.args.PyTreeSave(leaves), force=True)
    write_config(root, config)


class StoredParams:
    """The arrays of a checkpoint's `params` item, read one slice at a time."""

    def __init__(self, path: str):
        self.step_dir = resolve_checkpoint(path)
        self.root = self.step_dir / "params"
        try:
            metadata = json.loads((self.root / "_METADATA").read_text())
            tree = metadata["tree_metadata"]
            self.paths = {
                tuple(str(k["key"]) for k in entry["key_metadata"]) for entry in tree.values()
            }
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise CheckpointError(f"{self.root}: unreadable Orbax metadata ({error})") from None
        self._ocdbt = bool(metadata.get("use_ocdbt", False))
        self._zarr3 = bool(metadata.get("use_zarr3", False))
        self._context = type_handlers.get_ts_context(use_ocdbt=self._ocdbt)

    def _open(self, path: tuple[str, ...]) -> ts.TensorStore:
        info = type_handlers.ParamInfo(
            name=".".join(path),
            parent_dir=self.root,
            is_ocdbt_checkpoint=self._ocdbt,
            use_zarr3=self._zarr3,
            ts_context=self._context,
        )
        spec = orbax_array_read_spec(info)
        try:
            return ts.open(ts.Spec(spec), open=True, context=self._context).result()
        except Exception as error:  # TensorStore raises plain Exceptions for bad files
            raise CheckpointError(
                f"checkpoint {str(self.step_dir)!r}: cannot open {'.'.join(path)}: "
                f"{describe_error(error)}"
            ) from error

    def chunk_shape(self, path: tuple[str, ...]) -> tuple[int, ...]:
        """The storage chunk of the array at `path`: a read decodes whole chunks."""
        return tuple(self._open(path).chunk_layout.read_chunk.shape)

    def read(self, path: tuple[str, ...], index: Index = ()) -> np.ndarray:
        """Slice `index` (over the leading axes) of the array at `path`, read one storage
        chunk at a time (TensorStore would decode every touched chunk at once)."""
        store = self._open(path)
        view = store[index] if index else store
        # Chunks start at 0 on every axis; integer indexing keeps the others' origins at 0.
        chunk = store.chunk_layout.read_chunk.shape[len(index) :]
        starts = [range(0, n, c) for n, c in zip(view.shape, chunk, strict=True)]
        try:
            if all(len(axis) == 1 for axis in starts):  # within one chunk: no block copies
                out = view.read().result()
            else:
                out = np.empty(view.shape, view.dtype.numpy_dtype)
                for corner in itertools.product(*starts):
                    block = tuple(
                        slice(b, min(b + c, n))
                        for b, c, n in zip(corner, chunk, view.shape, strict=True)
                    )
                    out[block] = view[block].read().result()
        except Exception as error:
            raise CheckpointError(
                f"checkpoint {str(self.step_dir)!r} is damaged: {'.'.join(path)}: "
                f"{describe_error(error)}"
            ) from error
        # What is read is exported (export hf): NaN weights are refused there as on import.
        return check_finite(out, f"checkpoint {str(self.step_dir)!r}: {'.'.join(path)}")
