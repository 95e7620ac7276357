"""A checkpoint is whole and is data.

Whole: a trained run copied to a fresh HOME, its training data and token cache deleted,
still evaluates, decodes, exports (transformers' AutoTokenizer loads the export with the
same ids as jaxmoe's tokenizer) and runs lm-eval, both jaxmoe's backend and lm-eval's own
Hugging Face backend on the export.

Data: nothing a checkpoint stores makes jaxmoe read or write outside its directory. Each
vector plants a marker: a FIFO that records whether anything opened it for reading
(`ReadDetector`), or a directory that must never be created.
"""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from pydoc_data.topics import topics

import jax
import numpy as np
import pytest
from flax import nnx

from jaxmoe.checkpoints.manager import save_params, write_config
from jaxmoe.cli import main as jaxmoe_main
from jaxmoe.config.loading import with_overrides
from jaxmoe.config.stored import read_config
from jaxmoe.data.tokenizer import open_tokenizer, train_sentencepiece
from jaxmoe.errors import ConfigError
from jaxmoe.inference.evaluate import evaluate
from jaxmoe.models import build_model
from jaxmoe.models.spec import model_params
from tests.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "lm_eval_tasks"
# English prose every CPython ships (its help topics): tokenizers and training data.
PROSE = [line for text in topics.values() for line in text.splitlines() if line.strip()]
TINY = (
    "--config.model.num_layers=2",
    "--config.model.d_model=32",
    "--config.model.num_heads=4",
    "--config.model.num_kv_heads=2",
    "--config.model.head_dim=8",
    "--config.model.ffn_dim=64",
    "--config.model.moe.ffn_dim=32",
    "--config.model.moe.block_size=8",
    "--config.train.batch_size=8",
    "--config.train.seq_len=32",
    "--config.train.steps=2",
    "--config.train.eval_every=2",
    "--config.train.checkpoint_every=2",
    "--config.optimizer.warmup_steps=1",
    "--config.data.vocab_size=512",
)


