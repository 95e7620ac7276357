"""The output loss a few sequence positions at a time (`train.loss_chunk`), so the training
step never holds the whole batch's f32 logits [B, L, V].

On pod-scale compiles the logits and their bf16 copy are the largest buffers of the step
(docs/results/2026-12-02_qwen3_compile.md). Here the model stops at the head's input
[B, L, D]; a `jax.lax.scan` over chunks of `loss_chunk` positions applies the head, the
log-softmax, the NLL and the z-loss's logsumexp^2 to [B, loss_chunk, V] at a time, and
`jax.checkpoint` on the scan body makes the backward pass recompute each chunk's logits
instead of keeping them: one chunk's logits (and their gradient) are live at once.

Chunks run along the sequence, never across examples, so each keeps the batch sharding of
the hidden states; the chunk's logits are pinned to (batch, -, vocab) like the head's vocab
axis. A length that `loss_chunk` does not divide (a seq2seq decoder) is padded up to the next
multiple with zero-weight positions, which add nothing to either sum.

Under mesh.context (each sequence split over N devices, contiguous L / N positions each)
a chunk takes loss_chunk / N positions from every device's part instead of loss_chunk
consecutive ones, so each device computes the logits of its own positions and nothing
moves between them; the sums do not depend on which positions share a chunk.
"""

import jax
import jax.numpy as jnp

from jaxmoe.models.layers import head_logits
from jaxmoe.parallel.sharding import constrain_batch, logical_to_spec


def _constrain_logits(logits_BCV):
    """Pin a chunk's logits to the batch axes (dim 0) and the vocab axes (dim 2)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return logits_BCV
    spec = logical_to_spec(("batch", "length", "vocab"), logits_BCV.shape, dict(mesh.shape))
    return jax.lax.with_sharding_constraint(logits_BCV, spec)


def _chunks(x_BL, chunk: int, num_chunks: int):
    """[B, L, ...] -> [num_chunks, B, chunk, ...], zero-padded along L."""
    pad = num_chunks * chunk - x_BL.shape[1]
    if pad:
        x_BL = jnp.pad(x_BL, [(0, 0), (0, pad)] + [(0, 0)] * (x_BL.ndim - 2))
    x = x_BL.reshape(x_BL.shape[0], num_chunks, chunk, *x_BL.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _context_parts(length: int, chunk: int) -> int:
    """N when the sequence is split over N context devices and a chunk can take chunk / N
    positions from each device's part; else 1 (consecutive chunks)."""
    mesh = jax.sharding.get_abstract_mesh()
    parts = 1 if mesh.empty else int(dict(mesh.shape).get("context", 1))
    if parts > 1 and chunk % parts == 0 and length % chunk == 0:
        return parts
    return 1


def _strided_chunks(x_BL, chunk: int, parts: int):
    """[B, L, ...] -> [L / chunk, B, chunk, ...], chunk i holding positions
    p * L / parts + i * chunk / parts + j of every part p (j < chunk / parts)."""
    b, length = x_BL.shape[:2]
    per = chunk // parts
    x = x_BL.reshape(b, parts, length // chunk, per, *x_BL.shape[2:])
    return jnp.moveaxis(x, 2, 0).reshape(length // chunk, b, chunk, *x_BL.shape[2:])


def chunked_output_losses(hidden_BLD, w_DV, scale, targets_BL, weights_BL, chunk: int):
    """(sum of weights * NLL, sum of weights * logsumexp(logits)^2) over the batch, the
    logits head_logits(hidden, w_DV, scale) made [B, chunk, V] at a time.

    The same two sums as steps.token_nll and steps.logits_z_loss_sum on the full logits.
    `w_DV` stays in its parameter dtype outside the scan, so its gradient adds up over the
    chunks in that dtype (not in the bf16 of the product)."""
    length = hidden_BLD.shape[1]
    chunk = min(chunk, length)
    num_chunks = -(-length // chunk)
    parts = _context_parts(length, chunk)

    def split(x_BL):
        if parts > 1:
            return _strided_chunks(x_BL, chunk, parts)
        return _chunks(x_BL, chunk, num_chunks)

    xs = (split(hidden_BLD), split(targets_BL), split(weights_BL.astype(jnp.float32)))

    def body(sums, chunk_xs):
        h_BCD, targets_BC, weights_BC = chunk_xs
        logits_BCV = _constrain_logits(head_logits(constrain_batch(h_BCD), w_DV, scale))
        log_z_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
        target_BC = jnp.take_along_axis(logits_BCV, targets_BC[..., None], axis=-1)[..., 0]
        nll_sum, z_sum = sums
        nll_sum = nll_sum + jnp.sum((log_z_BC - target_BC) * weights_BC)
        z_sum = z_sum + jnp.sum(jnp.square(log_z_BC) * weights_BC)
        return (nll_sum, z_sum), None

    zero = jnp.zeros((), jnp.float32)
    (nll_sum, z_sum), _ = jax.lax.scan(jax.checkpoint(body, prevent_cse=False), (zero, zero), xs)
    return nll_sum, z_sum
