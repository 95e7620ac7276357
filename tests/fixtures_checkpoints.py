"""Session fixtures for tiny checkpoints, made once and read by every test that needs one of
their kind to evaluate, decode, refuse or start from, not the making of it. They are
read-only: a test that changes one works on its own copy (shutil.copytree).

Under pytest-xdist each worker is a session of its own; the first worker to need a checkpoint
builds it in the run's shared temporary directory under a file lock, and the others wait for
it and read the same files (jaxmoe's data cache is made to be shared by processes: its files
appear atomically).
"""

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.fixtures_data import copy_data_cache
from tests.helpers import tiny_config

VOCAB = 512  # the embedded corpus's SentencePiece tokenizer (tests/fixtures_data.py)


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """The directory `name`, filled by build(directory) once per test run."""
    if "PYTEST_XDIST_WORKER" not in os.environ:  # one session: its own temporary directory
        root = tmp_path_factory.mktemp(name)
        build(root)
        return root
    # The workers' base directories share a parent, new for each run.
    shared = tmp_path_factory.getbasetemp().parent / "shared_checkpoints"
    shared.mkdir(exist_ok=True)
    root, done = shared / name, shared / f"{name}.done"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)  # what a build that failed left
            root.mkdir()
            build(root)
            done.touch()
    return root


def dense_config(root: Path, *overrides: str):
    """saved_dense's config: tiny_config's dense decoder, vocabulary 512, its data cache (the
    embedded corpus) at ROOT/cache."""
    return tiny_config(
        "model.moe.num_experts=0",
        f"model.vocab_size={VOCAB}",
        f"data.cache_dir={root / 'cache'}",
        *overrides,
    )


@pytest.fixture(scope="session")
def saved_dense(tmp_path_factory, request) -> Path:
    """ROOT: ROOT/ckpt is a parameters-only checkpoint (save_params) of dense_config(ROOT)'s
    decoder with its parameters drawn from nnx.Rngs(0), holding the embedded corpus's
    512-piece tokenizer; ROOT/cache is that corpus's data cache."""

    def build(root: Path) -> None:
        import jax
        from flax import nnx

        from jaxmoe.checkpoints.manager import save_params
        from jaxmoe.data.sources import load_tokenizer
        from jaxmoe.models import build_model
        from jaxmoe.models.spec import model_params

        copy_data_cache(request.getfixturevalue("embedded_data_cache"), root / "cache")
        tokenizer = load_tokenizer(dense_config(root).data).path  # the cache's: no training
        config = dense_config(root, f"data.tokenizer={tokenizer}")
        _, params = model_params(build_model(config.model, rngs=nnx.Rngs(0)))
        save_params(str(root / "ckpt"), jax.device_get(params), config)

    return built_once(tmp_path_factory, "saved_dense", build)


def trained_dense_config(root: Path, *overrides: str):
    """trained_dense's config: tiny_config's dense decoder and run (4 AdamW steps on a cosine
    from 3e-3 to 0.1 x that after 1 warmup step; one checkpoint, at the end) on the embedded
    corpus, its data cache at ROOT/cache."""
    return tiny_config(
        "model.moe.num_experts=0",
        "model.vocab_size=0",  # the tokenizer's: 512
        "train.eval_batches=1",
        "train.log_every=1",
        f"data.cache_dir={root / 'cache'}",
        *overrides,
    )


@pytest.fixture(scope="session")
def trained_dense(tmp_path_factory, request) -> Path:
    """ROOT: ROOT/run is the workdir of `train()` of trained_dense_config(ROOT) (its one
    checkpoint ROOT/run/checkpoints/4 holds the optimizer state and the tokenizer);
    ROOT/cache is the embedded corpus's data cache it read."""

    def build(root: Path) -> None:
        from jaxmoe.training.loop import train

        copy_data_cache(request.getfixturevalue("embedded_data_cache"), root / "cache")
        train(trained_dense_config(root), str(root / "run"), progress=False)

    return built_once(tmp_path_factory, "trained_dense", build)