def user_env(home: Path) -> dict:
    """A user's shell: their HOME, no test-only JAX settings, offline as here."""
    environ = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    return {**environ, "HOME": str(home), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1"}  # fmt: skip


def jaxmoe(*args: str, cwd: Path, home: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "jaxmoe.cli", *args],
        cwd=cwd,
        env=user_env(home),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def moved_run(tmp_path_factory) -> Path:
    """`jaxmoe train` of a tiny adaptive MoE on a jsonl file, then the run copied to
    another machine: a new directory and HOME, the data file and token cache gone."""
    here = tmp_path_factory.mktemp("trained")
    home = here / "home"
    home.mkdir()
    texts = PROSE[:2000]
    (here / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    result = jaxmoe("train", "--config", str(ROOT / "configs/default.py"), "--workdir", "run",
                    "--config.data.source=jsonl:train.jsonl", *TINY,
                    cwd=here, home=home)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    there = tmp_path_factory.mktemp("elsewhere")
    shutil.copytree(here / "run", there / "run")
    shutil.rmtree(here)
    (there / "home").mkdir()
    return there


def test_trained_checkpoint_holds_its_tokenizer(moved_run):
    step = moved_run / "run" / "checkpoints" / "2"
    assert (step / "tokenizer" / "tokenizer.model").is_file()
    stored = json.loads((step / "config" / "metadata").read_text())
    assert stored["data"]["tokenizer"] == "tokenizer/tokenizer.model"


def test_moved_run_evaluates_decodes_exports_and_runs_lm_eval(moved_run):
    home, cwd = moved_run / "home", moved_run
    (cwd / "eval.jsonl").write_text('{"text": "Train the default model on two cores."}\n')
    scored = jaxmoe("eval", "--checkpoint", "run", "--data", "jsonl:eval.jsonl", cwd=cwd, home=home)
    assert scored.returncode == 0, scored.stderr
    result = json.loads(scored.stdout.strip().splitlines()[-1])
    assert result["step"] == 2 and result["checkpoint"].endswith("run/checkpoints/2")
    assert np.isfinite(result["loss"]) and result["num_tokens"] > 5

    decoded = jaxmoe("decode", "--checkpoint", "run", "--prompt", "The ", "--max_new_tokens", "4",
                     cwd=cwd, home=home)  # fmt: skip
    assert decoded.returncode == 0, decoded.stderr
    assert json.loads(decoded.stdout.strip().splitlines()[-1])["step"] == 2

    exported = jaxmoe("export", "hf", "run", "hf", cwd=cwd, home=home)
    assert exported.returncode == 0, exported.stderr
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(cwd / "hf"), trust_remote_code=True)
    ours = open_tokenizer(str(cwd / "run/checkpoints/2/tokenizer/tokenizer.model"))
    for text in ("Train the default model.", "  two  spaces\nand a newline", "ünï ✓ 漢字"):
        ids = hf(text, add_special_tokens=True)["input_ids"]
        assert ids == ours.encode(text), text
        assert hf.decode(ids) == text
    assert not (home / ".cache").exists()  # nothing re-trained, nothing cached

    # From the repository: the task YAML reads its jsonl relative to it.
    evaluated = jaxmoe("lm-eval", "--model_args", f"checkpoint={cwd / 'run'},max_gen_toks=4",
                       "--tasks", "jaxmoe_tiny_mc", "--include_path", str(TASKS),
                       "--batch_size", "8", cwd=ROOT, home=home)  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "jaxmoe_tiny_mc" in evaluated.stdout


def test_lm_eval_hf_backend_runs_on_the_export(moved_run, monkeypatch):
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    export = moved_run / "hf"
    if not export.exists():
        pytest.skip("needs the export of test_moved_run_evaluates_decodes_exports...")
    monkeypatch.chdir(ROOT)  # the task YAML reads its jsonl relative to the repository
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    model = HFLM(pretrained=str(export), trust_remote_code=True, dtype="float32",
                 device="cpu", batch_size=4, max_length=32)  # fmt: skip
    results = lm_eval.simple_evaluate(
        model=model, tasks=["jaxmoe_tiny_mc"], task_manager=TaskManager(include_path=str(TASKS))
    )
    assert 0 <= results["results"]["jaxmoe_tiny_mc"]["acc,none"] <= 1


# ------------------------------------------------------------------ received checkpoints


class ReadDetector:
    """A FIFO at `path` that notes whether any process opened it for reading: opening a
    FIFO's write end without blocking succeeds only while a reader holds it open."""

    def __init__(self, path: Path):
        self.path = path
        os.mkfifo(path)
        self.read = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self):
        while not self._stop.is_set():
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # ENXIO: nobody is reading
                time.sleep(0.005)
                continue
            self.read = True
            os.close(fd)  # the reader sees end of file at once
            return

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


VOCAB = 512


@pytest.fixture(scope="module")
def received(tmp_path_factory) -> Path:
    """A tiny dense checkpoint that holds a 512-piece tokenizer of its own."""
    tmp = tmp_path_factory.mktemp("received")
    model_file = tmp / "spm.model"
    lines = PROSE
    model_file.write_bytes(train_sentencepiece(iter(lines), VOCAB))
    config = tiny_config("model.moe.num_experts=0", f"model.vocab_size={VOCAB}",
                         "train.seq_len=32", f"data.tokenizer={model_file}",
                         "model.max_len=32")  # fmt: skip
    _, params = model_params(build_model(config.model, rngs=nnx.Rngs(0)))
    save_params(str(tmp / "ckpt"), jax.device_get(params), config)
    model_file.unlink()  # the checkpoint's own copy is all there is
    return tmp / "ckpt"


def tampered(received: Path, tmp: Path, **data) -> Path:
    """A copy of `received` whose stored config says `data.KEY=VALUE` for each of `data`."""
    ckpt = tmp / "ckpt"
    shutil.copytree(received, ckpt, symlinks=True)
    file = ckpt / "config" / "config.json"
    stored = json.loads(file.read_text())
    stored["data"].update(data)
    file.write_text(json.dumps(stored))
    return ckpt


def one_line_error(capsys, *args) -> str:
    code = jaxmoe_main(list(args))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) <= 3, err
    return err[-1]


