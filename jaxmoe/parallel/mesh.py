"""The device mesh: five named axes over the devices, slice-aware.

The one mesh builder: training, evaluation, decoding, analysis and the ahead-of-time compile
check all call `make_mesh`, so the preflight checks the layout that training runs.
"""

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxmoe.errors import ConfigError
from jaxmoe.parallel.options import MeshOptions

MESH_AXES = ("data", "fsdp", "context", "tensor", "expert")


def mesh_shape(options: MeshOptions, num_devices: int) -> dict[str, int]:
    """Sizes of the mesh axes; one axis may be -1 and takes the remaining devices."""
    sizes = {axis: getattr(options, axis) for axis in MESH_AXES}
    fill = [axis for axis, size in sizes.items() if size == -1]
    if len(fill) > 1:
        raise ConfigError(f"mesh: only one axis may be -1, got {fill}")
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
            f"mesh: data*fsdp*context*tensor*expert = {fixed} but there are {num_devices} devices "
            f"({sizes}); set one axis to -1 to take the remaining devices"
        )
    return sizes


def slice_count(devices: Sequence[jax.Device]) -> int:
    """How many TPU slices `devices` span (1 without `slice_index`: one slice, a GPU or CPU)."""
    return len({getattr(device, "slice_index", 0) for device in devices})


def dcn_shape(options: MeshOptions, sizes: Mapping[str, int], num_slices: int):
    """How many slices each mesh axis spans: `mesh.dcn_data` x `mesh.dcn_fsdp` = the slices.

    Only data and fsdp may cross the data-center network: their collectives (a gradient
    all-reduce, parameter all-gathers) tolerate its bandwidth, tensor and expert traffic does
    not. The default (dcn_data=-1, dcn_fsdp=1) joins slices over data, or over fsdp when the
    data axis does not divide by the number of slices.
    """
    dcn = {"data": options.dcn_data, "fsdp": options.dcn_fsdp}
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


def make_mesh(
    options: MeshOptions,
    devices: Sequence[jax.Device] | None = None,
    slice_ids: Sequence[int] | None = None,
) -> Mesh:
    """The 5-axis mesh (data, fsdp, context, tensor, expert) over `devices` (default: all devices).

    The one mesh builder: training, evaluation, decoding and the ahead-of-time compile check
    all call it, so the preflight checks the layout that training runs. On TPU the axes
    follow the torus links; devices of several slices (multislice) are joined over the data
    and fsdp axes only (see `dcn_shape`). `slice_ids` names each device's slice where the
    devices do not carry it: a GPU cluster's NVLink domains (aot/gpu_topologies.py).
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_shape(options, len(devices))
    shape = tuple(sizes[axis] for axis in MESH_AXES)
    num_slices = slice_count(devices) if slice_ids is None else len(set(slice_ids))
    if num_slices > 1:
        dcn = dcn_shape(options, sizes, num_slices)
        ici = tuple(size // count for size, count in zip(shape, dcn, strict=True))
        if slice_ids is None:
            grid = mesh_utils.create_hybrid_device_mesh(
                ici, dcn, devices, allow_split_physical_axes=True
            )
        else:
            grid = _slices_grid(ici, dcn, devices, slice_ids)
    elif devices[0].platform == "tpu":
        try:
            grid = mesh_utils.create_device_mesh(shape, devices)
        except (ValueError, NotImplementedError, AssertionError):
            # Some shapes only map onto the torus by splitting a physical axis.
            grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    else:
        grid = np.array(devices).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _slices_grid(ici, dcn, devices, slice_ids) -> np.ndarray:
    """Each slice's devices, in order, laid out as `ici`; the slices laid out as `dcn`
    (as jax's create_hybrid_device_mesh does with slices the devices name themselves)."""
    slices: dict[int, list] = {}
    for device, slice_id in zip(devices, slice_ids, strict=True):
        slices.setdefault(slice_id, []).append(device)
    per_slice = [np.array(members).reshape(ici) for _, members in sorted(slices.items())]
    order = np.arange(len(per_slice)).reshape(dcn)
    blocks = np.vectorize(lambda i: per_slice[i], otypes=[object])(order)
    return np.block(blocks.tolist())
