"""`jaxmoe export hf CKPT DST`: a jaxmoe checkpoint -> `config.json` + `model.safetensors`,
plus the tokenizer files and `generation_config.json` (tokenizer_files.py) when the
checkpoint names its tokenizer (`data.tokenizer`) or `--tokenizer FILE` is given.

Only models that Hugging Face transformers can express exactly are written: dense decoders
(as Llama, or as Qwen2 with q/k/v biases), decoders with an MoE FFN in every layer (as
Mixtral when routed top-k with renormalised weights; other gates, adaptive and top-p
included, as `jaxmoe_moe` with a modeling file for `trust_remote_code`: remote.py), and
multi-head T5 v1.1 encoder-decoders. Anything else (`moe.every` > 1, a token capacity, GQA
in T5...) is refused with a one-line reason.
"""

import json
import struct
from pathlib import Path

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxmoe.checkpoints.dtypes import output_dtype
from jaxmoe.checkpoints.hf.importer import SINGLE_FILE, check_coverage
from jaxmoe.checkpoints.hf.names import ImportPlan, TensorMap, export_plan
from jaxmoe.checkpoints.hf.remote import write_modeling_file
from jaxmoe.checkpoints.hf.tokenizer_files import export_tokenizer
from jaxmoe.checkpoints.manager import CheckpointError, read_config, restore_params
from jaxmoe.checkpoints.trees import flatten, unflatten
from jaxmoe.models.spec import abstract_params
from jaxmoe.models.stack import unrolled_config
from jaxmoe.storage.paths import absolute_path

_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16"}


def _hf_tensor(params: dict, m: TensorMap, dtype: np.dtype) -> np.ndarray:
    value = np.asarray(params[m.path])
    if m.expert is not None:
        value = value[m.expert]
    return np.ascontiguousarray(m.layout.to_hf(value).astype(dtype))


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
            f.write(tensor.tobytes())


def export_hf(
    ckpt_path: str, dst_dir: str, dtype: str = "float32", tokenizer: str | None = None
) -> dict:
    """Writes the model of jaxmoe checkpoint `ckpt_path` as an HF checkpoint in `dst_dir`
    (`config.json` + `model.safetensors`, tensors in `dtype`; the tokenizer `tokenizer`,
    default the checkpoint's `data.tokenizer`, if any). Returns the HF config."""
    out_dtype = output_dtype(dtype)
    config = read_config(ckpt_path)
    m = config.model
    seq_len = config.get("train", {}).get("seq_len", 0) or 0
    hf_config, maps = export_plan(m, max_positions=max(2048, seq_len, m.get("max_len", 0)))
    leaves = flatten(abstract_params(unrolled_config(m)))
    check_coverage(ImportPlan(maps), leaves, what="has no Hugging Face counterpart")
    dst = Path(dst_dir)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(f"{dst}: already exists; exporting writes a new directory")
    # Restore on the host: exporting never needs an accelerator.
    host = SingleDeviceSharding(jax.devices("cpu")[0])
    abstract = unflatten(
        {p: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=host) for p, a in leaves.items()}
    )
    params = flatten(restore_params(ckpt_path, abstract, m))  # per-layer paths
    by_name = {t.hf_name: t for t in maps}
    shapes = {t.hf_name: t.hf_shape(leaves[t.path].shape) for t in maps}
    dst.mkdir(parents=True, exist_ok=True)
    write_safetensors(
        dst / SINGLE_FILE, shapes, dtype, lambda name: _hf_tensor(params, by_name[name], out_dtype)
    )
    hf_config |= {"dtype": dtype, "torch_dtype": dtype}  # transformers 5.x / 4.x spellings
    hf_config |= export_tokenizer(config, dst, absolute_path(tokenizer) if tokenizer else None)
    (dst / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    write_modeling_file(hf_config, dst)
    return hf_config
