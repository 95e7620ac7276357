"""Speculative decoding with the model's own multi-token-prediction module as the draft
(`jaxmoe decode --speculative mtp`; models/mtp.py, docs/mtp.md).

Greedy only, and exact: every token emitted is the main model's argmax given the tokens
before it, so the output equals plain greedy decoding (decode.Generator) token for token.
Each loop step feeds the main model two tokens at slots p, p + 1: x, the last token emitted,
and d, module 1's draft of the token after it. Its argmaxes g1 (after x) and g2 (after d)
are both right when d == g1, so the step emits g1 and g2 (draft accepted), else g1 only.
Module 1 then reads the main model's head inputs at p, p + 1 with the tokens one ahead of
them (g1, g2) through its own one-layer KV cache, and its argmax at p (rejected) or p + 1
(accepted) is the next draft. A rejected step leaves stale keys/values at slot p + 1 in both
caches; the next step writes that slot again before anything reads it (queries see slots up
to their own), so rolling back is moving the shared index back, and every shape is static:
the whole generation is one compiled `lax.while_loop`, as in decode.py.

Rows share one cache index (left-padded prompts), so a step advances two slots only when
every unfinished row's draft is right; a row whose draft was right in a rejected step still
emits its (correct) g1. `acceptance_rate` counts drafts accepted per step: with one prompt it
is the fraction of the module's drafts that were the main model's next token.
"""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.data.tokenizer import PAD_ID
from jaxmoe.inference.decode import (
    Generation,
    Generator,
    Sampling,
    bucket,
    cut_at_stop,
    left_padded,
)
from jaxmoe.models.kv_cache import DecodeCache, LayerCache, cache_shapes, init_cache
from jaxmoe.models.layers import head_logits
from jaxmoe.models.spec import merge_model


@dataclasses.dataclass
class SpeculativeGeneration(Generation):
    """Generation plus the drafts: `accepted` of `steps` loop steps took two tokens."""

    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.steps, 1)


def _greedy(logits, vocab_limit: int):
    return jnp.argmax(logits[..., :vocab_limit], axis=-1).astype(jnp.int32)


def _mtp_cache(cfg, batch: int, length: int, pad_B, constrain, index) -> DecodeCache:
    """Module 1's own one-layer cache, laid out like one unrolled decoder layer's."""
    dtype = jnp.dtype(cfg.dtype)
    layer = constrain(LayerCache(*(jnp.zeros(s, dtype) for s in cache_shapes(cfg, batch, length))))
    return DecodeCache([layer], jnp.asarray(index, jnp.int32), pad_B)


def _prefill(params, prompt_BP, pad_B, *, graphdef, rest, cfg, cache_len, constrain, vocab_limit):
    """The prompt through the main model (its head inputs at every position) and through
    module 1 (with the tokens one ahead: the prompt's own, then the first new token)."""
    model = merge_model(graphdef, params, rest)
    b = prompt_BP.shape[0]
    cache = init_cache(cfg, b, cache_len, pad_B, constrain)
    hidden_BPD, _, cache = model(prompt_BP, cache=cache, head=False)
    first_B = _greedy(head_logits(hidden_BPD[:, -1:], *model.output_weights())[:, 0], vocab_limit)
    ahead_BP = jnp.concatenate([prompt_BP[:, 1:], first_B[:, None]], axis=1)
    mtp = _mtp_cache(cfg, b, cache_len, pad_B, constrain, 0)
    draft_logits, mtp = model.mtp_draft_step(hidden_BPD, ahead_BP, mtp)
    return {
        "caches": cache.layers,
        "mtp_caches": mtp.layers,
        "index": cache.index,
        "pad_B": pad_B,
        "first_B": first_B,
        "draft_B": _greedy(draft_logits[:, -1], vocab_limit),
    }


