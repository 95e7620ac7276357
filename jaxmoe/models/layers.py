"""Dense building blocks. Every parameter carries logical axis names (`axes` metadata).

The names are mapped to mesh axes by one rules table (jaxmoe/parallel/sharding.py), so a
new parallelism layout is a config change, not a model change.
"""

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.models.quantization import NONE, Quantization, quantized_matmul

Initializer = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


def fan_in_init(fan_in_axes: tuple[int, ...], scale: float = 1.0) -> Initializer:
    """Truncated normal with variance scale / fan_in, fan_in taken over `fan_in_axes`."""

    def init(key, shape, dtype):
        fan_in = 1
        for axis in fan_in_axes:
            fan_in *= shape[axis]
        std = (scale / fan_in) ** 0.5 / 0.87962566103423978  # truncnorm(-2, 2) std correction
        return std * jax.random.truncated_normal(key, -2.0, 2.0, shape, dtype)

    return init


def normal_init(std: float) -> Initializer:
    return lambda key, shape, dtype: std * jax.random.normal(key, shape, dtype)


def make_param(
    rngs: nnx.Rngs,
    init: Initializer,
    shape: tuple[int, ...],
    axes: tuple[str | None, ...],
    dtype=jnp.float32,
) -> nnx.Param:
    """A parameter initialised by `init` and tagged with one logical axis name per dim."""
    if len(axes) != len(shape):
        raise ValueError(f"parameter of shape {shape} got {len(axes)} axis names {axes}")
    return nnx.Param(init(rngs.params(), shape, dtype), axes=axes)


def cast_weight(w: jax.Array, dtype) -> jax.Array:
    """`w.astype(dtype)` for a weight read inside a layer scan; f32 -> bf16 rounds to nearest
    even like the cast (same bits, NaN stays NaN).

    Why not the cast itself: the TPU compiler's bf16 propagation turns a loop that only
    reads bf16 casts of its f32 weight slices into a loop over a bf16 copy of the whole
    stack, made before the forward scan and alive until the backward scan ends (Mixtral-8x7B
    on v5p-256: 0.66 GiB per chip of expert weights, every layer's at once; an
    optimization barrier does not stop it). The rounding done with integer ops gives that
    pass no float cast to move.
    """
    w = jnp.asarray(w)
    if w.dtype == jnp.float32 and jnp.dtype(dtype) == jnp.bfloat16:
        return _f32_to_bf16(w)
    return w.astype(dtype)


@jax.custom_jvp
def _f32_to_bf16(w: jax.Array) -> jax.Array:
    bits = jax.lax.bitcast_convert_type(w, jnp.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # to nearest, ties to even
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    top = jnp.where(nan, (bits >> 16) | 0x40, rounded)  # a quiet NaN, never rounded to inf
    return jax.lax.bitcast_convert_type(top.astype(jnp.uint16), jnp.bfloat16)


@_f32_to_bf16.defjvp
def _f32_to_bf16_jvp(primals, tangents):
    (w,), (dw,) = primals, tangents
    return _f32_to_bf16(w), dw.astype(jnp.bfloat16)


def make_dropout(
    cfg,  # ModelOptions (not imported: models/options.py imports this module)
    rngs: nnx.Rngs,
    *,
    share_along_length: bool = True,
    rate: float | None = None,
):
    """T5X's dropout of `model.dropout_rate` (or `rate`), or None at rate 0 (no RNG state in
    the model).

    T5X shares one mask along the sequence axis (broadcast_dims=(-2,)) everywhere except
    after the encoder's final norm; its RNG stream is reseeded every step (steps.py).
    """
    return dropout_module(cfg.dropout_rate if rate is None else rate, rngs, share_along_length)


def dropout_module(rate: float, rngs: nnx.Rngs, share_along_length: bool = True):
    """An nnx.Dropout of `rate` (mask shared along axis -2 if `share_along_length`), or None
    at rate 0."""
    if not rate:
        return None
    return nnx.Dropout(rate, broadcast_dims=(-2,) if share_along_length else (), rngs=rngs)


def dropout(module, x, train: bool):
    """`module` (from make_dropout) applied in training; identity at eval and decode."""
    return module(x, deterministic=False) if module is not None and train else x


def dropout_multiplier(module, shape: tuple[int, ...], dtype, train: bool):
    """keep / (1 - rate) of shape `shape` drawn by `module`, or None (rate 0, eval, decode):
    for the sites where the mask is applied inside a product rather than to one array (the
    attention probabilities, an expert's hidden units)."""
    if module is None or not train:
        return None
    return module(jnp.ones(shape, dtype), deterministic=False)


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),  # T5.1.1 uses the tanh approximation
    "relu": jax.nn.relu,
}


