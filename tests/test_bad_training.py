"""Training that goes wrong says so in one line: non-finite steps (stop, skip, parameters
overflowed by an update), a torn metrics.jsonl on resume, a resume with another optimizer
or sequence length (refused, nothing lost), temp files of data preparation (interrupted or
killed), and a bare tokenizer.json's EOS."""

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from jaxmoe.checkpoints.manager import CheckpointError
from jaxmoe.data.hf_tokenizer import HFTokenizer
from jaxmoe.data.sources import load_tokenizer
from jaxmoe.data.tokenizer import open_tokenizer
from jaxmoe.errors import ConfigError
from jaxmoe.training.loop import train
from jaxmoe.training.metrics import MetricsWriter
from jaxmoe.training.trainer import describe_nonfinite
from tests.fixtures_data import copy_data_cache
from tests.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]
KEEP = "the last completed checkpoint is intact"


@pytest.fixture(scope="module")
def cache(tmp_path_factory, embedded_data_cache):
    return copy_data_cache(embedded_data_cache, tmp_path_factory.mktemp("data") / "cache")


# The runs here share their init programs: tests/conftest.py's persistent compilation
# cache compiles those once (the train steps differ: the learning rate is a constant in
# them).


def config(cache, *overrides):
    return tiny_config(
        "model.moe.num_experts=0",
        "model.vocab_size=0",
        "optimizer.grad_clip_norm=0.0",
        "optimizer.schedule=constant",
        "optimizer.warmup_steps=0",
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_batches=1",
        f"data.cache_dir={cache}",
        *overrides,
    )


def checkpoint_steps(workdir: Path) -> list[int]:
    folder = workdir / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


# lr 1e30: step 1 trains, step 2's gradient is NaN (its loss is ln(512), finite). lr 1e39
# is inf in f32: step 1's update makes the parameters non-finite (step 2's loss is NaN).
DEAD_GRADIENT = "non-finite gradient (norm nan; the loss, 6.2383, is finite)"


def test_stop_names_a_non_finite_gradient_not_the_finite_loss(cache, tmp_path):
    expected = (
        f"{DEAD_GRADIENT} at step 2; stopped without saving it ({KEEP}; "
        "--config.train.nonfinite=skip skips such steps instead)"
    )
    cfg = config(cache, "optimizer.learning_rate=1e30", "train.steps=6", "train.checkpoint_every=1")
    with pytest.raises(RuntimeError, match=f"^{re.escape(expected)}$"):
        train(cfg, str(tmp_path), progress=False)
    assert checkpoint_steps(tmp_path) == [1]


def test_stop_names_a_non_finite_loss():
    assert describe_nonfinite(float("nan"), float("nan")) == "non-finite loss (nan)"
    assert describe_nonfinite(float("inf"), 2.0) == "non-finite loss (inf)"


def test_non_finite_parameters_are_never_saved(cache, tmp_path):
    expected = (
        "non-finite parameters after the update of step 1 (lower optimizer.learning_rate); "
        f"stopped without saving them ({KEEP})"
    )
    cfg = config(cache, "optimizer.learning_rate=1e39", "train.steps=6", "train.checkpoint_every=1")
    with pytest.raises(RuntimeError, match=f"^{re.escape(expected)}$"):
        train(cfg, str(tmp_path), progress=False)
    assert checkpoint_steps(tmp_path) == []


def test_skip_stops_after_max_skipped_steps_in_a_row(cache, tmp_path, caplog):
    expected = (
        f"steps 2 to 4 were all skipped, the last for a {DEAD_GRADIENT}: "
        "train.max_skipped_steps=3 in a row, so the model no longer trains; stopped without "
        "saving any of them (the last completed checkpoint, if any, predates them; lower "
        "optimizer.learning_rate)"
    )
    cfg = config(
        cache,
        "optimizer.learning_rate=1e30",
        "train.steps=20",
        "train.checkpoint_every=2",  # step 2 is skipped: its save waits, and never comes
        "train.nonfinite=skip",
        "train.max_skipped_steps=3",
    )
    with (
        caplog.at_level(logging.WARNING, logger="jaxmoe"),
        pytest.raises(RuntimeError, match=f"^{re.escape(expected)}$"),
    ):
        train(cfg, str(tmp_path), progress=False)
    assert [r.getMessage() for r in caplog.records if r.name == "jaxmoe"] == [
        f"step {step} skipped: {DEAD_GRADIENT}; {step - 1} of train.max_skipped_steps=3 in a row"
        for step in (2, 3, 4)
    ]
    assert checkpoint_steps(tmp_path) == []


