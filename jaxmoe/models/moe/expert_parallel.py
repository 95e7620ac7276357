"""The MoE FFN on a device mesh: tokens split over the batch axes, experts over "expert".

Inside `jax.shard_map` every mesh axis splits either the tokens or the experts, so no device
repeats another's work:
- the batch dim of x_BLD over ("data", "fsdp", "expert") (the trainer's activation layout),
  the length dim over "tensor" (the MoE layer is per-token, so the tensor axis serves as
  one more token axis here and the expert weights arrive whole along expert_mlp);
- the expert dim of the weights over "expert": each device holds E / expert experts.
  Weights enter in the sharding the rules table gives them (fsdp / tensor / context on
  their other dims) and are all-gathered inside, so their gradients leave reduce-scattered
  (the transpose of the gather) instead of as whole all-reduced [E, D, F] stacks that
  are sliced afterwards: on DeepSeek-V3 at fsdp 512 those were 21 GiB per layer in bf16,
  and more once cast to the f32 parameters' dtype. Over token axes that do not shard the
  weights, the gradients are summed as before.
An axis that does not divide its dim (a decode batch of 1) repeats the work instead; see
`_layout`.

With expert size > 1, tokens travel to the devices holding their experts and back over
"expert", by `model.moe.ep_exchange`:
- "ragged" (assignment dispatches): ragged_exchange.py, sized to the routing with
  `ragged_all_to_all` (emulated on CPU, which lacks it);
- "padded" (assignment dispatches): `jax.lax.all_to_all` of buffers sized for the worst
  case (every local token's assignments on one device: T_local * min(K, E_local) rows per
  device); the receiving device's dispatch works only on the rows actually sent;
- "auto": "padded" when the program is lowered for CPU, "ragged" for GPU/TPU;
- the capacity dispatch always exchanges its fixed [E, B * C, D] buffers (GShard).
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxmoe.models.moe.dispatch import (
    Experts,
    capacity_buffers,
    capacity_combine,
    expert_ffn_ERD,
    grouped_ffn,
    local_moe_ffn,
)
from jaxmoe.models.moe.grouped_ffn import expert_ranks
from jaxmoe.models.moe.ragged_exchange import ragged_ep
from jaxmoe.models.quantization import NONE, Quantization
from jaxmoe.parallel.sharding import logical_to_spec

BATCH_AXES = ("data", "fsdp", "expert")
EXPERT_AXIS = "expert"
LENGTH_AXES = ("context", "tensor")
EXCHANGES = ("auto", "ragged", "padded")


def _size(mesh, axis: str) -> int:
    return mesh.shape[axis] if axis in mesh.axis_names else 1


def current_mesh():
    """The mesh set by `jax.set_mesh`, or None when there is none or it has one device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return None
    return mesh


def _layout(mesh, x_shape, num_experts: int) -> tuple[P, int]:
    """(sharding of [B, L, ...] token arrays inside shard_map, expert-parallel size).

    Like the rules table, an axis that does not divide its dim is left out: the batch takes
    the axes of BATCH_AXES whose running product divides B, the length takes "context" (the
    sequence split, context_parallel.py) and "tensor" while they divide L. Tokens are then
    repeated on the devices of a left-out axis, which is correct (forward and gradients) but
    not parallel; a small decode batch hits this. Expert parallelism needs the expert axis to
    split both the tokens and the experts.
    """
    batch, length = x_shape[:2]
    batch_axes, split = [], 1
    for axis in BATCH_AXES:
        size = _size(mesh, axis)
        if size > 1 and batch % (split * size) == 0:
            batch_axes.append(axis)
            split *= size
    length_axes, split = [], 1
    for axis in LENGTH_AXES:
        size = _size(mesh, axis)
        if size > 1 and length % (split * size) == 0:
            length_axes.append(axis)
            split *= size
    length_axis: str | tuple[str, ...] | None = None
    if length_axes:
        length_axis = tuple(length_axes) if len(length_axes) > 1 else length_axes[0]
    ep = _size(mesh, EXPERT_AXIS)
    if EXPERT_AXIS not in batch_axes or num_experts % ep:
        ep = 1
    return P(tuple(batch_axes) or None, length_axis), ep


