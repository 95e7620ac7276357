"""Multi-head latent attention (MLA, DeepSeek-V2/V3): keys and values rebuilt from a latent.

Per token the input x [D] is compressed to a latent c = RMSNorm(x W_down[:, :r]) [r] and
one rotary key k_rope = rope(x W_down[:, r:]) [dr] shared by every head. Head h's key is
[c W_kup[h, :dn], k_rope] and its value c W_kup[h, dn:] ([dn + dr] and [dv] wide). Queries
are x W_q (or, with `q_lora_rank`, RMSNorm(x W_qdown) W_qup), split per head into dn plain
and dr rotary dims. Because the up-projection is linear, decoding never rebuilds the keys:
the cache holds only c and k_rope per token (latent_cache.py) and the query is multiplied
into W_kup instead (the "absorbed" form).

Rotary dims use DeepSeek's interleaved layout: pairs (2i, 2i + 1) rotate together (the
Llama layout pairs i with i + dr/2). YaRN (`rope_type="yarn"`) rescales the rotary
frequencies and adds two magnitude corrections: the rotary parts of q and k are multiplied
by `attention_factor`, and the softmax scale by mscale(factor, mscale_all_dim)**2.

Parameters (logical axes for sharding.py): query [D, H, dn + dr] or q_down [D, rq] + q_norm
+ q_up [rq, H, dn + dr]; kv_down [D, r + dr]; kv_norm [r]; kv_up [r, H, dn + dv];
out [H, dv, D]. The latent axis is never sharded; heads split over `tensor` as in GQA.
"""

import math
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmoe.models.attention import (
    RopeScaling,
    grouped_attention,
    head_max_logits,
    query_chunked_attention,
    resolve_causal_block,
)
from jaxmoe.models.attention_kernel import (
    SPLASH,
    XLA,
    kernel_attention,
    log_once,
    resolve_attention_kernel,
)
from jaxmoe.models.context_kernels import context_kernel
from jaxmoe.models.context_parallel import ContextLayout, context_attention, gather_length
from jaxmoe.models.layers import RMSNorm, adapted_weight, fan_in_init, lora_project, make_param
from jaxmoe.models.platform import mesh_platform
from jaxmoe.models.quantization import Quantization

