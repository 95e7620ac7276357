"""NVIDIA GPU clusters by name, and their compile-only devices (GPU facts: parallel/chips.py).

`h100-32` is 32 H100s in nodes of 8 (4 nodes); `h100:4x8` names the nodes and the GPUs per
node; `h100-4` is half a node. A node of HGX/DGX GPUs is one NVLink domain; a GB200 NVL72
rack joins 72 GPUs (18 hosts of 4) in one: `gb200-144` is two racks, `gb200:2x18x4` the
same as domains x hosts x GPUs per host. An NVLink domain plays the part of a TPU slice:
the mesh keeps the tensor and expert axes inside it, and only the data and fsdp axes cross
the cluster network between domains (parallel/mesh.py, as a TPU multislice's DCN).

The devices come from JAX's CUDA plugin (the `gpu` extra), given the GPU's description
(`target_config`, the facts XLA's GPU compiler reads from a real device) and the cluster's
shape, on any x86_64 Linux host: no GPU, no driver. They exist only to compile for.
"""

import os
from dataclasses import dataclass

from jaxmoe.parallel.chips import GPUS, Gpu

# What JAX's GPU allocator may use of a GPU's memory unless XLA_CLIENT_MEM_FRACTION (or the
# older XLA_PYTHON_CLIENT_MEM_FRACTION) says otherwise: XLA's GpuAllocatorConfig default.
DEFAULT_MEMORY_FRACTION = 0.75
_MEMORY_FRACTION_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")


@dataclass(frozen=True)
class GpuTopology:
    """`domains` NVLink domains of `hosts_per_domain` hosts driving `gpus_per_host` GPUs each."""

    gpu: Gpu
    domains: int
    hosts_per_domain: int
    gpus_per_host: int
    memory_fraction: float = DEFAULT_MEMORY_FRACTION  # share of each GPU's memory JAX may use

    platform = "gpu"

    @property
    def num_chips(self) -> int:
        return self.domains * self.chips_per_slice

    @property
    def chips_per_slice(self) -> int:
        return self.hosts_per_domain * self.gpus_per_host

    @property
    def num_slices(self) -> int:
        """NVLink domains: the slices of the mesh (joined by the cluster network)."""
        return self.domains

    @property
    def num_hosts(self) -> int:
        return self.domains * self.hosts_per_domain

    @property
    def name(self) -> str:
        return f"{self.gpu.name}-{self.num_chips}"

    @property
    def device_topology(self) -> str:
        """The CUDA plugin's topology: NVLink domains x hosts per domain x GPUs per host."""
        return f"{self.domains}x{self.hosts_per_domain}x{self.gpus_per_host}"

    @property
    def hbm_bytes(self) -> int:
        """What one step may use of a GPU: the allocator's share of its memory."""
        return int(self.gpu.memory_bytes * self.memory_fraction)

    @property
    def peak_bf16_flops(self) -> float:
        return self.gpu.peak_bf16_flops

    def describe(self) -> str:
        hosts = f"{self.num_hosts} hosts of {self.gpus_per_host}"
        domains = "one NVLink domain" if self.domains == 1 else f"{self.domains} NVLink domains"
        return f"{self.name} ({self.num_chips} {self.gpu.device_kind}: {hosts}, {domains})"


def is_gpu_topology(name: str) -> bool:
    """Whether `--topology name` names a GPU model of GPUS (else it is a TPU one)."""
    text = name.strip().lower()
    model = text.partition(":")[0] if ":" in text else text.rpartition("-")[0]
    return model in GPUS


def memory_fraction_from_env() -> float:
    """The share of GPU memory JAX's allocator takes in a process started with this
    environment: XLA_CLIENT_MEM_FRACTION / XLA_PYTHON_CLIENT_MEM_FRACTION, else 0.75."""
    for variable in _MEMORY_FRACTION_VARIABLES:
        value = os.environ.get(variable)
        if value:
            try:
                fraction = float(value)
            except ValueError:
                raise ValueError(f"{variable}={value!r} is not a number") from None
            if not 0 < fraction <= 1:
                raise ValueError(f"{variable}={value}: must be in (0, 1]")
            return fraction
    return DEFAULT_MEMORY_FRACTION


