"""Dispatch of tokens to experts and combination of their outputs, on one device or shard.

Implementations, chosen by `model.moe.dispatch`:
- "blocks": assignments laid out by expert, block loops whose cost follows the number of
  assignments (grouped_ffn.py). The CPU default.
- "ragged": the same expert-sorted layout fed to `jax.lax.ragged_dot` (a grouped matmul
  kernel on GPU/TPU; on CPU it is lowered to a masked dense matmul over every group, so its
  cost does not fall with fewer assignments). The GPU/TPU default when dropless.
- "megablox": the "ragged" layout through the Pallas megablox grouped matmul (TPU;
  megablox.py).
- "dense": every expert on every token, masked. A reference for tests and tiny models.
- "capacity": GShard-style fixed buffers [E, B * C, D]; needs capacity_factor > 0. The
  GPU/TPU default with a capacity (static shapes suit their matmul units).

The first three share one signature over "assignments": y_ND[n] = sum over valid a with
src_A[a] = n of weight_A[a] * FFN_{expert_A[a]}(x_ND[n]), FFN_e(x) = act(x wi_0[e]) *
(x wi_1[e]) wo[e]. The expert-parallel code reuses it on the rows it receives.

Capacity (GShard): per sequence (the "group"), each expert takes at most
C = ceil(capacity_factor * L * K / E) assignments; all first choices of the sequence are
served before any second choice, and within a slot earlier tokens first. The rest are
dropped (their combine weight becomes 0; the residual connection carries the token).
"""

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxmoe.models.moe.glu import gated_hidden
from jaxmoe.models.moe.grouped_ffn import expert_ranks, grouped_ffn_blocks
from jaxmoe.models.moe.grouping import group_rows
from jaxmoe.models.platform import mesh_platform
from jaxmoe.models.quantization import NONE, Quantization, batched_matmul, ragged_dot

Activation = Callable[[jax.Array], jax.Array]
Experts = tuple[jax.Array, jax.Array, jax.Array]  # wi_0 [E, D, F], wi_1 [E, D, F], wo [E, F, D]
DISPATCHES = ("auto", "blocks", "ragged", "megablox", "dense", "capacity")


# The dispatches whose expert products model.quantization quantizes (quantization.py): the
# grouped matmul (ragged_dot) and the capacity buffers' batched products.
QUANTIZED_DISPATCHES = ("ragged", "capacity")


def resolve_dispatch(
    name: str, capacity_factor: float, backend: str | None = None, *, quantized: bool = False
) -> str:
    """The implementation to run: `name`, or for "auto" the best measured for the backend
    (with quantized experts: the grouped matmul, or the capacity buffers)."""
    if name not in DISPATCHES:
        raise ValueError(f"model.moe.dispatch: got {name!r}, expected {' | '.join(DISPATCHES)}")
    if name == "capacity" and capacity_factor <= 0:
        raise ValueError("model.moe.dispatch='capacity' needs model.moe.capacity_factor > 0")
    if quantized and name not in ("auto", *QUANTIZED_DISPATCHES):
        raise ValueError(
            f"model.moe.dispatch={name!r} has no quantized expert products: with "
            "model.quantization use auto | " + " | ".join(QUANTIZED_DISPATCHES)
        )
    if name != "auto":
        return name
    if quantized:
        return "capacity" if capacity_factor > 0 else "ragged"
    on_cpu = (backend or jax.default_backend()) == "cpu"
    if on_cpu:
        return "blocks"  # with a capacity, blocks skip dropped assignments for free
    return "capacity" if capacity_factor > 0 else "ragged"


def expert_capacity(capacity_factor: float, group_size: int, slots: int, num_experts: int) -> int:
    """C = ceil(capacity_factor * group_size * slots / num_experts), at least 1."""
    return max(1, math.ceil(capacity_factor * group_size * slots / num_experts))


def slot_ranks(indices_BLK: jax.Array, mask_BLK: jax.Array, num_experts: int) -> jax.Array:
    """rank_BLK: position of each assignment in its (sequence, expert) queue, -1 if masked.

    The queue is slot-major: every first choice of the sequence, then every second, ...
    """
    batch, length, slots = indices_BLK.shape

    def slot_major(a_BLK):
        return a_BLK.transpose(0, 2, 1).reshape(batch, slots * length)

    ranks = jax.vmap(lambda e, m: expert_ranks(e, m, num_experts)[0])
    rank_BA = ranks(slot_major(indices_BLK), slot_major(mask_BLK))
    return rank_BA.reshape(batch, slots, length).transpose(0, 2, 1)