ATTENTION_KINDS = ("gqa", "mla")
LATENT_AXIS = "latent"
# DeepSeek's q_a_layernorm / kv_a_layernorm keep their own eps (1e-6 in the reference code
# and in transformers) whatever rms_norm_eps the block norms use.
LATENT_NORM_EPS = 1e-6


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class Yarn:
    """YaRN frequency interpolation (static, hashable): dims that turn fewer than
    `beta_slow` times over the original context are interpolated (divided by `factor`),
    those turning more than `beta_fast` times kept, with a linear ramp between."""

    factor: float
    original_max_len: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # 0: not given
    mscale_all_dim: float = 0.0  # 0: not given
    attention_factor: float = 0.0  # 0: derived from factor and the mscales
    truncate: bool = True

    @classmethod
    def from_config(cls, cfg) -> "Yarn":
        return cls(
            cfg.rope_factor,
            cfg.rope_original_max_len,
            cfg.rope_beta_fast,
            cfg.rope_beta_slow,
            cfg.rope_mscale,
            cfg.rope_mscale_all_dim,
            cfg.rope_attention_factor,
            cfg.rope_truncate,
        )

    def rotary_factor(self) -> float:
        """What the rotated q and k parts are multiplied by."""
        if self.attention_factor:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)

    def score_factor(self) -> float:
        """What the softmax scale 1/sqrt(dn + dr) is multiplied by."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

    def inv_freq(self, dim: int, theta: float) -> np.ndarray:
        exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
        extrapolated = 1.0 / theta**exponents
        interpolated = extrapolated / self.factor

        def correction_dim(rotations):  # the dim index turning `rotations` times
            turns = self.original_max_len / (rotations * 2 * math.pi)
            return dim * math.log(turns) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # a one-step ramp instead of a division by zero
        ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
        return interpolated * ramp + extrapolated * (1 - ramp)


def rotary_tables(positions_BL, dim: int, theta: float, scaling):
    """cos/sin [B, L, dim/2] (times YaRN's rotary factor) for `rope_interleaved`.
    scaling: None, a RopeScaling (linear / llama3) or a Yarn."""
    base = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    factor = 1.0
    if isinstance(scaling, Yarn):
        base, factor = scaling.inv_freq(dim, theta), scaling.rotary_factor()
    elif scaling is not None:
        base = scaling.rescale(base)
    angles = positions_BL.astype(jnp.float32)[..., None] * jnp.asarray(base, jnp.float32)
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def rope_interleaved(x_BLNr, cos_BLh, sin_BLh):
    """Rotate adjacent pairs (2i, 2i + 1) by angle i: DeepSeek's layout. x [B, L, N, r]."""
    b, l, n, r = x_BLNr.shape
    pairs = x_BLNr.astype(jnp.float32).reshape(b, l, n, r // 2, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos_BLh[:, :, None, :], sin_BLh[:, :, None, :]
    rotated = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.reshape(b, l, n, r).astype(x_BLNr.dtype)


def rope_scaling_of(cfg):
    """The model config's rotary scaling for MLA: None, a RopeScaling or a Yarn."""
    if cfg.rope_type == "yarn":
        return Yarn.from_config(cfg)
    return RopeScaling.from_config(cfg)


class LatentAttention(nnx.Module):
    """Causal MLA self-attention of a decoder block (model.attention="mla")."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        d, h = cfg.d_model, cfg.num_heads
        self.num_heads = h
        self.q_rank, self.rank = cfg.q_lora_rank, cfg.kv_lora_rank
        self.nope, self.rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.rope_theta = cfg.rope_theta
        self.rope_scaling = rope_scaling_of(cfg)
        self.causal_block = cfg.attention_block
        self.quant = Quantization.from_config(cfg)  # the projections' products
        self.kernel = cfg.attention_kernel
        qk = self.nope + self.rope
        score_factor = self.rope_scaling.score_factor() if self.rope_scaling_is_yarn else 1.0
        self.scale = qk**-0.5 * score_factor
        head_axes = ("heads", "head_dim")
        if self.q_rank:
            self.q_down = make_param(
                rngs, fan_in_init((0,)), (d, self.q_rank), ("embed", LATENT_AXIS)
            )
            self.q_norm = RMSNorm(self.q_rank, eps=LATENT_NORM_EPS, rngs=rngs)
            self.q_up = make_param(
                rngs, fan_in_init((0,)), (self.q_rank, h, qk), (LATENT_AXIS, *head_axes)
            )
        else:
            self.query = make_param(rngs, fan_in_init((0,)), (d, h, qk), ("embed", *head_axes))
        self.kv_down = make_param(
            rngs, fan_in_init((0,)), (d, self.rank + self.rope), ("embed", LATENT_AXIS)
        )
        self.kv_norm = RMSNorm(self.rank, eps=LATENT_NORM_EPS, rngs=rngs)
        self.kv_up = make_param(
            rngs,
            fan_in_init((0,)),
            (self.rank, h, self.nope + self.v_dim),
            (LATENT_AXIS, *head_axes),
        )
        self.out = make_param(
            rngs, fan_in_init((0, 1)), (h, self.v_dim, d), ("heads", "head_dim", "embed")
        )

    @property
    def rope_scaling_is_yarn(self) -> bool:
        return isinstance(self.rope_scaling, Yarn)

    def _rotate(self, x_BLNr, positions_BL):
        tables = rotary_tables(positions_BL, self.rope, self.rope_theta, self.rope_scaling)
        return rope_interleaved(x_BLNr, *tables)

    def project_q(self, x_BLD, positions_BL, train: bool = False):
        """(q_nope [B, L, H, dn], rotated q_rope [B, L, H, dr])."""
        if self.q_rank:
            low = lora_project(self, "q_down", x_BLD, self.quant, train=train)
            q = lora_project(self, "q_up", self.q_norm(low), self.quant, train=train)
        else:
            q = lora_project(self, "query", x_BLD, self.quant, train=train)
        return q[..., : self.nope], self._rotate(q[..., self.nope :], positions_BL)

    def project_latent(self, x_BSD, positions_BS, train: bool = False):
        """(normed latent [B, S, r], rotated shared key [B, S, dr]): what the cache holds."""
        both = lora_project(self, "kv_down", x_BSD, self.quant, train=train)
        latent = self.kv_norm(both[..., : self.rank])
        rope_key = self._rotate(both[..., None, self.rank :], positions_BS)[:, :, 0]
        return latent, rope_key

    def key_up(self, dtype):
        """W_kup [r, H, dn]: latent -> the heads' plain keys."""
        return adapted_weight(self, "kv_up", dtype)[..., : self.nope]

    def value_up(self, dtype):
        """W_vup [r, H, dv]: latent -> the heads' values."""
        return adapted_weight(self, "kv_up", dtype)[..., self.nope :]

    def project_out(self, o_BLHv, train: bool = False):
        return lora_project(self, "out", o_BLHv, self.quant, contract=2, train=train)

    def expanded_qkv(self, x_BLD, positions_BL=None, gather: bool = False, train: bool = False):
        """Training / eval: (q [B, L, H, dn + dr], k [B, S, H, dn + dr], v [B, S, H, dv]),
        the rotary key shared by every head. `gather` (mesh.context): the latent of the
        whole sequence gathered first, so k and v cover all of it (S = the full length).
        `train`: LoRA dropout on the adapters' input."""
        b, l, _ = x_BLD.shape
        if positions_BL is None:
            positions_BL = jnp.broadcast_to(jnp.arange(l), (b, l))
        q_nope, q_rope = self.project_q(x_BLD, positions_BL, train)
        latent, rope_key = self.project_latent(x_BLD, positions_BL, train)
        if gather:  # every context device gathers the latent and expands all of it
            latent, rope_key = gather_length(latent), gather_length(rope_key)
        kv = lora_project(self, "kv_up", latent, self.quant, train=train)
        k_nope, v = kv[..., : self.nope], kv[..., self.nope :]
        h = self.num_heads
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        s = latent.shape[1]
        k = jnp.concatenate(
            [k_nope, jnp.broadcast_to(rope_key[:, :, None], (b, s, h, self.rope))], axis=-1
        )
        return q, k, v

    def max_logits(self, x_BLD, *, mask, positions_BL=None):
        """Each head's largest logit over the pairs `mask` allows: f32 [H] (MuonClip)."""
        q, k, _ = self.expanded_qkv(x_BLD, positions_BL)
        return head_max_logits(q, k, mask, self.scale)

    def __call__(self, x_BLD, *, mask=None, positions_BL=None, train=False, segment_ids_BL=None):
        """Training / eval: keys and values expanded per head, the GQA kernels with K = H.
        `segment_ids_BL` (packed rows): the documents `mask` keeps apart, for a fused
        kernel's causal mode, which reads no mask."""
        l = x_BLD.shape[1]  # no attention dropout in MLA models (train: LoRA dropout)
        context = isinstance(mask, ContextLayout)  # mesh.context: the sequence split
        q, k, v = self.expanded_qkv(x_BLD, positions_BL, gather=context, train=train)
        # The kernels take one head width for q, k and v: pad the narrower side with zeros
        # (zeros add nothing to q.k, and padded value dims are cut off below).
        width = max(q.shape[-1], self.v_dim)
        q, k, v = (_pad_last(a, width) for a in (q, k, v))
        o = None if context else self._kernel(q, k, v, mask, segment_ids_BL)
        if o is None:
            block = resolve_causal_block(self.causal_block, l) if self.causal_block else 0
            if context:  # the gathered latent's keys: all-gather's kernels, any strategy
                kernel = context_kernel(
                    self.kernel, q, k, v, mask, strategy="all_gather", refuse=_refuse_splash
                )
                options = dict(gathered=True, kernel=kernel, platform=mesh_platform())
                o = context_attention(q, k, v, mask, scale=self.scale, **options)
            elif block:
                o = grouped_attention(q, k, v, mask, None, self.scale, block)
            else:
                o = query_chunked_attention(q, k, v, mask, None, self.scale)
        return self.project_out(o[..., : self.v_dim], train)

    def _kernel(self, q, k, v, mask, segment_ids_BL=None):
        """Causal self-attention through `model.attention_kernel`'s kernel (cuDNN's flash
        attention on GPU, at the padded width), or None for the XLA path."""
        platform = mesh_platform()
        kernel = resolve_attention_kernel(self.kernel, platform)
        if kernel == XLA:
            return None
        if kernel == SPLASH:
            log_once(_refuse_splash(kernel))
            return None
        return kernel_attention(
            q,
            k,
            v,
            mask=mask,
            causal=True,
            window=0,
            scale=self.scale,
            platform=platform,
            segment_ids_BL=segment_ids_BL,
        )


def _refuse_splash(kernel: str) -> str:
    return "splash attention takes no multi-head latent attention" if kernel == SPLASH else ""


def _pad_last(x, width: int):
    extra = width - x.shape[-1]
    return x if not extra else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])
