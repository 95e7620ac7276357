"""What is asked of a trained model is checked before any work, in one line naming it: ids
outside the vocabulary and prompts past the context (the Python API as well as the
commands), empty or too long inputs of `eval --task generate`, data kinds evaluation does
not read, flags that would be silently ignored, lm-eval task files and paths, and API
arguments of the wrong type. Expected lines are written by hand.
"""

import json
import shutil
from pathlib import Path

import pytest
from flax import nnx

from jaxmoe.errors import ConfigError
from jaxmoe.inference.decode import Generator
from jaxmoe.inference.evaluate import check_eval_data
from jaxmoe.models import build_model
from jaxmoe.models.spec import model_params
from jaxmoe.parallel.mesh import make_mesh
from tests import test_bad_input
from tests.fixtures_checkpoints import VOCAB, dense_config

checkpoint = test_bad_input.checkpoint  # its tiny checkpoint fixture (vocabulary 512)


@pytest.fixture(scope="module")
def generator(checkpoint) -> Generator:
    """A Generator of the tiny model with a 16-token context (model.max_len)."""
    config = dense_config(checkpoint.parent, "model.max_len=16")
    _, params = model_params(build_model(config.model, rngs=nnx.Rngs(0)))
    return Generator(config.model, params, make_mesh(config.mesh))


@pytest.fixture(scope="module")
def short_context(checkpoint, tmp_path_factory) -> Path:
    """The tiny checkpoint with model.max_len=16 stored, as training stores its seq_len."""
    copy = Path(shutil.copytree(checkpoint, tmp_path_factory.mktemp("short") / "ckpt"))
    stored = copy / "config" / "config.json"
    config = json.loads(stored.read_text())
    config["model"]["max_len"] = 16
    stored.write_text(json.dumps(config))
    return copy


# ----------------------------------------------------------------- Generator (Python API)


@pytest.mark.parametrize(
    "prompts, new, line",
    [
        ([[5, 10**6]], 2, f"prompt 0: token id 1000000 (position 1) is outside the model's "
         f"vocabulary [0, {VOCAB})"),
        ([[5], [7, -1]], 2, f"prompt 1: token id -1 (position 1) is outside the model's "
         f"vocabulary [0, {VOCAB})"),
        ([[5], []], 2, "prompt 1 is empty (no tokens)"),
        ([[5.0, 6.0]], 2, "prompt 0: expected a list of integer token ids"),
        ([list(range(5, 105))], 4, "prompt 0: 100 tokens + --max_new_tokens=4 exceed the "
         "model's context of 16 tokens (model.max_len, the longest sequence it was trained "
         "on); shorten it, or --truncate keeps its last 12 tokens"),
        ([[5]], 16, "--max_new_tokens=16 leaves no room for a prompt in the model's context "
         "of 16 tokens (model.max_len)"),
    ],
    ids=["past_vocab", "negative", "empty", "floats", "past_context", "no_room"],
)  # fmt: skip
def test_generate_refuses_what_it_cannot_generate(generator, prompts, new, line):
    """The embedding lookup would clamp an id outside the table and generate from another
    token: refused, as prompts past the trained context are (before anything compiles)."""
    from jaxmoe.inference.beam_search import beam_search

    with pytest.raises(ValueError) as refused:
        generator.generate(prompts, new)
    assert str(refused.value) == line
    with pytest.raises(ValueError) as refused:  # beam search: the same checks
        beam_search(generator, prompts, new, beams=2)
    assert str(refused.value) == line


# ------------------------------------------------------------------ eval --task generate


@pytest.mark.parametrize(
    "inputs, new, message",
    [
        ("", 4, "'inputs' gives no tokens (a decoder-only model needs a prompt)"),
        ("river " * 40, 4, "'inputs': 200 tokens + --max_new_tokens=4 exceed the model's "
         "context of 16 tokens (model.max_len, the longest sequence it was trained on); "
         "shorten it, or --truncate keeps its last 12 tokens"),
        ("The river", 100_000, None),
    ],
    ids=["empty", "past_context", "huge_new_tokens"],
)  # fmt: skip
def test_generate_eval_refuses_inputs_it_cannot_continue(short_context, tmp_path, inputs, new,
                                                         message):  # fmt: skip
    pytest.importorskip("rouge_score")
    from jaxmoe.inference.generate_eval import generate_eval

    data = tmp_path / "gen.jsonl"
    data.write_text(json.dumps({"inputs": "The sea", "targets": "x"}) + "\n"
                    + json.dumps({"inputs": inputs, "targets": "runs"}) + "\n")  # fmt: skip
    with pytest.raises(ValueError) as refused:
        generate_eval(str(short_context), f"jsonl:{data}", max_new_tokens=new)
    if message is None:
        message = (
            "--max_new_tokens=100000 leaves no room for a prompt in the model's context of "
            "16 tokens (model.max_len)"
        )
        assert str(refused.value) == message
    else:
        assert str(refused.value) == f"{data}:2: {message}"


