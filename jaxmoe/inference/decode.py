"""Autoregressive decoding with a KV cache (`jaxmoe decode`: decode_text.py).

Two compiled functions per request shape: `prefill` (the prompt in one pass, or the encoder
and the cross-attention K/V once for an encoder-decoder) and `decode` (a `lax.while_loop`
that samples one token per iteration, writes its K/V into the cache in place and stops when
every row has produced EOS or the budget is spent). The host waits only once per request.
Prompt and new-token counts are rounded up to power-of-two buckets, so a new request
recompiles only when it changes bucket. Parameters, the batch (rows padded to the
data-parallel size) and the caches (sequences over the batch axes, KV heads over `tensor`)
are sharded on the mesh.
"""

import dataclasses
import functools
import logging
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxmoe.data.tokenizer import EOS_ID, PAD_ID
from jaxmoe.models.kv_cache import DecodeCache, LayerCache, init_cache, longest_cache
from jaxmoe.models.moe.replay import record_shape
from jaxmoe.models.spec import merge_model, model_spec
from jaxmoe.parallel.device_memory import refuse_over_memory, state_bytes_per_device
from jaxmoe.parallel.sharding import batch_spec, data_parallel_size, logical_to_spec, named

log = logging.getLogger(__name__)

MIN_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy; top_k 0 = off; top_p 1 = off. Applied in that order."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not 0 <= self.temperature < math.inf:  # NaN too
            raise ValueError(
                f"--temperature={self.temperature} must be a finite number >= 0 (0 = greedy)"
            )
        if self.top_k < 0:
            raise ValueError(f"--top_k={self.top_k} must be >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top_p={self.top_p} must be in (0, 1] (1 = off)")

    @classmethod
    def from_flags(cls, temperature: float | None, top_k: int = 0, top_p: float = 1.0):
        """The decoding `--temperature/--top_k/--top_p` ask for. top-k and top-p narrow the
        distribution a token is sampled from: without a temperature they sample at 1 (as
        transformers' do_sample does); with temperature 0 (greedy) they would change
        nothing, and a warning says so once."""
        narrowed = top_k > 0 or top_p < 1.0
        if temperature is None:
            temperature = 1.0 if narrowed else 0.0
        elif temperature == 0.0 and narrowed:
            log.warning(
                "--temperature 0 decodes greedily: --top_k=%d / --top_p=%s change nothing "
                "(leave out --temperature, or give one > 0, to sample)",
                top_k,
                top_p,
            )
        return cls(temperature, top_k, top_p)

    def describe(self) -> str:
        """'greedy', or what is sampled ('sample temperature=1.0 top_p=0.9')."""
        if self.temperature == 0.0:
            return "greedy"
        narrowing = (f" top_k={self.top_k}" if self.top_k else "") + (
            f" top_p={self.top_p}" if self.top_p < 1.0 else ""
        )
        return f"sample temperature={self.temperature}{narrowing}"


def fit_context(
    prompts: list[list[int]],
    max_len: int,
    max_new_tokens: int,
    truncate: bool,
    encoder_decoder,
    labels: list[str] | None = None,
) -> list[list[int]]:
    """Prompts checked against the model's context `max_len` (model.max_len: the longest
    sequence it was trained on or converted with; 0 = unknown, nothing checked). A decoder's
    prompt and new tokens share the context; an encoder's input has it alone. Too long is
    refused, or with `truncate` cut to its last tokens and logged; `labels` name the prompts
    in those lines (default "prompt I")."""
    if not max_len:
        return prompts
    room = max_len if encoder_decoder else max_len - max_new_tokens
    if room < 1:
        raise ValueError(
            f"--max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's "
            f"context of {max_len} tokens (model.max_len)"
        )
    out = []
    for i, prompt in enumerate(prompts):
        if len(prompt) > room:
            what = "" if encoder_decoder else f" + --max_new_tokens={max_new_tokens}"
            label = labels[i] if labels else f"prompt {i}"
            if not truncate:
                raise ValueError(
                    f"{label}: {len(prompt)} tokens{what} exceed the model's context of "
                    f"{max_len} tokens (model.max_len, the longest sequence it was trained "
                    f"on); shorten it, or --truncate keeps its last {room} tokens"
                )
            log.warning(
                "%s truncated from %d to its last %d tokens (model.max_len=%d%s)",
                label, len(prompt), room, max_len, what.replace(" +", ","),
            )  # fmt: skip
            prompt = prompt[-room:]
        out.append(prompt)
    return out


