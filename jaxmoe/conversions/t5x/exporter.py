"""`jaxmoe export t5x CKPT OUT`: a jaxmoe T5.1.1 checkpoint -> T5X checkpoint `OUT/checkpoint_S/`.

An MoE checkpoint (every `moe.every`-th layer sparse, a router and stacked experts) is
written in Flaxformer's MoeLayer layout (Switch Transformer / ST-MoE; moe.py), the inverse
of `convert t5x`; ReLU (ungated `wi`: T5 v1.0, Switch Base) and tied logits (no
`decoder/logits_dense`, the embedding scaled by 1/sqrt(D)) are written as those read them.

Written as T5X's msgpack + TensorStore `Checkpointer.save` writes it from one host:
- `checkpoint`: a flax msgpack file `{'version': 3, 'optimizer': {'state': {'param_states':
  ..., 'step': int32}, 'target': params}}`, keys sorted below `optimizer` (T5X builds the
  tree with jax tree maps, which sort dict keys); arrays inline as flax's ext type 1.
- every array T5X partitions (each parameter, and Adafactor's unfactored second moment `v`)
  is a zarr v2 array in `<'.'-joined name>/` (`target.encoder.layers_0.mlp.wi_0.kernel/`),
  gzip level 1, chunked by T5X's rule, with its TensorStore spec in the msgpack tree
  (`kvstore` a relative `file` path ending in '/'; the fixture's Google-internal `gfile`
  is the same to T5X, which rewrites both).
- the rest is inline in the msgpack file: `step` and the `v_row`/`v_col`/`m` moments, which
  T5X's Adafactor leaves unpartitioned, and the (1,) placeholders of unused moments.
Parameters keep T5X's names and 2-D attention kernels (t5x_convert.t5x_name / t5x_shape);
a GQA model's key/value kernels are `[D, G*dh]` (what `convert t5x` reads back; T5X's own
T5.1.1 has no GQA, so a T5X model restoring them must define it).
The Adafactor state is the checkpoint's own `t5x_adafactor` state when it stores one (e.g.
`convert t5x --keep_optimizer`), its count (plus `optimizer.start_step` for a state that
started fresh) becoming `step`; otherwise T5X's initial state (zeros, factored where
`t5x_adafactor` factors) at step `--step` (default: `source.step`, else 0).
"""

import math
import os
from pathlib import Path

import jax
import msgpack
import numpy as np
import tensorstore as ts

from jaxmoe.checkpoints.dtypes import output_dtype
from jaxmoe.checkpoints.finite import check_finite
from jaxmoe.checkpoints.manager import CheckpointError, resolve_checkpoint
from jaxmoe.checkpoints.safe_paths import resolve_inside
from jaxmoe.checkpoints.staging import staged_directory
from jaxmoe.checkpoints.trees import flatten, unflatten
from jaxmoe.config.stored import read_config
from jaxmoe.conversions.t5x.convert import t5x_name, t5x_shape
from jaxmoe.models.spec import abstract_params
from jaxmoe.models.stack import unrolled_config

T5X_VERSION = 3
_CHUNK_BYTES = 64 << 20  # T5X's desired chunk size
_PLACEHOLDER = np.zeros((1,), np.float32)  # T5X's Adafactor: a moment it does not keep


def chunk_shape(shape: tuple[int, ...], itemsize: int) -> list[int]:
    """T5X's chunking: start from the whole array and, while a chunk holds more than 64 MiB,
    step the largest chunk dimension (the first, on ties) down to its next smaller divisor
    of the array's size along that axis."""
    limit = _CHUNK_BYTES / itemsize
    divisors = [[d for d in range(1, n + 1) if n % d == 0] or [1] for n in shape]
    while math.prod(d[-1] for d in divisors) > limit:
        axis = max(range(len(shape)), key=lambda i: divisors[i][-1])
        divisors[axis].pop()
    return [d[-1] for d in divisors]


