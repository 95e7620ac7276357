"""Beam search on the KV cache of decode.Generator, scored as T5X scores it.

Each prompt runs `beams` rows (prompt i owns rows i * beams ...). Every step extends each
live beam by every token, keeps the 2 * beams best extensions (so `beams` of them survive
even when the rest end in EOS, which is any EOS id of the tokenizer: Generator.stop_ids):
those ending in EOS join the finished set with score log p / ((5 + length) / 6) ** alpha
(T5X's `brevity_penalty`; length counts the new tokens, EOS included), the best `beams`
others stay live with their plain log p, and the caches' rows are gathered from their
parent beams. After `max_new_tokens` steps a prompt returns its
best finished sequence, or its best live one (scored by plain log p) when none finished.
The whole search is one compiled `lax.fori_loop`.
"""

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmoe.inference.decode import Generation, bucket, cached_step, cut_at_stop
from jaxmoe.models.kv_cache import longest_cache, reorder_rows

NEG_INF = -1.0e30  # finite, so that sums and divisions stay ordered and never make NaN


def brevity_penalty(alpha: float, length):
    """T5X's length normalisation: ((5 + length) / 6) ** alpha."""
    return ((5.0 + length) / 6.0) ** alpha


def _beam_loop(
    params, caches, state, *, graphdef, beams, max_new, alpha, stop_ids, vocab_limit, constrain
):
    """(best sequences [P, max_new] padded with 0, their scores [P], caches), P = rows / beams."""
    model = nnx.merge(graphdef, params)
    stop_S = jnp.asarray(stop_ids or (-1,), jnp.int32)  # -1: never drawn
    rows = state["logits_BV"].shape[0]
    prompts = rows // beams

    def body(t, carry):
        logits_RV, caches, live_seqs, live_logp, fin_seqs, fin_scores = carry
        logp_RV = jax.nn.log_softmax(logits_RV[:, :vocab_limit].astype(jnp.float32), axis=-1)
        v = logp_RV.shape[-1]
        total_PC = (live_logp[..., None] + logp_RV.reshape(prompts, beams, v)).reshape(
            prompts, beams * v
        )
        top_logp, top_index = jax.lax.top_k(total_PC, 2 * beams)
        parent, token = top_index // v, top_index % v
        seqs = jnp.take_along_axis(live_seqs, parent[..., None], axis=1)
        seqs = seqs.at[:, :, t].set(token)
        ended = jnp.isin(token, stop_S)  # any EOS id of the tokenizer ends a beam
        # Finished: the best `beams` of the old finished set and the new EOS endings.
        new_scores = jnp.where(ended, top_logp / brevity_penalty(alpha, t + 1), NEG_INF)
        fin_scores, keep = jax.lax.top_k(jnp.concatenate([fin_scores, new_scores], 1), beams)
        fin_seqs = jnp.take_along_axis(
            jnp.concatenate([fin_seqs, seqs], 1), keep[..., None], axis=1
        )
        # Live: the best `beams` extensions that did not end.
        live_logp, keep = jax.lax.top_k(jnp.where(ended, NEG_INF, top_logp), beams)
        live_seqs = jnp.take_along_axis(seqs, keep[..., None], axis=1)
        parent = jnp.take_along_axis(parent, keep, axis=1)
        source_R = (jnp.arange(prompts)[:, None] * beams + parent).reshape(rows)
        caches = [constrain(c) for c in reorder_rows(caches, source_R)]
        tokens_R1 = jnp.take_along_axis(token, keep, axis=1).reshape(rows, 1)
        logits_R1V, caches = cached_step(model, tokens_R1, caches, state["index"] + t, state)
        caches = [constrain(c) for c in caches]
        return logits_R1V[:, -1], caches, live_seqs, live_logp, fin_seqs, fin_scores

    # Beam 0 starts alone: the others are copies of it and must not be extended twice.
    live_logp = jnp.tile(jnp.array([0.0] + [NEG_INF] * (beams - 1), jnp.float32), (prompts, 1))
    seqs = jnp.zeros((prompts, beams, max_new), jnp.int32)
    carry = (state["logits_BV"], caches, seqs, live_logp, seqs, jnp.full_like(live_logp, NEG_INF))
    _, caches, live_seqs, live_logp, fin_seqs, fin_scores = jax.lax.fori_loop(
        0, max_new, body, carry
    )
    none_finished = fin_scores[:, 0] <= NEG_INF / 2
    best = jnp.where(none_finished[:, None], live_seqs[:, 0], fin_seqs[:, 0])
    # The caches are returned so that XLA updates the donated buffers in place.
    return best, jnp.where(none_finished, live_logp[:, 0], fin_scores[:, 0]), caches


def beam_search(
    generator, prompts: list[list[int]], max_new_tokens: int, beams: int, alpha: float = 0.6
) -> tuple[Generation, list[float]]:
    """The best beam's new tokens per prompt (up to and including EOS) with timings, and
    its score. `generator` is a decode.Generator (model, mesh, EOS ids, vocabulary limit)."""
    if beams < 1:
        raise ValueError(f"--num_beams={beams} must be >= 1")
    if not 0 <= alpha < math.inf:  # NaN too
        raise ValueError(f"--length_penalty={alpha} must be a finite number >= 0")
    generator.check_prompts(prompts, max_new_tokens)
    # Pad the prompts so that prompts * beams rows divide over the data-parallel axes.
    multiple = generator.batch_multiple // np.gcd(generator.batch_multiple, beams)
    padded = -(-len(prompts) // multiple) * multiple
    rows = [p for p in prompts for _ in range(beams)]
    rows += [[generator.eos_id if generator.eos_id >= 0 else 0]] * ((padded - len(prompts)) * beams)
    start = time.perf_counter()
    state, _, compile_prefill = generator.prefill(rows, bucket(max_new_tokens))
    jax.block_until_ready(state)
    prefill_s = time.perf_counter() - start - compile_prefill
    start = time.perf_counter()
    cache_len = longest_cache(state["caches"])  # sliding layers hold rings
    fn = functools.partial(
        _beam_loop,
        graphdef=generator.spec.graphdef,
        beams=beams,
        max_new=max_new_tokens,
        alpha=float(alpha),
        stop_ids=generator.stop_ids,
        vocab_limit=generator.vocab_limit,
        constrain=generator.cache_constraint(len(rows), cache_len),
    )
    rest = {k: v for k, v in state.items() if k != "caches"}
    name = ("beam", beams, max_new_tokens, float(alpha))
    compiled, compile_loop = generator.compile_once(
        name, fn, generator.params, state["caches"], rest, donate=(1,)
    )
    best, scores, _ = compiled(generator.params, state["caches"], rest)
    best, scores = jax.device_get((best, scores))
    decode_s = time.perf_counter() - start - compile_loop
    out = [
        cut_at_stop(row, generator.stop_ids) for row in np.asarray(best)[: len(prompts)].tolist()
    ]
    generation = Generation(out, prefill_s, decode_s, compile_prefill + compile_loop)
    return generation, [float(s) for s in np.asarray(scores)[: len(prompts)]]
