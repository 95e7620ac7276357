"""Files received from others are read only when they are what they claim: a FIFO or a
device where a tokenizer or weights should be is refused, never read (a FIFO blocks forever,
/dev/zero never ends); a file far larger than such a file can be is refused before it fills
the memory; a tokenizer whose ids run past the model's embedding is refused at conversion
and at use, by its largest id (not its token count). Expected lines are written by hand.
"""

import json
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from safetensors.numpy import load_file, save_file

from jaxmoe.checkpoints.manager import CheckpointError, resolve_checkpoint
from jaxmoe.config.stored import read_config
from jaxmoe.conversions.hf.importer import convert_hf
from jaxmoe.data.tokenizer import open_tokenizer
from jaxmoe.errors import ConfigError
from jaxmoe.inference.trained_model import checkpoint_tokenizer
from jaxmoe.storage.received import read_file
from tests import test_bad_input
from tests.test_bad_input import LLAMA, llama_tensors, write_hf

GIB = 1 << 30
checkpoint = test_bad_input.checkpoint  # its tiny checkpoint fixture, here too


def finishes(call, seconds: float = 60.0):
    """`call()`'s result or exception, failing the test if it is still running after
    `seconds` (a reader blocked on a FIFO never returns)."""
    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as error:  # handed to the test thread
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@pytest.fixture
def received(checkpoint, tmp_path) -> Path:
    """A copy of the tiny checkpoint, as if received from someone else."""
    return Path(shutil.copytree(checkpoint, tmp_path / "received"))


# ------------------------------------------------------------------ checkpoints received


def test_fifo_in_a_checkpoint_is_refused_unread(received):
    model = received / "tokenizer" / "tokenizer.model"
    model.unlink()
    os.mkfifo(model)
    with pytest.raises(CheckpointError) as refused:
        finishes(lambda: read_config(str(received)))
    assert str(refused.value) == (
        f"checkpoint {str(received)!r}: {str(model)!r} is a FIFO (named pipe), not a file "
        f"(never read)"
    )


def test_sparse_giant_tokenizer_is_refused_unread(received):
    model = received / "tokenizer" / "tokenizer.model"
    with open(model, "r+b") as f:
        f.truncate(2 * GIB)  # a hole: no disk used, 2 GiB claimed
    config = read_config(str(received))
    with pytest.raises(ValueError) as refused:
        finishes(lambda: checkpoint_tokenizer(str(received), config))
    assert str(refused.value) == (
        f"data.tokenizer={str(model)!r}: 2,147,483,648 bytes, more than a tokenizer model can "
        f"hold (1,073,741,824): not read"
    )


def test_checkpoint_that_is_a_file_or_an_unfinished_save_is_one_line(received, tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError) as refused:
        resolve_checkpoint(str(tmp_path / "afile"))
    assert str(refused.value) == (
        f"checkpoint {str(tmp_path / 'afile')!r} is a file, not a directory (a checkpoint is "
        f"a step directory or a training workdir)"
    )
    unfinished = tmp_path / "run" / "checkpoints" / "15.orbax-checkpoint-tmp-1234"
    shutil.copytree(received, unfinished)
    with pytest.raises(CheckpointError) as refused:
        resolve_checkpoint(str(unfinished))
    assert str(refused.value) == (
        f"checkpoint {str(unfinished)!r} is an unfinished save (Orbax writes a step under a "
        f"temporary name until it is complete): name a finished step"
    )


def test_read_file_checks_the_file_it_opened(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ValueError, match=r"fifo: is a FIFO \(named pipe\), not a regular file"):
        finishes(lambda: read_file(tmp_path / "fifo", "tokenizer.json", 100))
    with pytest.raises(ValueError, match=r"null: is a character device, not a regular file"):
        read_file("/dev/null", "tokenizer.json", 100)
    (tmp_path / "small").write_bytes(b"12345")
    assert read_file(tmp_path / "small", "x", 5) == b"12345"
    with pytest.raises(ValueError, match=r"small: 5 bytes, more than a x can hold \(4\)"):
        read_file(tmp_path / "small", "x", 4)


# ------------------------------------------------------------- Hugging Face folders received


def test_weights_that_are_a_fifo_are_refused_unread(tmp_path):
    src = write_hf(tmp_path / "src", LLAMA, llama_tensors())
    (src / "model.safetensors").unlink()
    os.mkfifo(src / "model.safetensors")
    with pytest.raises(CheckpointError) as refused:
        finishes(lambda: convert_hf(src, tmp_path / "dst"))
    assert str(refused.value) == (
        f"{src}: path 'model.safetensors' is a FIFO (named pipe), not a file (never read)"
    )
    assert not (tmp_path / "dst").exists()