def check_exportable(m) -> None:
    """T5X's T5.1.1 (`t5x/examples/t5/network.py`) holds what `convert t5x` converts; refuse
    what it cannot hold, naming the setting."""
    ffn = (m.activation, m.ffn_gated)
    mixed = "Flaxformer's MIXED placement, every moe.every-th layer"
    problems = [
        (m.arch != "encoder_decoder", f"model.arch={m.arch!r} (T5X T5.1.1 is encoder_decoder)"),
        (
            ffn not in (("gelu", True), ("relu", False)),
            f"model.activation={m.activation!r} with model.ffn_gated={m.ffn_gated} (T5.1.1 "
            "and Switch XXL: gated gelu; Switch Base / Large: ungated relu)",
        ),
        (m.moe.num_experts and m.moe.first_dense_layers, f"model.moe.first_dense_layers ({mixed})"),
        (m.moe.num_experts and m.moe.dense_layers, f"model.moe.dense_layers ({mixed})"),
        (not m.relpos_buckets, "model.relpos_buckets=0 (T5 needs a relative-position bias)"),
        (m.qkv_bias, "model.qkv_bias=True (T5 has no biases)"),
    ]
    for bad, why in problems:
        if bad:
            raise CheckpointError(f"export t5x: this checkpoint cannot be a T5X T5.1.1: {why}")


def adafactor_states(ckpt: str, config, shapes: dict, keep: bool):
    """({jaxmoe path: {'m','v','v_col','v_row'}}, step or None): the checkpoint's stored
    `t5x_adafactor` moments when `keep`, else T5X's zero-initialised state."""
    import optax

    from jaxmoe.training.adafactor import t5x_adafactor

    abstract_params_tree = unflatten(
        {path: jax.ShapeDtypeStruct(shape, np.float32) for path, shape in shapes.items()}
    )
    if keep:
        from jaxmoe.checkpoints.manager import restore_opt_state
        from jaxmoe.training.optimizer import make_optimizer

        optimizer, _ = make_optimizer(config.optimizer, config.train.steps)
        host = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
        abstract = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=host),
            jax.eval_shape(optimizer.init, abstract_params_tree),
        )
        state = restore_opt_state(ckpt, abstract)
    else:
        state = jax.eval_shape(t5x_adafactor(1.0).init, abstract_params_tree)
    moments, counts = {}, set()

    def visit(keypath, node):
        if isinstance(node, optax.FactoredState):
            path = tuple(k.key for k in keypath if isinstance(k, jax.tree_util.DictKey))
            arrays = {"v": node.v, "v_col": node.v_col, "v_row": node.v_row}
            if keep:
                arrays = {k: np.asarray(v, np.float32) for k, v in arrays.items()}
                counts.add(int(node.count))
            else:
                arrays = {k: np.zeros(v.shape, np.float32) for k, v in arrays.items()}
            moments[path] = {"m": _PLACEHOLDER, **arrays}
        return node

    jax.tree_util.tree_map_with_path(
        visit, state, is_leaf=lambda node: isinstance(node, optax.FactoredState)
    )
    if set(moments) != set(shapes):
        raise CheckpointError(f"{ckpt}: optimizer state does not cover the parameters")
    if len(counts) > 1:
        raise CheckpointError(f"{ckpt}: Adafactor step counts differ between parameters")
    return moments, (counts.pop() if counts else None)


def _keeps_adafactor(ckpt: str, config) -> bool:
    """Whether the checkpoint stores a momentum-free `t5x_adafactor` state to export."""
    o = config.optimizer
    stored = (resolve_checkpoint(ckpt) / "opt_state").exists()
    return stored and o.name == "t5x_adafactor" and not o.momentum


