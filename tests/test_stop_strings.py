"""Stop strings inside the decode loop equal lm-eval's cut-after method.

References: a naive per-prefix text check (the earliest token after which the stopping rule
holds on the decoded text) and the cut of the full-length generation's text.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxmoe.data.sources import load_tokenizer
from jaxmoe.inference.decode import Generator, Sampling
from jaxmoe.inference.stop_strings import StopStrings, cut_at_strings
from jaxmoe.models import build_model
from jaxmoe.models.spec import model_params
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.parallel.options import MeshOptions
from tests.fixtures_data import copy_data_cache
from tests.helpers import tiny_config


class PieceTokenizer:
    """Text = the pieces joined; id 0 is EOS (empty)."""

    def __init__(self, pieces):
        self.pieces = pieces

    def encode(self, text):
        ids = []
        while text:  # longest piece first
            best = max((i for i, p in enumerate(self.pieces) if p and text.startswith(p)),
                       key=lambda i: len(self.pieces[i]))  # fmt: skip
            ids.append(best)
            text = text[len(self.pieces[best]) :]
        return ids

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)


PIECES = ["", "a", "b", "c", "\n", "\n\n", "ab", "bc", "ca", "b\n", "x", "Q:", ":", "Q"]


def naive_stop(tokenizer, strings, row):
    """The first index after which the decoded text allows a stop (stop_strings' rule)."""
    for i in range(len(row)):
        text = tokenizer.decode(row[: i + 1])
        if any(s in text for s in strings) and not any(
            s not in text and any(text.endswith(s[:k]) for k in range(1, len(s))) for s in strings
        ):
            return i
    return None


@pytest.mark.parametrize(
    "strings",
    [["\n\n"], ["\n", "Q:"], ["bc", "ab"], ["abc", "b"], ["ca", "Q:", "\n\n", "cab"], ["zz"]],
)
def test_loop_stop_equals_naive_rule_and_cut_after(strings):
    tokenizer = PieceTokenizer(PIECES)
    stop = StopStrings(strings, tokenizer, len(PIECES))
    rng = np.random.default_rng(0)
    for _ in range(300):
        row = rng.integers(1, len(PIECES), size=int(rng.integers(1, 14))).tolist()
        end = stop.stop_index(row)
        assert end == naive_stop(tokenizer, strings, row)
        kept = row if end is None else row[: end + 1]
        full = cut_at_strings(tokenizer.decode(row), strings)
        assert cut_at_strings(tokenizer.decode(kept), strings) == full


@pytest.fixture(scope="module")
def generator_and_tokenizer(tmp_path_factory, embedded_data_cache):
    cache = copy_data_cache(embedded_data_cache, tmp_path_factory.mktemp("data") / "cache")
    tokenizer = load_tokenizer(tiny_config(f"data.cache_dir={cache}").data)
    cfg = tiny_config("model.moe.num_experts=0", "model.vocab_size=512").model
    _, params = model_params(build_model(cfg, rngs=nnx.Rngs(3)))
    params = jax.tree.map(lambda a: a * 4, params)  # peaked logits: varied, repeated text
    mesh = make_mesh(MeshOptions(data=4, fsdp=1, tensor=2, expert=1))
    generator = Generator(cfg, params, mesh, eos_id=-1, vocab_limit=tokenizer.vocab_size)
    return generator, tokenizer


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0)])
def test_generator_stops_early_with_the_cut_after_output(generator_and_tokenizer, sampling):
    generator, tokenizer = generator_and_tokenizer
    prompts = [tokenizer.encode(t) for t in ["the cat", "a story of", "In 1990, the", "x"]]
    budget = 48
    full = generator.generate(prompts, budget, sampling, seed=1)
    texts = [tokenizer.decode(row) for row in full.tokens]
    # Strings that occur early in some rows (a short piece of row 0's text) and never.
    early = texts[0][4:6]
    for strings in ([early], [early, "zzqq"], ["zzqq"], [texts[1][:3], " "]):
        stop = StopStrings(strings, tokenizer, generator.vocab_limit)
        cut = generator.generate(prompts, budget, sampling, seed=1, stop=stop)
        for row_full, row_cut in zip(full.tokens, cut.tokens, strict=True):
            assert row_cut == row_full[: len(row_cut)]
            assert cut_at_strings(tokenizer.decode(row_cut), strings) == cut_at_strings(
                tokenizer.decode(row_full), strings
            )
        if strings == ["zzqq"]:
            assert cut.steps == full.steps == budget
        else:
            assert cut.num_new_tokens < full.num_new_tokens
