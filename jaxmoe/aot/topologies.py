"""TPU topologies by name and their compile-only devices (chip facts: parallel/chips.py);
`parse_target` and `target_devices` also take the GPU clusters of gpu_topologies.py.

`v5p-128` counts TensorCores the way Cloud TPU names do: a v4 or v5p chip has two cores run
as one device (megacore), so v5p-128 is 64 chips in a 4x4x4 torus; a v5e or v6e chip has one
core, so v6e-256 is 256 chips in a 16x16 grid. An explicit shape such as `v5p:4x4x8` also
works. The devices come from libtpu (the `tpu` extra) and need no TPU: they exist only to
compile for.
"""

import math
import os
from dataclasses import dataclass

from jaxmoe.aot.gpu_topologies import (
    GpuTopology,
    gpu_topology_devices,
    is_gpu_topology,
    nvlink_domains,
    parse_gpu_topology,
)
from jaxmoe.parallel.chips import CHIPS, GPUS, Chip

ALIASES = {"v5litepod": "v5e", "v5lite": "v5e"}


@dataclass(frozen=True)
class Topology:
    """One or more identical slices of `chip` chips laid out as `shape`."""

    name: str  # accelerator type of one slice, e.g. v5p-128
    chip: Chip
    shape: tuple[int, ...]  # chips per torus/grid dimension of one slice
    num_slices: int = 1

    platform = "tpu"

    @property
    def hbm_bytes(self) -> int:
        return self.chip.hbm_bytes

    @property
    def peak_bf16_flops(self) -> float:
        return self.chip.peak_bf16_flops

    @property
    def device_topology(self) -> str:
        return self.libtpu_name

    @property
    def chips_per_slice(self) -> int:
        return math.prod(self.shape)

    @property
    def num_chips(self) -> int:
        return self.chips_per_slice * self.num_slices

    @property
    def libtpu_name(self) -> str:
        return f"{self.chip.libtpu_prefix}:{'x'.join(map(str, self.shape))}"

    @property
    def wrap(self) -> tuple[bool, ...]:
        """Wraparound links: 3-D slices of whole 4x4x4 cubes, and the full 16x16 2-D pod."""
        if self.chip.ndim == 3:
            cubes = self.chips_per_slice >= 64 and all(d % 4 == 0 for d in self.shape)
            return (cubes,) * 3
        full_pod = self.shape == (16, 16)
        return (full_pod, full_pod, False)

    def describe(self) -> str:
        slices = f" x {self.num_slices} slices" if self.num_slices > 1 else ""
        return f"{self.name}{slices} ({self.num_chips} chips, {self.libtpu_name})"


def standard_shape(num_chips: int, ndim: int) -> tuple[int, ...]:
    """The slice shape Cloud TPU uses for a power-of-two chip count: double the smallest
    dimension (the last of equals) from 2x2x1 (3-D) or 2x2 (2-D); e.g. 64 -> 4x4x4."""
    if num_chips == 1 and ndim == 2:
        return (1, 1)
    if num_chips < 4 or num_chips & (num_chips - 1):
        raise ValueError(
            f"--topology: {num_chips} chips has no standard slice shape; give it explicitly, "
            f"e.g. v5p:4x4x8"
        )
    shape = [2, 2, 1] if ndim == 3 else [2, 2]
    while math.prod(shape) < num_chips:
        smallest = min(shape)
        last = max(i for i, d in enumerate(shape) if d == smallest)
        shape[last] *= 2
    return tuple(shape)


def _chip(generation: str, name: str) -> Chip:
    generation = ALIASES.get(generation, generation)
    if generation not in CHIPS:
        raise ValueError(
            f"--topology {name!r}: unknown TPU generation or GPU {generation!r} "
            f"(TPU: {', '.join(CHIPS)}; GPU: {', '.join(GPUS)})"
        )
    return CHIPS[generation]


def parse_topology(name: str, num_slices: int = 1) -> Topology:
    """`v5p-128` (accelerator type) or `v5p:4x4x4` (explicit chip shape) -> Topology."""
    if num_slices < 1:
        raise ValueError(f"--num_slices={num_slices} must be >= 1")
    text = name.strip().lower()
    if ":" in text:
        generation, _, dims = text.partition(":")
        chip = _chip(generation, name)
        try:
            shape = tuple(int(d) for d in dims.split("x"))
        except ValueError:
            raise ValueError(f"--topology {name!r}: expected a shape like 4x4x4") from None
        if len(shape) != chip.ndim:
            raise ValueError(f"--topology {name!r}: {chip.generation} needs {chip.ndim} dims")
        if min(shape) < 1:
            raise ValueError(f"--topology {name!r}: every dim must be at least 1 chip")
        label = f"{chip.generation}-{math.prod(shape) * chip.cores_per_chip}"
        return Topology(label, chip, shape, num_slices)
    generation, sep, count = text.rpartition("-")
    if not sep or not count.isdigit():
        raise ValueError(f"--topology {name!r}: expected e.g. v5p-128 or v5p:4x4x4")
    chip = _chip(generation, name)
    cores = int(count)
    if cores % chip.cores_per_chip:
        raise ValueError(
            f"--topology {name!r}: {chip.generation} names count {chip.cores_per_chip} "
            f"cores per chip, so the number must be a multiple of {chip.cores_per_chip}"
        )
    shape = standard_shape(cores // chip.cores_per_chip, chip.ndim)
    return Topology(f"{chip.generation}-{cores}", chip, shape, num_slices)


def quiet_libtpu_env(topology: Topology) -> None:
    """Environment that keeps libtpu from probing a TPU metadata server that is not there.

    Must run before libtpu is first loaded; values already set (on a real TPU VM) win.
    """
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", topology.name)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # libtpu takes /tmp/libtpu_lockfile for the TPU hardware, which compiling never touches;
    # without this, two compiles (or a compile next to a job holding the lock) cannot run.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def have_libtpu() -> bool:
    """Whether the `tpu` extra (libtpu) is installed."""
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


def topology_devices(topology: Topology) -> list:
    """Compile-only devices of the topology (all slices), from libtpu; no TPU needed."""
    if not have_libtpu():
        raise RuntimeError("compiling for a TPU topology needs libtpu: pip install 'jaxmoe[tpu]'")
    quiet_libtpu_env(topology)
    from jax.experimental import topologies

    description = topologies.get_topology_desc(
        platform="tpu",
        topology_name=topology.libtpu_name,
        chip_config_name=topology.chip.chip_config,
        chips_per_host_bounds=(2, 2, 1),
        num_slices=topology.num_slices,
        wrap=topology.wrap,
    )
    devices = list(description.devices)
    if len(devices) != topology.num_chips:
        raise RuntimeError(
            f"libtpu gave {len(devices)} devices for {topology.describe()}, "
            f"expected {topology.num_chips}"
        )
    return devices


def parse_target(name: str, num_slices: int = 1) -> Topology | GpuTopology:
    """A TPU topology (`v5p-128`, `v5p:4x4x4`) or a GPU cluster (`h100-32`, `h100:4x8`)."""
    if is_gpu_topology(name):
        return parse_gpu_topology(name, num_slices)
    return parse_topology(name, num_slices)


def target_devices(target: Topology | GpuTopology) -> tuple[list, list[int] | None]:
    """(compile-only devices, each one's slice where the devices do not say it) of a target."""
    if isinstance(target, GpuTopology):
        return gpu_topology_devices(target), nvlink_domains(target)
    return topology_devices(target), None
