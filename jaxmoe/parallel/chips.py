"""Accelerator facts: TPU chips and NVIDIA GPUs (memory, peak FLOP/s, what a compiler needs
to know of them), and the peak of a running device.

`device_peak_flops` is the denominator of MFU, by the device kind JAX reports;
`train.peak_flops` overrides it (and is the only source on CPU). The ahead-of-time compile
check (`jaxmoe compile`) takes TPU chips' HBM and GPUs' whole descriptions from the same
tables: `CHIPS` (TPU generations) and `GPUS` (GPU models).
"""

from dataclasses import dataclass

import jax

GiB = 2**30


@dataclass(frozen=True)
class Chip:
    """One TPU generation: how libtpu names it and what one device (chip) holds and does."""

    generation: str  # as in accelerator names: v4 | v5e | v5p | v6e
    libtpu_prefix: str  # the prefix libtpu's topology names use
    chip_config: str  # libtpu chip config: megacore (2 cores as one device) | default
    cores_per_chip: int  # TensorCores counted per chip in an accelerator name
    ndim: int  # 3-D torus (v4, v5p) or 2-D grid (v5e, v6e)
    hbm_bytes: int  # HBM of one chip the TPU compiler lets a program use
    peak_bf16_flops: float  # dense bf16 FLOP/s of one chip (Cloud TPU spec sheets)


# Usable HBM per chip is what libtpu's compiler reports as "available HBM" in its
# out-of-memory errors (measured with libtpu 0.0.42): a little under the spec sheets' 32 GiB
# (v4, v6e) and 16 GiB (v5e); v5p's spec sheet says 95 GB. Peak bf16 FLOP/s per chip are
# the Cloud TPU spec sheets' figures.
CHIPS: dict[str, Chip] = {
    "v4": Chip("v4", "v4", "megacore", 2, 3, int(30.75 * GiB), 275e12),
    "v5p": Chip("v5p", "v5", "megacore", 2, 3, int(95.74 * GiB), 459e12),
    "v5e": Chip("v5e", "v5e", "default", 1, 2, int(15.75 * GiB), 197e12),
    "v6e": Chip("v6e", "v6e", "default", 1, 2, int(31.25 * GiB), 918e12),
}


@dataclass(frozen=True)
class Gpu:
    """One NVIDIA GPU model: what one device holds and does, and how nodes group it.

    The hardware fields are what XLA's GPU compiler reads from a device (its
    `GpuTargetConfig`): `jaxmoe compile` describes a GPU with them to compile for it on a
    host without one (aot/gpu_topologies.py).
    """

    name: str  # jaxmoe's name, as in `--topology h100-32`
    device_kind: str  # the name CUDA reports (`jax.Device.device_kind`)
    compute_capability: tuple[int, int]  # (major, minor): 9.0 Hopper, 10.0 Blackwell
    sm_count: int  # streaming multiprocessors
    fp32_lanes_per_sm: int  # FP32 units per SM
    clock_ghz: float  # SM boost clock
    memory_bytes: int  # device memory CUDA reports (total, before any allocator's share)
    memory_bandwidth: int  # bytes/s
    l2_cache_bytes: int
    shared_memory_per_sm: int  # bytes
    shared_memory_per_block_optin: int  # bytes a block may opt in to
    peak_bf16_flops: float  # dense (no 2:4 sparsity) bf16 tensor-core FLOP/s
    peak_fp8_flops: float  # dense fp8 tensor-core FLOP/s; 0 = no fp8 tensor cores
    gpus_per_host: int  # GPUs one host (one process) drives
    nvlink_domain: int  # GPUs one NVLink domain joins: a node of 8, or a GB200 NVL72 rack

    @property
    def shared_memory_per_block(self) -> int:
        """48 KiB: what a block gets without opting in, on every CUDA GPU since Volta."""
        return 48 * 2**10


