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
    tokenizer = load_tokenizer(config.data)
    for split_key in ("train_split", "eval_split"):
        token_stream(config.data, tokenizer, split_key)
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


# The data package takes the `data` section, what it reads of `train` and whether the model
# reads span corruption, never the whole config: these call it for a whole JobConfig, as
# `jaxmoe train` does (training/run_setup.py).


def build_data(config, process_index: int = 0, process_count: int = 1, **kwargs):
    """pipeline.build_data of a JobConfig's data."""
    from jaxmoe.data import pipeline

    return pipeline.build_data(
        config.data,
        config.train,
        spans=config.span_corruption,
        process_index=process_index,
        process_count=process_count,
        **kwargs,
    )


def train_batches(config, tokenizer, *args, **kwargs):
    """pipeline.TrainBatches of a JobConfig's data (args: process_index, process_count,
    epoch_order, examples)."""
    from jaxmoe.data import pipeline

    return pipeline.TrainBatches(
        config.data, config.train, tokenizer, *args, spans=config.span_corruption, **kwargs
    )


def eval_batches(config, tokenizer, max_batches=None, process_index=0, process_count=1):
    """pipeline.eval_batches of a JobConfig's data."""
    from jaxmoe.data import pipeline

    return pipeline.eval_batches(
        config.data,
        config.train,
        tokenizer,
        max_batches,
        process_index,
        process_count,
        spans=config.span_corruption,
    )


def split_examples(config, tokenizer, split_key: str, partial_last: bool):
    """pipeline.split_examples of a JobConfig's data."""
    from jaxmoe.data import pipeline

    return pipeline.split_examples(
        config.data, config.train, tokenizer, split_key, partial_last, spans=config.span_corruption
    )