def parse_gpu_topology(
    name: str, num_slices: int = 1, memory_fraction: float | None = None
) -> GpuTopology:
    """`h100-32` (GPU count), `h100:4x8` (nodes x GPUs per node) or `gb200:2x18x4` (NVLink
    domains x hosts x GPUs per host) -> GpuTopology; `num_slices` repeats it over more
    NVLink domains."""
    if num_slices < 1:
        raise ValueError(f"--num_slices={num_slices} must be >= 1")
    text = name.strip().lower()
    if ":" in text:
        model, _, dims = text.partition(":")
        try:
            sizes = [int(d) for d in dims.split("x")]
        except ValueError:
            raise ValueError(f"--topology {name!r}: expected e.g. {model}:4x8") from None
        if len(sizes) not in (2, 3) or min(sizes) < 1:
            raise ValueError(
                f"--topology {name!r}: give nodes x GPUs per node (h100:4x8) or NVLink "
                f"domains x hosts x GPUs per host (gb200:2x18x4)"
            )
        gpu = GPUS[model]
        if len(sizes) == 3:
            domains, hosts, per_host = sizes
        else:
            nodes, per_host = sizes
            domains, hosts = _domains_of(gpu, nodes, per_host, name)
    else:
        model, _, count = text.rpartition("-")
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"--topology {name!r}: expected e.g. {model}-32 or {model}:4x8")
        gpu, total = GPUS[model], int(count)
        if total <= gpu.gpus_per_host:
            domains, hosts, per_host = 1, 1, total
        elif total % gpu.gpus_per_host:
            raise ValueError(
                f"--topology {name!r}: {gpu.name} hosts hold {gpu.gpus_per_host} GPUs, so more "
                f"than {gpu.gpus_per_host} must be a multiple of {gpu.gpus_per_host} "
                f"(or name the nodes: {gpu.name}:NODESxGPUS)"
            )
        else:
            per_host = gpu.gpus_per_host
            domains, hosts = _domains_of(gpu, total // per_host, per_host, name)
    if per_host > gpu.gpus_per_host:
        raise ValueError(
            f"--topology {name!r}: a {gpu.name} host drives at most {gpu.gpus_per_host} GPUs"
        )
    if hosts * per_host > gpu.nvlink_domain:
        raise ValueError(
            f"--topology {name!r}: an NVLink domain of {gpu.name} joins at most "
            f"{gpu.nvlink_domain} GPUs, not {hosts} x {per_host}"
        )
    fraction = memory_fraction_from_env() if memory_fraction is None else memory_fraction
    return GpuTopology(gpu, domains * num_slices, hosts, per_host, fraction)


def _domains_of(gpu: Gpu, nodes: int, per_host: int, name: str) -> tuple[int, int]:
    """(NVLink domains, hosts per domain) of `nodes` hosts: each domain as full as it can be."""
    hosts_per_domain = max(gpu.nvlink_domain // gpu.gpus_per_host, 1)
    if nodes <= hosts_per_domain:
        return 1, nodes
    if nodes % hosts_per_domain:
        raise ValueError(
            f"--topology {name!r}: {nodes} hosts do not fill whole NVLink domains of "
            f"{hosts_per_domain} hosts; name them: {gpu.name}:DOMAINSxHOSTSxGPUS"
        )
    return nodes // hosts_per_domain, hosts_per_domain


def cuda_plugin_installed() -> bool:
    """Whether one of JAX's CUDA plugins (the `gpu` extra) is installed."""
    import importlib.util

    return any(importlib.util.find_spec(name) is not None for name in CUDA_PLUGINS)


def software_versions() -> dict[str, tuple[int, ...]]:
    """The CUDA runtime and cuDNN the installed plugin loads (compat/private_apis.py)."""
    from jaxmoe.compat.private_apis import cuda_library_versions

    versions = cuda_library_versions()
    if versions is None:
        raise RuntimeError("JAX's CUDA plugin reports no CUDA library versions")
    return versions


def target_config(gpu: Gpu, versions: dict[str, tuple[int, ...]]) -> str:
    """The GPU as XLA's compiler sees a device: a GpuTargetConfig text proto.

    The launch limits (threads, blocks, registers) are the same on every CUDA GPU since
    Volta; "accelerated features" (sm_90a, sm_100a) are what XLA compiles for on Hopper
    and Blackwell devices. The cuDNN version goes in twice: XLA's compiler reads the one in
    `gpu_device_info` (e.g. to decide whether cuDNN can run a grouped matmul).
    """
    major, minor = gpu.compute_capability
    extension = "ACCELERATED_FEATURES" if major >= 9 else "NONE"
    cudnn, runtime = versions["cudnn"], versions["cuda_runtime"]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: {gpu.shared_memory_per_block}
  shared_memory_per_core: {gpu.shared_memory_per_sm}
  threads_per_core_limit: 2048
  core_count: {gpu.sm_count}
  fpus_per_core: {gpu.fp32_lanes_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {gpu.memory_bandwidth}
  l2_cache_size: {gpu.l2_cache_bytes}
  clock_rate_ghz: {gpu.clock_ghz}
  device_memory_size: {gpu.memory_bytes}
  shared_memory_per_block_optin: {gpu.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} feature_extension: {extension} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  dnn_version: "{cudnn[0]}.{cudnn[1]}.{cudnn[2]}"
  runtime_version: "{runtime[0]}.{runtime[1]}.0"
}}
platform_name: "CUDA"
dnn_version_info {{ major: {cudnn[0]} minor: {cudnn[1]} patch: {cudnn[2]} }}
runtime_version {{ major: {runtime[0]} minor: {runtime[1]} }}
device_description_str: "{gpu.device_kind}"
"""


def gpu_topology_devices(topology: GpuTopology) -> list:
    """Compile-only devices of `topology`, NVLink domain by domain, host by host; no GPU needed.

    Call it in a process that has not started JAX's CUDA backend on a GPU-less host (the
    `jaxmoe compile` command keeps JAX on the CPU backend for this).
    """
    if not cuda_plugin_installed():
        raise RuntimeError(
            "compiling for NVIDIA GPUs needs JAX's CUDA plugin: pip install 'jaxmoe[gpu]'"
        )
    # The plugin checks its CUDA libraries against the driver's when it starts; a host
    # without a GPU has no driver to ask, and compiling needs none.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from jax.experimental import topologies

    try:
        description = topologies.get_topology_desc(
            platform="cuda",
            target_config=target_config(topology.gpu, software_versions()),
            topology=topology.device_topology,
        )
    except NotImplementedError:
        raise RuntimeError(
            "JAX's CUDA plugin did not start in this process (see the log above); "
            "run `jaxmoe compile` in a fresh process"
        ) from None
    devices = list(description.devices)
    if len(devices) != topology.num_chips:
        raise RuntimeError(
            f"the CUDA plugin gave {len(devices)} devices for {topology.describe()}, "
            f"expected {topology.num_chips}"
        )
    return devices


def nvlink_domains(topology: GpuTopology) -> list[int]:
    """The NVLink domain of each of `gpu_topology_devices(topology)`: the plugin lists the
    devices domain by domain, host by host."""
    return [i // topology.chips_per_slice for i in range(topology.num_chips)]
