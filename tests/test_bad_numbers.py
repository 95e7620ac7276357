"""A number that means nothing, or a destination that cannot be written, is refused before any
work, in one line naming the flag or key: never a silent default, never a crash after the work.

The expected lines are written out by hand."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxmoe.cli import main
from jaxmoe.config.defaults import base_config
from jaxmoe.config.loading import apply_overrides
from jaxmoe.config.validation import validate
from jaxmoe.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CKPT = ["--checkpoint", "/nowhere/ckpt"]  # never opened: the flags fail first
DATA = ["--data", "embedded"]


def refused(capsys, *argv: str) -> str:
    """stderr of `jaxmoe ARGV` in this process, which must exit 2 with at most 3 lines."""
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert len(err.splitlines()) <= 3 and "Traceback" not in err, err
    return err.splitlines()[0]


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["eval", *CKPT, *DATA, "--task", "generate", "--num_beams", "0"],
            "jaxmoe eval: error: argument --num_beams: expected a positive integer, got 0",
        ),
        (
            ["eval", *CKPT, *DATA, "--task", "generate", "--max_new_tokens", "0"],
            "jaxmoe eval: error: argument --max_new_tokens: expected a positive integer, got 0",
        ),
        (
            ["eval", *CKPT, *DATA, "--task", "generate", "--max_new_tokens", "-1"],
            "jaxmoe eval: error: argument --max_new_tokens: expected a positive integer, got -1",
        ),
        (
            ["eval", *CKPT, *DATA, "--task", "generate", "--seed", "-1"],
            "jaxmoe eval: error: argument --seed: expected an integer >= 0, got -1",
        ),
        (
            ["eval", *CKPT, *DATA, "--task", "generate", "--batch_size", "-8"],
            "jaxmoe eval: error: argument --batch_size: expected an integer >= 0, got -8",
        ),
        (
            ["eval", *CKPT, *DATA, "--task", "generate", "--top_k", "-2"],
            "jaxmoe eval: error: argument --top_k: expected an integer >= 0, got -2",
        ),
        (
            ["eval", *CKPT, *DATA, "--num_beams", "two"],
            "jaxmoe eval: error: argument --num_beams: expected an integer, got 'two'",
        ),
        (
            ["decode", *CKPT, "--prompt", "a", "--seed", "-1"],
            "jaxmoe decode: error: argument --seed: expected an integer >= 0, got -1",
        ),
        (
            ["decode", *CKPT, "--prompt", "a", "--max_new_tokens", "0"],
            "jaxmoe decode: error: argument --max_new_tokens: expected a positive integer, got 0",
        ),
        (
            ["analyze-routing", *CKPT, *DATA, "--out", "/tmp/r", "--max_batches", "-1"],
            "jaxmoe analyze-routing: error: argument --max_batches: expected an integer >= 0, "
            "got -1",
        ),
        (
            ["analyze-routing", *CKPT, *DATA, "--out", "/tmp/r", "--top", "0"],
            "jaxmoe analyze-routing: error: argument --top: expected a positive integer, got 0",
        ),
        (
            ["train", "--workdir", "/tmp/w", "--num_processes", "0"],
            "jaxmoe train: error: argument --num_processes: expected a positive integer, got 0",
        ),
    ],
    ids=lambda v: " ".join(v[:1] + v[-2:]) if isinstance(v, list) else None,
)
def test_nonsense_flag_is_one_line(capsys, argv, line):
    assert refused(capsys, *argv) == line


@pytest.mark.parametrize(
    "override, line",
    [
        ("train.steps=-1", "train.steps=-1 must be positive"),
        ("train.steps=0", "train.steps=0 must be positive"),
        ("train.seed=-1", "train.seed=-1 must be >= 0"),
        ("train.log_every=0", "train.log_every=0 must be positive"),
        ("train.max_skipped_steps=0", "train.max_skipped_steps=0 must be positive"),
        ("train.eval_every=-5", "train.eval_every=-5 must be >= 0"),
        ("train.checkpoint_every=-1", "train.checkpoint_every=-1 must be >= 0"),
        ("train.eval_batches=-1", "train.eval_batches=-1 must be >= 0"),
        ("model.max_len=-1", "model.max_len=-1 must be >= 0 (0 = the default)"),
        ("model.vocab_size=-4", "model.vocab_size=-4 must be >= 0 (0 = the default)"),
        ("model.norm_eps=0.0", "model.norm_eps=0.0 must be positive"),
        ("optimizer.b2=1.0", "optimizer.b2=1.0 not in [0, 1)"),
        ("optimizer.weight_decay=-0.1", "optimizer.weight_decay=-0.1 must be >= 0"),
        ("optimizer.min_lr_ratio=2.0", "optimizer.min_lr_ratio=2.0 not in [0, 1]"),
        ("data.prefetch=-1", "data.prefetch=-1 must be >= 0 (0 = off)"),
        ("data.prepare_timeout_s=0", "data.prepare_timeout_s=0 must be positive"),
    ],
)
def test_nonsense_config_number_names_the_key(override, line):
    config = base_config()
    apply_overrides(config, [override])
    with pytest.raises(ConfigError) as error:
        validate(config)
    assert str(error.value) == line


def test_encoder_decoder_relative_positions_must_be_positive():
    config = base_config()
    apply_overrides(config, ["model.arch=encoder_decoder", "model.relpos_buckets=0"])
    with pytest.raises(ConfigError, match=r"^model.relpos_buckets=0 must be positive$"):
        validate(config)


def test_negative_seed_from_the_command_line_names_the_key(capsys, tmp_path):
    argv = ["train", "--workdir", str(tmp_path / "run"), "--config.train.seed=-1"]
    assert main(argv) == 2
    assert capsys.readouterr().err == "jaxmoe train: error: train.seed=-1 must be >= 0\n"
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ lm-eval --model_args


@pytest.mark.parametrize(
    "model_args, line",
    [
        ("checkpoint=/c,max_length=0", "--model_args max_length=0: expected a positive integer"),
        (
            "checkpoint=/c,max_length=-1",
            "--model_args max_length=-1.0: expected a positive integer",
        ),
        (
            "checkpoint=/c,max_gen_toks=0",
            "--model_args max_gen_toks=0: expected a positive integer",
        ),
        (
            "checkpoint=/c,max_length=abc",
            "--model_args max_length=abc: expected a positive integer",
        ),
    ],
)
def test_lm_eval_token_counts_refused_before_lm_eval_starts(model_args, line):
    from jaxmoe.inference.lm_eval_backend import JaxmoeLM, check_model_args

    with pytest.raises(ValueError) as error:
        check_model_args(["--tasks", "x", "--model_args", model_args])
    assert str(error.value) == line
    with pytest.raises(ValueError) as error:  # the model class, as the Python API builds it
        JaxmoeLM.create_from_arg_string(model_args)
    assert str(error.value) == line.replace("-1.0", "-1")


def _cli(*args: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    return subprocess.run(
        [sys.executable, "-m", "jaxmoe.cli", *args],
        cwd=ROOT,
        env={**environ, "PYTHONPATH": str(ROOT), "HF_DATASETS_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_lm_eval_max_length_zero_is_the_only_line():
    result = _cli(
        "lm-eval",
        "--model_args",
        "checkpoint=/nowhere/ckpt,max_length=0",
        "--tasks",
        "jaxmoe_tiny_mc",
        "--include_path",
        str(ROOT / "tests" / "lm_eval_tasks"),
    )
    assert result.returncode == 2
    assert result.stderr == (
        "jaxmoe lm-eval: error: --model_args max_length=0: expected a positive integer\n"
    )


# ---------------------------------------------------------------- unwritable destinations


def test_generate_output_under_a_file_is_refused_before_generating(tmp_path):
    (tmp_path / "notes").write_text("a file")
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"inputs": "a", "targets": "b"}\n')
    output = tmp_path / "notes" / "predictions.jsonl"
    # A checkpoint that does not exist: the flag is refused before it would be opened.
    result = _cli(
        "eval", *CKPT, "--data", f"jsonl:{data}", "--task", "generate", "--output", str(output)
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) <= 3
    assert result.stderr.splitlines()[0] == (
        f"jaxmoe eval: error: argument --output: cannot write file {output}: "
        f"{tmp_path / 'notes'} is a file, not a directory"
    )


def test_generate_output_that_is_a_directory_is_refused(capsys, tmp_path):
    line = refused(capsys, "eval", *CKPT, *DATA, "--task", "generate", "--output", str(tmp_path))
    assert (
        line
        == f"jaxmoe eval: error: argument --output: cannot write file {tmp_path}: it is a directory"
    )


def test_generate_output_in_a_missing_directory_is_refused(capsys, tmp_path):
    output = tmp_path / "missing" / "p.jsonl"
    line = refused(capsys, "eval", *CKPT, *DATA, "--task", "generate", "--output", str(output))
    assert line == (
        f"jaxmoe eval: error: argument --output: cannot write file {output}: its directory "
        f"{tmp_path / 'missing'} does not exist"
    )


def test_routing_out_under_a_file_is_refused(capsys, tmp_path):
    (tmp_path / "notes").write_text("a file")
    out = tmp_path / "notes" / "deeper" / "routing"
    line = refused(capsys, "analyze-routing", *CKPT, *DATA, "--out", str(out))
    assert line == (
        f"jaxmoe analyze-routing: error: argument --out: cannot write directory {out}: "
        f"{tmp_path / 'notes'} is a file, not a directory"
    )


def test_routing_out_that_is_a_file_is_refused(capsys, tmp_path):
    (tmp_path / "routing").write_text("a file")
    line = refused(capsys, "analyze-routing", *CKPT, *DATA, "--out", str(tmp_path / "routing"))
    assert line == (
        f"jaxmoe analyze-routing: error: argument --out: cannot write into directory "
        f"{tmp_path / 'routing'}: it is a file"
    )


def test_writable_destinations_pass(tmp_path):
    from jaxmoe.cli.flags import writable_dir, writable_file

    assert writable_dir(str(tmp_path / "a" / "b")) == str(tmp_path / "a" / "b")
    assert writable_file(str(tmp_path / "p.jsonl")) == str(tmp_path / "p.jsonl")
    assert writable_file("gs://bucket/p.jsonl") == "gs://bucket/p.jsonl"