def capacity_keep(indices_BLK, mask_BLK, num_experts: int, capacity: int) -> jax.Array:
    """keep_BLK: the assignments that fit in their expert's capacity (see module doc)."""
    return mask_BLK & (slot_ranks(indices_BLK, mask_BLK, num_experts) < capacity)


def expert_ffn_ERD(
    x_ERD: jax.Array, experts: Experts, act: Activation, quant: Quantization = NONE
) -> jax.Array:
    """Each expert on its own rows: x [E, R, D] -> [E, R, D] (one batched matmul each).

    Expert-major on purpose: with the expert dim first XLA runs plain batched matmuls;
    a [B, E, C, D] layout measured 2x slower on CPU (transposes around every product).
    """
    wi_0, wi_1, wo = experts
    gate = batched_matmul(x_ERD, wi_0, quant)
    up = batched_matmul(x_ERD, wi_1, quant)
    return batched_matmul(gated_hidden(act, gate, up), wo, quant)


def dense_ffn(x_ND, src_A, expert_A, weight_A, valid_A, experts: Experts, *, act):
    """Every expert on every row, combined with a [N, E] weight matrix.

    Written as products batched over the expert dim (x broadcast to [E, N, D]) so that each
    expert's [D, F] slab is read in place: a plain `nd,edf->enf` einsum made XLA:CPU
    transpose every weight first (66 ms against 12 ms for one row, D 1024, F 2816, E 8).
    The combine weights scale the hidden units, so the down products of all experts sum in
    one [N, E * F] x [E * F, D] product.
    """
    wi_0, wi_1, wo = experts
    num_rows, num_experts = x_ND.shape[0], wi_0.shape[0]
    x_END = jnp.broadcast_to(x_ND, (num_experts, *x_ND.shape))
    gate_ENF = jnp.einsum("end,edf->enf", x_END, wi_0)
    hidden_ENF = gated_hidden(act, gate_ENF, jnp.einsum("end,edf->enf", x_END, wi_1))
    weight_A = jnp.where(valid_A, weight_A, 0).astype(jnp.float32)
    combine_NE = jnp.zeros((num_rows, num_experts), jnp.float32)
    combine_NE = combine_NE.at[src_A, expert_A].add(weight_A)
    hidden_ENF = hidden_ENF * combine_NE.T[:, :, None].astype(hidden_ENF.dtype)
    y_ND = jnp.einsum("enf,efd->nd", hidden_ENF, wo, preferred_element_type=jnp.float32)
    return y_ND.astype(x_ND.dtype)


# Up to this many tokens, inference on one device runs every expert on every token
# ("dense") instead of the blocks: the blocks' scan over experts copies every expert's
# weight slab before its products, however few rows it has, while the batched products
# read the slabs in place. Measured on a quiet 2-core AVX2 EPYC (D 1024, F 2816, E 8,
# top-2; benchmarks/decode_peer.py's MoE model): the layer's forward on 1 token 11.8 vs
# 25.7 ms; greedy decode at batch 1 48.99 vs 77.40 ms per token (adaptive 47.60 vs
# 73.84). At batch 8 the dense path's E / k times the rows cost as much as the copies
# save (top-2 173.5 vs 181.0 ms, adaptive 173.8 vs 149.0), so larger calls keep the blocks.
ALL_EXPERTS_MAX_ROWS = 4


def inference_dispatch(impl: str, num_rows: int, capacity: int) -> str:
    """The dispatch for an inference call on `num_rows` tokens on one device: "dense" where
    it beats the dropless blocks (ALL_EXPERTS_MAX_ROWS), else `impl`."""
    if impl == "blocks" and capacity == 0 and num_rows <= ALL_EXPERTS_MAX_ROWS:
        return "dense"
    return impl


# Largest [rows, F / n] hidden buffer the ragged dispatch makes at once (bytes), and the
# granularity of its F chunks (a TPU vector lane is 128 wide).
RAGGED_CHUNK_BYTES = 128 * 2**20
RAGGED_CHUNK_LANES = 128