def test_stored_data_source_and_cache_dir_are_not_followed(received, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    planted = tmp_path / "planted"
    planted.mkdir()
    attacker = tmp_path / "attacker_cache"
    with ReadDetector(planted / "secret.conf") as marker:
        ckpt = tampered(received, tmp_path, source=f"text:{planted}/*.conf",
                        cache_dir=str(attacker), data_dir=str(attacker / "tfds"),
                        mixture=f"text:{planted}/*.conf=1")  # fmt: skip
        code = jaxmoe_main(["decode", "--checkpoint", str(ckpt), "--prompt", "the ",
                            "--max_new_tokens", "2"])  # fmt: skip
        evaluate(str(ckpt), "embedded")  # packs data: would write into data.cache_dir
    assert code == 0, capsys.readouterr().err
    assert not marker.read and not attacker.exists()


def test_stored_absolute_tokenizer_outside_is_refused(received, tmp_path, capsys):
    with ReadDetector(tmp_path / "passwd") as marker:
        ckpt = tampered(received, tmp_path, tokenizer=str(tmp_path / "passwd"))
        line = one_line_error(capsys, "decode", "--checkpoint", str(ckpt), "--prompt", "x")
    assert not marker.read
    assert line == (
        f"jaxmoe decode: error: {ckpt}/config/config.json: data.tokenizer: "
        f"'{tmp_path}/passwd' lies outside the checkpoint '{ckpt}'; a checkpoint's tokenizer "
        f"must lie inside it (--config.data.tokenizer=FILE names one)"
    )


def test_stored_relative_tokenizer_leaving_is_refused(received, tmp_path, capsys):
    with ReadDetector(tmp_path / "spm.model") as marker:
        ckpt = tampered(received, tmp_path, tokenizer="../spm.model")
        line = one_line_error(capsys, "eval", "--checkpoint", str(ckpt), "--data", "embedded")
    assert not marker.read
    assert "data.tokenizer: path '../spm.model' has a '..' component" in line


@pytest.mark.parametrize("item", ["params", "tokenizer/tokenizer.model", "config/config.json"])
def test_symlinked_item_leading_out_is_refused(received, tmp_path, capsys, item):
    outside = tmp_path / "outside"
    outside.mkdir()
    ckpt = tmp_path / "ckpt"
    shutil.copytree(received, ckpt)
    target = ckpt / item
    if target.is_dir():  # the real item moved out, a FIFO planted where Orbax reads first
        shutil.move(target, outside / "params")
        (outside / "params" / "_METADATA").unlink()
        detector = ReadDetector(outside / "params" / "_METADATA")
        target.symlink_to(outside / "params")
    else:
        target.unlink()
        detector = ReadDetector(outside / target.name)
        target.symlink_to(outside / target.name)
    with detector:
        line = one_line_error(capsys, "eval", "--checkpoint", str(ckpt), "--data", "embedded")
    assert not detector.read
    assert line == (
        f"jaxmoe eval: error: checkpoint '{ckpt}': '{target.name}' is a symlink to "
        f"{outside / target.name}, outside {ckpt} (a checkpoint is read only inside its own "
        f"directory)"
    )


def test_step_directory_symlinked_out_of_the_workdir_is_refused(received, tmp_path, capsys):
    workdir = tmp_path / "run"
    (workdir / "checkpoints").mkdir(parents=True)
    (workdir / "checkpoints" / "9").symlink_to(received)
    line = one_line_error(capsys, "eval", "--checkpoint", str(workdir), "--data", "embedded")
    assert line.startswith(f"jaxmoe eval: error: checkpoint '{workdir}/checkpoints/9': '9' is a "
                           f"symlink to {received}, outside {workdir}")  # fmt: skip


def test_tokenizer_named_on_the_command_line_may_lie_anywhere(received, tmp_path):
    ckpt = tampered(received, tmp_path, tokenizer="/nonexistent/spm.model")
    own = str(received / "tokenizer" / "tokenizer.model")
    result = evaluate(str(ckpt), "embedded", overrides=[f"data.tokenizer={own}"])
    assert np.isfinite(result["loss"])


# --------------------------------------------------- checkpoints without their tokenizer


@pytest.fixture(scope="module")
def bare(received, tmp_path_factory) -> Path:
    """A checkpoint as older jaxmoe wrote them: no tokenizer inside, none named."""
    ckpt = tmp_path_factory.mktemp("bare") / "ckpt"
    shutil.copytree(received, ckpt)
    shutil.rmtree(ckpt / "tokenizer")
    file = ckpt / "config" / "config.json"
    stored = json.loads(file.read_text())
    stored["data"]["tokenizer"] = ""
    file.write_text(json.dumps(stored))
    return ckpt


def test_no_tokenizer_refuses_text_in_one_line_that_says_how(bare, tmp_path, capsys):
    line = one_line_error(capsys, "decode", "--checkpoint", str(bare), "--prompt", "x")
    assert line == (
        f"jaxmoe decode: error: checkpoint '{bare}' holds no tokenizer (saved before "
        f"checkpoints carried one, or converted without tokenizer files): name one with "
        f"--config.data.tokenizer=FILE (a .model, a tokenizer.json or its folder)"
    )


def test_no_tokenizer_never_trains_one_on_stored_data(bare, tmp_path, capsys):
    """The attack of a received checkpoint: no tokenizer, data.source at the victim's files
    and data.cache_dir where the sender wants their text written."""
    planted, attacker = tmp_path / "etc", tmp_path / "attacker"
    planted.mkdir()
    with ReadDetector(planted / "secret.conf") as marker:
        ckpt = tampered(bare, tmp_path, source=f"text:{planted}/*.conf", cache_dir=str(attacker))
        line = one_line_error(capsys, "decode", "--checkpoint", str(ckpt), "--prompt", "x")
    assert not marker.read and not attacker.exists()
    assert line.startswith(f"jaxmoe decode: error: checkpoint '{ckpt}' holds no tokenizer")


def test_no_tokenizer_still_scores_token_ids_and_works_with_a_named_one(bare, received, tmp_path):
    (tmp_path / "ids.jsonl").write_text('{"targets": [5, 6, 7, 8]}\n')
    assert evaluate(str(bare), f"jsonl:{tmp_path / 'ids.jsonl'}")["num_tokens"] == 3
    own = str(received / "tokenizer" / "tokenizer.model")
    assert np.isfinite(evaluate(str(bare), "embedded", overrides=[f"data.tokenizer={own}"])["loss"])


def test_tokenizer_larger_than_the_vocabulary_is_refused_at_conversion_and_use(
    bare, tmp_path, capsys
):
    big = tmp_path / "big.model"
    big.write_bytes(train_sentencepiece(iter(PROSE), 1024))
    config = with_overrides(read_config(str(bare)), [f"data.tokenizer={big}"])
    with pytest.raises(ConfigError) as refused:
        write_config(tmp_path / "converted", config)
    last = open_tokenizer(str(big)).token_of_id(1023)
    assert str(refused.value) == (
        f"data.tokenizer={big} ({big}) has ids up to 1023 (token {last!r}), past the model's "
        f"vocabulary of 512 (model.vocab_size): its ids past 511 have no embedding"
    )
    line = one_line_error(capsys, "eval", "--checkpoint", str(bare), "--data", "embedded",
                          f"--config.data.tokenizer={big}")  # fmt: skip
    assert line == (
        f"jaxmoe eval: error: --config.data.tokenizer ({big}) has ids up to 1023 (token "
        f"{last!r}), past the model's vocabulary of 512 (model.vocab_size): its ids past 511 "
        f"have no embedding"
    )


def test_conversion_copies_a_named_tokenizer_into_the_checkpoint(received, bare, tmp_path):
    own = received / "tokenizer" / "tokenizer.model"
    config = with_overrides(read_config(str(bare)), [f"data.tokenizer={own}"])
    write_config(tmp_path / "converted", config)
    assert (tmp_path / "converted/tokenizer/tokenizer.model").read_bytes() == own.read_bytes()
    stored = json.loads((tmp_path / "converted/config/config.json").read_text())
    assert stored["data"]["tokenizer"] == "tokenizer/tokenizer.model"


# ---------------------------------------------------------- every number for what was asked


def test_damaged_newest_step_is_named_not_passed_over(received, tmp_path, capsys):
    checkpoints = tmp_path / "run" / "checkpoints"
    for step in (3, 5):
        shutil.copytree(received, checkpoints / str(step))
    shutil.rmtree(checkpoints / "5" / "params")
    line = one_line_error(capsys, "eval", "--checkpoint", str(tmp_path / "run"), "--data",
                          "embedded")  # fmt: skip
    assert line == (
        f"jaxmoe eval: error: checkpoint '{checkpoints}/5': item 'params' is missing (the "
        f"newest step is damaged); name '{checkpoints}/3' to use step 3"
    )


def test_sequences_longer_than_the_context_are_refused_or_cut_by_a_flag(received, tmp_path, capsys):
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"targets": list(range(1, 101))}) + "\n")
    line = one_line_error(capsys, "eval", "--checkpoint", str(received), "--data", f"jsonl:{data}")
    assert line == (
        "jaxmoe eval: error: example 0: 'targets' is 99 tokens, longer than the model's "
        "context of 32 (model.max_len, the longest sequence it was trained on); --truncate "
        "scores its first 32"
    )
    assert evaluate(str(received), f"jsonl:{data}", truncate=True)["num_tokens"] == 32