def filter_logits(logits_BV, sampling: Sampling):
    """Temperature-scaled logits with tokens outside the top-k / top-p set at -inf."""
    logits_BV = logits_BV.astype(jnp.float32) / sampling.temperature
    if sampling.top_k and sampling.top_k < logits_BV.shape[-1]:
        kth_B1 = jax.lax.top_k(logits_BV, sampling.top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    if sampling.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose probability reaches top_p: a
        # token is kept when the mass of the tokens ranked before it is still below top_p.
        sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
        num_kept_B = jnp.sum(mass_before_BV < sampling.top_p, axis=-1)
        threshold_B1 = jnp.take_along_axis(sorted_BV, num_kept_B[:, None] - 1, axis=-1)
        logits_BV = jnp.where(logits_BV < threshold_B1, -jnp.inf, logits_BV)
    return logits_BV


def sample_tokens(logits_BV, key, sampling: Sampling):
    """Next token ids [B] int32: argmax when greedy, else a draw from the filtered logits."""
    if sampling.temperature == 0.0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filter_logits(logits_BV, sampling)).astype(jnp.int32)


def bucket(n: int) -> int:
    """Smallest power of two >= n (at least MIN_BUCKET): few distinct compiled shapes."""
    return max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length())


@dataclasses.dataclass
class Generation:
    """New tokens per prompt (up to and including EOS) and where the time went."""

    tokens: list[list[int]]
    prefill_s: float
    decode_s: float
    compile_s: float
    steps: int = 0  # decode loop iterations (tokens generated per row, at most)
    # record_routing: per prompt, the experts [n - 1, M, K] of its prompt and new tokens fed
    routing: list | None = None

    @property
    def num_new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of prefill + decode (compilation not counted)."""
        return self.num_new_tokens / max(self.prefill_s + self.decode_s, 1e-9)


def cut_at_stop(row: list[int], stop_ids) -> list[int]:
    """`row` up to and including its first stop id (all of it when it has none)."""
    ends = [i for i, token in enumerate(row) if token in stop_ids]
    return row[: ends[0] + 1] if ends else row


def without_stop(new: list[int], stop_ids) -> tuple[list[int], bool]:
    """(new tokens without the stop id that ended them, whether one did): what is decoded
    to text, as transformers drops the EOS it stopped at."""
    ended = bool(new) and new[-1] in stop_ids
    return (new[:-1] if ended else new), ended


def left_padded(prompts: list[list[int]], rows: int, length: int):
    """(tokens [rows, length] int32, left padding [rows]) of decoder-only prompts: each row's
    last token at the last slot, so every row writes the same cache slot at each step;
    filler rows past the prompts hold one pad token."""
    tokens = np.full((rows, length), PAD_ID, np.int32)
    pad = np.full((rows,), length - 1, np.int32)
    for i, prompt in enumerate(prompts):
        tokens[i, length - len(prompt) :] = prompt
        pad[i] = length - len(prompt)
    return tokens, pad


def recorded_experts(aux: dict):
    """int32 [B, L, M, K]: the chosen experts of each MoE layer's aux (record_routing)."""
    return jnp.stack([layer["experts"] for layer in aux.values()], axis=2)


def _prefill_decoder(
    params, prompt_BP, pad_B, *, graphdef, rest, cfg, cache_len, constrain, record=False
):
    model = merge_model(graphdef, params, rest)
    cache = init_cache(cfg, prompt_BP.shape[0], cache_len, pad_B, constrain)
    logits, aux, cache = model(prompt_BP, cache=cache, last_only=True, record_routing=record)
    index = cache.index
    out = {"logits_BV": logits[:, -1], "caches": cache.layers, "index": index, "pad_B": pad_B}
    if record:  # every prompt position's experts (--record_routing)
        out["experts_BPMK"] = recorded_experts(aux)
    return out


def _prefill_encoder_decoder(params, encoder_BS, *, graphdef, rest, cfg, cache_len, constrain):
    model = merge_model(graphdef, params, rest)
    cache = init_cache(cfg, encoder_BS.shape[0], cache_len, constrain=constrain)
    start_B1 = jnp.zeros((encoder_BS.shape[0], 1), jnp.int32)  # T5's decoder start token
    logits, _, cache = model(encoder_BS, start_B1, cache=cache)  # runs the encoder once
    return {
        "logits_BV": logits[:, -1],
        "caches": cache.layers,
        "index": cache.index,
        "cross": cache.cross,
        "encoder_valid_BS": cache.encoder_valid_BS,
    }