def test_resume_drops_a_torn_write_of_metrics_jsonl(tmp_path, caplog):
    """What a resume from step 2 reads: a run killed while writing left random bytes."""
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "split": "train", "loss": 3.0}, {"step": 2, "split": "train", "loss": 2.0}]
    torn = b'\x9f\xff{"step": 9, "sp\n\x00\x13\xfe not json'  # two damaged lines
    metrics.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows) + torn)
    with caplog.at_level(logging.WARNING, logger="jaxmoe"):
        writer = MetricsWriter(str(tmp_path), total_steps=3, start_step=2, progress=False)
    writer.write(3, "train", {"loss": 1.5})
    writer.close()
    assert [r.getMessage() for r in caplog.records if r.name == "jaxmoe"] == [
        f"{metrics}: dropped 2 damaged lines (a torn write), kept its rows up to step 2"
    ]
    assert [json.loads(line) for line in metrics.read_text().splitlines()] == [
        *rows,
        {"step": 3, "split": "train", "loss": 1.5},
    ]


def prepare(tmp_path, *overrides):
    """`jaxmoe prepare` in a subprocess whose temp directory is tmp_path/tmp."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxmoe",
            "prepare",
            "--config",
            "configs/default.py:dense",
            f"--config.data.cache_dir={tmp_path / 'cache'}",
            "--config.data.vocab_size=512",
            *overrides,
        ],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "TMPDIR": str(temp)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return result, sorted(p.name for p in temp.iterdir())


def test_prepare_leaves_nothing_in_the_temp_directory(tmp_path):
    result, left = prepare(tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert left == []


def test_failed_prepare_leaves_nothing_in_the_temp_directory(tmp_path):
    text = tmp_path / "one.txt"
    text.write_text("a single paragraph: nothing for the validation split")
    result, left = prepare(tmp_path, f"--config.data.source=text:{text}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"jaxmoe prepare: error: data.source='text:{text}' (data.validation_fraction=0.05): "
        "split 'validation' has no documents"
    ]
    assert left == []


def bare_tokenizer_json(folder: Path, specials: list[str]) -> Path:
    """A word-level tokenizer.json (tokenizers library), no side files, no post-processor."""
    words = ["<unk>", "hello", "world"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    folder.mkdir()
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def test_bare_tokenizer_json_takes_its_conventional_eos(tmp_path):
    path = bare_tokenizer_json(tmp_path / "t5", ["<pad>", "</s>"])
    assert HFTokenizer(str(path)).eos_id == 4  # <unk> hello world <pad> </s>
    # </s> is absent: <|endoftext|> comes before <eos>.
    path = bare_tokenizer_json(tmp_path / "gpt", ["<eos>", "<|endoftext|>"])
    assert open_tokenizer(str(path)).eos_id == 4


def test_bare_tokenizer_json_eos_named_by_data_eos_token(tmp_path):
    path = bare_tokenizer_json(tmp_path / "tok", ["<pad>", "<end>", "</s>"])
    cfg = tiny_config(f"data.tokenizer={path}", "data.eos_token=<end>")
    assert load_tokenizer(cfg.data).eos_id == 4
    expected = f"data.eos_token='<stop>' is not a token of data.tokenizer='{path}'"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        HFTokenizer(str(path), eos_token="<stop>")


def test_tokenizer_json_without_any_eos_names_the_key(tmp_path):
    path = bare_tokenizer_json(tmp_path / "tok", ["<pad>", "<end>"])
    expected = (
        f"data.tokenizer='{path}' defines no EOS token (no eos_token in tokenizer_config.json, "
        "no single token appended by its post-processor, none of </s> <|endoftext|> "
        "<|end_of_text|> <eos> in its vocabulary): name it with --config.data.eos_token=TOKEN"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        HFTokenizer(str(path))


# ------------------------------------------------------------ resuming with another setup


@pytest.fixture(scope="module")
def saved_run(cache, tmp_path_factory) -> Path:
    """A finished AdamW run (checkpoints at steps 1 and 2) that the tests below copy."""
    workdir = tmp_path_factory.mktemp("saved") / "run"
    train(config(cache, "train.steps=2", "train.checkpoint_every=1"), str(workdir), progress=False)
    return workdir


def resumed(saved_run: Path, tmp_path: Path) -> tuple[Path, dict]:
    """A copy of `saved_run` and the bytes of every file in it, to see nothing changed."""
    workdir = Path(shutil.copytree(saved_run, tmp_path / "run"))
    files = {p: p.read_bytes() for p in sorted(workdir.rglob("*")) if p.is_file()}
    return workdir, files


@pytest.mark.parametrize("optimizer", ["adafactor", "t5x_adafactor"])
def test_resume_with_another_optimizer_is_refused_losing_nothing(
    cache, saved_run, tmp_path, caplog, optimizer
):
    """Another optimizer's state is not damage: both intact checkpoints stay where they
    are (never renamed N.damaged), training never restarts from step 0, and the line says
    which optimizer saved them."""
    workdir, before = resumed(saved_run, tmp_path)
    cfg = config(cache, "train.steps=4", "train.checkpoint_every=1", f"optimizer.name={optimizer}")
    with pytest.raises(CheckpointError) as refused:
        train(cfg, str(workdir), progress=False)
    step = workdir / "checkpoints" / "2"
    assert str(refused.value).startswith(
        f"checkpoint {str(step)!r} holds the state of another optimizer than optimizer.* of "
        f"this run (saved with optimizer.name=adamw; state "
    )
    assert str(refused.value).endswith(
        "resume with the config this run was started with, or start a new --workdir "
        "(train.init_from=<checkpoint> loads its weights, with a fresh optimizer state)"
    )
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    after = {p: p.read_bytes() for p in sorted(workdir.rglob("*")) if p.is_file()}
    assert after.keys() == before.keys() and all(after[p] == before[p] for p in before)


def test_resume_with_another_seq_len_names_it(cache, saved_run, tmp_path):
    workdir, _ = resumed(saved_run, tmp_path)
    cfg = config(cache, "train.steps=4", "train.checkpoint_every=1", "train.seq_len=32")
    with pytest.raises(ConfigError) as refused:
        train(cfg, str(workdir), progress=False)
    assert "; changed since checkpoint 2: train.seq_len 16 -> 32; resume with the values it " in (
        str(refused.value)
    )
    assert checkpoint_steps(workdir) == [1, 2]


# ------------------------------------------------------- interrupts and killed preparers


def test_interrupted_command_is_one_line(capsys, monkeypatch):
    """Ctrl-C, or SIGTERM (raised as Interrupted), anywhere in a command: one line and the
    signal's exit status, no traceback; `finally` blocks have run on the way out."""
    from jaxmoe.cli import main
    from jaxmoe.cli import prepare as prepare_command
    from jaxmoe.storage.interrupts import Interrupted

    for raised, name, status in ((KeyboardInterrupt(), "SIGINT", 130),
                                 (Interrupted("SIGTERM"), "SIGTERM", 143)):  # fmt: skip

        def stop(args, raised=raised):
            raise raised

        monkeypatch.setattr(prepare_command, "run", stop)
        assert main(["prepare", "--config", "configs/default.py"]) == status
        assert capsys.readouterr().err == f"jaxmoe prepare: interrupted by {name}\n"


