"""`mesh.context`: each sequence split over the context axis, attention over all of it.

Layout. With N devices on the axis, a sequence of L tokens is cut into 2N chunks of
L / 2N and device i holds chunks i and 2N - 1 - i (an early and a late one), so under a
causal mask every device has the same number of (query, earlier key) pairs. The decoder
reorders its inputs (tokens, positions, document ids) into this layout once, runs every
block on the reordered tokens (norms, FFNs and MoE routing do not care about order; rotary
positions travel with their tokens) and puts the last hidden states back in order before the
output layer, so the logits, the loss and every gradient are the unsplit model's.

Attention ("all-gather KV"). Each device keeps its own queries and gathers the keys and
values of the whole sequence over the axis (`all_gather`; its transpose, a reduce-scatter,
returns their gradients). GQA/MQA gather the K/V heads, never the queries; MLA gathers the
compressed latent and expands it per device (LatentAttention). The mask is rebuilt on each
device from the original token indices of its queries and of all keys: causal, the sliding
window, and same-document for packed rows, so nothing [L, L] is ever materialised outside
the per-device query pieces.
"""

import functools
from dataclasses import dataclass
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxmoe.models.attention_kernel import SPLASH, XLA, kernel_attention
from jaxmoe.models.attention_math import grouped_attention, piece_queries
from jaxmoe.models.context_kernels import dpa_chunks, splash_chunks, splash_kernel_and_spec
from jaxmoe.models.ring_attention import ring_attention
from jaxmoe.models.splash_attention import local_splash_attention
from jaxmoe.models.ulysses_attention import ulysses_attention
from jaxmoe.parallel.sharding import logical_to_spec

CONTEXT_AXIS = "context"
# How attention reaches the other devices' keys and values (model.context_strategy).
ContextStrategy = Literal["all_gather", "ring", "ulysses"]
CONTEXT_STRATEGIES = get_args(ContextStrategy)


