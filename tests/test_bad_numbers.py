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
        # float() takes "nan" and "inf": no temperature, penalty or time is either.
        (
            ["decode", *CKPT, "--prompt", "a", "--temperature", "nan"],
            "jaxmoe decode: error: argument --temperature: expected a finite number, got 'nan'",
        ),
        (
            ["decode", *CKPT, "--prompt", "a", "--top_p", "nan"],
            "jaxmoe decode: error: argument --top_p: expected a finite number, got 'nan'",
        ),
        (
            ["eval", *CKPT, *DATA, "--task", "generate", "--temperature", "inf"],
            "jaxmoe eval: error: argument --temperature: expected a finite number, got 'inf'",
        ),
        (
            ["eval", *CKPT, *DATA, "--task", "generate", "--temperature", "-0.5"],
            "jaxmoe eval: error: argument --temperature: expected a number >= 0, got -0.5",
        ),
        (
            ["eval", *CKPT, *DATA, "--num_beams", "2", "--length_penalty", "nan"],
            "jaxmoe eval: error: argument --length_penalty: expected a finite number, got 'nan'",
        ),
        (
            ["eval", *CKPT, *DATA, "--top_p", "1.5"],
            "jaxmoe eval: error: argument --top_p: expected a number in (0, 1], got 1.5",
        ),
        (
            ["compile", "--config", "c.py", "--topology", "v5p-8", "--step_time", "-1"],
            "jaxmoe compile: error: argument --step_time: expected a number > 0, got -1",
        ),
        (
            ["compile", "--config", "c.py", "--topology", "v5p-8", "--step_time", "nan"],
            "jaxmoe compile: error: argument --step_time: expected a finite number, got 'nan'",
        ),
        (
            ["compile", "--config", "c.py", "--topology", "v5p-8", "--num_slices", "0"],
            "jaxmoe compile: error: argument --num_slices: expected a positive integer, got 0",
        ),
        (
            ["export", "t5x", "/c", "/out", "--step", "-5"],
            "jaxmoe export t5x: error: argument --step: expected an integer >= 0, got -5",
        ),
        (
            ["convert", "gqa", "/c", "/out", "--num_kv_heads", "2", "--seed", "-1"],
            "jaxmoe convert gqa: error: argument --seed: expected an integer >= 0, got -1",
        ),
        (
            ["convert", "gqa", "/c", "/out", "--num_kv_heads", "0"],
            "jaxmoe convert gqa: error: argument --num_kv_heads: expected a positive integer, "
            "got 0",
        ),
        (
            ["convert", "upcycle", "/c", "/out", "--num_experts", "8", "--seed", "-2"],
            "jaxmoe convert upcycle: error: argument --seed: expected an integer >= 0, got -2",
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
        # An expert never takes more than every token of a group: 1e9 overflowed int32.
        (
            "model.moe.capacity_factor=1e9",
            "model.moe.capacity_factor: expected a number in [0, model.moe.num_experts=8], "
            "got 1000000000.0 (0 = dropless)",
        ),
    ],
)
def test_nonsense_config_number_names_the_key(override, line):
    config = base_config()
    apply_overrides(config, [override])
    with pytest.raises(ConfigError) as error:
        validate(config)
    assert str(error.value) == line


def test_library_refuses_nan_sampling_and_penalty():
    """The Python API checks what the flags check: NaN passes a `< 0` test."""
    from jaxmoe.inference.beam_search import beam_search
    from jaxmoe.inference.decode import Sampling

    with pytest.raises(ValueError, match=r"^--temperature=nan must be a finite number >= 0"):
        Sampling(temperature=float("nan"))
    with pytest.raises(ValueError, match=r"^--length_penalty=nan must be a finite number >= 0"):
        beam_search(None, [[1]], 4, 2, alpha=float("nan"))


def test_topology_with_a_zero_dim_names_it():
    from jaxmoe.aot.topologies import parse_topology

    with pytest.raises(ValueError) as refused:
        parse_topology("v5p:0x4x4")
    assert str(refused.value) == "--topology 'v5p:0x4x4': every dim must be at least 1 chip"


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
