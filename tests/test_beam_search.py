"""Beam search against an exhaustive search: with more beams than there are live prefixes,
beam search must return the best of all sequences under T5X's length-normalised score, each
scored here by the full forward pass (no cache) in numpy."""

import itertools

import jax
import numpy as np
import pytest
from flax import nnx

from jaxmoe.conversions.hf.importer import abstract_params
from jaxmoe.inference.beam_search import beam_search, brevity_penalty
from jaxmoe.inference.decode import Generator
from jaxmoe.models import build_model
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.parallel.options import MeshOptions
from tests.helpers import TINY_T5, tiny_config

VOCAB, EOS, STEPS = 8, 1, 3
SECOND_EOS = 5  # a further EOS id, as Llama 3's generation_config.json lists
PROMPTS = [[3, 5, 2], [7, 4, 6, 2, 5], [6]]
MESH = MeshOptions(data=4, tensor=2)


# decoder_scanned: 3 layers under one scan, its caches stacked [3, ...] and their rows
# gathered from the parent beams along the second axis.
SCANNED = ("model.scan_layers=true", "model.num_layers=3")


@pytest.fixture(scope="module", params=["decoder", "encoder_decoder", "decoder_scanned"])
def model(request):
    """(config, params, token_logp): token_logp(prompt, seqs [N, STEPS]) -> log p of each
    token of each sequence [N, STEPS], from one full forward pass without a cache."""
    extra = {"encoder_decoder": TINY_T5, "decoder_scanned": SCANNED}.get(request.param, ())
    cfg = tiny_config("model.moe.num_experts=0", f"model.vocab_size={VOCAB}", *extra).model
    rng = np.random.default_rng(3)  # unit-scale weights: peaked, distinct scores
    params = jax.tree.map(
        lambda a: (a.ndim == 1) + rng.standard_normal(a.shape, np.float32) / a.shape[0] ** 0.5,
        abstract_params(cfg),
    )
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0))))
    forward = jax.jit(lambda p, *t: nnx.merge(graphdef, p)(*t)[0])

    def token_logp(prompt, seqs):
        n = len(seqs)
        if request.param == "encoder_decoder":  # the decoder starts from id 0
            decoder = np.concatenate([np.zeros((n, 1), np.int32), seqs[:, :-1]], 1)
            logits = forward(params, np.tile(prompt, (n, 1)).astype(np.int32), decoder)
        else:
            logits = forward(params, np.concatenate([np.tile(prompt, (n, 1)), seqs], 1))
            logits = logits[:, len(prompt) - 1 : -1]
        logits = np.asarray(logits, np.float64)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        return np.take_along_axis(logp, seqs[..., None], -1)[..., 0]

    return cfg, params, token_logp


def exhaustive(token_logp, prompt, alpha, stops=(EOS,)):
    """(best tokens, score) over every sequence of at most STEPS tokens that ends at its
    first EOS (any id of `stops`), scored log p / brevity penalty (EOS always has some
    probability)."""
    every = np.array(list(itertools.product(range(VOCAB), repeat=STEPS)), np.int32)
    best = (None, -np.inf)
    for seq, lps in zip(every.tolist(), token_logp(prompt, every), strict=True):
        ends = [i for i, token in enumerate(seq) if token in stops]
        n = ends[0] + 1 if ends else None
        if n is not None:
            score = lps[:n].sum() / brevity_penalty(alpha, n)
            if score > best[1]:
                best = (seq[:n], score)
    return best


@pytest.mark.parametrize("alpha", [0.0, 0.6, 3.0])
def test_wide_beam_finds_the_exhaustive_best(model, alpha):
    cfg, params, forward = model
    generator = Generator(cfg, params, make_mesh(MESH), eos_id=EOS)
    # 7 * 7 live prefixes of two tokens (no EOS): 64 beams keep every one of them.
    generation, scores = beam_search(generator, PROMPTS, STEPS, beams=64, alpha=alpha)
    for prompt, got, score in zip(PROMPTS, generation.tokens, scores, strict=True):
        want, want_score = exhaustive(forward, prompt, alpha)
        assert got == want
        assert score == pytest.approx(want_score, abs=1e-4)


def test_length_penalty_changes_the_choice(model):
    """A check on the test itself: the prompts include a case where alpha matters."""
    _, _, forward = model
    picks = [[tuple(exhaustive(forward, p, a)[0]) for p in PROMPTS] for a in (0.0, 3.0)]
    assert picks[0] != picks[1]


def test_bad_beam_arguments(model):
    cfg, params, _ = model
    generator = Generator(cfg, params, make_mesh(MESH), eos_id=EOS)
    with pytest.raises(ValueError, match="--num_beams=0"):
        beam_search(generator, PROMPTS, STEPS, beams=0)
    with pytest.raises(ValueError, match="--length_penalty=-1"):
        beam_search(generator, PROMPTS, STEPS, beams=2, alpha=-1)


def test_every_eos_id_ends_a_beam(model):
    """A tokenizer with a second EOS id (generation_config.json's further eos_token_id):
    sequences ending at it finish too, so the best one can be one the single-EOS search
    would not return."""
    cfg, params, forward = model
    generator = Generator(cfg, params, make_mesh(MESH), eos_id=EOS, stop_ids=(SECOND_EOS,))
    generation, scores = beam_search(generator, PROMPTS, STEPS, beams=64, alpha=0.6)
    for prompt, got, score in zip(PROMPTS, generation.tokens, scores, strict=True):
        want, want_score = exhaustive(forward, prompt, 0.6, stops=(EOS, SECOND_EOS))
        assert got == want
        assert score == pytest.approx(want_score, abs=1e-4)
    # A check on the test itself: the second EOS id decides at least one prompt.
    assert any(got[-1] == SECOND_EOS for got in generation.tokens)
    assert any(
        exhaustive(forward, p, 0.6)[0] != got
        for p, got in zip(PROMPTS, generation.tokens, strict=True)
    )