# Hardware fields: the device descriptions XLA keeps for these GPUs, recorded from real
# devices (github.com/openxla/xla, xla/backends/gpu/target_config/specs/: h100_sxm,
# h200, b200, gb200 and a100_sxm_80 .txtpb), i.e. what cudaGetDeviceProperties reports.
# Peaks: NVIDIA's datasheets (H100/H200 SXM, HGX B200, GB200 NVL72, A100), which quote the
# tensor-core rates with 2:4 sparsity; the dense rates here are half of those. Hosts and
# NVLink domains: HGX/DGX nodes hold 8 GPUs joined by NVLink; a GB200 NVL72 rack joins 72
# GPUs (18 compute trays of 4) in one NVLink domain.
GPUS: dict[str, Gpu] = {
    gpu.name: gpu
    for gpu in (
        Gpu(
            name="a100-80g", device_kind="NVIDIA A100-SXM4-80GB", compute_capability=(8, 0),
            sm_count=108, fp32_lanes_per_sm=64, clock_ghz=1.41, memory_bytes=85_100_068_864,
            memory_bandwidth=2_039_040_000_000, l2_cache_bytes=41_943_040,
            shared_memory_per_sm=167_936, shared_memory_per_block_optin=166_912,
            peak_bf16_flops=312e12, peak_fp8_flops=0.0, gpus_per_host=8, nvlink_domain=8,
        ),
        Gpu(
            name="h100", device_kind="NVIDIA H100 80GB HBM3", compute_capability=(9, 0),
            sm_count=132, fp32_lanes_per_sm=128, clock_ghz=1.98, memory_bytes=84_942_979_072,
            memory_bandwidth=3_352_320_000_000, l2_cache_bytes=52_428_800,
            shared_memory_per_sm=233_472, shared_memory_per_block_optin=232_448,
            peak_bf16_flops=989e12, peak_fp8_flops=1979e12, gpus_per_host=8, nvlink_domain=8,
        ),
        Gpu(
            name="h200", device_kind="NVIDIA H200 141GB HBM3e", compute_capability=(9, 0),
            sm_count=132, fp32_lanes_per_sm=128, clock_ghz=1.98, memory_bytes=151_397_597_184,
            memory_bandwidth=4_800_000_000_000, l2_cache_bytes=52_428_800,
            shared_memory_per_sm=233_472, shared_memory_per_block_optin=232_448,
            peak_bf16_flops=989e12, peak_fp8_flops=1979e12, gpus_per_host=8, nvlink_domain=8,
        ),
        Gpu(
            name="b200", device_kind="NVIDIA B200", compute_capability=(10, 0),
            sm_count=148, fp32_lanes_per_sm=128, clock_ghz=1.965, memory_bytes=191_514_411_008,
            memory_bandwidth=7_672_320_000_000, l2_cache_bytes=132_644_864,
            shared_memory_per_sm=233_472, shared_memory_per_block_optin=232_448,
            peak_bf16_flops=2.25e15, peak_fp8_flops=4.5e15, gpus_per_host=8, nvlink_domain=8,
        ),
        Gpu(
            name="gb200", device_kind="NVIDIA GB200", compute_capability=(10, 0),
            sm_count=152, fp32_lanes_per_sm=128, clock_ghz=2.062, memory_bytes=197_897_748_480,
            memory_bandwidth=7_928_064_000_000, l2_cache_bytes=135_528_448,
            shared_memory_per_sm=233_472, shared_memory_per_block_optin=232_448,
            peak_bf16_flops=2.5e15, peak_fp8_flops=5e15, gpus_per_host=4, nvlink_domain=72,
        ),
    )
}  # fmt: skip


# Substrings of `jax.Device.device_kind`, most specific first. TPU figures come from the
# same spec-sheet table as the ahead-of-time compile check; GPU figures are NVIDIA's dense
# (no structured sparsity) bf16 tensor-core peaks for the SXM parts (GPUS, and the L4's).
_KINDS: tuple[tuple[str, float], ...] = (
    ("TPU v6 lite", CHIPS["v6e"].peak_bf16_flops),
    ("TPU v6e", CHIPS["v6e"].peak_bf16_flops),
    ("TPU v5 lite", CHIPS["v5e"].peak_bf16_flops),
    ("TPU v5e", CHIPS["v5e"].peak_bf16_flops),
    ("TPU v5p", CHIPS["v5p"].peak_bf16_flops),
    ("TPU v5", CHIPS["v5p"].peak_bf16_flops),
    ("TPU v4", CHIPS["v4"].peak_bf16_flops),
    ("GB200", GPUS["gb200"].peak_bf16_flops),
    ("B200", GPUS["b200"].peak_bf16_flops),
    ("H200", GPUS["h200"].peak_bf16_flops),
    ("H100", GPUS["h100"].peak_bf16_flops),
    ("A100", GPUS["a100-80g"].peak_bf16_flops),
    ("L4", 121e12),
)


def gpu_of_kind(device_kind: str) -> Gpu | None:
    """The GPUS entry whose CUDA name is `device_kind` (a running device's), else None."""
    return next((gpu for gpu in GPUS.values() if gpu.device_kind == device_kind), None)


def device_peak_flops(device: jax.Device | None = None, override: float = 0.0) -> float | None:
    """FLOP/s of one device, or None when neither the override nor the table knows it."""
    if override > 0:
        return float(override)
    kind = (device or jax.devices()[0]).device_kind
    return next((peak for name, peak in _KINDS if name in kind), None)
