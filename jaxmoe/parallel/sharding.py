"""The device mesh and the one table that maps logical axis names to mesh axes.

Parameters are created with logical names (layers.make_param); `param_shardings` turns the
names into NamedShardings for a given mesh. A mesh axis that does not divide a dimension is
dropped for that dimension (e.g. 2 KV heads on a tensor axis of 4 stay replicated), so any
mesh can hold any model, at worst with some replication.
"""

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# Logical axis -> mesh axes, in order of preference. The batch is split over every axis that
# does not split weights along it, so expert-parallel devices also share the dense layers' work.
DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp", "expert"),
    "length": (),
    "vocab": ("tensor",),
    # The expert axis splits the batch too, so it also shards dense weights (ZeRO-3 over
    # fsdp x expert): each chip stores 1 / (fsdp * expert) of them, not 1 / fsdp. Expert
    # weights already use it for their expert dim, so their embed dim stays on fsdp.
    "embed": ("fsdp", "expert"),
    "mlp": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "norm": (),
    "expert": ("expert",),
    "expert_mlp": ("tensor",),
    "relpos_buckets": (),
    "layers": (),  # the stacked axis of a scanned layer stack: every device holds all rows
}


class ConfigError(ValueError):
    """A configuration problem, reported as one line naming the key and the values."""


def mesh_shape(mesh_cfg: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Sizes of the four mesh axes; one axis may be -1 and takes the remaining devices."""
    sizes = {axis: int(mesh_cfg[axis]) for axis in MESH_AXES}
    fill = [axis for axis, size in sizes.items() if size == -1]
    if len(fill) > 1:
        raise ConfigError(f"mesh: only one axis may be -1, got {fill}")
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{axis}={size}: sizes must be positive or -1")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if fill:
        if num_devices % fixed:
            raise ConfigError(
                f"mesh: {num_devices} devices cannot be split with the fixed axes "
                f"{ {a: s for a, s in sizes.items() if s != -1} } (product {fixed})"
            )
        sizes[fill[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ConfigError(
            f"mesh: data*fsdp*tensor*expert = {fixed} but there are {num_devices} devices "
            f"({sizes}); set one axis to -1 to take the remaining devices"
        )
    return sizes


def slice_count(devices: Sequence[jax.Device]) -> int:
    """How many TPU slices `devices` span (1 without `slice_index`: one slice, a GPU or CPU)."""
    return len({getattr(device, "slice_index", 0) for device in devices})


def dcn_shape(mesh_cfg: Mapping[str, int], sizes: Mapping[str, int], num_slices: int):
    """How many slices each mesh axis spans: `mesh.dcn_data` x `mesh.dcn_fsdp` = the slices.

    Only data and fsdp may cross the data-center network: their collectives (a gradient
    all-reduce, parameter all-gathers) tolerate its bandwidth, tensor and expert traffic does
    not. The default (dcn_data=-1, dcn_fsdp=1) joins slices over data, or over fsdp when the
    data axis does not divide by the number of slices.
    """
    dcn = {"data": int(mesh_cfg.get("dcn_data", -1)), "fsdp": int(mesh_cfg.get("dcn_fsdp", 1))}
    if dcn == {"data": -1, "fsdp": 1} and sizes["data"] % num_slices:
        dcn = {"data": 1, "fsdp": -1}
    fill = [axis for axis, size in dcn.items() if size == -1]
    fixed = math.prod(size for size in dcn.values() if size != -1)
    if len(fill) > 1 or fixed < 1 or num_slices % fixed:
        raise ConfigError(
            f"mesh: dcn_data={dcn['data']} x dcn_fsdp={dcn['fsdp']} cannot span "
            f"{num_slices} slices (one of them may be -1: the remaining slices)"
        )
    if fill:
        dcn[fill[0]] = num_slices // fixed
    elif fixed != num_slices:
        raise ConfigError(
            f"mesh: dcn_data={dcn['data']} x dcn_fsdp={dcn['fsdp']} = {fixed}, but the devices "
            f"span {num_slices} slices"
        )
    for axis, count in dcn.items():
        if sizes[axis] % count:
            raise ConfigError(
                f"mesh: {num_slices} slices are joined over mesh.data or mesh.fsdp, but "
                f"mesh.{axis}={sizes[axis]} does not divide by dcn_{axis}={count} ({sizes})"
            )
    return tuple(dcn.get(axis, 1) for axis in MESH_AXES)


def make_mesh(mesh_cfg: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The 4-axis mesh (data, fsdp, tensor, expert) over `devices` (default: all devices).

    The one mesh builder: training, evaluation, decoding and the ahead-of-time compile check
    all call it, so the preflight checks the layout that training runs. On TPU the axes
    follow the torus links; devices of several slices (multislice) are joined over the data
    and fsdp axes only (see `dcn_shape`).
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_shape(mesh_cfg, len(devices))
    shape = tuple(sizes[axis] for axis in MESH_AXES)
    num_slices = slice_count(devices)
    if num_slices > 1:
        dcn = dcn_shape(mesh_cfg, sizes, num_slices)
        ici = tuple(size // count for size, count in zip(shape, dcn, strict=True))
        grid = mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, allow_split_physical_axes=True
        )
    elif devices[0].platform == "tpu":
        try:
            grid = mesh_utils.create_device_mesh(shape, devices)
        except (ValueError, NotImplementedError, AssertionError):
            # Some shapes only map onto the torus by splitting a physical axis.
            grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    else:
        grid = np.array(devices).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(
    axes: Sequence[str | None],
    shape: Sequence[int],
    mesh_sizes: Mapping[str, int],
    rules: Mapping[str, Sequence[str]] = DEFAULT_RULES,
) -> PartitionSpec:
    """PartitionSpec for a tensor with logical `axes`; each mesh axis is used at most once."""
    used: set[str] = set()
    spec = []
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
    """Pin an activation's dim 0 to the batch axes of the current mesh (no-op without one).

    Without it, under FSDP XLA may shard activations along `embed` like the weights, and
    every device then holds the whole batch's activations.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return x
    names = ("batch",) + (None,) * (x.ndim - 1)
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, x.shape, dict(mesh.shape)))