def test_weights_followed_by_a_sparse_tail_are_refused(tmp_path):
    """A valid file with 2 GiB of holes after its tensors: safe_open would map it all."""
    src = write_hf(tmp_path / "src", LLAMA, llama_tensors())
    weights = src / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size + 2 * GIB)
    with pytest.raises(CheckpointError) as refused:
        finishes(lambda: convert_hf(src, tmp_path / "dst"))
    assert str(refused.value) == (
        f"{weights}: {size + 2 * GIB:,} bytes, but its header describes {size:,} (a file "
        f"truncated, or with data past its tensors)"
    )


def test_tokenizer_linked_to_a_device_is_refused_not_dropped(tmp_path):
    src = write_hf(tmp_path / "src", LLAMA, llama_tensors())
    (src / "tokenizer.json").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError) as refused:
        finishes(lambda: convert_hf(src, tmp_path / "dst"))
    assert str(refused.value) == (
        f"{src}: path 'tokenizer.json' resolves to /dev/zero, outside {src.resolve()}"
    )
    (src / "tokenizer.json").unlink()
    os.mkfifo(src / "tokenizer.json")  # inside, but a FIFO: refused unread
    with pytest.raises(CheckpointError) as refused:
        finishes(lambda: convert_hf(src, tmp_path / "dst"))
    assert str(refused.value) == (
        f"{src}: path 'tokenizer.json' is a FIFO (named pipe), not a file (never read)"
    )
    assert not (tmp_path / "dst").exists()


def test_single_file_and_index_both_present_read_the_single_file(tmp_path, caplog):
    """transformers loads model.safetensors when both are there: so does jaxmoe, saying so,
    never the index's shards (here: zeros)."""
    tensors = llama_tensors()
    src = write_hf(tmp_path / "src", LLAMA, tensors)
    save_file({k: v * 0 for k, v in tensors.items()}, str(src / "model-00001-of-00001.safetensors"))
    weight_map = {name: "model-00001-of-00001.safetensors" for name in tensors}
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    convert_hf(src, tmp_path / "dst")
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"{src}: both model.safetensors and model.safetensors.index.json; reading "
        f"model.safetensors, as transformers does (the index and its shards are not read)"
    ]
    from jaxmoe.checkpoints.leafwise import StoredParams

    embedding = StoredParams(str(tmp_path / "dst")).read(("embed", "embedding"))
    np.testing.assert_array_equal(embedding, load_file(str(src / "model.safetensors"))[
        "model.embed_tokens.weight"])  # fmt: skip


# ---------------------------------------------------------- tokenizer ids past the model


def gap_tokenizer(folder: Path, largest: int) -> Path:
    """A word-level tokenizer.json of 5 tokens whose last id is `largest` (ids need not be
    dense in a tokenizer.json)."""
    vocab = {"<unk>": 0, "</s>": 1, "the": 2, "river": 3, "63": largest}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_tokenizer_is_sized_by_its_largest_id_not_its_count(tmp_path):
    tokenizer = open_tokenizer(str(gap_tokenizer(tmp_path / "tok", 100_000)))
    assert tokenizer.encode("the river 63") == [2, 3, 100_000]
    assert tokenizer.vocab_size == 100_001  # 5 tokens, ids up to 100000


def test_tokenizer_ids_past_the_embedding_are_refused_at_conversion(tmp_path):
    src = write_hf(tmp_path / "src", LLAMA, llama_tensors())  # 32 embeddings
    gap_tokenizer(src, 100_000)
    with pytest.raises(ConfigError) as refused:
        convert_hf(src, tmp_path / "dst")
    assert str(refused.value).endswith(
        f"({src / 'tokenizer.json'}) has ids up to 100000 (token '63'), past the model's "
        f"vocabulary of 32 (model.vocab_size): its ids past 31 have no embedding"
    )
    assert not (tmp_path / "dst").exists()


def test_tokenizer_ids_past_the_embedding_are_refused_at_use(checkpoint, tmp_path):
    """--config.data.tokenizer names another tokenizer at use: same check (its largest id,
    600, is past the checkpoint's 512 embeddings though it has 5 tokens)."""
    folder = gap_tokenizer(tmp_path / "tok", 600)
    overrides = [f"data.tokenizer={folder}"]
    from jaxmoe.inference.trained_model import checkpoint_config

    config = checkpoint_config(str(checkpoint), overrides)
    with pytest.raises(ConfigError) as refused:
        checkpoint_tokenizer(str(checkpoint), config, overrides)
    assert str(refused.value) == (
        f"--config.data.tokenizer ({folder / 'tokenizer.json'}) has ids up to 600 (token "
        f"'63'), past the model's vocabulary of 512 (model.vocab_size): its ids past 511 have "
        f"no embedding"
    )