def activation_fn(name: str) -> Callable[[jax.Array], jax.Array]:
    if name not in ACTIVATIONS:
        raise ValueError(
            f"model.activation: unknown activation {name!r} ({' | '.join(ACTIVATIONS)})"
        )
    return ACTIVATIONS[name]


def ungated_gate_fn(name: str) -> Callable[[jax.Array], jax.Array]:
    """s with act(h) = s(h) * h for activation `name` (relu: step, silu: sigmoid, gelu: its
    tanh-approximation factor). A gated FFN with this gate and wi_0 = wi_1 = wi (the same
    array, so autodiff sums both gradient paths into d act(h) / dh) is exactly the ungated
    act(x wi) wo, in value and gradient: how the MoE layer runs ungated experts through the
    gated dispatch code."""
    if name == "relu":
        return lambda h: (h > 0).astype(h.dtype)
    if name == "silu":
        return jax.nn.sigmoid
    if name == "gelu":
        return lambda h: 0.5 * (1 + jnp.tanh(0.7978845608028654 * (h + 0.044715 * h**3)))
    raise ValueError(f"model.activation: unknown activation {name!r} (silu | gelu | relu)")


class RMSNorm(nnx.Module):
    """Root-mean-square norm with a learned scale and no bias (Llama, T5)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, rngs: nnx.Rngs):
        del rngs
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), axes=("norm",))

    def __call__(self, x):
        # Statistics in f32 even under bf16 compute: the mean of squares underflows otherwise.
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...]).astype(x.dtype)


class Embed(nnx.Module):
    """Token embedding table [V, D]."""

    def __init__(self, vocab_size: int, d_model: int, *, std: float = 1.0, rngs: nnx.Rngs):
        self.embedding = make_param(
            rngs, normal_init(std), (vocab_size, d_model), ("vocab", "embed")
        )

    def __call__(self, ids_BL, dtype):
        return jnp.take(self.embedding[...], ids_BL, axis=0).astype(dtype)

    def attend(self, x_BLD):
        """Logits against the embedding table (tied output layer)."""
        return matmul_2d(x_BLD, self.embedding[...].astype(x_BLD.dtype).T)


def matmul_2d(x, w, contract: int = 1):
    """x [..., *w.shape[:contract]] times w -> [..., *w.shape[contract:]] as one 2-D product.

    XLA's CPU backend turns the backward pass of a batched einsum such as "bld,df->blf" into
    fusions that write transposed copies element by element; the same product on a
    [B*L, D] matrix runs as plain matmuls. Measured on the tiny Mixtral's dense variant:
    train step 1.49 s -> 0.98 s. On TPU/GPU it is the same computation.
    """
    lead = x.shape[: x.ndim - contract]
    inner = math.prod(w.shape[:contract])
    y = x.reshape(-1, inner) @ w.reshape(inner, -1)
    return y.reshape(*lead, *w.shape[contract:])


def project(x, w, quant: Quantization = NONE, contract: int = 1):
    """x times the weight w (f32 parameter) in x's dtype, as `matmul_2d`: the projections'
    product, in int8 or fp8 when `quant` (model.quantization) is enabled (quantization.py)."""
    w = cast_weight(w, x.dtype)
    if not quant.enabled:
        return matmul_2d(x, w, contract)
    lead = x.shape[: x.ndim - contract]
    inner = math.prod(w.shape[:contract])
    y = quantized_matmul(x.reshape(-1, inner), w.reshape(inner, -1), quant)
    return y.reshape(*lead, *w.shape[contract:])


# LoRA (models/lora.py): an adapted weight `name` has `name_lora_a` A [*lead, *in, r] and
# `name_lora_b` B [*lead, r, *out] beside it on its module, and the module a `lora_scale`.
LORA_A, LORA_B = "_lora_a", "_lora_b"


def _lora_factors(module, name: str, dtype):
    """(A, B, scale) of the adapter of weight `name` in `dtype`, or None without one."""
    a = getattr(module, name + LORA_A, None)
    if a is None:
        return None
    b = getattr(module, name + LORA_B)
    return cast_weight(a[...], dtype), cast_weight(b[...], dtype), module.lora_scale


def lora_project(
    module, name: str, x, quant: Quantization = NONE, contract: int = 1, train: bool = False
):
    """`project` of x by the module's weight `name`, plus its LoRA adapter's s (x A) B
    (x dropped first in training under train.lora.dropout); the projection alone for a
    weight without an adapter. Base and adapter are never merged here."""
    y = project(x, getattr(module, name)[...], quant, contract)
    factors = _lora_factors(module, name, x.dtype)
    if factors is None:
        return y
    a, b, scale = factors
    x_in = dropout(getattr(module, "lora_dropout", None), x, train)
    low = matmul_2d(x_in, a, contract)
    return y + matmul_2d(low, b) * jnp.asarray(scale, y.dtype)


def adapted_weight(module, name: str, dtype):
    """The module's weight `name` in `dtype` plus its LoRA adapter's s A B (one product per
    leading index, e.g. per expert), for the sites that take a weight rather than an input
    (expert stacks, the router, MLA's absorbed decode); the weight alone without one."""
    w = cast_weight(getattr(module, name)[...], dtype)
    factors = _lora_factors(module, name, dtype)
    if factors is None:
        return w
    a, b, scale = factors
    lead = a.ndim + b.ndim - 2 - w.ndim  # A [*lead, *in, r], B [*lead, r, *out]
    a2 = a.reshape(*a.shape[:lead], -1, a.shape[-1])
    b2 = b.reshape(*b.shape[: lead + 1], -1)
    delta = jnp.matmul(a2, b2).reshape(w.shape)
    return w + delta * jnp.asarray(scale, dtype)


def head_logits(h_BLD, w_DV, scale: float = 1.0):
    """The output layer: logits [B, L, V] f32 of the final-normed hidden states and the head
    matrix (tied: the embedding table transposed), the product in the hidden states' dtype.
    Models and the chunked training loss (training/chunked_loss.py) share it, so both give
    the same numbers."""
    logits = matmul_2d(h_BLD, w_DV.astype(h_BLD.dtype)).astype(jnp.float32)
    return logits * scale if scale != 1.0 else logits


class MLP(nnx.Module):
    """Ungated FFN: act(x wi) wo (T5 v1.0 and Switch Base / Large / C with relu).

    `dropout_rate` > 0: in training, dropout on the hidden units before wo, one mask per
    sequence shared along it (Flaxformer MlpBlock's intermediate_dropout)."""

    def __init__(
        self,
        d_model: int,
        ffn_dim: int,
        activation: str,
        *,
        dropout_rate: float = 0.0,
        quant: Quantization = NONE,
        rngs: nnx.Rngs,
    ):
        self.act = activation_fn(activation)
        self.quant = quant
        self.wi = make_param(rngs, fan_in_init((0,)), (d_model, ffn_dim), ("embed", "mlp"))
        self.wo = make_param(rngs, fan_in_init((0,)), (ffn_dim, d_model), ("mlp", "embed"))
        self.hidden_dropout = dropout_module(dropout_rate, rngs)

    def __call__(self, x_BLD, *, train: bool = False, token_mask_BL=None):
        """Returns (y_BLD, {}), like GatedMLP."""
        del token_mask_BL
        hidden_BLF = self.act(lora_project(self, "wi", x_BLD, self.quant, train=train))
        hidden_BLF = dropout(self.hidden_dropout, hidden_BLF, train)
        return lora_project(self, "wo", hidden_BLF, self.quant, train=train), {}


class GatedMLP(nnx.Module):
    """Gated FFN: act(x wi_0) * (x wi_1) wo. SwiGLU with silu, T5.1.1's gated GELU with gelu.

    `dropout_rate` > 0: in training, dropout on act(x wi_0) * (x wi_1) before wo, as MLP."""

    def __init__(
        self,
        d_model: int,
        ffn_dim: int,
        activation: str,
        *,
        dropout_rate: float = 0.0,
        quant: Quantization = NONE,
        rngs: nnx.Rngs,
    ):
        self.act = activation_fn(activation)
        self.quant = quant
        self.wi_0 = make_param(rngs, fan_in_init((0,)), (d_model, ffn_dim), ("embed", "mlp"))
        self.wi_1 = make_param(rngs, fan_in_init((0,)), (d_model, ffn_dim), ("embed", "mlp"))
        self.wo = make_param(rngs, fan_in_init((0,)), (ffn_dim, d_model), ("mlp", "embed"))
        self.hidden_dropout = dropout_module(dropout_rate, rngs)

    def __call__(self, x_BLD, *, train: bool = False, token_mask_BL=None):
        """Returns (y_BLD, aux); aux is empty for a dense FFN (the MoE layer fills it; the
        token mask only matters to its routing statistics)."""
        del token_mask_BL
        gate_BLF = self.act(lora_project(self, "wi_0", x_BLD, self.quant, train=train))
        up_BLF = lora_project(self, "wi_1", x_BLD, self.quant, train=train)
        hidden_BLF = dropout(self.hidden_dropout, gate_BLF * up_BLF, train)
        return lora_project(self, "wo", hidden_BLF, self.quant, train=train), {}


def compute_dtype(cfg):
    """The activations' dtype (`model.dtype`); parameters stay float32."""
    return jnp.dtype(cfg.dtype)
