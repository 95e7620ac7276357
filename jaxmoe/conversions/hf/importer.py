"""`jaxmoe convert hf SRC DST`: Hugging Face safetensors checkpoints -> a jaxmoe checkpoint.

Reads Llama (3.x RoPE scaling too) / Mistral / Mixtral / Qwen2 / Qwen2-MoE / Qwen3-MoE /
OLMoE / GPT-OSS (names_gpt_oss.py) / T5 v1.1 (`config.json` + `model.safetensors`, or
shards listed in `model.safetensors.index.json`). Every tensor is
checked against the model that the translated config builds (names, shapes, nothing missing,
nothing left over) before anything is written. Tensors are then read, transposed and cast
one at a time while Orbax writes the checkpoint (leafwise.py: each HF tensor is one piece
of a jaxmoe array, one expert of [E, ...] or one layer of a scanned [L, ...] stack), so the
conversion holds about one tensor in RAM; it is written, with the tokenizer files
(tokenizer_files.py), in a staging directory renamed to DST at the end (staging.py). PyTorch
pickle files (`*.bin`) are refused: unpickling runs code from the file. Shard names from the
index pass `safe_paths.resolve_inside`: reading never leaves SRC.
"""

import json
import logging
import math
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxmoe.checkpoints.dtypes import output_dtype
from jaxmoe.checkpoints.finite import check_finite
from jaxmoe.checkpoints.leafwise import LazyArray, save_params_leafwise
from jaxmoe.checkpoints.manager import CheckpointError
from jaxmoe.checkpoints.safe_paths import resolve_inside
from jaxmoe.checkpoints.staging import refuse_existing, staged_directory
from jaxmoe.checkpoints.tokenizer_item import TOKENIZER_DIR, check_tokenizer_fits
from jaxmoe.checkpoints.trees import flatten, unflatten
from jaxmoe.config.loading import override_keys, with_overrides
from jaxmoe.config.schema import JobConfig
from jaxmoe.conversions.hf.names import ImportPlan, TensorMap, import_plan
from jaxmoe.conversions.hf.names_deepseek import DEEPSEEK_FAMILIES, deepseek_plan
from jaxmoe.conversions.hf.names_gpt_oss import MODEL_TYPE as GPT_OSS
from jaxmoe.conversions.hf.names_gpt_oss import gpt_oss_plan
from jaxmoe.conversions.hf.tokenizer_files import keep_tokenizer_files, kept_tokenizer
from jaxmoe.data.options import DataOptions
from jaxmoe.data.tokenizer import open_tokenizer
from jaxmoe.models.options import ModelOptions
from jaxmoe.models.spec import abstract_params
from jaxmoe.models.stack import stack_layers, stacked_location, unrolled_config
from jaxmoe.storage.received import JSON_LIMIT, check_file, read_text

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_NUMPY_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}


