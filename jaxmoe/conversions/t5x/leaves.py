"""The tensors of a T5X msgpack tree, each read on demand (reader.py builds the tree).

Inline leaves keep flax's ext payloads (1 ndarray, 2 complex, 3 numpy scalar; arrays over
1 GiB as chunked pieces) and decode them in `read` without copying the bytes before then.
Zarr leaves are TensorStore specs (legacy layout) or Orbax `PLACEHOLDER://<dir>` values;
their metadata is checked (keys, dtype, chunks against the files present: TensorStore
would read a missing chunk as zeros) and every path they name passes
`safe_paths.resolve_inside`, so a crafted checkpoint cannot read outside its directory.
"""

import dataclasses
import itertools
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import ml_dtypes
import msgpack
import numpy as np
import tensorstore as ts

from jaxmoe.checkpoints.safe_paths import resolve_inside

_PLACEHOLDER = "PLACEHOLDER://"
# T5X writes this bucket name into specs of checkpoints saved on GCS so that they stay
# portable; T5X itself reads such an array from the checkpoint's own directory, and so
# does this reader (published T5X checkpoints copied to local disk all look like this).
_T5X_PORTABLE_BUCKET = "t5x-dummy-bucket"
_LOCAL_KVSTORES = ("file", "gfile")
# Keys T5X puts in a spec; anything else (`base`, `context`, `transform`...) could redirect
# or reshape the read, so it is refused rather than ignored.
_SPEC_KEYS = frozenset({"driver", "dtype", "kvstore", "metadata", "path"})
_KVSTORE_KEYS = frozenset({"driver", "path", "bucket"})
_ZARR_KEYS = (
    "zarr_format", "shape", "chunks", "dtype", "compressor", "fill_value", "order", "filters",
    "dimension_separator",
)  # fmt: skip
_ML_DTYPE_NAMES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")
_MAX_ZARRAY_BYTES = 1 << 20
_HEADER_PEEK = 4096  # bytes enough for flax's `[shape, dtype name, <bin header>]` prefix
# msgpack bin/str headers: marker -> width of the big-endian length that follows.
_BYTES_MARKERS = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}
_CHUNK_NAME = re.compile(r"\d+(\.\d+)*")
# A zarr array may declare any shape; with a fill_value, chunks missing on disk decode to
# it, so a few hundred bytes of spec can ask TensorStore for gigabytes. What the chunk files
# present can decode to is bounded: deflate (gzip, zlib: what T5X writes) expands at most
# 1032:1. An array declaring more than that (plus a little for small fill-only arrays) is
# refused before anything is allocated; T5X itself writes no fill_value and every chunk.
_MAX_EXPANSION = 1032
_FILL_ONLY_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Ext:
    """A msgpack ext value kept undecoded until its tensor is built (or read)."""

    code: int
    data: bytes


def is_leaf_dict(node: dict) -> bool:
    """A dict that is one tensor (a chunked inline array, a TensorStore spec), not a subtree."""
    return "__msgpack_chunked_array__" in node or (
        isinstance(node.get("driver"), str) and "kvstore" in node
    )


@dataclasses.dataclass(frozen=True)
class LeafMaker:
    root: Path  # the checkpoint directory
    context: Any  # one TensorStore context shared by the checkpoint's arrays

    def __call__(self, path: str, value: Any) -> "Leaf | None":
        """The tensor stored at `path`, or None for a non-tensor value (None, text)."""
        if isinstance(value, Ext):
            return _inline_from_ext(path, value)
        if isinstance(value, dict):
            if "__msgpack_chunked_array__" in value:
                return _inline_from_chunks(path, value)
            return _ZarrLeaf.from_spec(path, value, self.root, self.context)
        if isinstance(value, str) and value.startswith(_PLACEHOLDER):
            return _ZarrLeaf.from_placeholder(path, value, self.root, self.context)
        if isinstance(value, bool | int | float):
            array = np.asarray(value)
            if array.dtype.kind not in "biuf":
                raise ValueError(f"tensor {path}: number {value!r} does not fit a numpy dtype")
            return _ValueLeaf(array)
        return None