def _loop(
    params,
    caches,
    mtp_caches,
    state,
    done_B,
    max_new,
    *,
    graphdef,
    rest,
    new_bucket,
    stop_ids,
    vocab_limit,
):
    """Up to `max_new` tokens [B, new_bucket + 1] (PAD after a stop id), the loop steps, the
    steps whose drafts were accepted, and both caches (returned so that the donated buffers
    are updated in place from the first step to the last)."""
    model = merge_model(graphdef, params, rest)
    weights = model.output_weights()
    stop_S = jnp.asarray(stop_ids or (-1,), jnp.int32)
    pad_B, first_B = state["pad_B"], state["first_B"]
    b = first_B.shape[0]
    first_B = jnp.where(done_B, PAD_ID, first_B)
    tokens_BN = jnp.full((b, new_bucket + 1), PAD_ID, jnp.int32).at[:, 0].set(first_B)
    done_B = done_B | jnp.isin(first_B, stop_S)

    def cond(carry):
        n, _, _, _, _, _, _, done_B, _, _ = carry
        return (n < max_new) & ~jnp.all(done_B)

    def body(carry):
        n, x_B, d_B, caches, mtp_caches, index, tokens_BN, done_B, accepted, steps = carry
        pair_B2 = jnp.stack([x_B, d_B], axis=1)
        hidden_B2D, _, cache = model(pair_B2, cache=DecodeCache(caches, index, pad_B), head=False)
        g_B2 = _greedy(head_logits(hidden_B2D, *weights), vocab_limit)
        accept = jnp.all((g_B2[:, 0] == d_B) | done_B)
        draft_logits, mtp = model.mtp_draft_step(
            hidden_B2D, g_B2, DecodeCache(mtp_caches, index, pad_B)
        )
        drafts_B2 = _greedy(draft_logits, vocab_limit)
        emitted_B2 = g_B2.at[:, 1].set(jnp.where(accept, g_B2[:, 1], PAD_ID))
        emitted_B2 = jnp.where(done_B[:, None], PAD_ID, emitted_B2)
        tokens_BN = jax.lax.dynamic_update_slice(tokens_BN, emitted_B2, (jnp.int32(0), n))
        stops_B2 = jnp.isin(g_B2, stop_S)
        done_B = done_B | stops_B2[:, 0] | (accept & stops_B2[:, 1])
        step = 1 + accept.astype(jnp.int32)
        x_B = jnp.where(accept, g_B2[:, 1], g_B2[:, 0])
        d_B = jnp.where(accept, drafts_B2[:, 1], drafts_B2[:, 0])
        return (
            n + step,
            x_B,
            d_B,
            cache.layers,
            mtp.layers,
            index + step,
            tokens_BN,
            done_B,
            accepted + accept.astype(jnp.int32),
            steps + 1,
        )

    carry = (
        jnp.int32(1),
        first_B,
        state["draft_B"],
        caches,
        mtp_caches,
        state["index"],
        tokens_BN,
        done_B,
        jnp.int32(0),
        jnp.int32(0),
    )
    out = jax.lax.while_loop(cond, body, carry)
    return out[6], out[9], out[8], (out[3], out[4])


class MTPGenerator(Generator):
    """decode.Generator's greedy generation with module 1 of the model's multi-token
    prediction as the draft (module docstring); the same prompts, padding and sharding."""

    def __init__(self, model_cfg, params, mesh, **kwargs):
        if model_cfg.arch != "decoder" or not model_cfg.mtp_depth:
            raise ValueError(
                "--speculative mtp needs a decoder with multi-token prediction modules "
                f"(model.mtp_depth={model_cfg.mtp_depth})"
            )
        super().__init__(model_cfg, params, mesh, **kwargs)

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        sampling: Sampling | None = None,
        seed: int = 0,
        stop=None,
    ) -> SpeculativeGeneration:
        del seed  # greedy
        if sampling is not None and sampling.temperature != 0.0:
            raise ValueError("--speculative mtp decodes greedily (--temperature 0)")
        if stop is not None and stop.tables is not None:
            raise ValueError("--speculative mtp does not take stop strings")
        self.check_prompts(prompts, max_new_tokens)
        self.check_fits(len(prompts), max(len(p) for p in prompts), max_new_tokens)
        new_bucket = bucket(max_new_tokens)
        rows = -(-len(prompts) // self.batch_multiple) * self.batch_multiple
        length = bucket(max(len(p) for p in prompts))
        tokens, pad = left_padded(prompts, rows, length)
        args = (
            jax.device_put(tokens, self._batch_sharding(tokens.shape)),
            jax.device_put(pad, self._batch_sharding(pad.shape)),
        )
        cache_len = length + new_bucket
        common = {"graphdef": self.spec.graphdef, "rest": self.spec.rest}
        prefill = functools.partial(
            _prefill,
            **common,
            cfg=self.cfg,
            cache_len=cache_len,
            constrain=self.cache_constraint(rows, cache_len),
            vocab_limit=self.vocab_limit,
        )
        start = time.perf_counter()
        compiled, compile_prefill = self.compile_once(
            ("mtp_prefill", cache_len), prefill, self.params, *args
        )
        state = compiled(self.params, *args)
        jax.block_until_ready(state)
        prefill_s = time.perf_counter() - start - compile_prefill
        loop = functools.partial(
            _loop,
            **common,
            new_bucket=new_bucket,
            stop_ids=self.stop_ids,
            vocab_limit=self.vocab_limit,
        )
        done = jax.device_put(np.arange(rows) >= len(prompts), self._batch_sharding((rows,)))
        rest = {k: v for k, v in state.items() if k not in ("caches", "mtp_caches")}
        loop_args = (state["caches"], state["mtp_caches"], rest, done, jnp.int32(max_new_tokens))
        start = time.perf_counter()
        compiled, compile_loop = self.compile_once(
            ("mtp_decode", new_bucket), loop, self.params, *loop_args, donate=(1, 2)
        )
        tokens_BN, steps, accepted, _ = compiled(self.params, *loop_args)
        tokens_BN = np.asarray(tokens_BN)
        decode_s = time.perf_counter() - start - compile_loop
        out = [
            cut_at_stop(row, self.stop_ids)
            for row in tokens_BN[: len(prompts), :max_new_tokens].tolist()
        ]
        return SpeculativeGeneration(
            out,
            prefill_s,
            decode_s,
            compile_prefill + compile_loop,
            int(steps),
            accepted=int(accepted),
        )