class SafetensorsFolder:
    """The tensors of an HF checkpoint directory, read lazily one at a time."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        if not self.root.is_dir():
            raise CheckpointError(f"{root}: no such checkpoint directory")
        self._headers: dict[Path, dict] = {}  # file -> {tensor name: dtype, shape, offsets}
        self._data_start: dict[Path, int] = {}
        self._file_of: dict[str, Path] = {}
        files, weight_map = self._files()
        for file in files:
            self._open(file)
        for name, file_name in weight_map.items():
            file = self._file_of.get(name)
            if file is None or file != resolve_inside(self.root, file_name):
                raise CheckpointError(f"{INDEX_FILE}: tensor {name} is not in {file_name}")

    def _files(self) -> tuple[list[Path], dict[str, str]]:
        """(files to read, the index's name -> file map or {} without an index). Where both
        a model.safetensors and an index are present, transformers loads the single file:
        so does this, saying so (the index's shards may hold other weights)."""
        index = self.root / INDEX_FILE
        if os.path.lexists(index) and os.path.lexists(self.root / SINGLE_FILE):
            log.warning(
                "%s: both %s and %s; reading %s, as transformers does (the index and its "
                "shards are not read)", self.root, SINGLE_FILE, INDEX_FILE, SINGLE_FILE
            )  # fmt: skip
            return [self._inside(SINGLE_FILE)], {}
        if os.path.lexists(index):
            weight_map = _read_index(index)
            files = []
            for name in sorted(set(weight_map.values())):
                try:
                    file = resolve_inside(self.root, name)
                except ValueError as error:
                    raise CheckpointError(f"{index}: shard {error}") from None
                if not file.exists():
                    raise CheckpointError(f"{index}: shard file {name!r} is missing")
                files.append(file)
            return files, weight_map
        if os.path.lexists(self.root / SINGLE_FILE):  # a FIFO or a folder: _open says so
            return [self._inside(SINGLE_FILE)], {}
        found = sorted(self.root.glob("*.safetensors"))
        if len(found) == 1:
            return [self._inside(found[0].name)], {}
        if found:
            raise CheckpointError(
                f"{self.root}: {len(found)} .safetensors files but no {INDEX_FILE} naming them"
            )
        pickles = sorted(p.name for p in self.root.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(
                f"{self.root}: only PyTorch pickle files ({', '.join(pickles[:3])}); jaxmoe "
                "never unpickles external data: re-save with "
                "save_pretrained(..., safe_serialization=True)"
            )
        raise CheckpointError(f"{self.root}: no model.safetensors or {INDEX_FILE}")

    def _inside(self, name: str) -> Path:
        """`root/name` resolved; a symlink leading out of the checkpoint is refused, exactly
        as a shard name from the index is."""
        try:
            return resolve_inside(self.root, name)
        except ValueError as error:
            raise CheckpointError(f"{self.root}: {error}") from None

    def _open(self, file: Path) -> None:
        _check_safetensors_size(file)
        # safe_open validates the file: header, dtypes, and offsets that tile the data
        # section exactly (a truncated file fails here).
        try:
            with safe_open(str(file), framework="numpy") as handle:
                names = handle.keys()
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"{file}: not a readable safetensors file: {error}") from None
        # Tensors are then read through np.memmap at their offsets: safetensors' numpy
        # reader copies every tensor into RAM and cannot decode bf16.
        with open(file, "rb") as f:
            (header_size,) = struct.unpack("<Q", f.read(8))
            self._headers[file] = json.loads(f.read(header_size))
        self._data_start[file] = 8 + header_size
        for name in names:
            if name in self._file_of:
                raise CheckpointError(
                    f"tensor {name} is in both {self._file_of[name].name} and {file.name}"
                )
            self._file_of[name] = file

    @property
    def names(self) -> list[str]:
        return sorted(self._file_of)

    def file(self, name: str) -> Path:
        return self._file_of[name]

    def _entry(self, name: str) -> dict:
        return self._headers[self._file_of[name]][name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)["shape"])

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` as float32: a read-only view of the file when it is float32 already
        (no copy in RAM), else one converted copy."""
        file, entry = self._file_of[name], self._entry(name)
        dtype = _NUMPY_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"tensor {name} in {file.name} has dtype {entry['dtype']}")
        shape = tuple(entry["shape"])
        count = math.prod(shape)
        if count == 0:
            return np.zeros(shape, np.float32)
        offset = self._data_start[file] + entry["data_offsets"][0]
        view = np.memmap(file, dtype=dtype, mode="r", offset=offset, shape=(count,))
        return view.reshape(shape).astype(np.float32, copy=False)


def _check_safetensors_size(file: Path) -> None:
    """CheckpointError unless safetensors `file` is a regular file exactly as long as its
    header says: safe_open maps the whole file into memory first, so a FIFO would block it
    and a valid file followed by 20 GB of sparse zeros fill the memory."""
    try:
        size = check_file(file, "safetensors file")
    except ValueError as error:
        raise CheckpointError(str(error)) from None
    try:
        with open(file, "rb") as f:
            (header_size,) = struct.unpack("<Q", f.read(8))
            if header_size > min(size, JSON_LIMIT):
                return  # safe_open refuses such a header itself, naming the problem
            header = json.loads(f.read(header_size))
        end = max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__")
        expected = 8 + header_size + int(end)
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError, struct.error):
        return  # likewise a header that is not one
    if size != expected:
        raise CheckpointError(
            f"{file}: {size:,} bytes, but its header describes {expected:,} (a file "
            f"truncated, or with data past its tensors)"
        )


def _read_index(path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(read_text(path, INDEX_FILE))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{path}: not a safetensors index ({error})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: not a safetensors index (nested too deeply)") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{path}: weight_map must map tensor names to file names")
    return weight_map


def read_hf_config(root: Path) -> dict:
    path = root / "config.json"
    try:
        resolve_inside(root, "config.json")
    except ValueError as error:
        raise CheckpointError(f"{root}: {error}") from None
    try:
        config = json.loads(read_text(path, "config.json"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (an HF checkpoint carries its config)") from None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable JSON ({error})") from None
    except RecursionError:  # json recurses per nesting level: 10**5 `[` exhaust the stack
        raise CheckpointError(f"{path}: unreadable JSON (nested too deeply)") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return config


def _listing(names: list[str], limit: int = 8) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_plan(plan: ImportPlan, leaves: dict, folder: SafetensorsFolder) -> None:
    """Every HF tensor used exactly as the model expects; one-line CheckpointErrors."""
    present = set(folder.names)
    mapped = {m.hf_name for m in plan.maps}
    missing = sorted(mapped - present)
    unknown = sorted(
        n for n in present - mapped - plan.tied_copies.keys() if not plan.is_ignored(n)
    )
    problems = []
    if missing:
        problems.append(f"{len(missing)} expected tensor(s) missing: {_listing(missing)}")
    if unknown:
        problems.append(f"{len(unknown)} unknown tensor(s): {_listing(unknown)}")
    if problems:
        raise CheckpointError(f"{folder.root}: " + "; ".join(problems))
    for m in plan.maps:
        if m.path not in leaves:
            raise CheckpointError(
                f"tensor {m.hf_name} maps to jaxmoe {'.'.join(m.path)}, which the model "
                "config does not have (a --config override changed the architecture?)"
            )
        leaf_shape = tuple(leaves[m.path].shape)
        expected, actual = m.hf_shape(leaf_shape), folder.shape(m.hf_name)
        if expected != actual:
            raise CheckpointError(
                f"tensor {m.hf_name} in {folder.file(m.hf_name).name} has shape {actual}, but "
                f"config.json implies {expected} (jaxmoe {'.'.join(m.path)} {leaf_shape})"
            )
    for copy, source in plan.tied_copies.items():
        if folder.shape(copy) != folder.shape(source):
            raise CheckpointError(
                f"tensor {copy} has shape {folder.shape(copy)}, but its source {source} "
                f"has {folder.shape(source)}"
            )
    check_coverage(plan, leaves, what="gets no value from the checkpoint")


def check_coverage(plan: ImportPlan, leaves: dict, what: str) -> None:
    """Every jaxmoe parameter is mapped (whole, or every expert slice), else `... {what}`."""
    whole = {m.path for m in plan.maps if m.expert is None}
    experts: dict[tuple[str, ...], set[int]] = {}
    for m in plan.maps:
        if m.expert is not None:
            experts.setdefault(m.path, set()).add(m.expert)
    for path, leaf in leaves.items():
        if path in whole or experts.get(path) == set(range(leaf.shape[0])):
            continue
        raise CheckpointError(f"jaxmoe parameter {'.'.join(path)} {what}")


def _finite(folder: SafetensorsFolder, name: str) -> np.ndarray:
    """Tensor `name`, refused if any value is NaN or infinite (finite.py)."""
    return check_finite(folder.read(name), f"tensor {name} in {folder.file(name).name}")


def _lazy_leaves(plan: ImportPlan, leaves: dict, folder, dtype: np.dtype, m) -> dict:
    """The checkpoint's parameters in the layout model config `m` restores (stacked for
    `scan_layers`), each a LazyArray whose pieces are the HF tensors mapped to it."""
    stacked = m.scan_layers
    pieces: dict[tuple[str, ...], list[tuple[tuple[int, ...], TensorMap]]] = {}
    for t in plan.maps:
        path, row = stacked_location(t.path, m) if stacked else (t.path, None)
        index = tuple(i for i in (row, t.expert) if i is not None)
        pieces.setdefault(path, []).append((index, t))
    stored = flatten(stack_layers(unflatten(leaves), m)) if stacked else leaves

    def produce(items):
        for index, t in sorted(items, key=lambda item: item[0]):
            # No name keeps the source tensor alive while the next one is read.
            shape = t.slot_shape(leaves[t.path].shape)
            yield index, t.layout.to_jaxmoe(_finite(folder, t.hf_name), shape)

    return unflatten(
        {
            path: LazyArray(
                tuple(leaf.shape),
                dtype,
                depth=len(pieces[path][0][0]),
                pieces=lambda items=pieces[path]: produce(items),
            )
            for path, leaf in stored.items()
        }
    )


def _check_tied_copies(plan: ImportPlan, folder) -> None:
    for copy, source in plan.tied_copies.items():
        if not np.array_equal(folder.read(copy), folder.read(source)):
            raise CheckpointError(
                f"tensor {copy} differs from {source}; jaxmoe shares one embedding table"
            )


def _regated_up_to_checkpoint_k(model: ModelOptions, set_keys: list[str]) -> ModelOptions:
    """A checkpoint re-gated to `adaptive_k` or `top_p` without a `max_k` of the user's own
    may use as many experts per token as it was trained with (the plan's `top_k`), not the
    key's default of 2: re-gating a top-8 Qwen3-MoE keeps up to 8 slots."""
    gate = model.moe.gate
    regated = "model.moe.gating" in set_keys and gate.gating in ("adaptive_k", "top_p")
    if regated and "model.moe.max_k" not in set_keys and gate.top_k > 0:
        return model.replace(moe=model.moe.replace(max_k=gate.top_k))
    return model


def convert_hf(
    src_dir: str | os.PathLike, dst_dir: str | os.PathLike, dtype: str = "float32", overrides=()
) -> JobConfig:
    """Converts the HF checkpoint in `src_dir` into a new jaxmoe checkpoint directory
    `dst_dir` (parameters in `dtype` + the full config, with `--config.KEY=VALUE` style
    `overrides` applied, e.g. data.tokenizer). Returns that config."""
    out_dtype = output_dtype(dtype)
    src, dst = Path(src_dir), refuse_existing(dst_dir)
    folder = SafetensorsFolder(src)
    hf_config = read_hf_config(src)
    plan_of = gpt_oss_plan if hf_config.get("model_type") == GPT_OSS else import_plan
    if hf_config.get("model_type") in DEEPSEEK_FAMILIES:  # names_deepseek builds on names
        plan_of = deepseek_plan
    model, plan = plan_of(hf_config, set(folder.names))
    kept = kept_tokenizer(src)  # the copy made below, if any
    copied = str(dst / kept) if kept else ""
    config = with_overrides(JobConfig(model=model, data=DataOptions(tokenizer=copied)), overrides)
    model = _regated_up_to_checkpoint_k(config.model, override_keys(overrides))
    config = config.replace(model=model)
    if kept and config.data.tokenizer == copied:
        # Stored relative to DST: it moves with the checkpoint.
        config = config.replace(data=config.data.replace(tokenizer=kept))
    if kept and config.data.tokenizer == kept:  # the copy made below: checked before any work
        own = src if kept == TOKENIZER_DIR else src / "tokenizer.model"
        check_tokenizer_fits(open_tokenizer(str(own)), config.model.vocab_size, f"{own}")
    leaves = flatten(abstract_params(unrolled_config(config.model)))
    check_plan(plan, leaves, folder)
    _check_tied_copies(plan, folder)
    with staged_directory(dst) as staging:  # DST never holds half a checkpoint
        params = _lazy_leaves(plan, leaves, folder, out_dtype, config.model)
        save_params_leafwise(str(staging), params, config)
        if config.data.tokenizer == kept:  # else the named one, copied in with the config
            keep_tokenizer_files(src, staging)
    return config