def context_size() -> int:
    """Devices on the context axis of the current (abstract) mesh; 1 without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    return int(dict(mesh.shape).get(CONTEXT_AXIS, 1))


def load_balanced_order(length: int, parts: int) -> np.ndarray:
    """order[j] = the original index of position j of the split layout: device i's slice
    [i * L / N, (i + 1) * L / N) holds chunks i and 2N - 1 - i of the 2N chunks."""
    if length % (2 * parts):
        raise ValueError(
            f"mesh.context={parts}: the sequence length {length} must be a multiple of "
            f"2 x mesh.context = {2 * parts} (an early and a late chunk per device)"
        )
    chunks = np.arange(length).reshape(2 * parts, length // (2 * parts))
    return np.concatenate([np.concatenate([chunks[i], chunks[-1 - i]]) for i in range(parts)])


@dataclass(frozen=True, eq=False)
class ContextLayout:
    """The decoder's sequence in the split layout: `order` (static) and, for packed rows,
    the document ids [B, L] already reordered. Passed to self-attention as its mask: the
    mask is described, not built (each device builds its own rows)."""

    order: np.ndarray
    parts: int
    segment_ids_BL: jax.Array | None = None

    @classmethod
    def of(cls, length: int, parts: int) -> "ContextLayout":
        return cls(load_balanced_order(length, parts), parts)

    def split(self, a_BL):
        """[B, L, ...] in sequence order -> the split layout (None stays None)."""
        return None if a_BL is None else jnp.take(a_BL, jnp.asarray(self.order), axis=1)

    def merge(self, a_BL):
        """The split layout -> sequence order."""
        return jnp.take(a_BL, jnp.asarray(np.argsort(self.order)), axis=1)

    def with_segments(self, segment_ids_BL) -> "ContextLayout":
        """This layout with packed rows' document ids (in sequence order; None: one
        document per row)."""
        return ContextLayout(self.order, self.parts, self.split(segment_ids_BL))


def _spec(names, shape) -> P:
    mesh = jax.sharding.get_abstract_mesh()
    return logical_to_spec(names, shape, dict(mesh.shape))


def _heads_axis(num_heads: int, num_kv_heads: int):
    """The tensor axis for the heads if it splits both query and K/V heads evenly (so a
    device's query heads read its own K/V heads), else None (heads whole per device)."""
    spec = _spec(("heads",), (num_heads * num_kv_heads,))[0]
    if spec is None:
        return None
    size = dict(jax.sharding.get_abstract_mesh().shape)[spec]
    return spec if num_heads % size == 0 and num_kv_heads % size == 0 else None


def context_attention(
    q_BLHd,
    k_BSKd,
    v_BSKd,
    layout: ContextLayout,
    *,
    scale,
    window=0,
    sinks_H=None,
    gathered=False,
    strategy="all_gather",
    kernel=XLA,
    platform="cpu",
):
    """softmax(q k^T) v per device: its queries against the whole sequence's keys/values,
    gathered at once ("all_gather") or passed around the axis ("ring", ring_attention.py),
    or the whole sequence for a share of the heads ("ulysses", ulysses_attention.py).

    q/k/v are in the split layout with their length sharded over the context axis, unless
    `gathered` (MLA: k/v already built from the gathered latent, whole on every device).
    `kernel` (all-gather and Ulysses; the caller checked that it applies, context_kernels.py):
    XLA (jaxmoe's pieces), SPLASH, or DOT_PRODUCT_ATTENTION (jax.nn's, with the
    implementation of `platform`: cuDNN on GPU).
    """
    if strategy not in CONTEXT_STRATEGIES:
        raise ValueError(
            f"model.context_strategy: got {strategy!r}, expected {' | '.join(CONTEXT_STRATEGIES)}"
        )
    # MLA (`gathered`) gathers its latent whatever the strategy.
    ring = strategy == "ring" and not gathered
    ulysses = strategy == "ulysses" and not gathered
    b, length, h, _ = q_BLHd.shape
    kv_heads = k_BSKd.shape[2]
    heads = _heads_axis(h, kv_heads)
    batch = _spec(("batch",), (b,))[0]
    q_spec = P(batch, CONTEXT_AXIS, heads, None)
    kv_spec = P(batch, None if gathered else CONTEXT_AXIS, heads, None)
    segments = layout.segment_ids_BL
    order = jnp.asarray(layout.order, jnp.int32)
    local = length // layout.parts

    # Optional inputs travel in a dict (an absent one is no argument at all).
    extra = {}
    extra_specs = {}
    if segments is not None:
        extra["seg_q"], extra_specs["seg_q"] = segments, P(batch, CONTEXT_AXIS)
        extra["seg_k"], extra_specs["seg_k"] = (
            segments,
            P(batch, None if not (ring or ulysses) else CONTEXT_AXIS),
        )
    if sinks_H is not None:
        extra["sinks"], extra_specs["sinks"] = sinks_H, P(heads)
    if kernel == SPLASH and not ulysses:
        local_heads = h // (dict(jax.sharding.get_abstract_mesh().shape)[heads] if heads else 1)
        splash_args = (layout.order, local_heads, window, layout.parts, CONTEXT_AXIS)
        extra["splash"], extra_specs["splash"] = splash_kernel_and_spec(*splash_args)

    def per_device(q, k, v, extra):
        index = jax.lax.axis_index(CONTEXT_AXIS)
        q_at_L = jax.lax.dynamic_slice_in_dim(order, index * local, local)
        if ring:
            options = dict(scale=scale, window=window, sinks_H=extra.get("sinks"))
            seg_q, seg_k = extra.get("seg_q"), extra.get("seg_k")
            axis = dict(axis=CONTEXT_AXIS, parts=layout.parts)
            return ring_attention(q, k, v, q_at_L, q_at_L, seg_q, seg_k, **options, **axis)
        if ulysses:
            attend = functools.partial(
                _whole_sequence_attention,
                order=layout.order,
                scale=scale,
                window=window,
                kernel=kernel,
                platform=platform,
            )
            axis = dict(axis=CONTEXT_AXIS, parts=layout.parts)
            seg_q, sinks = extra.get("seg_q"), extra.get("sinks")
            return ulysses_attention(attend, q, k, v, seg_q, sinks, **axis)
        if not gathered:
            k = jax.lax.all_gather(k, CONTEXT_AXIS, axis=1, tiled=True)
            v = jax.lax.all_gather(v, CONTEXT_AXIS, axis=1, tiled=True)
        seg_q, seg_k = extra.get("seg_q"), extra.get("seg_k")
        if kernel != XLA:  # the kernels read the keys in sequence order
            back = jnp.asarray(np.argsort(layout.order))
            k, v = jnp.take(k, back, axis=1), jnp.take(v, back, axis=1)
            seg_k = None if seg_k is None else jnp.take(seg_k, back, axis=1)
        if kernel == SPLASH:
            return splash_chunks(extra["splash"], q, k, v, seg_q, seg_k, scale=scale)
        if kernel != XLA:
            options = dict(scale=scale, window=window, platform=platform)
            return dpa_chunks(q, k, v, q_at_L, seg_q, seg_k, **options)
        return _pieces_attention(
            q, k, v, q_at_L, order, seg_q, seg_k, scale, window, extra.get("sinks")
        )

    return jax.shard_map(
        per_device,
        in_specs=(q_spec, kv_spec, kv_spec, extra_specs),
        out_specs=q_spec,
        # The kernels' custom VJPs carry no varying-axis annotations (as splash_attention's).
        check_vma=kernel == XLA,
    )(q_BLHd, k_BSKd, v_BSKd, extra)


def _whole_sequence_attention(q, k, v, seg, sinks, *, order, scale, window, kernel, platform):
    """Causal attention of the whole split sequence (Ulysses: every token, some heads):
    jaxmoe's pieces with the mask from `order`, or a kernel in its own causal mode on the
    sequence put back in order (and the outputs returned to the split layout)."""
    order_L = jnp.asarray(order, jnp.int32)
    if kernel != XLA:
        back = jnp.asarray(np.argsort(order))
        q_s, k_s, v_s = (jnp.take(a, back, axis=1) for a in (q, k, v))
        seg_s = None if seg is None else jnp.take(seg, back, axis=1)
        if kernel == SPLASH:
            out = local_splash_attention(q_s, k_s, v_s, seg_s, scale=scale, window=window)
        else:
            options = dict(mask=None, causal=True, window=window, scale=scale, platform=platform)
            out = kernel_attention(q_s, k_s, v_s, **options, segment_ids_BL=seg_s)
        if out is not None:  # None: the kernel refused at trace time (logged); XLA below
            return jnp.take(out, order_L, axis=1)
    options = dict(remat_masks=True)  # the whole sequence's queries: [L, L] of masks
    return _pieces_attention(q, k, v, order_L, order_L, seg, seg, scale, window, sinks, **options)


def _pieces_attention(
    q, k, v, q_at_L, k_at_S, seg_q, seg_k, scale, window, sinks, remat_masks=False
):
    """One device's queries in rematerialised pieces (attention.query_chunked_attention's
    arithmetic), each piece's mask built from the original indices inside the loop.

    `remat_masks`: rebuild each piece's mask in the backward pass too, instead of keeping
    it: the kept masks add up to a bool [local queries, S] per device, which for Ulysses'
    whole sequence is [L, L] (Llama-3-8B's 2-layer proxy at 65,536 tokens on v5p-64:
    12.56 -> 6.95 GiB per chip); under all-gather ([L / N, L]) keeping them measured
    0.13 GiB less than rebuilding them (6.82 vs 6.94 GiB)."""
    kept = jax.checkpoint(grouped_attention, static_argnums=(5, 6))  # scale, block
    attend = grouped_attention if remat_masks else kept
    b, local, h, d = q.shape
    chunk = piece_queries(local, h, k.shape[1])
    pieces = local // chunk

    def piece(xs):
        q_C, at_C, seg_C = xs
        allowed_CS = k_at_S[None, :] <= at_C[:, None]
        if window:
            allowed_CS &= k_at_S[None, :] > at_C[:, None] - window
        mask = allowed_CS[None]
        if seg_C is not None:
            mask = mask & (seg_C[:, :, None] == seg_k[:, None, :])
        return attend(q_C, k, v, mask, None, scale, 0, None, sinks)

    def by_piece(a_BL):  # [B, L, ...] -> [pieces, B, chunk, ...]
        return jnp.moveaxis(a_BL.reshape(b, pieces, chunk, *a_BL.shape[2:]), 1, 0)

    seg_P = None if seg_q is None else by_piece(seg_q)
    step = jax.checkpoint(piece) if remat_masks else piece
    out = jax.lax.map(step, (by_piece(q), q_at_L.reshape(pieces, chunk), seg_P))
    return jnp.moveaxis(out, 0, 1).reshape(b, local, h, d)


def gather_length(x_BL):
    """x [B, L, ...] whole along the sequence on every context device (batch still split):
    what MLA gathers, its compressed latent."""
    names = ("batch",) + (None,) * (x_BL.ndim - 1)
    return jax.lax.with_sharding_constraint(x_BL, _spec(names, x_BL.shape))