# ------------------------------------------------------------------------- eval --data


@pytest.mark.parametrize(
    "spec, line",
    [
        ("csv:/d/x.jsonl", "--data 'csv:/d/x.jsonl': unknown kind 'csv:'; evaluation reads "
         "jsonl:FILE, NAME/SPLIT (a prepared TFDS dataset) or embedded"),
        ("parquet:/d/x.parquet", "--data 'parquet:/d/x.parquet': parquet: data is read by "
         "train and prepare (data.source); evaluation reads jsonl:FILE, NAME/SPLIT (a "
         "prepared TFDS dataset) or embedded"),
    ],
)  # fmt: skip
def test_eval_data_kinds_it_does_not_read_are_named(spec, line):
    with pytest.raises(ValueError) as refused:
        check_eval_data(spec)
    assert str(refused.value) == line
    for fine in ("jsonl:/d/x.jsonl", "embedded", "c4/validation", "mnist:3.0.1/test",
                 "tfds:c4/validation"):  # fmt: skip
        check_eval_data(fine)


def test_eval_output_without_generate_is_refused(capsys, tmp_path):
    from jaxmoe.cli import main

    argv = ["eval", "--checkpoint", "/nowhere", "--data", "embedded",
            "--output", str(tmp_path / "out.jsonl")]  # fmt: skip
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "jaxmoe eval: error: --output writes --task generate's predictions; --task score "
        "prints its result (with --per_example, the loss of every example)\n"
    )
    assert not (tmp_path / "out.jsonl").exists()


# ---------------------------------------------------------------------------- Python API


def test_open_with_a_mesh_of_the_wrong_type_names_it(checkpoint):
    from jaxmoe import TrainedModel

    with pytest.raises(TypeError) as refused:
        TrainedModel.open(str(checkpoint), mesh="data:2")
    assert str(refused.value) == (
        "TrainedModel.open: mesh='data:2' is not a jax.sharding.Mesh (None: the checkpoint's "
        "mesh.*; overrides=['mesh.data=2'] changes it)"
    )


# --------------------------------------------------------------------------- lm-eval


def test_lm_eval_max_length_past_the_context_is_refused(short_context):
    from jaxmoe.inference.lm_eval_backend import check_model_args

    with pytest.raises(ValueError) as refused:
        check_model_args(["--model_args", f"checkpoint={short_context},max_length=100000"])
    assert str(refused.value) == (
        "--model_args max_length=100000 exceeds the model's context of 16 tokens "
        "(model.max_len, the longest sequence it was trained on)"
    )
    check_model_args(["--model_args", f"checkpoint={short_context},max_length=16"])


TASK = """task: {name}
dataset_path: json
test_split: test
output_type: multiple_choice
doc_to_text: {text}
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
"""


@pytest.mark.parametrize(
    "text, problem",
    [
        ('"Question: {{question}}"\ntest_split: [test', ":7: not valid YAML (expected ',' or "
         "']', but got ':')"),
        ('"{{ question "', ":5: Jinja template '{{ question ': unexpected end of template, "
         "expected 'end of print statement'."),
    ],
    ids=["yaml", "jinja"],
)  # fmt: skip
def test_lm_eval_task_files_are_checked_before_lm_eval_starts(tmp_path, text, problem):
    from jaxmoe.inference.lm_eval_checks import check_paths

    pytest.importorskip("lm_eval")
    (tmp_path / "good.yaml").write_text(TASK.format(name="good", text='"Q: {{question}}"'))
    (tmp_path / "bad.yaml").write_text(TASK.format(name="bad", text=text))
    with pytest.raises(ConfigError) as refused:
        check_paths(["--tasks", "bad", "--include_path", str(tmp_path)])
    assert str(refused.value) == f"--include_path: {tmp_path / 'bad.yaml'}{problem}"


def test_lm_eval_paths_that_do_not_exist_or_cannot_be_written(tmp_path):
    from jaxmoe.inference.lm_eval_checks import check_paths

    with pytest.raises(ConfigError) as refused:
        check_paths(["--include_path", str(tmp_path / "none")])
    assert str(refused.value) == f"--include_path {tmp_path / 'none'}: no such file or folder"
    (tmp_path / "file").write_text("x")
    for output in (tmp_path / "file" / "results", tmp_path / "file" / "r.json"):
        with pytest.raises(ConfigError) as refused:
            check_paths(["--output_path", str(output)])
        folder = output if output.suffix != ".json" else output.parent
        assert str(refused.value).startswith(f"--output_path {output}: {folder}: ")
    check_paths(["--output_path", str(tmp_path / "new" / "results")])
