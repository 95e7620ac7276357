"""Converters write DST atomically (checkpoints/staging.py): a conversion that fails half way,
after tensors were written, leaves neither DST nor its staging folder behind; an empty DST
made ahead of time stays as it was; the same DST then converts cleanly."""

import os
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from jaxmoe.config.stored import read_config
from jaxmoe.conversions.hf import importer
from tests.test_hf import randomize

# The T5X fixture of test_t5x_convert.py (imported from there, a missing one would skip all).
TINY = (
    Path(os.environ.get("JAXMOE_T5X_FIXTURES", "/work/shared/fixtures/t5x"))
    / "test_t5_tiny.checkpoint_0"
)


class Interrupted(RuntimeError):
    pass


@pytest.fixture(scope="module")
def hf_src(tmp_path_factory):
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    src = tmp_path_factory.mktemp("hf_src")
    randomize(LlamaForCausalLM(config), seed=2).save_pretrained(src)
    return src


def _fail_after_params(seen):
    """Stands in for a step late in a conversion: checks that the tensors were already
    written into the staging folder (not DST), then fails."""

    def fail(src, staging, *rest):
        seen.append(staging)
        assert (staging / "params").is_dir() and staging.name.startswith(".out.converting-")
        raise Interrupted("killed mid-conversion")

    return fail


@pytest.mark.parametrize("premade", [False, True], ids=["new", "empty_dst"])
def test_failed_hf_conversion_leaves_nothing(hf_src, tmp_path, monkeypatch, premade):
    dst = tmp_path / "out"
    if premade:
        dst.mkdir()
    seen = []
    with monkeypatch.context() as patch:
        patch.setattr(importer, "keep_tokenizer_files", _fail_after_params(seen))
        with pytest.raises(Interrupted):
            importer.convert_hf(hf_src, dst)
    assert len(seen) == 1 and seen[0].parent == tmp_path
    assert os.listdir(tmp_path) == (["out"] if premade else [])
    if premade:
        assert os.listdir(dst) == []
    importer.convert_hf(hf_src, dst)  # nothing left over blocks a second try
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert read_config(str(dst)).model.num_kv_heads == 1


def test_failed_t5x_conversion_leaves_nothing(tmp_path, monkeypatch):
    if not TINY.exists():
        pytest.skip(f"T5X fixture not found at {TINY}")
    from jaxmoe.conversions.t5x import convert

    seen = []

    def fail(checkpoint):  # Orbax has written every tensor group by then
        seen.append(checkpoint)
        assert any(checkpoint.iterdir())
        raise Interrupted("killed mid-conversion")

    monkeypatch.setattr(convert, "_tree_directory", fail)
    with pytest.raises(Interrupted):
        convert.convert_t5x(TINY, tmp_path / "out")
    assert seen[0].parent.parent == tmp_path
    assert os.listdir(tmp_path) == []