# The logical axes of the expert stacks (layer.py): wi_0 / wi_1 [E, D, F], wo [E, F, D].
EXPERT_WEIGHT_AXES = (
    ("expert", "embed", "expert_mlp"),
    ("expert", "embed", "expert_mlp"),
    ("expert", "expert_mlp", "embed"),
)


def _weight_specs(mesh, experts) -> tuple[P, ...]:
    """The shard_map specs of the expert stacks: the rules table's sharding of each, as they
    are stored (a stack whose shape a rule does not divide, such as an expert bias's extra
    row, is replicated along that dim)."""
    sizes = dict(mesh.shape)
    return tuple(
        logical_to_spec(axes, w.shape, sizes)
        for w, axes in zip(experts, EXPERT_WEIGHT_AXES, strict=True)
    )


def _gathered(w, spec: P, ep: int):
    """Inside shard_map: `w` whole along every dim but the expert dim when the experts are
    spread over the expert axis (ep > 1); the gather's transpose reduce-scatters the
    gradient back to `spec`."""
    for dim, axes in enumerate(spec):
        if axes is None or (dim == 0 and ep > 1):
            continue
        w = jax.lax.all_gather(w, axes, axis=dim, tiled=True)
    return w


def _exchange(x, axis_name):
    """[ep, ...] -> [ep, ...]: row j goes to device j; row j of the result came from j."""
    return jax.lax.all_to_all(x, axis_name, 0, 0, tiled=False)


def _dropless_ep(x_BLD, indices_BLK, weights_BLK, keep_BLK, experts, *, ep, act, impl, bs, quant):
    """Dropless dispatch with experts spread over the expert axis (runs per device)."""
    batch, length, dim = x_BLD.shape
    slots = indices_BLK.shape[-1]
    local_experts = experts[0].shape[0]
    num_tokens = batch * length
    expert_A = indices_BLK.reshape(-1)
    valid_A = keep_BLK.reshape(-1)
    token_A = jnp.repeat(jnp.arange(num_tokens, dtype=jnp.int32), slots)
    # A token's experts are distinct, so at most min(K, E_local) of them live on one device.
    rows = num_tokens * min(slots, local_experts)
    dest_A = expert_A // local_experts
    pos_A, _ = expert_ranks(dest_A, valid_A, ep)
    send_A = jnp.where(valid_A, dest_A * rows + pos_A, ep * rows)  # ep * rows: dropped

    def to_buffer(values_A, fill):
        buf = jnp.full((ep * rows,), fill, values_A.dtype)
        return buf.at[send_A].set(values_A, mode="drop").reshape(ep, rows)

    send_src = to_buffer(token_A, num_tokens)
    send_x = x_BLD.reshape(num_tokens, dim).at[send_src].get(mode="fill", fill_value=0)
    send_expert = to_buffer(expert_A % local_experts, 0)
    send_valid = to_buffer(valid_A.astype(jnp.int32), 0)

    recv_x = _exchange(send_x, EXPERT_AXIS).reshape(ep * rows, dim)
    recv_expert = _exchange(send_expert, EXPERT_AXIS).reshape(-1)
    recv_valid = _exchange(send_valid, EXPERT_AXIS).reshape(-1) > 0
    out_ND = grouped_ffn(
        recv_x,
        jnp.arange(ep * rows, dtype=jnp.int32),
        recv_expert,
        jnp.ones((ep * rows,), jnp.float32),
        recv_valid,
        experts,
        act=act,
        impl=impl,
        block_size=bs,
        quant=quant,
    )
    back_RD = _exchange(out_ND.reshape(ep, rows, dim), EXPERT_AXIS).reshape(ep * rows, dim)
    out_AD = back_RD.at[send_A].get(mode="fill", fill_value=0).astype(jnp.float32)
    weight_A = jnp.where(valid_A, weights_BLK.reshape(-1), 0).astype(jnp.float32)
    y_TD = jnp.sum((out_AD * weight_A[:, None]).reshape(num_tokens, slots, dim), axis=1)
    return y_TD.reshape(batch, length, dim).astype(x_BLD.dtype)


