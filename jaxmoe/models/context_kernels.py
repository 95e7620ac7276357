"""The fused attention kernels inside each context-parallel chunk (context_parallel.py).

Under `mesh.context` each device holds an early and a late chunk of the sequence (the
load-balanced layout) and, with the all-gather strategy, the keys and values of the whole
sequence. Its queries' causal boundaries are therefore not those of a square causal mask:
query j of the device sits at original position order[j]. Each kernel is told so:

- splash (TPU, `model.attention_kernel=splash`): one kernel over the whole split sequence,
  its mask rows in the split layout (`OrderedCausalMask`: row j is query order[j], key k
  the k-th token of the sequence) and its query rows sharded over the context axis
  (`q_seq_shards`), so each device runs the rows of its own two chunks and skips the
  blocks above each chunk's diagonal and (for a window) before it. Keys arrive in sequence
  order so that the skipped blocks are whole kernel blocks.
- jax.nn.dot_product_attention (cuDNN on GPU, XLA's lowering elsewhere): per piece of
  queries (contiguous positions within one chunk), the causal/window/document mask as the
  kernel's mask and `key_value_seq_lengths` = the piece's last position + 1, so the kernel
  reads no key past the piece's end (cuDNN's padding mask bounds its key loop). The kernel's
  own causal mode aligns the diagonal to the top-left corner of each call, which is not the
  chunk's (its queries start at an offset); the explicit mask is.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.models.attention_kernel import (
    SPLASH,
    XLA,
    cudnn_refusal,
    head_dim_max,
    implementation,
    log_once,
    resolve_attention_kernel,
)
from jaxmoe.models.attention_math import piece_queries
from jaxmoe.models.platform import mesh_platform
from jaxmoe.models.splash_attention import BLOCK, LANES, block_sizes, splash_refusal


def context_kernel(requested: str, q, k, v, layout, *, strategy: str, refuse=None) -> str:
    """The kernel that computes one attention under mesh.context: `model.attention_kernel`
    = `requested` resolved for the mesh's platform, or XLA where it cannot take these
    operands (`refuse(kernel)`: the caller's own reason, e.g. sinks, or ""); the reason is
    logged once, as unsplit attention's are. q/k/v [B, L, heads, d] (the whole length)."""
    platform = mesh_platform()
    kernel = resolve_attention_kernel(requested, platform)
    if kernel == XLA:
        return XLA
    refusal = refuse(kernel) if refuse else ""
    if not refusal and strategy == "ring":
        refusal = f"{kernel} does not run inside ring attention's blocks (model.context_strategy)"
    # Ulysses attends the whole sequence with the kernel's own causal mode (a document mask
    # beside it for packed rows); all-gather masks each piece of queries.
    whole = strategy == "ulysses"
    if not refusal and kernel == SPLASH:
        length = q.shape[1]
        refusal = splash_refusal(length) if whole else splash_context_refusal(length, layout.parts)
    if not refusal and platform == "gpu":
        masked = layout.segment_ids_BL is not None if whole else True
        reason = cudnn_refusal(q, k, v, masked=masked, head_dim_max=head_dim_max())
        refusal = reason and f"cuDNN refuses {reason}"
    if refusal:
        log_once(refusal)
        return XLA
    return kernel


def splash_context_refusal(length: int, parts: int) -> str:
    """Why splash cannot run the chunks of a `length` sequence over `parts` devices."""
    local = length // parts
    if length % LANES:
        return f"length {length} is not a multiple of {LANES} (splash attention)"
    if length % min(BLOCK, length):
        return f"length {length} is not a multiple of the block {BLOCK} (splash attention)"
    if local % LANES or local % min(BLOCK, local):
        return (
            f"{local} queries per context device (length {length} / mesh.context {parts}) "
            f"are not a multiple of {LANES} and of the block {BLOCK} (splash attention)"
        )
    return ""


@functools.cache  # one class, so that equal masks are equal (splash caches by mask)
def _mask_class():
    from jax.experimental.pallas.ops.tpu.splash_attention import CausalMask

    class OrderedCausalMask(CausalMask):
        """Causal (and windowed) mask whose row j is the query at original position
        order[j] and whose column k is key k: splash's causal mask (computed inside the
        kernel) with its query sequence replaced by the split layout's order (the kernel
        reads the query positions of its shard from it, and computes the key positions)."""

        def __init__(self, order: np.ndarray, window: int):
            super().__init__((len(order), len(order)))
            self.window = window

            def allowed(q_ids, kv_ids):
                causal = q_ids >= kv_ids
                return causal if not window else causal & (q_ids - kv_ids < window)

            self.mask_function = allowed
            self.q_sequence = np.asarray(order, np.int32)

        def __eq__(self, other):
            if not isinstance(other, type(self)):
                return NotImplemented
            same = self.shape == other.shape and self.window == other.window
            return same and np.array_equal(self.q_sequence, other.q_sequence)

        def __hash__(self):
            return hash((type(self), self.shape, self.window, self.q_sequence.tobytes()))

    return OrderedCausalMask


def _splash_kernel(order: np.ndarray, heads: int, window: int, parts: int):
    """The splash kernel of one split layout. Built in each trace (its arrays are that
    trace's constants); the block masks it walks on the host are cached by splash itself
    (process_mask, keyed by the mask's hash)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    length = len(order)
    mask = _mask_class()(order, window)
    return splash.make_splash_mha(
        splash.MultiHeadMask([mask] * heads),
        block_sizes=block_sizes(min(BLOCK, length // parts), min(BLOCK, length)),
        head_shards=1,
        q_seq_shards=parts,
    )


def splash_kernel_and_spec(order: np.ndarray, heads: int, window: int, parts: int, axis: str):
    """(kernel, its shard_map spec): the kernel's block masks split over `axis` by query
    rows, so each device receives those of its own chunks."""
    kernel = _splash_kernel(order, heads, int(window), parts)
    mesh = jax.sharding.get_abstract_mesh()
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, axis))
    return kernel, kernel.manual_sharding_spec(sharding)


def splash_chunks(kernel, q_BLHd, k_BSKd, v_BSKd, seg_q, seg_k, *, scale):
    """One device's queries (split layout) against the whole sequence's keys/values (in
    sequence order) through its shard of `kernel`; seg_q / seg_k: document ids (packed
    rows) of the queries and keys, or None. Runs inside shard_map; [B, L/N, H, d]."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    if scale is not None:
        q_BLHd = q_BLHd * jnp.asarray(scale, q_BLHd.dtype)
    q, k, v = (a.transpose(0, 2, 1, 3) for a in (q_BLHd, k_BSKd, v_BSKd))

    def run(interpret, q, k, v, *segments):
        local = type(kernel)(
            kernel.fwd_mask_info,
            kernel.dq_mask_info,
            kernel.dkv_mask_info,
            **{**kernel.kwargs, "interpret": interpret},
        )
        if not segments:
            return jax.vmap(local)(q, k, v)
        ids = splash.SegmentIds(q=segments[0], kv=segments[1])
        return jax.vmap(local)(q, k, v, segment_ids=ids)

    operands = (q, k, v) + (() if seg_q is None else (seg_q, seg_k))
    out = jax.lax.platform_dependent(
        *operands,
        cpu=functools.partial(run, True),
        default=functools.partial(run, False),
    )
    return out.transpose(0, 2, 1, 3)


def dpa_chunks(q_BLHd, k_BSKd, v_BSKd, q_at_L, seg_q, seg_k, *, scale, window, platform):
    """One device's queries against the whole sequence's keys/values (in sequence order)
    through `jax.nn.dot_product_attention` (cuDNN on GPU), a piece of queries at a time.

    q_at_L: the original positions of the local queries; a piece's keys past its last
    position are cut off by `key_value_seq_lengths` (never read), those before it masked
    by causality, the window and the documents. Runs inside shard_map; [B, L/N, H, d].
    """
    b, local, h, d = q_BLHd.shape
    length = k_BSKd.shape[1]
    chunk = piece_queries(local // 2, h, length)  # dividing a chunk: each piece in one
    pieces = local // chunk
    k_at_S = jnp.arange(length)
    impl = implementation(platform)

    def piece(xs):
        q_C, at_C, seg_C = xs
        allowed_CS = k_at_S[None, :] <= at_C[:, None]
        if window:
            allowed_CS &= k_at_S[None, :] > at_C[:, None] - window
        mask = jnp.broadcast_to(allowed_CS[None, None], (b, 1, chunk, length))
        if seg_C is not None:
            mask = mask & (seg_C[:, :, None] == seg_k[:, None, :])[:, None]
        ends = jnp.broadcast_to(at_C[-1] + 1, (b,)).astype(jnp.int32)
        return jax.nn.dot_product_attention(
            q_C,
            k_BSKd,
            v_BSKd,
            mask=mask,
            scale=1.0 if scale is None else float(scale),
            key_value_seq_lengths=ends,
            implementation=impl,
        )

    def by_piece(a_BL):  # [B, L, ...] -> [pieces, B, chunk, ...]
        return jnp.moveaxis(a_BL.reshape(b, pieces, chunk, *a_BL.shape[2:]), 1, 0)

    if impl is None:  # XLA's lowering keeps its [C, S] probabilities unless rematerialised
        piece = jax.checkpoint(piece)
    seg_P = None if seg_q is None else by_piece(seg_q)
    out = jax.lax.map(piece, (by_piece(q_BLHd), q_at_L.reshape(pieces, chunk), seg_P))
    return jnp.moveaxis(out, 0, 1).reshape(b, local, h, d)
