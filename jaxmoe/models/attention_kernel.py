"""Which kernel computes softmax(q k^T) v: jaxmoe's XLA path or `jax.nn.dot_product_attention`.

`model.attention_kernel`:
- "xla": jaxmoe's own einsums (attention.py: query-chunked and rematerialised, or
  blocked-causal on CPU). Every feature: masks, biases, sinks, probability dropout.
- "dot_product_attention": `jax.nn.dot_product_attention`, with implementation="cudnn"
  (cuDNN's fused flash attention) on GPU and XLA's own lowering elsewhere. The causal
  mode skips the masked half of the work; GQA groups share K/V inside the kernel.
- "auto": dot_product_attention on GPU, xla elsewhere.

The platform is that of the mesh in context, else the default backend (platform.py).

What the kernel cannot express keeps the XLA path: learned sinks (GPT-OSS: an extra
logit in the denominator with no value), attention-probability dropout and additive
biases (T5's relative positions). MLA (keys wider than values) pads its values to the
keys' width to use it. Where cuDNN refuses a shape or dtype (f32, head_dim over the
limit, odd lengths with a mask in training, no cuDNN) the call also keeps the XLA path.
Either way, where the kernel was asked for (`auto` on GPU), the log says why once per
reason (logger "jaxmoe"), and `jaxmoe compile` lists the reasons of its trace.
"""

import logging

import jax
import jax.numpy as jnp

from jaxmoe.models.platform import mesh_platform
from jaxmoe.parallel.chips import gpu_of_kind

log = logging.getLogger("jaxmoe")

XLA, DOT_PRODUCT_ATTENTION, AUTO = "xla", "dot_product_attention", "auto"
SPLASH = "splash"  # Pallas splash attention, TPU (splash_attention.py)
ATTENTION_KERNELS = (AUTO, XLA, DOT_PRODUCT_ATTENTION, SPLASH)
CUDNN_DTYPES = (jnp.float16, jnp.bfloat16)
_logged: set[str] = set()  # reasons already logged: one line each per process
_times: dict[str, int] = {}  # how often each reason kept an attention on the XLA path


def resolve_attention_kernel(name: str, platform: str | None = None) -> str:
    """The kernel to run for `model.attention_kernel` = name on `platform` (mesh_platform())."""
    if name not in ATTENTION_KERNELS:
        raise ValueError(
            f"model.attention_kernel: got {name!r}, expected {' | '.join(ATTENTION_KERNELS)}"
        )
    if name != AUTO:
        return name
    return DOT_PRODUCT_ATTENTION if (platform or mesh_platform()) == "gpu" else XLA


def implementation(platform: str) -> str | None:
    """`jax.nn.dot_product_attention`'s implementation for `platform`: cuDNN on GPU."""
    return "cudnn" if platform == "gpu" else None


def cudnn_refusal(q_BLHd, k_BSKd, v_BSKd, *, masked: bool, head_dim_max: int = 128) -> str:
    """Why cuDNN's flash attention would refuse these operands ("" = it takes them).

    The limits of jax's cuDNN wrapper, checked here up front because its training-time
    check runs when the backward pass is traced, out of reach of a fallback: fp16/bf16
    only; q, k and v of one width, at most `head_dim_max` (128; 256 from Hopper on) and
    a multiple of 8; with a mask (passed to cuDNN as a bias) even query and key lengths.
    """
    d = q_BLHd.shape[-1]
    if q_BLHd.dtype not in CUDNN_DTYPES:
        return f"dtype {q_BLHd.dtype} (cuDNN takes float16/bfloat16)"
    if k_BSKd.shape[-1] != d or v_BSKd.shape[-1] != d:
        return f"q/k/v widths {d}/{k_BSKd.shape[-1]}/{v_BSKd.shape[-1]} differ"
    if d > head_dim_max or d % 8:
        return f"head_dim {d} (cuDNN: a multiple of 8, at most {head_dim_max})"
    if masked and (q_BLHd.shape[1] % 2 or k_BSKd.shape[1] % 2):
        return f"odd lengths {q_BLHd.shape[1]}/{k_BSKd.shape[1]} with a mask"
    return ""


def head_dim_max() -> int:
    """256 on Hopper and later GPUs, else 128 (cuDNN's flash-attention head widths): of the
    GPU the mesh in context is made of (a compile-only one too), else of this host's."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    kind = getattr(device, "device_kind", None)
    target = gpu_of_kind(kind) if kind else None
    if target is not None:
        return 256 if target.compute_capability >= (9, 0) else 128
    try:
        capability = jax.devices("gpu")[0].compute_capability
        return 256 if float(capability) >= 9.0 else 128
    except (RuntimeError, AttributeError, ValueError):
        return 128


def fallbacks() -> list[str]:
    """The refusals logged so far in this process (each once), for reports."""
    return sorted(_logged)


def fallback_counts() -> dict[str, int]:
    """How often each reason kept an attention on the XLA path so far (a trace's reasons are
    those whose count grew while it ran)."""
    return dict(_times)


def log_once(reason: str) -> None:
    _times[reason] = _times.get(reason, 0) + 1
    if reason not in _logged:
        _logged.add(reason)
        log.warning("attention: %s; this attention keeps the XLA path", reason)


def kernel_attention(
    q_BLHd, k_BSKd, v_BSKd, *, mask, causal, window, scale, platform, segment_ids_BL=None
):
    """softmax(q k^T * scale, masked) v through `jax.nn.dot_product_attention`, or None
    where cuDNN refuses these operands (the caller then runs the XLA path; logged once).

    q [B, L, H, d], k/v [B, S, K, d], K dividing H. causal: self-attention whose mask is
    the causal one (then `mask` is not read: the kernel's causal mode replaces it), and
    `window` > 0 narrows it to keys q - window < k <= q; `segment_ids_BL` (packed rows)
    then keeps documents apart: jax's API takes no segment ids, so they go in as a mask
    [B, 1, L, L] beside the causal mode (cuDNN adds it as a bias). Otherwise `mask` (bool
    broadcastable to [B, L, S], or None) says which keys each query may see.
    Returns [B, L, H, d].
    """
    impl = implementation(platform)
    dpa_mask = None if causal or mask is None else jnp.asarray(mask)[:, None]
    if causal and segment_ids_BL is not None:
        dpa_mask = (segment_ids_BL[:, :, None] == segment_ids_BL[:, None, :])[:, None]
    if impl == "cudnn":
        masked = dpa_mask is not None
        reason = cudnn_refusal(q_BLHd, k_BSKd, v_BSKd, masked=masked, head_dim_max=head_dim_max())
        if reason:
            log_once(f"cuDNN refuses {reason}")
            return None
    try:
        return jax.nn.dot_product_attention(
            q_BLHd,
            k_BSKd,
            v_BSKd,
            mask=dpa_mask,
            scale=1.0 if scale is None else float(scale),
            is_causal=bool(causal),
            local_window_size=(window - 1, 0) if causal and window else None,
            implementation=impl,
        )
    except (NotImplementedError, RuntimeError, ValueError) as error:
        if impl is None:
            raise
        log_once(f"cuDNN refuses {q_BLHd.shape} {q_BLHd.dtype}: {str(error).splitlines()[0]}")
        return None