def cached_step(model, tokens_BL, caches: list, index, state: dict, record: bool = False):
    """The model's own call on L new tokens per row at cache slot `index`, with the rest of
    the request's cache from a prefill `state`: (logits [B, L, V] f32, updated caches), and
    with `record` the tokens' chosen experts [B, L, M, K] third."""
    pad_B = state.get("pad_B", jnp.zeros((tokens_BL.shape[0],), jnp.int32))
    cache = DecodeCache(
        caches,
        jnp.asarray(index, jnp.int32),
        pad_B,
        state.get("cross"),
        state.get("encoder_valid_BS"),
    )
    if cache.cross is None:
        logits, aux, cache = model(tokens_BL, cache=cache, record_routing=record)
    else:
        logits, aux, cache = model(None, tokens_BL, cache=cache)
    if record:
        return logits, cache.layers, recorded_experts(aux)
    return logits, cache.layers


def _decode_loop(
    params,
    caches,
    state,
    done_B,
    max_new,
    key,
    *,
    graphdef,
    rest,
    sampling,
    new_bucket,
    stop_ids,
    vocab_limit,
    constrain,
    record=False,
):
    """Sample up to `max_new` tokens [B, new_bucket] (pad after a stop id: EOS...).

    Returns (tokens, number of loop steps, caches, recorded experts or None). The caches are
    donated by the caller and returned, so XLA updates one buffer in place from the first
    step to the last. `record`: the experts of every new token fed back, [B, new_bucket, M,
    K] (new token t at t; the last is never fed).
    """
    model = merge_model(graphdef, params, rest)  # rest: RNG streams, unused at decode
    stop_S = jnp.asarray(stop_ids or (-1,), jnp.int32)  # -1: never drawn

    b = state["logits_BV"].shape[0]
    key, sub = jax.random.split(key)
    # Only ids the tokenizer knows may be drawn (T5 pads its 32100 pieces to 32128 logits).
    first_B = sample_tokens(state["logits_BV"][:, :vocab_limit], sub, sampling)
    first_B = jnp.where(done_B, PAD_ID, first_B)
    tokens_BN = jnp.full((b, new_bucket), PAD_ID, jnp.int32).at[:, 0].set(first_B)

    def cond(carry):
        t, _, _, _, done_B, _, _, _ = carry
        return (t < max_new) & ~jnp.all(done_B)

    def body(carry):
        t, prev_B, caches, tokens_BN, done_B, key, text_B, experts = carry
        index = state["index"] + t - 1
        out = cached_step(model, prev_B[:, None], caches, index, state, record)
        logits_B1V, caches = out[:2]
        if record:
            start = (jnp.int32(0), t - 1, jnp.int32(0), jnp.int32(0))
            experts = jax.lax.dynamic_update_slice(experts, out[2], start)
        caches = [constrain(c) for c in caches]
        key, sub = jax.random.split(key)
        next_B = sample_tokens(logits_B1V[:, -1, :vocab_limit], sub, sampling)
        next_B = jnp.where(done_B, PAD_ID, next_B)
        tokens_BN = jax.lax.dynamic_update_slice(tokens_BN, next_B[:, None], (jnp.int32(0), t))
        text_B, stopped_B = _stop_string_step(state, text_B, next_B)
        done_B = done_B | jnp.isin(next_B, stop_S) | stopped_B
        return t + 1, next_B, caches, tokens_BN, done_B, key, text_B, experts

    text_B, stopped_B = _stop_string_step(state, jnp.zeros((2, b), jnp.int32), first_B)
    done_B = done_B | jnp.isin(first_B, stop_S) | stopped_B
    experts = None
    if record:  # (M, K): MoE layers, gate slots
        experts = jnp.full((b, new_bucket, *record), -1, jnp.int32)
    carry = (jnp.int32(1), first_B, caches, tokens_BN, done_B, key, text_B, experts)
    steps, _, caches, tokens_BN, _, _, _, experts = jax.lax.while_loop(cond, body, carry)
    return tokens_BN, steps, caches, experts


