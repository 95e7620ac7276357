"""Packed rows (segment ids, per-document positions): every document of a packed row gives
the logits it gives alone, in every attention path that runs on CPU: the XLA dense and
blocked-causal paths, sliding windows, MLA, `jax.nn.dot_product_attention` (the API the
cuDNN path calls) and Pallas splash attention in interpret mode, and for T5's encoder and
decoder. The reference is each document in a row of its own (right padding, which causal
attention and T5's padding mask never read); the packed rows are built here by hand. A
mutation that merges two documents' segment ids (one document sees the other) must fail
the same check, so the check can see a leak.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxmoe.models import build_model
from jaxmoe.training.steps import forward
from tests.helpers import TINY_T5, tiny_config, unit_scale_params

TOL = 1e-5
MOE = ("model.moe.num_experts=4", "model.moe.every=2", "model.moe.dispatch=dense")
PATHS = {
    "xla_dense": ("model.attention_kernel=xla", "model.attention_block=0"),
    "xla_blocked": ("model.attention_kernel=xla", "model.attention_block=4"),
    "sliding_window": (
        "model.attention_kernel=xla",
        "model.sliding_window=3",
        "model.layer_types=sliding,full",
    ),
    "mla": (
        "model.attention=mla",
        "model.kv_lora_rank=16",
        "model.qk_rope_head_dim=4",
        "model.qk_nope_head_dim=8",
        "model.v_head_dim=8",
        "model.attention_block=4",
    ),
    "dot_product_attention": ("model.attention_kernel=dot_product_attention",),
}


def model_of(config, seed: int = 0):
    model = build_model(config.model, rngs=nnx.Rngs(0))
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    params = jax.tree.map(np.asarray, unit_scale_params(config.model, seed))
    return graphdef, params, rest


def logits_of(model, batch):
    graphdef, params, rest = model
    fn = jax.jit(lambda p, b: forward(graphdef, p, b, train=False, rest=rest)[0])
    return np.asarray(fn(params, batch))


def pack(rows, length: int):
    """Rows of documents (lists of token lists) as one packed decoder-only batch, and the
    (row, start, document) of every document."""
    b = len(rows)
    batch = {
        name: np.zeros((b, length), np.int32) for name in ("inputs", "segment_ids", "positions")
    }
    batch["targets"] = np.zeros((b, length), np.int32)
    batch["weights"] = np.zeros((b, length), np.float32)
    where = []
    for r, docs in enumerate(rows):
        start = 0
        for k, doc in enumerate(docs):
            n = len(doc)
            batch["inputs"][r, start : start + n] = doc
            batch["segment_ids"][r, start : start + n] = k + 1
            batch["positions"][r, start : start + n] = np.arange(n)
            batch["weights"][r, start : start + n] = 1.0
            where.append((r, start, doc))
            start += n
    return batch, where


def alone(docs, length: int):
    """Each document in a row of its own, padded on the right (no segment ids)."""
    batch = {"inputs": np.zeros((len(docs), length), np.int32)}
    for r, doc in enumerate(docs):
        batch["inputs"][r, : len(doc)] = doc
    batch["targets"] = np.zeros_like(batch["inputs"])
    batch["weights"] = (batch["inputs"] != 0).astype(np.float32)
    return batch


def worst_leak(packed_logits, where, alone_logits) -> float:
    return max(
        float(np.abs(packed_logits[r, s : s + len(d)] - alone_logits[i, : len(d)]).max())
        for i, (r, s, d) in enumerate(where)
    )


def documents(rng, lengths, vocab: int):
    return [list(rng.integers(1, vocab, n)) for n in lengths]


def check_decoder(config, lengths_per_row, length: int):
    rng = np.random.default_rng(7)
    rows = [documents(rng, lengths, config.model.vocab_size) for lengths in lengths_per_row]
    model = model_of(config)
    batch, where = pack(rows, length)
    want = logits_of(model, alone([d for _, _, d in where], length))
    assert worst_leak(logits_of(model, batch), where, want) <= TOL
    # The mutation: document 2 of each row joins document 1 (it now sees it).
    merged = dict(batch, segment_ids=np.where(batch["segment_ids"] == 2, 1, batch["segment_ids"]))
    assert worst_leak(logits_of(model, merged), where, want) > 100 * TOL


@pytest.mark.parametrize("path", PATHS)
def test_packed_documents_give_their_own_logits(path):
    config = tiny_config(*MOE, *PATHS[path], "model.vocab_size=64")
    check_decoder(config, [[5, 7, 3], [9, 6]], 16)


def test_splash_interpret_packed_documents():
    """Splash needs rows of a multiple of 128 tokens (its lanes): one row of three."""
    config = tiny_config(*MOE, "model.attention_kernel=splash", "model.vocab_size=64")
    check_decoder(config, [[40, 50, 30]], 128)


def test_t5_packed_documents_both_sides():
    config = tiny_config(*TINY_T5, "model.vocab_size=64", "model.attention_block=0")
    rng = np.random.default_rng(3)
    pairs = [[(6, 4), (5, 7), (3, 2)], [(9, 5), (4, 6)]]  # (encoder, decoder) lengths
    enc_len, dec_len = 16, 16
    model = model_of(config)
    b = len(pairs)
    fields = ("encoder_inputs", "encoder_segment_ids", "encoder_positions")
    batch = {k: np.zeros((b, enc_len), np.int32) for k in fields}
    for k in ("inputs", "targets", "segment_ids", "positions"):
        batch[k] = np.zeros((b, dec_len), np.int32)
    batch["weights"] = np.zeros((b, dec_len), np.float32)
    singles, where = [], []
    for r, row in enumerate(pairs):
        e0 = d0 = 0
        for k, (ne, nd) in enumerate(row):
            enc, dec = documents(rng, [ne, nd], 64)
            batch["encoder_inputs"][r, e0 : e0 + ne] = enc
            batch["encoder_segment_ids"][r, e0 : e0 + ne] = k + 1
            batch["encoder_positions"][r, e0 : e0 + ne] = np.arange(ne)
            batch["inputs"][r, d0 : d0 + nd] = [0, *dec[:-1]]  # shifted right per document
            batch["segment_ids"][r, d0 : d0 + nd] = k + 1
            batch["positions"][r, d0 : d0 + nd] = np.arange(nd)
            batch["weights"][r, d0 : d0 + nd] = 1.0
            singles.append((enc, [0, *dec[:-1]]))
            where.append((r, d0, dec))
            e0, d0 = e0 + ne, d0 + nd
    single = {
        "encoder_inputs": np.zeros((len(singles), enc_len), np.int32),
        "inputs": np.zeros((len(singles), dec_len), np.int32),
    }
    for i, (enc, dec_in) in enumerate(singles):
        single["encoder_inputs"][i, : len(enc)] = enc
        single["inputs"][i, : len(dec_in)] = dec_in
    single["targets"] = np.zeros_like(single["inputs"])
    single["weights"] = np.ones(single["inputs"].shape, np.float32)
    want = logits_of(model, single)
    assert worst_leak(logits_of(model, batch), where, want) <= TOL
    for key in ("segment_ids", "encoder_segment_ids"):  # either side merged leaks
        merged = dict(batch)
        merged[key] = np.where(batch[key] == 2, 1, batch[key])
        assert worst_leak(logits_of(model, merged), where, want) > 100 * TOL, key