def _capacity_ep(x_BLD, indices_BLK, weights_BLK, keep_BLK, experts, *, ep, act, capacity, quant):
    """GShard: the fixed expert buffers travel to the expert devices and back."""
    local_experts = experts[0].shape[0]
    x_ERD, slot_BLK = capacity_buffers(x_BLD, indices_BLK, keep_BLK, ep * local_experts, capacity)
    rows, dim = x_ERD.shape[1:]
    # [E, R, D] = [ep, E_local, R, D]: block j holds device j's experts.
    recv = _exchange(x_ERD.reshape(ep, local_experts, rows, dim), EXPERT_AXIS)
    # Received [source, E_local, R, D] -> one batch of rows per local expert.
    x_local = recv.swapaxes(0, 1).reshape(local_experts, ep * rows, dim)
    out = expert_ffn_ERD(x_local, experts, act, quant).reshape(local_experts, ep, rows, dim)
    back = _exchange(out.swapaxes(0, 1), EXPERT_AXIS).reshape(x_ERD.shape)
    return capacity_combine(back, slot_BLK, weights_BLK).astype(x_BLD.dtype)


def sharded_moe_ffn(
    mesh,
    x_BLD,
    indices_BLK,
    weights_BLK,
    keep_BLK,
    experts: Experts,
    *,
    act,
    impl: str,
    block_size: int,
    capacity: int,
    quant: Quantization = NONE,
    exchange: str = "auto",
    buffer_factor: float = 2.0,
):
    """(y_BLD, overflow_BLK): the MoE FFN under `mesh` (y as dispatch.local_moe_ffn gives on
    one device). overflow_BLK marks kept assignments that did not fit the ragged exchange's
    receive buffer (ragged_exchange.ragged_ep); all False on the other paths."""
    if exchange not in EXCHANGES:
        raise ValueError(
            f"model.moe.ep_exchange: got {exchange!r}, expected {' | '.join(EXCHANGES)}"
        )
    token_spec, ep = _layout(mesh, x_BLD.shape, experts[0].shape[0])
    weight_specs = _weight_specs(mesh, experts)

    def per_device(x_BLD, indices_BLK, weights_BLK, keep_BLK, *experts):
        experts = tuple(
            _gathered(w, spec, ep) for w, spec in zip(experts, weight_specs, strict=True)
        )
        args = (x_BLD, indices_BLK, weights_BLK, keep_BLK, experts)
        none_BLK = jnp.zeros(keep_BLK.shape, bool)
        if ep == 1:
            options = dict(act=act, impl=impl, block_size=block_size, capacity=capacity)
            return local_moe_ffn(*args, **options, quant=quant), none_BLK
        if impl == "capacity":
            return _capacity_ep(*args, ep=ep, act=act, capacity=capacity, quant=quant), none_BLK

        def padded(*args):
            options = dict(act=act, impl=impl, bs=block_size, quant=quant)
            return _dropless_ep(*args, ep=ep, **options), none_BLK

        def ragged(*args):
            options = dict(act=act, impl=impl, bs=block_size, factor=buffer_factor, quant=quant)
            return ragged_ep(*args, ep=ep, axis=EXPERT_AXIS, dropless=capacity == 0, **options)

        if exchange == "auto":
            # Chosen when lowering: XLA:CPU has no ragged-all-to-all to run "ragged" fast.
            return jax.lax.platform_dependent(*args, cpu=padded, default=ragged)
        return (ragged if exchange == "ragged" else padded)(*args)

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(token_spec,) * 4 + weight_specs,
        out_specs=(token_spec, token_spec),
        # The block dispatch's loops and custom_vjp carry no varying-axis annotations. Without
        # the check, the transpose still sums weight gradients over the token axes only
        # (tests/test_expert_parallel.py compares gradients with one device).
        check_vma=False,
    )(x_BLD, indices_BLK, weights_BLK, keep_BLK, *experts)
