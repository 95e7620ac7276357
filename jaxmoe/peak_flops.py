"""Peak dense bf16 FLOP/s of one accelerator, by the device kind JAX reports: the
denominator of MFU. `train.peak_flops` overrides it (and is the only source on CPU)."""

import jax

from jaxmoe.topologies import CHIPS

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
