"""The one table that maps logical axis names to mesh axes, and the shardings it gives.

Parameters are created with logical names (layers.make_param); `param_specs` and `named` turn
the names into NamedShardings for a given mesh. A mesh axis that does not divide a dimension is
dropped for that dimension (e.g. 2 KV heads on a tensor axis of 4 stay replicated), so any
mesh can hold any model, at worst with some replication.
"""

import math
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxmoe.errors import ConfigError

# Logical axis -> mesh axes, in order of preference. The batch is split over every axis that
# does not split weights along it, so expert-parallel devices also share the dense layers' work.
DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp", "expert"),
    # The context axis splits each sequence (models/context_parallel.py); its devices hold
    # the same rows of the batch.
    "length": ("context",),
    "vocab": ("tensor",),
    # The expert axis splits the batch too, so it also shards dense weights (ZeRO-3 over
    # fsdp x expert): each chip stores 1 / (fsdp * expert) of them, not 1 / fsdp. Expert
    # weights already use it for their expert dim, so their embed dim stays on fsdp. The
    # context axis shards them as well (its devices hold one sequence's chunks: ZeRO-3 over
    # fsdp x context x expert, as MaxText shards weights over its context axis).
    "embed": ("fsdp", "context", "expert"),
    "mlp": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    # MLA's compressed query / key-value latent (models/mla.py): the input dim of the up
    # projections [latent, heads, head_dim], which have no embed dim for fsdp to shard
    # (DeepSeek-V3: 218 MB of f32 per layer, on every chip when this rule was empty). The
    # down projections' embed dim takes these axes first, leaving their latent dim whole.
    "latent": ("fsdp", "context", "expert"),
    "norm": (),
    "expert": ("expert",),
    "expert_mlp": ("tensor",),
    "relpos_buckets": (),
    "layers": (),  # the stacked axis of a scanned layer stack: every device holds all rows
}


def logical_to_spec(
    axes: Sequence[str | None],
    shape: Sequence[int],
    mesh_sizes: Mapping[str, int],
    rules: Mapping[str, Sequence[str]] = DEFAULT_RULES,
) -> PartitionSpec:
    """PartitionSpec for a tensor with logical `axes`; each mesh axis is used at most once."""
    used: set[str] = set()
    spec: list[str | tuple[str, ...] | None] = []
    for name, dim in zip(axes, shape, strict=True):
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise ConfigError(f"no sharding rule for logical axis {name!r}")
        chosen, size = [], 1
        for mesh_axis in rules[name]:
            axis_size = mesh_sizes.get(mesh_axis, 1)
            if mesh_axis in used or axis_size == 1 or dim % (size * axis_size):
                continue
            chosen.append(mesh_axis)
            size *= axis_size
        used.update(chosen)
        spec.append(tuple(chosen) if len(chosen) > 1 else (chosen[0] if chosen else None))
    return PartitionSpec(*spec)


def _is_variable(x) -> bool:
    from flax import nnx

    return isinstance(x, nnx.Variable)


def param_specs(abstract_state, mesh: Mesh, rules=DEFAULT_RULES):
    """PartitionSpecs for an nnx State of abstract Params (each with `axes` metadata)."""
    sizes = dict(mesh.shape)

    def spec(variable):
        axes = variable.get_metadata().get("axes")
        shape = variable.get_value().shape
        if axes is None:
            return PartitionSpec()
        return logical_to_spec(axes, shape, sizes, rules)

    return jax.tree.map(spec, abstract_state, is_leaf=_is_variable)


def named(mesh: Mesh, specs):
    """NamedShardings for a pytree of PartitionSpecs."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def batch_spec(mesh: Mesh, ndim: int, batch_size: int, rules=DEFAULT_RULES) -> PartitionSpec:
    """Activation/batch spec: dim 0 over the batch axes, the rest replicated."""
    names = ("batch",) + (None,) * (ndim - 1)
    shape = (batch_size,) + (1,) * (ndim - 1)
    return logical_to_spec(names, shape, dict(mesh.shape), rules)


def data_parallel_size(mesh: Mesh, rules=DEFAULT_RULES) -> int:
    return math.prod(mesh.shape[a] for a in rules["batch"])


def strict_param_check(spec, mesh: Mesh, rules=DEFAULT_RULES) -> None:
    """Refuse a mesh whose axes do not divide the tensors they are meant to split.

    Training tolerates this by replicating; evaluation on a user-chosen mesh reports it,
    since the user asked for a layout that cannot be laid out.
    """
    sizes = dict(mesh.shape)
    for path, leaf in jax.tree_util.tree_flatten_with_path(spec.param_axes)[0]:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        for axis_name, dim in zip(leaf.axes or (None,) * len(leaf.shape), leaf.shape, strict=True):
            for mesh_axis in rules.get(axis_name, ()) if axis_name else ():
                if sizes.get(mesh_axis, 1) > 1 and dim % sizes[mesh_axis]:
                    raise ConfigError(
                        f"mesh.{mesh_axis}={sizes[mesh_axis]} does not divide tensor {name} "
                        f"(dim {axis_name!r} of size {dim}, shape {tuple(leaf.shape)})"
                    )


def constrain_batch(x):
    """Pin an activation's dim 0 to the batch axes of the current mesh (no-op without one),
    and a [B, L, ...] activation's dim 1 to the context axis (`length`).

    Without it, under FSDP XLA may shard activations along `embed` like the weights, and
    every device then holds the whole batch's activations.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return x
    names = ("batch",) + (None,) * (x.ndim - 1)
    if x.ndim >= 3:
        names = ("batch", "length") + (None,) * (x.ndim - 2)
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, x.shape, dict(mesh.shape)))