def _stop_string_step(state: dict, text_2B, token_B):
    """One token through the stop-string automaton of stop_strings.py, when the request
    has one (`state["stop_next_SV"]`): (automaton state and strings seen [2, B], whether
    each row may stop now). Without one, nothing stops here."""
    if "stop_next_SV" not in state:
        return text_2B, jnp.zeros(token_B.shape, bool)
    at_B, seen_B = text_2B
    seen_B = seen_B | state["stop_completes_SV"][at_B, token_B]
    at_B = state["stop_next_SV"][at_B, token_B]
    stopped_B = (seen_B != 0) & ((state["stop_pending_S"][at_B] & ~seen_B) == 0)
    return jnp.stack([at_B, seen_B]), stopped_B


class Generator:
    """Compiled, sharded prefill + decode for one model on one mesh.

    params: the model's parameters (nested str-keyed dict), placed on `mesh` or not.
    eos_id < 0 disables stopping at EOS (benchmarks); `stop_ids` also end a row (the
    tokenizer's further EOS ids). vocab_limit: only ids below it are generated (the
    tokenizer's size; default the model's vocabulary).
    """

    def __init__(
        self,
        model_cfg,
        params,
        mesh: Mesh,
        *,
        spec=None,
        eos_id: int = EOS_ID,
        stop_ids: tuple[int, ...] = (),
        vocab_limit: int | None = None,
    ):
        self.cfg, self.mesh, self.eos_id = model_cfg, mesh, eos_id
        first = (eos_id,) if eos_id >= 0 else ()
        self.stop_ids = tuple(dict.fromkeys((*first, *(int(i) for i in stop_ids))))
        self.vocab_limit = vocab_limit or model_cfg.vocab_size
        self.spec = spec or model_spec(model_cfg, mesh)
        self.encoder_decoder = model_cfg.arch == "encoder_decoder"
        self.params = jax.device_put(params, named(mesh, self.spec.param_specs))
        self.batch_multiple = data_parallel_size(mesh)
        self._compiled: dict = {}

    @classmethod
    def for_tokenizer(cls, model_cfg, params, mesh: Mesh, tokenizer, *, spec=None) -> "Generator":
        """The Generator of `decode`, `eval --task generate` and lm-eval: it stops at every
        EOS id of `tokenizer` (its EOS and the further `eos_token_id`s of the
        generation_config.json beside it: `tokenizer.eos_ids`) and draws only ids below
        the tokenizer's size."""
        return cls(
            model_cfg,
            params,
            mesh,
            spec=spec,
            eos_id=tokenizer.eos_id,
            stop_ids=tokenizer.eos_ids,
            vocab_limit=min(tokenizer.vocab_size, model_cfg.vocab_size),
        )

    def _batch_sharding(self, shape) -> NamedSharding:
        return NamedSharding(self.mesh, batch_spec(self.mesh, len(shape), shape[0]))

    def cache_constraint(self, batch: int, length: int):
        """LayerCache -> LayerCache placed on the mesh: the N = B * K rows split over the
        batch axes (sequences) and then `tensor` (KV heads), where those divide B and K."""
        sizes = dict(self.mesh.shape)

        def axes(entry) -> tuple[str, ...]:
            return () if entry is None else (entry,) if isinstance(entry, str) else entry

        batch_axes = axes(logical_to_spec(("batch",), (batch,), sizes)[0])
        head_axes = axes(logical_to_spec(("kv_heads",), (self.cfg.num_kv_heads,), sizes)[0])
        if self.cfg.attention == "mla":  # one latent row per sequence (latent_cache.py)
            head_axes = ()
        rows = (*batch_axes, *head_axes)

        def place(x):  # a stacked cache [P, N, ...] keeps its layer axis whole
            spec = PartitionSpec(*([None] * (x.ndim - 3)), rows or None, None, None)
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

        return lambda cache: LayerCache(*(place(x) for x in cache))

    def compile_once(self, name, fn, *args, donate=()):
        """AOT-compile `fn` for these argument shapes once; returns (compiled, seconds)."""
        key = (name, tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(args[1:])))
        if key in self._compiled:
            return self._compiled[key], 0.0
        start = time.perf_counter()
        with jax.set_mesh(self.mesh):
            compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
        self._compiled[key] = compiled
        return compiled, time.perf_counter() - start

    def compiled_programs(self) -> dict:
        """{program key, e.g. ("decode", new bucket, sampling): its compiled executable}
        for every program compiled so far (benchmarks read their size)."""
        return {key[0]: compiled for key, compiled in self._compiled.items()}

    def prefill(self, prompts: list[list[int]], new_bucket: int, record: bool = False):
        """(state, rows, compile seconds): caches sized prompt bucket + new_bucket; `record`:
        the state holds the prompt positions' experts, "experts_BPMK"."""
        rows = -(-len(prompts) // self.batch_multiple) * self.batch_multiple
        length = bucket(max(len(p) for p in prompts))
        tokens = np.full((rows, length), PAD_ID, np.int32)
        if self.encoder_decoder:
            for i, prompt in enumerate(prompts):  # right-padded: T5 masks id 0
                tokens[i, : len(prompt)] = prompt
            tokens[len(prompts) :, 0] = EOS_ID  # filler rows: a one-token input
            cache_len, fn = new_bucket, _prefill_encoder_decoder
            args = (jax.device_put(tokens, self._batch_sharding(tokens.shape)),)
        else:
            tokens, pad = left_padded(prompts, rows, length)
            cache_len = length + new_bucket
            fn = functools.partial(_prefill_decoder, record=record)
            args = (
                jax.device_put(tokens, self._batch_sharding(tokens.shape)),
                jax.device_put(pad, self._batch_sharding(pad.shape)),
            )
        fn = functools.partial(
            fn,
            graphdef=self.spec.graphdef,
            rest=self.spec.rest,
            cfg=self.cfg,
            cache_len=cache_len,
            constrain=self.cache_constraint(rows, cache_len),
        )
        key = ("prefill", cache_len, record)
        compiled, seconds = self.compile_once(key, fn, self.params, *args)
        return compiled(self.params, *args), rows, seconds

    def decode(
        self,
        state,
        num_prompts: int,
        max_new_tokens: int,
        sampling,
        seed: int = 0,
        stop=None,
        record: bool = False,
    ):
        """(tokens [rows, bucket] np.int32, loop steps, compile seconds[, the new tokens'
        experts [rows, bucket, M, K] with `record`]).

        Consumes `state`: its caches are donated to the loop and updated in place. `stop`
        (stop_strings.StopStrings) also ends a row at its stop strings.
        """
        rows = state["logits_BV"].shape[0]
        new_bucket = bucket(max_new_tokens)
        cache_len = longest_cache(state["caches"])  # sliding layers hold rings
        needed = int(state["index"]) + max_new_tokens - 1  # the last token is never fed back
        if needed > cache_len:
            raise ValueError(
                f"max_new_tokens={max_new_tokens} needs {needed} cache slots, the cache has "
                f"{cache_len}"
            )
        done = jax.device_put(np.arange(rows) >= num_prompts, self._batch_sharding((rows,)))
        fn = functools.partial(
            _decode_loop,
            graphdef=self.spec.graphdef,
            rest=self.spec.rest,
            sampling=sampling,
            new_bucket=new_bucket,
            stop_ids=self.stop_ids,
            vocab_limit=self.vocab_limit,
            constrain=self.cache_constraint(rows, cache_len),
            record=record_shape(self.cfg) if record else False,
        )
        rest = {k: v for k, v in state.items() if k not in ("caches", "experts_BPMK")}
        if stop is not None and stop.tables is not None:
            replicated = NamedSharding(self.mesh, PartitionSpec())
            rest.update(jax.device_put(stop.tables, replicated))
        args = (state["caches"], rest, done, jnp.int32(max_new_tokens), jax.random.key(seed))
        name = ("decode", new_bucket, sampling, record)
        compiled, seconds = self.compile_once(name, fn, self.params, *args, donate=(1,))
        tokens, steps, _, experts = compiled(self.params, *args)
        if record:
            return np.asarray(tokens), int(steps), seconds, np.asarray(experts)
        return np.asarray(tokens), int(steps), seconds

    def bytes_lower_bound(self, num_prompts: int, prompt_len: int, max_new_tokens: int) -> dict:
        """Per-device bytes a request needs at least: the parameters, the KV caches, and
        one layer's prefill attention scores (float32 logits plus their probabilities)."""
        sizes = dict(self.mesh.shape)
        cfg = self.cfg
        rows = -(-num_prompts // self.batch_multiple)  # per device: batch axes split rows
        tensor = sizes.get("tensor", 1)
        itemsize = jnp.dtype(cfg.dtype).itemsize
        length, new = bucket(prompt_len), bucket(max_new_tokens)
        if self.encoder_decoder:
            queries, keys, cache_len = length, length, new  # encoder self-attention
        else:
            queries, keys, cache_len = length, length + new, length + new
        kv_heads = max(1, cfg.num_kv_heads // tensor)
        heads = max(1, cfg.num_heads // tensor)
        params = state_bytes_per_device(
            self.spec.abstract_params, named(self.mesh, self.spec.param_specs)
        )
        if cfg.attention == "mla":  # latent + rotary key per token, N = B rows
            kv_heads, head_dim = 1, (cfg.kv_lora_rank + cfg.qk_rope_head_dim) / 2
        else:
            head_dim = cfg.head_dim
        return {
            "parameters": params,
            "kv_cache": 2.0 * cfg.num_layers * rows * kv_heads * cache_len * head_dim * itemsize,
            "attention": float(rows) * heads * queries * keys * (4 + itemsize),
        }

    def check_fits(self, num_prompts: int, prompt_len: int, max_new_tokens: int) -> None:
        """A one-line ValueError when a request cannot fit in one device's memory."""
        refuse_over_memory(
            self.bytes_lower_bound(num_prompts, prompt_len, max_new_tokens),
            f"a {prompt_len}-token prompt (x{num_prompts}) with --max_new_tokens={max_new_tokens}",
            "shorten the prompt",
            error=ValueError,
            device=self.mesh.devices.flat[0],
        )

    def check_prompts(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        """ValueError naming the first request that cannot be generated: no prompts, an
        empty one, an id outside the model's vocabulary (the embedding lookup would clamp
        it and generate from another token, silently), or a prompt that with the new tokens
        exceeds the model's context (model.max_len; 0 = unknown, not checked)."""
        if not prompts:
            raise ValueError("no prompts given")
        if max_new_tokens < 1:
            raise ValueError(f"--max_new_tokens={max_new_tokens} must be >= 1")
        vocab = self.cfg.vocab_size
        for i, prompt in enumerate(prompts):
            if not len(prompt):
                raise ValueError(f"prompt {i} is empty (no tokens)")
            ids = np.asarray(prompt)
            if ids.ndim != 1 or ids.dtype.kind not in "iu":
                raise ValueError(f"prompt {i}: expected a list of integer token ids")
            outside = np.flatnonzero((ids < 0) | (ids >= vocab))
            if outside.size:
                at = int(outside[0])
                raise ValueError(
                    f"prompt {i}: token id {int(ids[at])} (position {at}) is outside the "
                    f"model's vocabulary [0, {vocab})"
                )
        fit_context(prompts, self.cfg.max_len, max_new_tokens, False, self.encoder_decoder)

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        seed: int = 0,
        stop=None,
    ) -> Generation:
        """New tokens for each prompt (token id lists), greedy or sampled. With `stop`
        (stop_strings.StopStrings) a row also ends inside the loop at its stop strings.
        decode_routing.generate_recorded is this, recording the experts each position ran."""
        self.check_prompts(prompts, max_new_tokens)
        self.check_fits(len(prompts), max(len(p) for p in prompts), max_new_tokens)
        new_bucket = bucket(max_new_tokens)
        start = time.perf_counter()
        state, _, compile_prefill = self.prefill(prompts, new_bucket)
        jax.block_until_ready(state)
        prefill_s = time.perf_counter() - start - compile_prefill
        start = time.perf_counter()
        tokens, steps, compile_decode = self.decode(
            state, len(prompts), max_new_tokens, sampling, seed, stop
        )
        decode_s = time.perf_counter() - start - compile_decode
        rows = tokens[: len(prompts), :max_new_tokens].tolist()
        out = [cut_at_stop(row, self.stop_ids) for row in rows]
        result = Generation(out, prefill_s, decode_s, compile_prefill + compile_decode, steps)
        if stop is not None and stop.tables is not None:
            out = stop.cut_rows(out)
            if out is None:  # the tokenizer broke the automaton's assumption: no early stop
                again = self.generate(prompts, max_new_tokens, sampling, seed)
                again.compile_s += result.compile_s
                return again
            result.tokens = out
        return result
