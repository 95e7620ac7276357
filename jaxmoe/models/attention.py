"""Multi-head, grouped-query and multi-query attention as one module.

H query heads share K key/value heads (K divides H): K = H is MHA, K = 1 is MQA. Query head
h reads KV head h // (H // K) (contiguous groups, as in the GQA paper's converters and in
Llama/Mistral). The grouped einsum reshapes queries to [.., K, G, ..] instead of repeating
K/V, so memory and bandwidth for K/V scale with K, not H.
"""

import dataclasses
import math
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmoe.models.attention_kernel import (
    SPLASH,
    XLA,
    kernel_attention,
    log_once,
    mesh_platform,
    resolve_attention_kernel,
)
from jaxmoe.models.attention_math import (  # noqa: F401  (re-exported: kv_cache, t5, mla, tests)
    AUTO,
    NEG_INF,
    QUERY_CHUNK,
    grouped_attention,
    head_max_logits,
    query_chunked_attention,
    resolve_causal_block,
    same_segment,
)
from jaxmoe.models.attention_window import with_window
from jaxmoe.models.context_kernels import context_kernel
from jaxmoe.models.context_parallel import ContextLayout, context_attention
from jaxmoe.models.layers import (
    RMSNorm,
    dropout_module,
    dropout_multiplier,
    fan_in_init,
    lora_project,
    make_param,
)
from jaxmoe.models.quantization import NONE, Quantization
from jaxmoe.models.rope_yarn import yarn_attention_factor, yarn_inv_freq

ROPE_TYPES = ("default", "linear", "llama3")  # "yarn": options.py adds it (rope_yarn.py)
# model.qk_norm: RMSNorm of queries and keys before rotary. head (Qwen3, Qwen3-MoE): over each
# head's d, one [d] scale shared by the heads; projection (OLMoE): over the whole projection
# (H*d for queries, K*d for keys) before it is split into heads.
QK_NORMS = ("none", "head", "projection")


@dataclass(frozen=True)
class RopeScaling:
    """Context-extension rescaling of the rotary frequencies (static, hashable).

    linear: every frequency divided by `factor` (positions interpolated).
    llama3: Llama 3.1's rule: wavelengths shorter than original_max_len / high_freq_factor
    kept, longer than original_max_len / low_freq_factor divided by `factor`, and a smooth
    interpolation between the two.
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192
    # yarn (rope_yarn.py): the ramp's ends, their rounding and the cos/sin multiplier.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 0.0

    @classmethod
    def from_config(cls, cfg) -> "RopeScaling | None":
        """The model config's scaling, or None for plain RoPE."""
        rope_type = cfg.rope_type
        if rope_type == "default":
            return None
        scaling = cls(
            rope_type,
            cfg.rope_factor,
            cfg.rope_low_freq_factor,
            cfg.rope_high_freq_factor,
            cfg.rope_original_max_len,
        )
        if rope_type != "yarn":
            return scaling
        return dataclasses.replace(
            scaling,
            beta_fast=cfg.rope_beta_fast,
            beta_slow=cfg.rope_beta_slow,
            truncate=cfg.rope_truncate,
            attention_factor=cfg.rope_attention_factor,
        )

    @property
    def table_factor(self) -> float:
        """What cos and sin are multiplied by (yarn's attention factor; else 1)."""
        if self.rope_type != "yarn":
            return 1.0
        return yarn_attention_factor(self.factor, self.attention_factor)

    def rescale(self, inv_freq: np.ndarray, theta: float = 0.0) -> np.ndarray:
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "yarn":
            return yarn_inv_freq(
                inv_freq,
                theta,
                self.factor,
                self.original_max_len,
                self.beta_fast,
                self.beta_slow,
                self.truncate,
            )
        low_wavelen = self.original_max_len / self.low_freq_factor
        high_wavelen = self.original_max_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (self.original_max_len / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled)