# --- Inline leaves (flax msgpack ext types) ---


class _ValueLeaf:
    """A small value decoded at parse time (plain numbers, complex scalars)."""

    def __init__(self, value: np.ndarray):
        self._value = value
        self.shape, self.dtype = value.shape, value.dtype

    def read(self) -> np.ndarray:
        return self._value.copy()


class _InlineLeaf:
    """An array whose C-order bytes sit in one or more msgpack ext payloads."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, pieces: list[tuple]):
        self.shape, self.dtype = shape, dtype
        self._pieces = pieces  # (payload bytes, byte offset, element count), in order

    def read(self) -> np.ndarray:
        flat = np.empty(math.prod(self.shape), self.dtype)
        start = 0
        for data, offset, count in self._pieces:
            flat[start : start + count] = np.frombuffer(data, self.dtype, count, offset)
            start += count
        return flat.reshape(self.shape)


def _inline_from_ext(path: str, ext: Ext) -> "Leaf":
    if ext.code in (1, 3):  # flax: 1 = ndarray, 3 = numpy scalar, same payload
        shape, dtype, offset, count = _ndarray_payload(path, ext.data)
        return _InlineLeaf(shape, dtype, [(ext.data, offset, count)])
    if ext.code == 2:  # flax: native complex, payload msgpack (real, imag)
        try:
            real, imag = msgpack.unpackb(ext.data)
            return _ValueLeaf(np.asarray(complex(real, imag)))
        except Exception as e:
            raise ValueError(f"tensor {path}: corrupt complex value: {one_line(e)}") from None
    raise ValueError(f"tensor {path}: unknown msgpack ext type {ext.code} (flax uses 1, 2, 3)")


def _inline_from_chunks(path: str, node: dict) -> "Leaf":
    """flax splits arrays over 1 GiB into flat pieces: {shape: {'0': d0..}, chunks: {'0':..}}."""
    try:
        shape = _int_tuple(_dict_values(node["shape"]))
        pieces_ext = _dict_values(node["chunks"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"tensor {path}: malformed chunked array: {one_line(e)}") from None
    pieces, dtype = [], None
    for i, ext in enumerate(pieces_ext):
        if not isinstance(ext, Ext) or ext.code != 1:
            raise ValueError(f"tensor {path}: chunk {i} of a chunked array is not an ndarray")
        piece_shape, piece_dtype, offset, count = _ndarray_payload(f"{path}[{i}]", ext.data)
        if len(piece_shape) != 1 or piece_dtype != (piece_dtype if dtype is None else dtype):
            raise ValueError(f"tensor {path}: chunk {i} is {piece_shape} {piece_dtype}, not flat")
        dtype = piece_dtype
        pieces.append((ext.data, offset, count))
    total = sum(count for _, _, count in pieces)
    if dtype is None or total != math.prod(shape):
        raise ValueError(
            f"tensor {path}: chunked array of shape {list(shape)} needs "
            f"{math.prod(shape)} elements but its chunks hold {total}"
        )
    return _InlineLeaf(shape, dtype, pieces)


def _ndarray_payload(path: str, data: bytes) -> tuple[tuple[int, ...], np.dtype, int, int]:
    """Parses flax's ndarray payload, msgpack `[shape, dtype name, raw bytes]`, without
    copying the bytes: returns (shape, dtype, offset of the bytes, element count)."""
    try:
        unpacker = msgpack.Unpacker(raw=True)
        unpacker.feed(data[:_HEADER_PEEK])
        if unpacker.read_array_header() != 3:
            raise ValueError("not a [shape, dtype, bytes] triple")
        shape = _int_tuple(unpacker.unpack())
        dtype = _numpy_dtype(unpacker.unpack().decode("ascii"))
        pos = unpacker.tell()
        marker = data[pos]
        if 0xA0 <= marker <= 0xBF:  # fixstr: an old msgpack packed bytes as text
            offset, length = pos + 1, marker & 0x1F
        else:
            width = _BYTES_MARKERS[marker]
            offset = pos + 1 + width
            length = int.from_bytes(data[pos + 1 : offset], "big")
    except Exception as e:
        raise ValueError(f"tensor {path}: corrupt inline array header: {one_line(e)}") from None
    count = math.prod(shape)
    if length != count * dtype.itemsize or offset + length != len(data):
        raise ValueError(
            f"tensor {path}: inline array header says shape {list(shape)} {dtype} "
            f"({count * dtype.itemsize} bytes) but the data holds {len(data) - offset} bytes"
        )
    return shape, dtype, offset, count


# --- Zarr leaves (TensorStore specs and Orbax placeholders) ---


@dataclasses.dataclass(frozen=True)
class _ZarrMeta:
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: np.dtype
    separator: str
    has_fill_value: bool
    fields: dict  # zarr v2 metadata handed to TensorStore


class _ZarrLeaf:
    """A zarr v2 array in a directory inside the checkpoint."""

    def __init__(self, path, root, rel, spec_meta: _ZarrMeta | None, context):
        self._path = path  # name in the msgpack tree, for messages
        self._root = root
        self._rel = rel.rstrip("/")  # directory, relative to root, already checked
        self._spec_meta = spec_meta  # from the msgpack spec; None for Orbax placeholders
        self._context = context
        self._meta: _ZarrMeta | None = None  # effective metadata, loaded on first use

    @classmethod
    def from_spec(cls, path: str, spec: dict, root: Path, context) -> "_ZarrLeaf":
        extra = set(spec) - _SPEC_KEYS
        if extra:
            raise ValueError(f"tensor {path}: TensorStore spec keys {sorted(extra)} are refused")
        if spec["driver"] != "zarr":
            raise ValueError(f"tensor {path}: TensorStore driver {spec['driver']!r} is not zarr")
        kvstore = spec["kvstore"]
        if not isinstance(kvstore, dict) or set(kvstore) - _KVSTORE_KEYS:
            raise ValueError(f"tensor {path}: kvstore {kvstore!r} is not a local file store")
        driver, bucket = kvstore.get("driver"), kvstore.get("bucket")
        local = driver in _LOCAL_KVSTORES and bucket is None
        if not (local or (driver == "gcs" and bucket == _T5X_PORTABLE_BUCKET)):
            where = f"{driver!r}" + (f" bucket {bucket!r}" if bucket is not None else "")
            raise ValueError(
                f"tensor {path}: kvstore {where} is outside the checkpoint; only local "
                f"files (or T5X's portable {_T5X_PORTABLE_BUCKET!r}) are read"
            )
        inner, outer = kvstore.get("path"), spec.get("path")
        if inner and outer:
            raise ValueError(f"tensor {path}: spec names two paths, {inner!r} and {outer!r}")
        rel = inner or outer
        _resolve(path, root, rel)
        meta = _zarr_meta(path, spec.get("metadata"), spec.get("dtype"), "spec")
        return cls(path, root, rel, meta, context)

    @classmethod
    def from_placeholder(cls, path: str, value: str, root: Path, context) -> "_ZarrLeaf":
        rel = value[len(_PLACEHOLDER) :]
        _resolve(path, root, rel)
        return cls(path, root, rel, None, context)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._metadata().shape  # size-checked: converters build configs from it

    @property
    def dtype(self) -> np.dtype:
        return self._metadata().dtype

    def read(self) -> np.ndarray:
        meta = self._metadata()
        self._check_chunk_files(meta)
        directory = _resolve(self._path, self._root, self._rel)
        spec = {
            "driver": "zarr",
            "kvstore": {"driver": "file", "path": f"{directory}/"},
            "metadata": meta.fields,
            "dtype": meta.dtype.name,
        }
        try:
            # assume_metadata: take the metadata given here and never read or write any
            # stored metadata file (T5X's array directories may have no `.zarray`).
            store = ts.open(
                spec, read=True, open=True, assume_metadata=True, context=self._context
            ).result()
            array = store.read().result()
        except Exception as e:  # TensorStore reports decode and I/O errors as ValueError
            raise ValueError(
                f"tensor {self._path}: data in {directory} does not decode as shape "
                f"{list(meta.shape)} {meta.dtype} in chunks of {list(meta.chunks)} "
                f"({math.prod(meta.chunks) * meta.dtype.itemsize} bytes each): {one_line(e)}"
            ) from None
        return np.asarray(array)

    def _metadata(self) -> _ZarrMeta:
        """The metadata to read with: `.zarray` if present (checked against the spec)."""
        if self._meta is not None:
            return self._meta
        zarray = _resolve(self._path, self._root, f"{self._rel}/.zarray")
        if zarray.is_file():
            meta = _zarr_meta(self._path, _load_json(self._path, zarray), None, str(zarray))
            spec = self._spec_meta
            if spec is not None and (spec.shape, spec.dtype) != (meta.shape, meta.dtype):
                raise ValueError(
                    f"tensor {self._path}: spec says {list(spec.shape)} {spec.dtype} but "
                    f"{zarray} says {list(meta.shape)} {meta.dtype}"
                )
        elif self._spec_meta is not None:
            meta = self._spec_meta
        else:
            raise ValueError(
                f"tensor {self._path}: {zarray} is missing, so the array's shape and dtype "
                "are unknown (a copy that dropped dotfiles? copy checkpoints with `cp -a`)"
            )
        self._check_size(meta)
        self._meta = meta
        return meta

    def _check_size(self, meta: _ZarrMeta) -> None:
        """Refuses a declared size that the chunk files present cannot hold (see
        _MAX_EXPANSION), before a shape this large reaches a config or an allocation."""
        declared = math.prod(meta.shape) * meta.dtype.itemsize
        if declared <= _FILL_ONLY_BYTES:
            return
        directory = _resolve(self._path, self._root, self._rel)
        stored = sum(
            (Path(folder) / name).stat().st_size
            for folder, _, names in os.walk(directory)
            for name in names
            if not name.startswith(".")
        )
        if declared > _MAX_EXPANSION * stored + _FILL_ONLY_BYTES:
            raise ValueError(
                f"tensor {self._path}: shape {list(meta.shape)} {meta.dtype} needs "
                f"{_bytes(declared)} but its chunk files hold {_bytes(stored)}, more than "
                f"gzip can expand ({_MAX_EXPANSION}:1); refused before allocating"
            )

    def _check_chunk_files(self, meta: _ZarrMeta) -> None:
        """Refuses chunks that escape the checkpoint, missing chunks and surplus chunks.

        TensorStore reads a missing chunk as zeros; that is only right when the array has
        a fill value (zarr then may omit chunks equal to it). T5X writes no fill value.
        """
        grid = [-(-size // chunk) for size, chunk in zip(meta.shape, meta.chunks, strict=True)]
        expected = set()
        for index in itertools.product(*(range(n) for n in grid)):
            key = meta.separator.join(map(str, index)) or "0"
            expected.add(key)
            chunk_file = _resolve(self._path, self._root, f"{self._rel}/{key}")
            if not chunk_file.is_file() and not meta.has_fill_value:
                raise ValueError(
                    f"tensor {self._path}: chunk file {chunk_file} is missing "
                    f"(shape {list(meta.shape)}, chunks {list(meta.chunks)})"
                )
        if meta.separator != ".":
            return  # nested chunk directories: the surplus check below does not apply
        directory = _resolve(self._path, self._root, self._rel)
        surplus = sorted(
            entry.name
            for entry in (directory.iterdir() if directory.is_dir() else ())
            if _CHUNK_NAME.fullmatch(entry.name) and entry.name not in expected
        )
        if surplus:
            last = max(surplus, key=lambda name: [int(i) for i in name.split(".")])
            index = [int(i) for i in last.split(".")]
            implied = "a different rank"
            if len(index) == len(meta.shape) and meta.shape:
                ends = [(i + 1) * c for i, c in zip(index, meta.chunks, strict=True)]
                least = [max(e, s) for e, s in zip(ends, meta.shape, strict=True)]
                implied = f"a shape of at least {least}"
            raise ValueError(
                f"tensor {self._path}: metadata shape {list(meta.shape)} (chunks "
                f"{list(meta.chunks)}) disagrees with the data: chunk file {last} "
                f"implies {implied}"
            )


def _resolve(path: str, root: Path, rel: Any) -> Path:
    if not isinstance(rel, str):
        raise ValueError(f"tensor {path}: array path {rel!r} is not text")
    try:
        return resolve_inside(root, rel)
    except ValueError as e:
        raise ValueError(f"tensor {path}: refused: {e}") from None


def _zarr_meta(path: str, fields: Any, dtype_name: Any, source: str) -> _ZarrMeta:
    """Validates zarr v2 metadata from `source` (a spec's `metadata` or a `.zarray`)."""
    if not isinstance(fields, dict):
        raise ValueError(f"tensor {path}: {source} metadata {fields!r} is not a dict")
    extra = set(fields) - set(_ZARR_KEYS)
    if extra:
        raise ValueError(f"tensor {path}: {source} metadata keys {sorted(extra)} are unknown")
    try:
        shape = _int_tuple(fields["shape"])
        chunks = _int_tuple(fields["chunks"])
        names = [n for n in (dtype_name, fields.get("dtype")) if n is not None]
        if not names or not all(isinstance(n, str) for n in names):
            raise ValueError(f"dtype {names or None} is not a dtype name")
        dtypes = {_numpy_dtype(n) for n in names}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"tensor {path}: bad {source} metadata: {one_line(e)}") from None
    if len(dtypes) != 1:
        raise ValueError(f"tensor {path}: {source} gives two dtypes {names}")
    if len(chunks) != len(shape) or not all(chunks):
        raise ValueError(
            f"tensor {path}: {source} chunks {list(chunks)} do not fit shape {list(shape)}"
        )
    separator = fields.get("dimension_separator", ".")
    if separator not in (".", "/"):
        raise ValueError(f"tensor {path}: {source} dimension_separator {separator!r}")
    return _ZarrMeta(
        shape=shape,
        chunks=chunks,
        dtype=dtypes.pop(),
        separator=separator,
        has_fill_value=fields.get("fill_value") is not None,
        fields={k: fields[k] for k in _ZARR_KEYS if k in fields},
    )


