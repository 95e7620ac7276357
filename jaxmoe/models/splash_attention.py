"""`model.attention_kernel=splash`: causal self-attention through Pallas splash attention.

`jax.experimental.pallas.ops.tpu.splash_attention` is a TPU flash-attention kernel (Mosaic)
driven by a static block mask: the blocks above the diagonal (and, for a sliding window,
those before it) are skipped, not masked, and no [L, S] scores exist outside VMEM, forward
or backward (its own VJP kernels). GQA groups read their K/V head inside the kernel.

It takes causal self-attention of one sequence length (the decoder's training and scoring
path), with `window` > 0 narrowing it to the keys q - window < k <= q, and the segment ids of
packed rows (the kernel's SegmentIds: documents never see each other). Inputs are split
over the mesh as the trainer lays out activations: batch over ("data", "fsdp", "expert"),
heads over "tensor" (each by the axes that divide it), one kernel per device under
`jax.shard_map`, vmapped over the local batch.

Lowered for TPU the kernel is Mosaic; lowered for CPU it runs in Pallas' interpret mode
(correct, slow: for tests). Lengths that are not a multiple of LANES give None (the
caller keeps the XLA path).
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

BLOCK = 512  # query / key block of the forward and backward kernels (at most the length)
LANES = 128  # a key block is a whole number of TPU lanes
BATCH_AXES = ("data", "fsdp", "expert")
HEADS_AXIS = "tensor"


def splash_refusal(length: int) -> str:
    """Why splash attention cannot take a sequence of `length` ("" = it can)."""
    if length % LANES:
        return f"length {length} is not a multiple of {LANES} (splash attention)"
    if length % min(BLOCK, length):
        return f"length {length} is not a multiple of the block {BLOCK} (splash attention)"
    return ""


def block_sizes(block_q: int, block_kv: int):
    """Splash's block sizes: `block_q` queries by `block_kv` keys in every kernel, forward
    and backward."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    return splash.BlockSizes(
        block_q=block_q,
        block_kv=block_kv,
        block_kv_compute=block_kv,
        block_q_dkv=block_q,
        block_kv_dkv=block_kv,
        block_kv_dkv_compute=block_kv,
        block_q_dq=block_q,
        block_kv_dq=block_kv,
    )


def _make_kernel(length: int, heads: int, window: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    shape = (length, length)
    mask: splash.Mask
    if window:
        mask = splash.LocalMask(shape, (window - 1, 0), offset=0)
    else:
        mask = splash.CausalMask(shape)
    block = min(BLOCK, length)
    return splash.make_splash_mha(
        splash.MultiHeadMask([mask] * heads),
        block_sizes=block_sizes(block, block),
        head_shards=1,
        q_seq_shards=1,
        interpret=interpret,
    )


def _local_splash(q_BHLd, k_BKLd, v_BKLd, segments_BL=None, *, window: int):
    """One device's causal attention, [B, H, L, d] -> [B, H, L, d]; `segments_BL` (packed
    rows) keeps documents apart (the kernel's SegmentIds, and-ed with its causal mask)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    heads, length = q_BHLd.shape[1:3]

    def run(interpret, q, k, v, *segments):
        kernel = _make_kernel(length, heads, window, interpret)
        if not segments:
            return jax.vmap(kernel)(q, k, v)
        ids = splash.SegmentIds(q=segments[0], kv=segments[0])
        return jax.vmap(kernel)(q, k, v, segment_ids=ids)

    operands = (q_BHLd, k_BKLd, v_BKLd) + (() if segments_BL is None else (segments_BL,))
    return jax.lax.platform_dependent(
        *operands,
        cpu=functools.partial(run, True),
        default=functools.partial(run, False),
    )


def _specs(mesh, batch: int, kv_heads: int) -> P:
    """(batch, heads) of the operands inside shard_map: batch over the batch axes that
    divide it, heads over "tensor" when it divides the KV heads (so every device keeps whole
    GQA groups)."""
    axes, split = [], 1
    for axis in BATCH_AXES:
        size = mesh.shape.get(axis, 1)
        if size > 1 and batch % (split * size) == 0:
            axes.append(axis)
            split *= size
    tensor = mesh.shape.get(HEADS_AXIS, 1)
    heads = HEADS_AXIS if tensor > 1 and kv_heads % tensor == 0 else None
    return P(tuple(axes) or None, heads)


def splash_attention(q_BLHd, k_BLKd, v_BLKd, *, scale=None, window: int = 0, segment_ids_BL=None):
    """Causal softmax(q k^T * scale) v, [B, L, H, d] with k/v [B, L, K, d], K dividing H,
    within each document of `segment_ids_BL` [B, L] (packed rows; None = one per row);
    None when the length does not suit the kernel (splash_refusal)."""
    batch, length = q_BLHd.shape[:2]
    if splash_refusal(length):
        return None
    attend = functools.partial(local_splash_attention, scale=scale, window=int(window))
    operands = (q_BLHd, k_BLKd, v_BLKd) + (() if segment_ids_BL is None else (segment_ids_BL,))
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1:
        spec = _specs(mesh, batch, k_BLKd.shape[2])
        spec = P(spec[0], None, spec[1])  # [B, L, H, d]
        segment_spec = P(spec[0])  # [B, L]: the batch split as q's
        specs = (spec,) * 3 + (() if segment_ids_BL is None else (segment_spec,))
        # The kernel's custom VJP carries no varying-axis annotations (as the MoE's).
        attend = jax.shard_map(attend, mesh=mesh, in_specs=specs, out_specs=spec, check_vma=False)
    return attend(*operands)


def local_splash_attention(q_BLHd, k_BLKd, v_BLKd, segment_ids_BL=None, *, scale, window):
    """`splash_attention` on one device's operands (inside shard_map or on one device)."""
    if scale is not None:
        q_BLHd = q_BLHd * jnp.asarray(scale, q_BLHd.dtype)
    q, k, v = (a.transpose(0, 2, 1, 3) for a in (q_BLHd, k_BLKd, v_BLKd))
    return _local_splash(q, k, v, segment_ids_BL, window=window).transpose(0, 2, 1, 3)
