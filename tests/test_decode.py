"""Greedy decoding against a no-cache loop, and top-k / top-p filtering against sets computed
by hand in numpy (cached logits against the full forward pass: tests/test_one_forward.py)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.cli import main as cli_main
from jaxmoe.inference.decode import (
    Generator,
    Sampling,
    bucket,
    filter_logits,
    sample_tokens,
)
from jaxmoe.inference.decode_text import decode_main
from jaxmoe.models import build_model
from jaxmoe.models.spec import model_params
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.parallel.options import MeshOptions
from tests.helpers import tiny_config


def decoder_config(*extra):
    return tiny_config("model.moe.num_experts=0", "model.num_kv_heads=2", *extra).model


def full_forward(model, length=16):
    """seqs -> each sequence's full-forward logits, one compiled shape for all lengths
    (right padding does not change a causal LM's logits at earlier positions)."""
    graphdef, params = model_params(model)
    forward = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens)[0])

    def logits_of(seqs):
        tokens = np.zeros((len(seqs), length), np.int32)
        for row, seq in enumerate(seqs):
            tokens[row, : len(seq)] = seq
        logits = np.asarray(forward(params, tokens))
        return [logits[row, : len(seq)] for row, seq in enumerate(seqs)]

    return logits_of


def greedy_without_cache(forward, prompt, steps):
    """Reference: re-run the full model on the whole sequence for every new token."""
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(np.argmax(forward([seq])[0][-1])))
    return seq[len(prompt) :]


@pytest.fixture(scope="module")
def sharded_generation():
    cfg = decoder_config()
    model = build_model(cfg, rngs=nnx.Rngs(2))
    _, params = model_params(model)
    mesh = make_mesh(MeshOptions(data=4, fsdp=1, tensor=2, expert=1))
    generator = Generator(cfg, params, mesh, eos_id=-1)
    prompts = [[5, 9, 17, 3], [40, 2, 77, 8, 8, 101, 6, 30, 12]]
    return full_forward(model), generator, prompts


def test_greedy_generation_sharded_matches_no_cache_loop(sharded_generation):
    forward, generator, prompts = sharded_generation
    result = generator.generate(prompts, 6)
    # Batch padded to the data-parallel size 4; the cache's B * K rows split as sequences
    # over `data` and KV heads over `tensor`.
    assert generator.batch_multiple == 4
    state, rows, _ = generator.prefill(prompts, 16)
    assert rows == 4 and state["caches"][0].k.shape == (4 * 2, 8, 32)
    assert state["caches"][0].k.sharding.spec[0] == ("data", "tensor")
    for prompt, new in zip(prompts, result.tokens, strict=True):
        assert new == greedy_without_cache(forward, prompt, 6)
    assert result.num_new_tokens == 12 and result.tokens_per_s > 0


def test_generation_stops_at_eos(sharded_generation):
    forward, generator, prompts = sharded_generation
    expected = greedy_without_cache(forward, prompts[0], 6)
    stopper = Generator(generator.cfg, generator.params, generator.mesh, eos_id=expected[2])
    first = expected.index(expected[2])
    assert stopper.generate(prompts[:1], 6).tokens[0] == expected[: first + 1]
    # A further stop id (generation_config.json's EOS list) ends the row too; EOS itself
    # never comes here.
    never = next(i for i in range(generator.cfg.vocab_size) if i not in expected)
    stop = expected[3]
    several = Generator(
        generator.cfg, generator.params, generator.mesh, eos_id=never, stop_ids=(stop,)
    )
    assert several.stop_ids == (never, stop)
    assert several.generate(prompts[:1], 6).tokens[0] == expected[: expected.index(stop) + 1]


def allowed_by_hand(logits, temperature, top_k, top_p):
    """Numpy: indices of the top-k tokens, then the smallest prefix reaching mass top_p."""
    order = np.argsort(-logits, kind="stable")
    keep = order[:top_k] if top_k else order
    z = logits[keep] / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    cumulative = np.cumsum(probs)
    n = int(np.searchsorted(cumulative, top_p - 1e-7) + 1)  # first index reaching top_p
    return set(keep[: min(n, len(keep))].tolist())


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(1.0, 3, 1.0), (1.0, 0, 0.5), (0.7, 5, 0.8), (2.0, 0, 0.9)]
)
def test_filter_logits_keeps_the_hand_computed_set(temperature, top_k, top_p):
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(4, 20)).astype(np.float32) * 2
    sampling = Sampling(temperature, top_k, top_p)
    filtered = np.asarray(filter_logits(jnp.asarray(logits), sampling))
    for row in range(4):
        kept = set(np.flatnonzero(np.isfinite(filtered[row])).tolist())
        assert kept == allowed_by_hand(logits[row], temperature, top_k, top_p)