def test_nan_weights_never_print_a_loss(received, tmp_path, capsys):
    config = read_config(str(received))
    _, params = model_params(build_model(config.model, rngs=nnx.Rngs(0)))
    params = jax.tree.map(lambda a: np.full(a.shape, np.nan, np.float32), params)
    save_params(str(tmp_path / "nan"), params, config)
    line = one_line_error(capsys, "eval", "--checkpoint", str(tmp_path / "nan"), "--data",
                          "embedded")  # fmt: skip
    assert line == (
        f"jaxmoe eval: error: eval of {tmp_path / 'nan'}: the loss is nan (the parameters "
        f"give non-finite logits: check the checkpoint with `jaxmoe eval` on other data, or "
        f"its conversion)"
    )


def test_a_directory_or_binary_file_as_data_is_one_line(received, tmp_path, capsys):
    (tmp_path / "bin.txt").write_bytes(b"\x00\xff\xfe")
    line = one_line_error(capsys, "eval", "--checkpoint", str(received), "--data",
                          f"jsonl:{tmp_path}")  # fmt: skip
    assert line == (
        f"jaxmoe eval: error: --data jsonl:{tmp_path}: is a directory (jsonl:FILE names one file)"
    )
    line = one_line_error(capsys, "eval", "--checkpoint", str(received), "--data",
                          f"jsonl:{tmp_path / 'bin.txt'}")  # fmt: skip
    assert line == (
        f"jaxmoe eval: error: --data jsonl:{tmp_path / 'bin.txt'}: not UTF-8 text (byte 1: "
        f"invalid start byte)"
    )
    line = one_line_error(capsys, "decode", "--checkpoint", str(received), "--prompts_file",
                          str(tmp_path / "bin.txt"))  # fmt: skip
    assert line == (
        f"jaxmoe decode: error: --prompts_file '{tmp_path / 'bin.txt'}': not UTF-8 text (byte "
        f"1: invalid start byte)"
    )


