"""Bad input gets one line naming the culprit: never a traceback, never a silent wrong number.

Each case is a hostile input a user can type or hand over (eval data, configs, checkpoints of
another model); the expected lines are written out by hand.
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from flax import nnx

from jaxmoe.checkpoints.hf import abstract_params
from jaxmoe.checkpoints.manager import CheckpointError, restore_params, save_params
from jaxmoe.config import validate
from jaxmoe.evaluate import evaluate, read_jsonl
from jaxmoe.models import build_model
from jaxmoe.parallel.sharding import ConfigError
from jaxmoe.train_state import model_params
from tests.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 512


def dense_config(tmp: Path, *overrides: str):
    return tiny_config(
        "model.moe.num_experts=0",
        f"model.vocab_size={VOCAB}",
        f"data.cache_dir={tmp / 'cache'}",
        *overrides,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A parameters-only checkpoint of a tiny dense decoder (vocabulary 512)."""
    tmp = tmp_path_factory.mktemp("bad_input")
    config = dense_config(tmp)
    _, params = model_params(build_model(config.model, rngs=nnx.Rngs(0)))
    save_params(str(tmp / "ckpt"), jax.device_get(params), config)
    return tmp / "ckpt"


def cli(*args: str, **env) -> subprocess.CompletedProcess:
    """`jaxmoe ARGS` as a user runs it: no JAX_PLATFORMS, whatever extras are installed."""
    environ = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    environ["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "jaxmoe.cli", *args],
        cwd=ROOT,
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


# ---------------------------------------------------------------------------- eval data


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"targets": [1, 2, 512, 4]}', "'targets'[2] = 512 is outside the vocabulary [0, 512)"),
        ('{"targets": [1, -3, 4]}', "'targets'[1] = -3 is outside the vocabulary [0, 512)"),
        ('{"targets": [1, true, 4]}', "'targets'[1] = true is not a token id"),
        ('{"targets": [1, false]}', "'targets'[1] = false is not a token id"),
        ('{"targets": [1, 2.0, 4]}', "'targets'[1] = 2.0 is not a token id"),
        ('{"targets": [1, 2.5, 4]}', "'targets'[1] = 2.5 is not a token id"),
        ('{"targets": 7}', "'targets' must be text or a list of token ids, not 7"),
        ("7", "expected a JSON object with 'text' or 'targets', got 7"),
        ("[1, 2, 3]", "expected a JSON object with 'text' or 'targets', got [1, 2, 3]"),
    ],
)
def test_bad_eval_ids_name_file_line_and_value(tmp_path, line, message):
    data = tmp_path / "data.jsonl"
    data.write_text('{"targets": [1, 2, 3]}\n\n' + line + "\n")  # the bad line is line 3
    with pytest.raises(ValueError) as error:
        read_jsonl(str(data), None, encoder_decoder=False, vocab_size=VOCAB)
    assert str(error.value) == f"{data}:3: {message}"


def test_largest_and_smallest_ids_are_accepted(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"targets": [0, 511]}\n')
    (example,) = read_jsonl(str(data), None, encoder_decoder=False, vocab_size=VOCAB)
    assert example.targets == [0, 511]
    with pytest.raises(ValueError, match=r":2: 'inputs'\[0\] = 600 is outside"):
        data.write_text('{"inputs": [5], "targets": [1]}\n{"inputs": [600], "targets": [1]}\n')
        read_jsonl(str(data), None, encoder_decoder=True, vocab_size=VOCAB)


def test_cli_bad_eval_data_prints_only_jaxmoes_line(checkpoint, tmp_path):
    """One stderr line, exit 2: no traceback, and no libtpu probe noise on a host without a
    TPU even when the `tpu` extra is installed."""
    data = tmp_path / "ids.jsonl"
    data.write_text('{"targets": [1, 2, 3]}\n{"targets": [4, 600, 6]}\n')
    result = cli("eval", "--checkpoint", str(checkpoint), "--data", f"jsonl:{data}")
    assert result.returncode == 2
    assert result.stderr == (
        f"jaxmoe eval: error: {data}:2: 'targets'[1] = 600 is outside the vocabulary [0, 512)\n"
    )


# ---------------------------------------------------------------------------- configs


def test_moe_every_beyond_the_layers_is_refused(tmp_path):
    config = tiny_config("model.num_layers=2", "model.moe.every=2")
    validate(config)  # layer 1 is MoE: fine
    with config.unlocked():
        config.model.moe.every = 3
    with pytest.raises(ConfigError) as error:
        validate(config)
    assert str(error.value) == (
        "model.moe.every=3 exceeds model.num_layers=2: no layer would be MoE "
        "(model.moe.num_experts=0 is the dense model)"
    )


def test_eval_with_the_training_config_sizes_the_vocabulary_from_the_tokenizer(
    checkpoint, tmp_path
):
    """A training config has model.vocab_size=0 ("take the tokenizer's"): eval resolves it
    as training does instead of building a (d_model, 0) output layer."""
    data = tmp_path / "ids.jsonl"
    data.write_text('{"targets": [1, 2, 3, 4]}\n')
    stored = evaluate(str(checkpoint), f"jsonl:{data}")
    config = dense_config(checkpoint.parent, "model.vocab_size=0", f"data.vocab_size={VOCAB}")
    passed = evaluate(str(checkpoint), f"jsonl:{data}", config=config)
    assert passed["loss"] == pytest.approx(stored["loss"], rel=1e-6)
    assert passed["num_tokens"] == 3


# ---------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize(
    "override, message",
    [
        # The embedding is [vocab, d_model]: (512, 32) stored, (512, 48) asked for.
        (
            "model.d_model=48",
            "tensor embed.embedding has shape (512, 32), the model config expects (512, 48)",
        ),
        # Layer 2's nine tensors (2 norms, 4 attention, 3 FFN) exist only in the model.
        (
            "model.num_layers=3",
            "the model's tensor layers.2.attn.key (32, 2, 8) is not in the checkpoint (9 missing)",
        ),
    ],
)
def test_restoring_another_model_names_the_tensor_and_shapes(
    checkpoint, tmp_path, override, message
):
    other = dense_config(tmp_path, override)
    with pytest.raises(CheckpointError) as error:
        restore_params(str(checkpoint), abstract_params(other.model))
    assert message in str(error.value) and "\n" not in str(error.value)
