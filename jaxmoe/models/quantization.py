"""`model.quantization`: the projections' and the experts' matrix products in int8 or fp8.

Each product quantizes both operands on the fly ("current" scaling: the scale comes from the
operand's own absolute maximum in this step), multiplies them in the narrow type with a wide
accumulator (int8 x int8 -> int32, fp8 x fp8 -> f32), and multiplies the result by the two
scales. Parameters, optimizer state and everything outside the products stay as they were
(f32 master weights, bf16 or f32 compute).

- int8 (TPU v5e/v5p MXUs; AQT / Qwix `quantization=int8` in MaxText): symmetric, round to
  nearest, [-127, 127]. Backward: the input gradient dy w^T also in int8 (dy and w
  quantized again along their new contraction dim); the weight gradient x^T dy in the
  compute dtype. MaxText's int8 (AQT `config_v3(fwd_bits=8, dlhs_bits=8, ...)`) does the
  same for the forward and the input gradient, and by default (quantization_local_shard_count
  = the slice count) quantizes the weight gradient to int8 as well; with
  quantization_local_shard_count=0 it keeps it in bf16, as here. AQT rounds dy
  stochastically; here it rounds to nearest.
- fp8 (H100/B200, TPU v7; Transformer Engine's recipe): forward operands float8_e4m3fn
  (max 448), the gradient dy float8_e5m2 (max 57344, wider range for gradients) against
  e4m3 weights for the input gradient; the weight gradient in the compute dtype.

Gradients are straight-through: the rounding has derivative 1, so the backward pass is the
plain product's backward with its own operands quantized (custom_vjp; nothing
differentiates through round or clip).

Scales (`model.quantization_scaling`): "channel" gives each row of the activations (a
token) and each output column of a weight matrix its own scale (AQT's default: one scale
per non-contracted index); "tensor" one scale per operand matrix (each expert's matrix its
own). Delayed scaling (Transformer Engine's default: scales from an amax history of earlier
steps) is not implemented: it keeps state outside the parameters, and current scaling is
what AQT/Qwix use for int8.
"""

from dataclasses import dataclass
from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp

QuantizationKind = Literal["none", "int8", "fp8"]
Scaling = Literal["channel", "tensor"]


@dataclass(frozen=True)
class NumberFormat:
    """A narrow operand type: its dtype, largest magnitude, and whether it is an integer."""

    dtype: jnp.dtype
    max: float
    integer: bool


INT8 = NumberFormat(jnp.dtype(jnp.int8), 127.0, True)
E4M3 = NumberFormat(jnp.dtype(jnp.float8_e4m3fn), 448.0, False)
E5M2 = NumberFormat(jnp.dtype(jnp.float8_e5m2), 57344.0, False)


@dataclass(frozen=True)
class Quantization:
    """How the products compute (static, hashable: passed through jit and custom_vjp). The
    model section's keys are checked where the section is made (ModelOptions), not here."""

    kind: QuantizationKind = "none"
    scaling: Scaling = "channel"

    @classmethod
    def from_config(cls, cfg) -> "Quantization":
        """The model section's setting."""
        return cls(cfg.quantization, cfg.quantization_scaling)

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    @property
    def forward_format(self) -> NumberFormat:
        return INT8 if self.kind == "int8" else E4M3

    @property
    def gradient_format(self) -> NumberFormat:
        return INT8 if self.kind == "int8" else E5M2

    @property
    def accumulator(self) -> jnp.dtype:
        return jnp.dtype(jnp.int32 if self.kind == "int8" else jnp.float32)


NONE = Quantization()


def quantize(x: jax.Array, reduce_axes: tuple[int, ...], fmt: NumberFormat):
    """(q, scale): x ~= q * scale, q in `fmt`, scale f32 with `reduce_axes` kept as size 1.

    scale = max |x| over `reduce_axes` / fmt.max (1 where that maximum is 0, so zeros stay
    zeros and nothing divides by 0).
    """
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=reduce_axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / fmt.max, 1.0)
    scaled = x32 / scale
    if fmt.integer:
        scaled = jnp.round(scaled)
    return jnp.clip(scaled, -fmt.max, fmt.max).astype(fmt.dtype), scale


def _operand_axes(quant: Quantization, contract_axis: int, ndim: int) -> tuple[int, ...]:
    """The axes one scale spans: the contracted one (channel), or all of them (tensor)."""
    if quant.scaling == "tensor":
        return tuple(range(ndim))
    return (contract_axis,)