def ffn_chunks(rows: int, ffn: int, itemsize: int) -> int:
    """How many slices of the expert width F the ragged dispatch runs one after another.

    The smallest n dividing F into multiples of RAGGED_CHUNK_LANES with a [rows, F / n]
    hidden buffer of at most RAGGED_CHUNK_BYTES; 1 when F cannot be split so.
    """
    valid = [n for n in range(1, ffn + 1) if ffn % n == 0 and (ffn // n) % RAGGED_CHUNK_LANES == 0]
    for n in valid:
        if rows * (ffn // n) * itemsize <= RAGGED_CHUNK_BYTES:
            return n
    return valid[-1] if valid else 1


def _ragged_chunk(x_RD, wi_0, wi_1, wo, counts_E, act, quant):
    """One slice of the expert width: act(x wi_0) * (x wi_1) wo, per group, [R, D].

    In the compute dtype: f32 [R, D] partial sums would cost more memory than the hidden
    slice saved.
    """
    hidden_RF = gated_hidden(
        act, ragged_dot(x_RD, wi_0, counts_E, quant), ragged_dot(x_RD, wi_1, counts_E, quant)
    )
    return ragged_dot(hidden_RF, wo, counts_E, quant)


def ragged_ffn(
    x_ND, src_A, expert_A, weight_A, valid_A, experts: Experts, *, act, quant: Quantization = NONE
):
    """Assignments sorted by expert (one-hot cumsum ranks) through `jax.lax.ragged_dot`.

    The expert width F runs in `ffn_chunks` slices, each under `jax.checkpoint`: the
    backward pass recomputes one slice's [R, F / n] hidden activations at a time instead of
    keeping all of them (with the block rematerialised, the slice's forward is not
    recomputed twice: its output is not needed to rebuild the block's residuals).
    """
    wi_0, wi_1, wo = experts
    num_rows, num_assign, num_experts = x_ND.shape[0], src_A.shape[0], wi_0.shape[0]
    rank_A, counts_E = expert_ranks(expert_A, valid_A, num_experts)
    # On GPU each group is padded with zero rows to whole row tiles (grouping.group_rows).
    tile = group_rows(num_assign, num_experts, mesh_platform())
    counts_E = -(-counts_E // tile) * tile
    offset_E = jnp.cumsum(counts_E) - counts_E
    rows = num_assign + num_experts * (tile - 1)  # static bound on the padded groups
    row_A = jnp.where(valid_A, offset_E[expert_A] + rank_A, rows)
    row_src_R = jnp.full((rows,), num_rows, jnp.int32)
    row_src_R = row_src_R.at[row_A].set(src_A.astype(jnp.int32), mode="drop")
    x_RD = x_ND.at[row_src_R].get(mode="fill", fill_value=0)
    # Rows past sum(counts_E) belong to no group: ragged_dot leaves them zero.
    ffn = wi_0.shape[-1]
    chunks = ffn_chunks(rows, ffn, x_ND.dtype.itemsize)
    width = ffn // chunks
    chunk = _ragged_chunk if chunks == 1 else jax.checkpoint(_ragged_chunk, static_argnums=(5, 6))
    out_RD = sum(
        chunk(
            x_RD,
            wi_0[..., c * width : (c + 1) * width],
            wi_1[..., c * width : (c + 1) * width],
            wo[:, c * width : (c + 1) * width],
            counts_E,
            act,
            quant,
        )
        for c in range(chunks)
    )
    # Combined in the compute dtype, like the output: under expert parallelism every
    # received row is one assignment, and f32 copies of [rows, D] would double the largest
    # buffers of the layer for one rounding step.
    out_AD = out_RD.at[row_A].get(mode="fill", fill_value=0)
    weight_A = jnp.where(valid_A, weight_A, 0).astype(x_ND.dtype)
    return jnp.zeros_like(x_ND).at[src_A].add(out_AD * weight_A[:, None])


def grouped_ffn(
    x_ND,
    src_A,
    expert_A,
    weight_A,
    valid_A,
    experts: Experts,
    *,
    act,
    impl,
    block_size,
    quant: Quantization = NONE,
):
    """Dispatches to the "blocks", "ragged", "megablox" or "dense" implementation (same
    result; `quant` enabled: "ragged" only, resolve_dispatch's choice)."""
    if quant.enabled and impl != "ragged":
        raise ValueError(f"model.moe.dispatch={impl!r} has no quantized expert products")
    if impl == "blocks":
        return grouped_ffn_blocks(
            x_ND, src_A, expert_A, weight_A, valid_A, *experts, act=act, block_size=block_size
        )
    if impl == "ragged":
        return ragged_ffn(x_ND, src_A, expert_A, weight_A, valid_A, experts, act=act, quant=quant)
    if impl == "megablox":
        from jaxmoe.models.moe.megablox import megablox_ffn

        return megablox_ffn(x_ND, src_A, expert_A, weight_A, valid_A, experts, act=act)
    if impl == "dense":
        return dense_ffn(x_ND, src_A, expert_A, weight_A, valid_A, experts, act=act)
    raise ValueError(f"model.moe.dispatch: {impl!r} is not an assignment dispatch")


def capacity_buffers(x_BLD, indices_BLK, keep_BLK, num_experts: int, capacity: int):
    """(x_ERD, slot_BLK): kept assignments gathered into expert buffers, R = B * C rows.

    Expert e's buffer holds C rows per sequence. slot_BLK indexes the flattened
    [E * B * C] buffer (E * B * C where not kept).
    """
    batch, length, dim = x_BLD.shape
    rank_BLK = slot_ranks(indices_BLK, keep_BLK, num_experts)
    seq_B11 = jnp.arange(batch)[:, None, None]
    slot_BLK = (indices_BLK * batch + seq_B11) * capacity + rank_BLK
    buffer_rows = num_experts * batch * capacity
    slot_BLK = jnp.where(keep_BLK & (rank_BLK < capacity), slot_BLK, buffer_rows)
    token_BLK = jnp.broadcast_to(
        jnp.arange(batch * length).reshape(batch, length, 1), indices_BLK.shape
    )
    slot_src = jnp.full((buffer_rows,), batch * length, jnp.int32)
    slot_src = slot_src.at[slot_BLK.reshape(-1)].set(token_BLK.reshape(-1), mode="drop")
    x_SD = x_BLD.reshape(batch * length, dim).at[slot_src].get(mode="fill", fill_value=0)
    return x_SD.reshape(num_experts, batch * capacity, dim), slot_BLK


def capacity_combine(out_ERD, slot_BLK, weights_BLK) -> jax.Array:
    """y_BLD = sum_k weight * expert output at the assignment's slot (0 if dropped)."""
    out_SD = out_ERD.reshape(-1, out_ERD.shape[-1])
    out_BLKD = out_SD.at[slot_BLK].get(mode="fill", fill_value=0).astype(jnp.float32)
    return jnp.einsum("blkd,blk->bld", out_BLKD, weights_BLK.astype(jnp.float32))


def capacity_ffn(
    x_BLD, indices_BLK, weights_BLK, keep_BLK, experts: Experts, *, act, capacity, quant=NONE
):
    """GShard-style fixed-capacity layer on one device."""
    num_experts = experts[0].shape[0]
    x_ERD, slot_BLK = capacity_buffers(x_BLD, indices_BLK, keep_BLK, num_experts, capacity)
    out_ERD = expert_ffn_ERD(x_ERD, experts, act, quant)
    return capacity_combine(out_ERD, slot_BLK, weights_BLK).astype(x_BLD.dtype)


def local_moe_ffn(
    x_BLD,
    indices_BLK,
    weights_BLK,
    keep_BLK,
    experts: Experts,
    *,
    act,
    impl,
    block_size,
    capacity,
    quant: Quantization = NONE,
):
    """The MoE FFN on tokens and experts that are all on this device: y_BLD."""
    x_BLD = jnp.asarray(x_BLD)
    if impl == "capacity":
        return capacity_ffn(
            x_BLD,
            indices_BLK,
            weights_BLK,
            keep_BLK,
            experts,
            act=act,
            capacity=capacity,
            quant=quant,
        )
    batch, length, dim = x_BLD.shape
    slots = indices_BLK.shape[-1]
    src_A = jnp.repeat(jnp.arange(batch * length, dtype=jnp.int32), slots)
    y_TD = grouped_ffn(
        x_BLD.reshape(batch * length, dim),
        src_A,
        indices_BLK.reshape(-1),
        weights_BLK.reshape(-1),
        keep_BLK.reshape(-1),
        experts,
        act=act,
        impl=impl,
        block_size=block_size,
        quant=quant,
    )
    return y_TD.reshape(batch, length, dim)