def export_t5x(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: str = "float32",
    step: int | None = None,
) -> Path:
    """Writes jaxmoe checkpoint `ckpt` as T5X checkpoint `out/checkpoint_<step>/`; returns
    that directory."""
    from jaxmoe.checkpoints.manager import restore_params
    from jaxmoe.models.stack import layer_layouts

    out_dtype = output_dtype(dtype)
    config = read_config(str(ckpt))
    check_exportable(config.model)
    abstract = flatten(abstract_params(unrolled_config(config.model)))  # per-layer paths
    shapes = {path: tuple(leaf.shape) for path, leaf in abstract.items()}
    # An MoE layer's FFN kernels are its stacked experts [E, ...] (`mlp/expert/...`).
    expert = {p: len(s) == 3 and p[2:3] == ("ffn",) for p, s in shapes.items()}
    names = {p: t5x_name(p, expert=expert[p]) for p in shapes}  # raises where T5X has none
    keep = _keeps_adafactor(str(ckpt), config) and not config.model.scan_layers
    moments, count = adafactor_states(str(ckpt), config, shapes, keep)
    if count is not None:
        # A state continued from T5X's (`train.init_optimizer`) counts T5X's steps; a fresh
        # one counts from the run's start, which sits at `optimizer.start_step` of T5X's
        # schedule (T5X then needs `step_offset` = that start for the same decay).
        offset = 0 if config.train.init_optimizer else config.optimizer.start_step
        if step is not None and step != count + offset:
            raise CheckpointError(
                f"--step={step} but the checkpoint's Adafactor state is at step {count + offset}"
            )
        step = count + offset
    elif step is None:
        source = config.extra.get("source")  # convert t5x's
        step = source["step"] if source else 0

    out = Path(out).absolute()
    final = out / f"checkpoint_{int(step)}"
    if final.exists():
        raise CheckpointError(f"{final}: already exists; exporting writes a new checkpoint")
    host = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    abstract = unflatten(
        {p: jax.ShapeDtypeStruct(s, np.float32, sharding=host) for p, s in shapes.items()}
    )
    params = restore_params(str(ckpt), abstract, layer_layouts(config.model))

    with staged_directory(final) as staging:  # `final` never holds half a checkpoint
        staging.mkdir()
        writer = _ArrayWriter(staging)
        target, param_states = {}, {}
        for path, shape in shapes.items():
            name = names[path]
            value = check_finite(_leaf(params, path), f"{ckpt}: parameter {'.'.join(path)}")
            value = value.reshape(t5x_shape(path, shape)).astype(out_dtype)
            target[tuple(name.split("/"))] = writer.write(f"target/{name}", value)
            for key, moment in moments[path].items():
                keys = (*name.split("/"), key)
                # T5X partitions (writes to TensorStore) only an unfactored `v`.
                if key == "v" and moment.shape != (1,):
                    moment = writer.write(f"state/param_states/{name}/v", moment)
                param_states[keys] = moment
        state = {
            "param_states": _sorted(unflatten(param_states)),
            "step": np.asarray(int(step), np.int32),
        }
        tree = {
            "version": T5X_VERSION,
            "optimizer": {"state": state, "target": _sorted(unflatten(target))},
        }
        (staging / "checkpoint").write_bytes(msgpack.packb(tree, default=_flax_ext))
    return final


class _ArrayWriter:
    """Writes arrays as T5X's TensorStore leaves in one checkpoint directory."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.context = ts.Context({"file_io_concurrency": {"limit": 128}})

    def write(self, name: str, array: np.ndarray) -> dict:
        """Writes `array` under T5X's name for it; returns the spec T5X stores for it."""
        relative = name.replace("/", ".")
        spec = {
            "driver": "zarr",
            "dtype": array.dtype.name,
            "kvstore": {"driver": "file", "path": relative},
            "metadata": {
                "compressor": {"id": "gzip"},
                "shape": list(array.shape),
                "chunks": chunk_shape(array.shape, array.dtype.itemsize),
            },
        }
        absolute = dict(
            spec, kvstore={"driver": "file", "path": str(resolve_inside(self.directory, relative))}
        )
        store = ts.open(absolute, create=True, context=self.context).result()
        store.write(array).result()
        return ts.Spec(spec).to_json()  # as T5X stores it: normalised, path ending in '/'


def _flax_ext(value):
    """flax's msgpack encoding of a numpy array (what T5X's `serialization.to_bytes` gives):
    ext type 1 holding msgpack `[shape, dtype name, C-order bytes]`. Packed here because
    recent flax sorts the top-level keys, where T5X's files have `version` first."""
    if isinstance(value, np.ndarray):
        payload = msgpack.packb([list(value.shape), value.dtype.name, value.tobytes()])
        return msgpack.ExtType(1, payload)
    raise TypeError(f"no T5X msgpack encoding for {type(value).__name__}")


def _leaf(params: dict, path: tuple[str, ...]) -> np.ndarray:
    node = params
    for key in path:
        node = node[key]
    return np.asarray(node)


def _sorted(node):
    return {k: _sorted(node[k]) for k in sorted(node)} if isinstance(node, dict) else node