def _scaled_dot(a_MK, b_KN, quant: Quantization, a_fmt: NumberFormat, out_dtype):
    """a b with a quantized per row (or tensor) and b per column (or tensor)."""
    qa, scale_a = quantize(a_MK, _operand_axes(quant, 1, 2), a_fmt)
    qb, scale_b = quantize(b_KN, _operand_axes(quant, 0, 2), quant.forward_format)
    acc = jnp.dot(qa, qb, preferred_element_type=quant.accumulator)
    return (acc.astype(jnp.float32) * scale_a * scale_b).astype(out_dtype)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def quantized_matmul(x_MK: jax.Array, w_KN: jax.Array, quant: Quantization) -> jax.Array:
    """x w [M, N] in `x`'s dtype, the product in `quant`'s narrow types (module doc)."""
    return _scaled_dot(x_MK, w_KN, quant, quant.forward_format, x_MK.dtype)


def _matmul_fwd(x_MK, w_KN, quant):
    return quantized_matmul(x_MK, w_KN, quant), (x_MK, w_KN)


def _matmul_bwd(quant, residuals, dy_MN):
    x_MK, w_KN = residuals
    dy_MN = dy_MN.astype(x_MK.dtype)
    dx_MK = _scaled_dot(dy_MN, w_KN.T, quant, quant.gradient_format, x_MK.dtype)
    dw_KN = jnp.dot(x_MK.T, dy_MN, preferred_element_type=jnp.float32).astype(w_KN.dtype)
    return dx_MK, dw_KN


quantized_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _row_groups(group_sizes_E: jax.Array, num_rows: int) -> jax.Array:
    """The group (expert) of each row of a ragged product; rows past the groups: the last."""
    ends_E = jnp.cumsum(group_sizes_E)
    group_M = jnp.searchsorted(ends_E, jnp.arange(num_rows), side="right")
    return jnp.minimum(group_M, group_sizes_E.shape[0] - 1)


def _scaled_ragged_dot(a_MK, b_EKN, group_sizes_E, quant, a_fmt, out_dtype):
    """ragged_dot(a, b) with a quantized per row (or whole) and b per (expert, column) (or
    per expert)."""
    qa, scale_a = quantize(a_MK, _operand_axes(quant, 1, 2), a_fmt)
    b_axes = (1, 2) if quant.scaling == "tensor" else (1,)
    qb, scale_b = quantize(b_EKN, b_axes, quant.forward_format)
    acc = jax.lax.ragged_dot(qa, qb, group_sizes_E, preferred_element_type=quant.accumulator)
    scale_b_MN = scale_b[_row_groups(group_sizes_E, a_MK.shape[0]), 0, :]
    return (acc.astype(jnp.float32) * scale_a * scale_b_MN).astype(out_dtype)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def quantized_ragged_dot(x_MK, w_EKN, group_sizes_E, quant: Quantization) -> jax.Array:
    """jax.lax.ragged_dot(x, w, group_sizes) in `quant`'s narrow types (module doc): rows of
    group e times w[e]; rows past sum(group_sizes) give zeros."""
    return _scaled_ragged_dot(x_MK, w_EKN, group_sizes_E, quant, quant.forward_format, x_MK.dtype)


def _ragged_fwd(x_MK, w_EKN, group_sizes_E, quant):
    out = quantized_ragged_dot(x_MK, w_EKN, group_sizes_E, quant)
    return out, (x_MK, w_EKN, group_sizes_E)


def _ragged_bwd(quant, residuals, dy_MN):
    x_MK, w_EKN, group_sizes_E = residuals
    dy_MN = dy_MN.astype(x_MK.dtype)
    w_ENK = w_EKN.transpose(0, 2, 1)
    dx_MK = _scaled_ragged_dot(
        dy_MN, w_ENK, group_sizes_E, quant, quant.gradient_format, x_MK.dtype
    )
    _, weight_vjp = jax.vjp(lambda w: jax.lax.ragged_dot(x_MK, w, group_sizes_E), w_EKN)
    (dw_EKN,) = weight_vjp(dy_MN)
    return dx_MK, dw_EKN, None


quantized_ragged_dot.defvjp(_ragged_fwd, _ragged_bwd)


def ragged_dot(x_MK, w_EKN, group_sizes_E, quant: Quantization = NONE) -> jax.Array:
    """jax.lax.ragged_dot, quantized when `quant` is enabled."""
    if not quant.enabled:
        return jax.lax.ragged_dot(x_MK, w_EKN, group_sizes_E)
    return quantized_ragged_dot(x_MK, w_EKN, group_sizes_E, quant)


def batched_matmul(x_ERK, w_EKN, quant: Quantization = NONE) -> jax.Array:
    """x[e] w[e] for every e: [E, R, N] (the capacity dispatch's expert products)."""
    if not quant.enabled:
        return jnp.einsum("erk,ekn->ern", x_ERK, w_EKN)
    return jax.vmap(quantized_matmul, in_axes=(0, 0, None))(x_ERK, w_EKN, quant)
