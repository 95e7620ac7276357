"""`jaxmoe export hf CKPT DST`: a jaxmoe checkpoint -> `config.json` + `model.safetensors`
(or, past `--max_shard_size`, shards `model-0000i-of-0000n.safetensors` listed in
`model.safetensors.index.json`), plus the tokenizer files and `generation_config.json`
(tokenizer_files.py) when the checkpoint names its tokenizer (`data.tokenizer`) or
`--tokenizer FILE` is given.

Tensors stream: each HF tensor is read from the checkpoint on its own (one layer of a
scanned stack, one expert: leafwise.StoredParams), converted and written before the next
is read, so host memory holds about one tensor whatever the model's size. DST appears only
once complete (staging.py).

Only models that Hugging Face transformers can express exactly are written: dense decoders
(as Llama, or as Qwen2 with q/k/v biases), decoders with an MoE FFN in every layer (as
Mixtral when routed top-k with renormalised weights; other gates, adaptive and top-p
included, as `jaxmoe_moe` with a modeling file for `trust_remote_code`: remote.py), MoE
decoders with q/k norms or a shared expert (dense layers among them too) as Qwen3-MoE,
OLMoE or Qwen2-MoE (export_moe.py), and multi-head T5 v1.1 encoder-decoders. Anything else
(dense layers in a Mixtral, a token capacity, GQA in T5...) is refused with a one-line
reason.
"""

import json
import re
import struct
from pathlib import Path

import numpy as np

from jaxmoe.checkpoints.dtypes import output_dtype
from jaxmoe.checkpoints.leafwise import Index, StoredParams
from jaxmoe.checkpoints.manager import CheckpointError, check_params_match
from jaxmoe.checkpoints.staging import staged_directory
from jaxmoe.checkpoints.trees import flatten, unflatten
from jaxmoe.config.stored import read_config
from jaxmoe.conversions.choices import DEFAULT_MAX_SHARD_SIZE
from jaxmoe.conversions.hf.export_config import export_plan
from jaxmoe.conversions.hf.importer import INDEX_FILE, SINGLE_FILE, check_coverage
from jaxmoe.conversions.hf.names import ImportPlan, TensorMap
from jaxmoe.conversions.hf.remote import write_modeling_file
from jaxmoe.conversions.hf.tokenizer_files import export_tokenizer
from jaxmoe.models.spec import abstract_params
from jaxmoe.models.stack import stack_layers, stacked_location, unrolled_config
from jaxmoe.storage.paths import absolute_path

_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16"}
SHARD_FILE = "model-{:05d}-of-{:05d}.safetensors"  # save_pretrained's shard names
# Decimal and binary units, as save_pretrained's max_shard_size reads them.
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes of a size such as 5GB, 500MB, 2GiB or 1000000."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and _UNITS.get(match.group(2).upper())
    if not unit or float(match.group(1)) * unit < 1:
        raise CheckpointError(
            f"--max_shard_size={text!r}: expected a positive size such as 5GB, 500MB or 2GiB"
        )
    return int(float(match.group(1)) * unit)


def plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Tensor names in order, grouped into files of at most `max_bytes` (a tensor larger
    than that gets a file of its own)."""
    shards: list[list[str]] = []
    used = 0
    for name, size in sizes.items():
        if not shards or used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _stored_layout(stored: StoredParams, leaves: dict, m) -> bool:
    """Whether the checkpoint keeps its layers stacked (scanned layout), whichever layout
    `model.scan_layers` names; one CheckpointError when it fits neither."""
    per_layer = unflatten(leaves)
    if set(flatten(per_layer)) == stored.paths:  # unrolled (irregular dense/MoE placements
        check_params_match(stored.step_dir, per_layer)  # other than a dense prefix never stack)
        return False
    try:
        stacked = stack_layers(per_layer, m)
    except ValueError:  # periods of different layer kinds: only the per-layer layout exists
        stacked = None
    if stacked is not None and set(flatten(stacked)) == stored.paths:
        check_params_match(stored.step_dir, stacked)  # shapes too
        return True
    check_params_match(stored.step_dir, stacked if m.scan_layers and stacked else per_layer)
    raise CheckpointError(f"checkpoint {str(stored.step_dir)!r}: parameters do not match")


def _location(t: TensorMap, m, stacked: bool) -> tuple[tuple[str, ...], Index]:
    """(stored path, index over its leading axes) of the slice that HF tensor `t` is."""
    path, row = stacked_location(t.path, m) if stacked else (t.path, None)
    return path, tuple(i for i in (row, t.expert) if i is not None)


def _hf_tensor(stored: StoredParams, t: TensorMap, m, stacked: bool, dtype) -> np.ndarray:
    value = stored.read(*_location(t, m, stacked))
    if hasattr(t.layout, "to_hf_pair"):  # one HF tensor packs two (GPT-OSS gate_up_proj)
        partner = TensorMap(t.hf_name, (*t.path[:-1], t.layout.partner), t.layout, t.expert)
        packed = t.layout.to_hf_pair(value, stored.read(*_location(partner, m, stacked)))
        return np.array(packed, dtype=dtype, order="C")
    return np.array(t.layout.to_hf(value), dtype=dtype, order="C")  # one copy


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], dtype: str, produce):
    """Streams tensors into a safetensors file: the header is laid out from `shapes` first,
    then `produce(name)` is called for one tensor at a time, in header order.

    Format: little-endian u64 header size, JSON header (space-padded to 8 bytes) mapping
    each name to dtype, shape and [begin, end) byte offsets into the data that follows.
    """
    itemsize = np.dtype(output_dtype(dtype)).itemsize
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape, dtype=np.int64)) * itemsize
        entry = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape)}
        header[name] = entry | {"data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape in shapes.items():
            tensor = produce(name)
            if tensor.shape != tuple(shape):
                raise CheckpointError(f"tensor {name}: produced {tensor.shape}, header {shape}")
            f.write(memoryview(tensor.reshape(-1).view(np.uint8)))  # no bytes copy


def write_sharded_safetensors(
    dst: Path, shapes: dict[str, tuple[int, ...]], dtype: str, max_bytes: int, produce
) -> list[str]:
    """`model.safetensors`, or shards of at most `max_bytes` listed in an index as
    save_pretrained writes them; tensors streamed from `produce(name)` as in
    `write_safetensors`. Returns the file names."""
    itemsize = output_dtype(dtype).itemsize
    sizes = {name: int(np.prod(shape, dtype=np.int64)) * itemsize for name, shape in shapes.items()}
    shards = plan_shards(sizes, max_bytes)
    if len(shards) == 1:
        write_safetensors(dst / SINGLE_FILE, shapes, dtype, produce)
        return [SINGLE_FILE]
    files = [SHARD_FILE.format(i + 1, len(shards)) for i in range(len(shards))]
    weight_map = {}
    for file, names in zip(files, shards, strict=True):
        write_safetensors(dst / file, {name: shapes[name] for name in names}, dtype, produce)
        weight_map |= dict.fromkeys(names, file)
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (dst / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return files


def export_hf(
    ckpt_path: str,
    dst_dir: str,
    dtype: str = "float32",
    tokenizer: str | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
) -> dict:
    """Writes the model of jaxmoe checkpoint `ckpt_path` as an HF checkpoint in `dst_dir`
    (`config.json` + safetensors files of at most `max_shard_size` bytes, tensors in
    `dtype`; the tokenizer `tokenizer`, default the checkpoint's `data.tokenizer`, if any).
    Returns the HF config."""
    out_dtype = output_dtype(dtype)
    max_bytes = parse_size(max_shard_size)
    config = read_config(ckpt_path, tokenizer=tokenizer is None)  # --tokenizer replaces it
    m = config.model
    hf_config, maps = export_plan(m, max_positions=max(2048, config.train.seq_len, m.max_len))
    leaves = flatten(abstract_params(unrolled_config(m)))
    check_coverage(ImportPlan(maps), leaves, what="has no Hugging Face counterpart")
    dst = Path(dst_dir)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(f"{dst}: already exists; exporting writes a new directory")
    # Read on the host, one tensor at a time: exporting never needs an accelerator.
    stored = StoredParams(ckpt_path)
    stacked = _stored_layout(stored, leaves, m)
    by_name = {t.hf_name: t for t in maps}
    shapes = {t.hf_name: t.hf_shape(leaves[t.path].shape) for t in maps}
    with staged_directory(dst) as staging:  # DST never holds half a checkpoint
        staging.mkdir()
        write_sharded_safetensors(
            staging,
            shapes,
            dtype,
            max_bytes,
            lambda n: _hf_tensor(stored, by_name[n], m, stacked, out_dtype),
        )
        hf_config |= {"dtype": dtype, "torch_dtype": dtype}  # transformers 5.x / 4.x spellings
        hf_config |= export_tokenizer(
            config, staging, absolute_path(tokenizer) if tokenizer else None
        )
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        write_modeling_file(hf_config, staging)
    return hf_config