def test_resuming_with_a_tokenizer_other_than_the_checkpoints_is_refused(tmp_path):
    """Edit the training file and rerun: data.* now trains another tokenizer, and going on
    with the old model's embeddings under new ids would be silently wrong."""
    from jaxmoe.training.loop import train

    data = tmp_path / "train.jsonl"
    lines = PROSE[:2000]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    overrides = (f"data.source=jsonl:{data}", f"data.cache_dir={tmp_path / 'cache'}",
                 "train.steps=2", "train.checkpoint_every=2", "train.eval_batches=1")  # fmt: skip
    train(tiny_config(*overrides, "model.vocab_size=0"), str(tmp_path / "run"), progress=False)
    data.write_text("".join(json.dumps({"text": t.upper()}) + "\n" for t in lines))
    with pytest.raises(ConfigError) as refused:
        train(tiny_config(*overrides, "model.vocab_size=0", "train.steps=4"),
              str(tmp_path / "run"), progress=False)  # fmt: skip
    step = tmp_path / "run" / "checkpoints" / "2"
    assert str(refused.value) == (
        f"checkpoint '{step}' was trained with another tokenizer than data.* gives now "
        f"(tokenizer.model differs): resume with the data it was started with, or a copy of "
        f"'{step / 'tokenizer' / 'tokenizer.model'}' as --config.data.tokenizer, or start a "
        f"new --workdir"
    )