def test_interrupted_token_cache_leaves_no_temporary_file(tmp_path):
    from jaxmoe.data.packing import write_token_cache

    tokenizer = bare_tokenizer_json(tmp_path / "tok", ["</s>"])

    def documents():
        yield "hello world"
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_token_cache(documents(), open_tokenizer(str(tokenizer)), str(tmp_path / "c/t.npy"))
    assert os.listdir(tmp_path / "c") == []


def test_temporaries_of_killed_writers_are_removed_by_the_next(tmp_path, caplog):
    """SIGKILL leaves a writer's temporary files; the next writer in the folder removes
    those of dead processes of this host, never a live one's."""
    from jaxmoe.storage.temporaries import make_temporary, write_atomically

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    host = socket.gethostname()
    killed = tmp_path / f".tmp-{host}.{dead}-abc.raw"
    killed.write_bytes(b"half")
    elsewhere = tmp_path / f".tmp-otherhost.{dead}-abc.raw"  # a live writer, maybe
    elsewhere.write_bytes(b"half")
    fd, live = make_temporary(str(tmp_path), suffix=".npy")  # this process: alive
    os.close(fd)
    write_atomically(str(tmp_path / "t.npy"), b"whole")
    assert sorted(os.listdir(tmp_path)) == sorted([elsewhere.name, Path(live).name, "t.npy"])
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"removed {killed}, left by a killed process (pid {dead})"
    ]