def _load_json(path: str, file: Path) -> Any:
    try:
        with file.open("rb") as f:
            return json.loads(f.read(_MAX_ZARRAY_BYTES))  # a bigger file fails to parse
    except (OSError, ValueError) as e:
        raise ValueError(f"tensor {path}: unreadable {file}: {one_line(e)}") from None


# --- Small helpers ---

Leaf = _ValueLeaf | _InlineLeaf | _ZarrLeaf


def _numpy_dtype(name: str) -> np.dtype:
    """A numeric numpy dtype from a numpy / zarr / TensorStore name ('<f4', 'bfloat16')."""
    if name in _ML_DTYPE_NAMES:
        return np.dtype(getattr(ml_dtypes, name))
    try:
        dtype = np.dtype(name)
    except TypeError:
        raise ValueError(f"unknown dtype {name!r}") from None
    if dtype.kind not in "biufc" or dtype.fields is not None:
        raise ValueError(f"dtype {name!r} is not numeric")
    return dtype


def _int_tuple(values: Any) -> tuple[int, ...]:
    if not isinstance(values, list | tuple) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values
    ):
        raise ValueError(f"{values!r} is not a list of sizes")
    return tuple(values)


def _dict_values(node: Any) -> list:
    """flax stores tuples as {'0': a, '1': b, ...}."""
    if not isinstance(node, dict):
        raise TypeError(f"{type(node).__name__} is not a dict")
    return [node[str(i)] for i in range(len(node))]


def _bytes(count: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} bytes"


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 300 else text[:297] + "..."