def rope_tables(positions_BL, head_dim: int, theta: float, scaling: RopeScaling | None = None):
    """cos/sin tables [B, L, head_dim/2] for rotary embeddings in the rotate-half layout."""
    if scaling is None:
        inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    else:  # a constant of the config: computed once on the host, in float64
        exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
        inv_freq = jnp.asarray(scaling.rescale(1.0 / theta**exponents, theta), jnp.float32)
    angles = positions_BL.astype(jnp.float32)[..., None] * inv_freq
    factor = 1.0 if scaling is None else scaling.table_factor
    if factor != 1.0:
        return jnp.cos(angles) * factor, jnp.sin(angles) * factor
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x_BLNd, cos_BLh, sin_BLh):
    """Rotate pairs (i, i + d/2): the Llama / Hugging Face layout."""
    half = x_BLNd.shape[-1] // 2
    x1, x2 = x_BLNd[..., :half].astype(jnp.float32), x_BLNd[..., half:].astype(jnp.float32)
    cos, sin = cos_BLh[:, :, None, :], sin_BLh[:, :, None, :]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BLNd.dtype)


class Attention(nnx.Module):
    """Self- or cross-attention with `num_kv_heads` key/value heads.

    Parameters: query [D, H, d], key/value [D, K, d], out [H, d, D].
    `rope_theta` > 0 applies rotary positions (frequencies rescaled by `rope_scaling`);
    `scale_logits=False` is T5's convention of folding 1/sqrt(d) into the query
    initialisation. `qkv_bias` adds biases query_bias [H, d], key_bias/value_bias [K, d]
    to the q/k/v projections, none to the output (Qwen2). `qk_norm` (QK_NORMS) adds
    q_norm / k_norm (layers.RMSNorm, eps `norm_eps`) on the projections, after the biases and
    before rotary; training and cached decoding both project through here.
    GPT-OSS (attention_window.py): `window` > 0 narrows causal self-attention to the last
    `window` keys (decoding: ring_cache.py), `sinks` adds sinks [H] to the softmax
    denominator, `out_bias` a bias out_bias [D] after the output projection.
    `kernel` (attention_kernel.py, model.attention_kernel) picks jaxmoe's XLA path or
    `jax.nn.dot_product_attention`; `causal` promises that self-attention masks are the
    causal mask (the decoder), so a kernel may use its causal mode instead of the mask.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        rope_theta: float = 0.0,
        rope_scaling: RopeScaling | None = None,
        scale_logits: bool = True,
        qkv_bias: bool = False,
        causal_block: int = 0,
        qk_norm: str = "none",
        norm_eps: float = 1e-6,
        dropout_rate: float = 0.0,
        window: int = 0,
        sinks: bool = False,
        out_bias: bool = False,
        kernel: str = XLA,
        causal: bool = False,
        quant: Quantization = NONE,
        context_strategy: str = "all_gather",
        rngs: nnx.Rngs,
    ):
        resolve_attention_kernel(kernel, "cpu")  # an unknown name fails here, by its key
        self.kernel, self.causal = kernel, causal
        self.quant = quant  # the q/k/v/out projections' products (quantization.py)
        self.context_strategy = context_strategy  # mesh.context > 1 (context_parallel.py)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}"
            )
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.causal_block = causal_block
        self.scale = head_dim**-0.5 if scale_logits else None
        q_scale = 1.0 if scale_logits else head_dim**-1.0
        self.query = make_param(
            rngs,
            fan_in_init((0,), q_scale),
            (d_model, num_heads, head_dim),
            ("embed", "heads", "head_dim"),
        )
        kv_shape, kv_axes = (d_model, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim")
        self.key = make_param(rngs, fan_in_init((0,)), kv_shape, kv_axes)
        self.value = make_param(rngs, fan_in_init((0,)), kv_shape, kv_axes)
        self.out = make_param(
            rngs,
            fan_in_init((0, 1)),
            (num_heads, head_dim, d_model),
            ("heads", "head_dim", "embed"),
        )
        self.qkv_bias = qkv_bias
        if qkv_bias:
            zeros = nnx.initializers.zeros_init()
            self.query_bias = make_param(rngs, zeros, (num_heads, head_dim), ("heads", "head_dim"))
            self.key_bias = make_param(rngs, zeros, kv_shape[1:], kv_axes[1:])
            self.value_bias = make_param(rngs, zeros, kv_shape[1:], kv_axes[1:])
        if qk_norm not in QK_NORMS:
            raise ValueError(f"model.qk_norm: got {qk_norm!r}, expected " + " | ".join(QK_NORMS))
        self.qk_norm = qk_norm
        if qk_norm != "none":
            q_width, k_width = (head_dim, head_dim)
            if qk_norm == "projection":
                q_width, k_width = num_heads * head_dim, num_kv_heads * head_dim
            self.q_norm = RMSNorm(q_width, eps=norm_eps, rngs=rngs)
            self.k_norm = RMSNorm(k_width, eps=norm_eps, rngs=rngs)
        # `dropout_rate` > 0: dropout on the probabilities in training (grouped_attention).
        self.probs_dropout = dropout_module(dropout_rate, rngs, share_along_length=False)
        # GPT-OSS (attention_window.py): a causal window of `window` keys (0 = all), learned
        # sink logits sinks [H] ("heads"), and a bias out_bias [D] ("embed") on the output.
        self.window = int(window)
        if sinks:
            self.sinks = make_param(rngs, nnx.initializers.zeros, (num_heads,), ("heads",))
        if out_bias:
            self.out_bias = make_param(rngs, nnx.initializers.zeros, (d_model,), ("embed",))

    def _rope(self, x_BLNd, positions_BL):
        tables = rope_tables(positions_BL, self.head_dim, self.rope_theta, self.rope_scaling)
        return apply_rope(x_BLNd, *tables)

    def _normed(self, norm, x_BLNd):
        if self.qk_norm == "none":
            return x_BLNd
        if self.qk_norm == "head":
            return norm(x_BLNd)
        return norm(x_BLNd.reshape(*x_BLNd.shape[:2], -1)).reshape(x_BLNd.shape)

    def project_q(self, x_BLD, positions_BL=None, train: bool = False):
        q = lora_project(self, "query", x_BLD, self.quant, train=train)
        if self.qkv_bias:
            q = q + self.query_bias[...].astype(q.dtype)
        q = self._normed(getattr(self, "q_norm", None), q)
        if self.rope_theta:
            q = self._rope(q, positions_BL)
        return q

    def project_kv(self, x_BSD, positions_BS=None, train: bool = False):
        dtype = x_BSD.dtype
        k = lora_project(self, "key", x_BSD, self.quant, train=train)
        v = lora_project(self, "value", x_BSD, self.quant, train=train)
        if self.qkv_bias:
            k = k + self.key_bias[...].astype(dtype)
            v = v + self.value_bias[...].astype(dtype)
        k = self._normed(getattr(self, "k_norm", None), k)
        if self.rope_theta:
            k = self._rope(k, positions_BS)
        return k, v

    def project_out(self, o_BLHd, train: bool = False):
        out = lora_project(self, "out", o_BLHd, self.quant, contract=2, train=train)
        if hasattr(self, "out_bias"):
            out = out + self.out_bias[...].astype(out.dtype)
        return out

    def sink_logits(self):
        """The per-head sink logits [H] f32, or None without sinks."""
        return self.sinks[...].astype(jnp.float32) if hasattr(self, "sinks") else None

    def __call__(
        self,
        x_BLD,
        *,
        mask=None,
        bias=None,
        positions_BL=None,
        kv_BSD=None,
        train=False,
        segment_ids_BL=None,
    ):
        """Self-attention over x, or cross-attention to `kv_BSD` when given.

        With `causal_block` set (causal self-attention only) `mask` must be causal.
        `train`: probability dropout on (cached decoding never comes here).
        `segment_ids_BL` (self-attention of packed rows): the documents `mask` already keeps
        apart, for the fused kernels, whose causal mode does not read the mask.
        """
        if isinstance(mask, ContextLayout):  # mesh.context: the sequence split over devices
            return self._context_attention(x_BLD, mask, positions_BL)
        if positions_BL is None and self.rope_theta:
            positions_BL = jnp.broadcast_to(jnp.arange(x_BLD.shape[1]), x_BLD.shape[:2])
        q = self.project_q(x_BLD, positions_BL, train)
        if kv_BSD is None:
            k, v = self.project_kv(x_BLD, positions_BL, train)
        else:
            k, v = self.project_kv(kv_BSD, train=train)
        block = 0
        if kv_BSD is None and self.causal_block:
            block = resolve_causal_block(self.causal_block, x_BLD.shape[1])
        if kv_BSD is None and self.window:
            mask = with_window(mask, x_BLD.shape[1], self.window)
        sinks = self.sink_logits()
        keep_shape = (x_BLD.shape[0], self.num_heads, 1, k.shape[1])
        keep = dropout_multiplier(self.probs_dropout, keep_shape, v.dtype, train)
        if sinks is None and keep is None and bias is None:
            causal = self.causal and kv_BSD is None
            o = self._kernel(q, k, v, mask, causal, segment_ids_BL if kv_BSD is None else None)
            if o is not None:
                return self.project_out(o, train)
        elif (kernel := resolve_attention_kernel(self.kernel, mesh_platform())) != XLA:
            log_once(f"{kernel} takes no {_unsupported(sinks, bias)}")
        if block:
            o = grouped_attention(q, k, v, mask, bias, self.scale, block, keep, sinks)
        else:
            o = query_chunked_attention(q, k, v, mask, bias, self.scale, keep, sinks)
        return self.project_out(o, train)

    def max_logits(self, x_BLD, *, mask, positions_BL=None):
        """Each query head's largest logit q.k * scale over the pairs `mask` allows (causal
        self-attention of x, its window included): f32 [H], for MuonClip
        (training/qk_clip.py). A second q k^T product beside the kernel's, which does not
        expose its logits; XLA shares the projections with the attention's own."""
        if positions_BL is None and self.rope_theta:
            positions_BL = jnp.broadcast_to(jnp.arange(x_BLD.shape[1]), x_BLD.shape[:2])
        q = self.project_q(x_BLD, positions_BL)
        k, _ = self.project_kv(x_BLD, positions_BL)
        if self.window:
            mask = with_window(mask, x_BLD.shape[1], self.window)
        return head_max_logits(q, k, mask, self.scale)

    def _context_attention(self, x_BLD, layout: ContextLayout, positions_BL):
        """Causal self-attention of a sequence split over the context axis
        (context_parallel.py): local queries against the gathered keys and values."""
        q = self.project_q(x_BLD, positions_BL)
        k, v = self.project_kv(x_BLD, positions_BL)
        sinks = self.sink_logits()
        platform = mesh_platform()
        strategy = self.context_strategy

        def refuse(kernel):
            return "" if sinks is None else f"{kernel} takes no {_unsupported(sinks, None)}"

        kernel = context_kernel(self.kernel, q, k, v, layout, strategy=strategy, refuse=refuse)
        o = context_attention(
            q,
            k,
            v,
            layout,
            scale=self.scale,
            window=self.window,
            sinks_H=sinks,
            strategy=self.context_strategy,
            kernel=kernel,
            platform=platform,
        )
        return self.project_out(o)

    def _kernel(self, q, k, v, mask, causal, segment_ids_BL=None):
        """The output through `model.attention_kernel`'s kernel, or None for the XLA path."""
        platform = mesh_platform()
        if resolve_attention_kernel(self.kernel, platform) == XLA:
            return None
        window = self.window if causal else 0
        if resolve_attention_kernel(self.kernel, platform) == SPLASH:
            return self._splash(q, k, v, causal, window, segment_ids_BL)
        return kernel_attention(
            q,
            k,
            v,
            mask=mask,
            causal=causal,
            window=window,
            scale=self.scale,
            platform=platform,
            segment_ids_BL=segment_ids_BL,
        )

    def _splash(self, q, k, v, causal, window, segment_ids_BL=None):
        """Splash attention (TPU) for causal self-attention, else None (the XLA path)."""
        from jaxmoe.models.splash_attention import splash_attention, splash_refusal

        reason = "not causal self-attention" if not causal else splash_refusal(q.shape[1])
        if reason:
            log_once(f"splash attention refuses {reason}")
            return None
        return splash_attention(
            q, k, v, scale=self.scale, window=window, segment_ids_BL=segment_ids_BL
        )


def _unsupported(sinks, bias) -> str:
    """What of this attention the kernels cannot express (the XLA path runs it)."""
    if sinks is not None:
        return "learned sinks (a softmax logit without a value)"
    if bias is not None:
        return "additive bias (T5's relative positions)"
    return "attention-probability dropout"
