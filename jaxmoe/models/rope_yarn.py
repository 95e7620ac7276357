"""YaRN rotary scaling (Peng et al. 2023): per-frequency blend of interpolated and original
rotary frequencies, and the attention-scale correction that goes with it.

Frequencies whose wavelength fits `beta_fast` times into the original context keep their
value (extrapolation); those fitting fewer than `beta_slow` times are divided by `factor`
(interpolation); between the two a linear ramp over the frequency index blends them. cos and
sin are multiplied by `attention_factor` (0.1 ln(factor) + 1 unless given), which scales
q . k by its square. GPT-OSS writes truncate=false (fractional ramp bounds); DeepSeek-V3 the
default truncate=true (bounds rounded outwards).
"""

import math

import numpy as np


def yarn_attention_factor(factor: float, attention_factor: float = 0.0) -> float:
    """The cos/sin multiplier: `attention_factor` when > 0, else 0.1 ln(factor) + 1."""
    if attention_factor > 0:
        return float(attention_factor)
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def _correction_dim(rotations: float, dim: int, theta: float, original_max_len: int) -> float:
    """The frequency index whose wavelength fits `rotations` times into the context."""
    return dim * math.log(original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_inv_freq(
    inv_freq: np.ndarray,
    theta: float,
    factor: float,
    original_max_len: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> np.ndarray:
    """YaRN frequencies [d/2] from the plain ones `inv_freq` [d/2] (= theta^(-2i/d))."""
    dim = 2 * inv_freq.shape[0]
    low = _correction_dim(beta_fast, dim, theta, original_max_len)
    high = _correction_dim(beta_slow, dim, theta, original_max_len)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: original frequency, 0: interpolated
    return inv_freq / factor * (1.0 - keep) + inv_freq * keep
