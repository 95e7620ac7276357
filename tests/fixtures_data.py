"""Session fixtures for the data cache: the embedded corpus prepared once per session (its
512-piece SentencePiece tokenizer and both token streams), copied into the data.cache_dir
of each test that only needs that data, not the preparing of it. Training the tokenizer
takes seconds; without these a dozen test modules each trained the same one."""

import shutil
from pathlib import Path

import pytest

from tests.helpers import tiny_config


@pytest.fixture(scope="session")
def embedded_data_cache(tmp_path_factory) -> Path:
    """A data.cache_dir holding what tiny_config's embedded corpus needs (never written to
    after this: tests get copies)."""
    from jaxmoe.data.sources import load_tokenizer, token_stream

    root = tmp_path_factory.mktemp("embedded_data_cache")
    config = tiny_config("model.vocab_size=0", f"data.cache_dir={root}")
    tokenizer = load_tokenizer(config)
    for split_key in ("train_split", "eval_split"):
        token_stream(config, tokenizer, split_key)
    return root


def copy_data_cache(prepared: Path, target: Path) -> Path:
    """A private copy of a prepared data cache at `target` (the same files a first run
    would have written there)."""
    shutil.copytree(prepared, target)
    return target


@pytest.fixture
def data_cache(embedded_data_cache, tmp_path) -> Path:
    """This test's own copy of the prepared embedded-corpus cache."""
    return copy_data_cache(embedded_data_cache, tmp_path / "cache")
