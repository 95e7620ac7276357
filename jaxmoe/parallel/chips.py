"""Accelerator facts: TPU chips' HBM and peak FLOP/s, and the peak of a running device.

`device_peak_flops` is the denominator of MFU, by the device kind JAX reports;
`train.peak_flops` overrides it (and is the only source on CPU). The ahead-of-time compile
check takes TPU chips' HBM from the same table.
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


# Substrings of `jax.Device.device_kind`, most specific first. TPU figures come from the
# same spec-sheet table as the ahead-of-time compile check; GPU figures are NVIDIA's dense
# (no structured sparsity) bf16 tensor-core peaks for the SXM parts.
_KINDS: tuple[tuple[str, float], ...] = (
    ("TPU v6 lite", CHIPS["v6e"].peak_bf16_flops),
    ("TPU v6e", CHIPS["v6e"].peak_bf16_flops),
    ("TPU v5 lite", CHIPS["v5e"].peak_bf16_flops),
    ("TPU v5e", CHIPS["v5e"].peak_bf16_flops),
    ("TPU v5p", CHIPS["v5p"].peak_bf16_flops),
    ("TPU v5", CHIPS["v5p"].peak_bf16_flops),
    ("TPU v4", CHIPS["v4"].peak_bf16_flops),
    ("B200", 2.25e15),
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L4", 121e12),
)


def device_peak_flops(device: jax.Device | None = None, override: float = 0.0) -> float | None:
    """FLOP/s of one device, or None when neither the override nor the table knows it."""
    if override > 0:
        return float(override)
    kind = (device or jax.devices()[0]).device_kind
    return next((peak for name, peak in _KINDS if name in kind), None)