def test_samples_follow_the_filtered_distribution():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    sampling = Sampling(temperature=1.0, top_p=0.7)  # keeps {0, 1}: renormalised 5/8, 3/8
    keys = jax.random.split(jax.random.key(0), 4000)
    draws = np.asarray(jax.vmap(lambda k: sample_tokens(logits, k, sampling))(keys))[:, 0]
    assert set(np.unique(draws)) == {0, 1}
    assert abs(np.mean(draws == 0) - 5 / 8) < 0.03


def test_bad_sampling_and_buckets():
    with pytest.raises(ValueError, match=r"--top_p=1\.5"):
        Sampling(top_p=1.5)
    with pytest.raises(ValueError, match="--temperature=-1"):
        Sampling(temperature=-1)
    assert [bucket(n) for n in (1, 16, 17, 100)] == [16, 16, 32, 128]


def test_decode_command_on_a_saved_checkpoint(saved_dense, tmp_path, capsys):
    """`jaxmoe decode` as the CLI wires it: text in, text and tokens/s out (a tiny dense
    decoder holding its tokenizer, tests/fixtures_checkpoints.py)."""
    (tmp_path / "prompts.txt").write_text("The first\n\nAnd a second prompt\n")
    command = ["decode", "--checkpoint", str(saved_dense / "ckpt"), "--prompts_file",
               str(tmp_path / "prompts.txt"), "--max_new_tokens", "5", "--temperature", "0.8",
               "--top_k", "20"]  # fmt: skip
    assert cli_main([*command, "--config.mesh.data=4", "--config.mesh.tensor=2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    summary = json.loads(lines[-1])
    assert summary["prompts"] == 2 and 2 <= summary["new_tokens"] <= 10
    assert lines[0] == "=== 'The first'" and lines[1].startswith("The first")
    assert "tokens/s" in lines[-2] and "'tensor': 2" in lines[-2]
    # The same checkpoint decoded by the scanned model (its layers stacked on restore).
    scan = ["--config.mesh.data=4", "--config.mesh.tensor=2", "--config.model.scan_layers=true"]
    assert cli_main([*command, *scan]) == 0
    scanned = capsys.readouterr().out.splitlines()
    assert scanned[:-2] == lines[:-2]
    with pytest.raises(ValueError, match="give exactly one of --prompt and --prompts_file"):
        decode_main(str(saved_dense / "ckpt"))


def test_top_k_or_top_p_without_a_temperature_samples_at_one(caplog):
    """transformers samples when top-k/top-p are asked for; greedy decoding would ignore them."""
    assert Sampling.from_flags(None) == Sampling(0.0, 0, 1.0)
    assert Sampling.from_flags(None, top_p=0.9) == Sampling(1.0, 0, 0.9)
    assert Sampling.from_flags(None, top_k=5) == Sampling(1.0, 5, 1.0)
    assert Sampling.from_flags(0.7, top_p=0.9) == Sampling(0.7, 0, 0.9)
    assert not caplog.records
    with caplog.at_level("WARNING", logger="jaxmoe"):
        assert Sampling.from_flags(0.0, top_p=0.9) == Sampling(0.0, 0, 0.9)
    assert [r.getMessage() for r in caplog.records] == [
        "--temperature 0 decodes greedily: --top_k=0 / --top_p=0.9 change nothing (leave out "
        "--temperature, or give one > 0, to sample)"
    ]
    assert Sampling(1.0, 0, 0.9).describe() == "sample temperature=1.0 top_p=0.9"
    assert Sampling().describe() == "greedy"


@pytest.mark.parametrize("command", [["decode", "--prompt", "x"], ["eval", "--data", "embedded"]])
def test_sampling_flags_leave_the_temperature_unset(command):
    from jaxmoe.cli import build_parser

    args = build_parser().parse_args(
        [command[0], "--checkpoint", "c", *command[1:], "--top_p", "0.9"]
    )
    assert args.temperature is None and args.top_p == 0.9
