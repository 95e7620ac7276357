"""`export t5x`: T5X's layout, and `convert t5x` reads it back bit for bit.

References: the real T5X fixtures (the tiny T5.1.1 msgpack file for names, shapes and dtypes
of parameters and Adafactor state; tiny_t5's TensorStore leaves for the spec form and the
file names), flax's own msgpack reader, gunzip of the chunk files by hand, and chunk shapes
of T5X's rule worked out by hand.
"""

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import flax.serialization
import jax
import msgpack
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import traverse_util

from jaxmoe.checkpoints.manager import CheckpointError
from jaxmoe.conversions.t5x.convert import convert_t5x
from jaxmoe.conversions.t5x.exporter import chunk_shape, export_t5x
from tests.test_t5x_keep_optimizer import t5_1_1_params, write_t5x_with_moments
from tests.test_t5x_ocdbt import jaxmoe_arrays
from tests.test_t5x_reader import TINY, TINY_T5

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "tests" / "data" / "t5x_tiny" / "checkpoint_0"


def flax_tree(file: Path) -> dict:
    """{'/'-joined name: leaf} of a msgpack file read by flax (arrays, or spec dicts)."""
    tree = flax.serialization.msgpack_restore(file.read_bytes())
    flat = {}

    def walk(node, prefix):
        if isinstance(node, dict) and "driver" not in node:  # a spec dict is a leaf
            for key, value in node.items():
                walk(value, (*prefix, key))
        else:
            flat["/".join(prefix)] = node

    walk(tree, ())
    return flat


def zarr_by_hand(directory: Path, spec: dict) -> np.ndarray:
    """One gzip chunk holding the whole array, C order, little-endian (T5X's zarr)."""
    assert spec["metadata"]["chunks"] == spec["metadata"]["shape"]
    key = ".".join("0" * len(spec["metadata"]["shape"])) or "0"
    raw = gzip.decompress((directory / spec["kvstore"]["path"] / key).read_bytes())
    return np.frombuffer(raw, "<" + np.dtype(spec["dtype"]).str[1:]).reshape(
        spec["metadata"]["shape"]
    )


def files_of(directory: Path) -> set[str]:
    """Relative paths of a checkpoint's files, without dotfiles (`.zarray`: the fixture
    copies lost theirs; T5X writes one)."""
    return {
        str(p.relative_to(directory)) for p in directory.rglob("*")
        if p.is_file() and not p.name.startswith(".")
    }  # fmt: skip


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    """fixture -> jaxmoe (with T5X's Adafactor state) -> T5X -> jaxmoe."""
    root = tmp_path_factory.mktemp("round_trip")
    convert_t5x(TINY, root / "first", keep_optimizer=True)
    exported = export_t5x(root / "first", root / "t5x")
    convert_t5x(exported, root / "second", keep_optimizer=True)
    return root, exported


def test_parameters_round_trip_bit_exactly(round_trip):
    root, _ = round_trip
    first, second = jaxmoe_arrays(root / "first"), jaxmoe_arrays(root / "second")
    assert sorted(first) == sorted(second) and len(first) == 52
    for name, value in first.items():
        assert value.dtype == second[name].dtype == np.float32
        assert value.tobytes() == second[name].tobytes(), name


def test_adafactor_state_round_trips_bit_exactly(round_trip):
    root, _ = round_trip

    def read(name):
        tree = ocp.PyTreeCheckpointer().restore(root / name / "opt_state")
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}

    first, second = read("first"), read("second")
    assert sorted(first) == sorted(second) and len(first) > 52
    assert all(first[k].tobytes() == second[k].tobytes() for k in first)


def test_factored_moments_export_as_t5x_stored_them(tmp_path):
    """T5X moments after 150000 steps (random, factored where T5X factors: d_model 128),
    through convert --keep_optimizer and export: every leaf of the T5X tree comes back
    bit for bit, in the same place (v_row/v_col inline, unfactored v in TensorStore)."""
    source = tmp_path / "checkpoint_150000"
    write_t5x_with_moments(source, t5_1_1_params(128, 2, 64, 256, 512), 150_000)
    convert_t5x(source, tmp_path / "kept", keep_optimizer=True)
    exported = export_t5x(tmp_path / "kept", tmp_path / "t5x")
    assert exported.name == "checkpoint_150000"
    want, got = flax_tree(source), flax_tree(exported / "checkpoint")
    assert sorted(got) == sorted(want)
    factored = [n for n in want if n.endswith("/v_row") and want[n].shape != (1,)]
    assert len(factored) >= 10 and not isinstance(got[factored[0]], dict)
    for name, value in want.items():
        leaf = got[name]
        leaf = zarr_by_hand(exported, leaf) if isinstance(leaf, dict) else np.asarray(leaf)
        value = np.asarray(value)
        assert (leaf.shape, leaf.dtype) == (value.shape, value.dtype), name
        assert leaf.tobytes() == value.tobytes(), name


def test_tree_equals_the_fixtures(round_trip):
    """Same names, shapes and dtypes as T5X's tiny T5.1.1 (parameters, Adafactor state,
    step), and the same values: arrays read back by hand from the chunk files."""
    _, exported = round_trip
    fixture, ours = flax_tree(TINY), flax_tree(exported / "checkpoint")
    assert sorted(ours) == sorted(fixture) and len(fixture) == 1 + 52 + 52 * 4 + 1
    for name, want in fixture.items():
        got, want = ours[name], np.asarray(want)
        if isinstance(got, dict):  # a TensorStore leaf: parameters and unfactored `v`
            assert name.startswith("optimizer/target/") or name.endswith("/v"), name
            assert (got["metadata"]["shape"], got["dtype"]) == (list(want.shape), want.dtype.name)
            got = zarr_by_hand(exported, got)
        got = np.asarray(got)
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert got.tobytes() == np.asarray(want).tobytes(), name
    # The msgpack tree's order and step encoding are T5X's (flax ext 1, int32, 0-d).
    raw = msgpack.unpackb((exported / "checkpoint").read_bytes(), strict_map_key=False)
    fixture_raw = msgpack.unpackb(TINY.read_bytes(), strict_map_key=False)
    assert list(raw) == list(fixture_raw) == ["version", "optimizer"]
    assert list(raw["optimizer"]) == ["state", "target"] and raw["version"] == 3
    assert raw["optimizer"]["state"]["step"] == fixture_raw["optimizer"]["state"]["step"]
    m = ("optimizer", "state", "param_states", "encoder", "encoder_norm", "scale", "m")
    assert (
        traverse_util.flatten_dict(raw)[m] == traverse_util.flatten_dict(fixture_raw)[m]
    )  # the same bytes: (1,) float32 zero


def test_tensorstore_leaves_are_laid_out_as_t5x_writes_them(round_trip):
    """Spec form, directory and chunk-file names as in tiny_t5 (T5X's TensorStore leaves)."""
    _, exported = round_trip
    toy = msgpack.unpackb((TINY_T5 / "checkpoint").read_bytes(), strict_map_key=False)
    toy_spec = toy["optimizer"]["state"]["param_states"]["kernel"]
    assert files_of(TINY_T5) == {
        "checkpoint", "state.param_states.bias/0", "state.param_states.kernel/0.0",
        "state.param_states.step/0",
    }  # fmt: skip
    ours = flax_tree(exported / "checkpoint")
    specs = {name: leaf for name, leaf in ours.items() if isinstance(leaf, dict)}
    expected_files = {"checkpoint"}
    for name, spec in specs.items():
        dotted = name.removeprefix("optimizer/").replace("/", ".")
        assert spec.keys() == toy_spec.keys()
        assert spec["kvstore"] == {"driver": "file", "path": f"{dotted}/"}  # fixture: gfile
        assert spec["metadata"].keys() == toy_spec["metadata"].keys()
        assert spec["metadata"]["compressor"] == toy_spec["metadata"]["compressor"]
        rank = len(spec["metadata"]["shape"])
        expected_files.add(f"{dotted}/" + (".".join("0" * rank) or "0"))
    assert len(specs) == 52 + 52  # every parameter, and its unfactored second moment
    assert files_of(exported) == expected_files


def test_chunk_shapes_follow_t5xs_rule():
    # float32: at most 16 Mi elements per chunk. 32128 = 2^7 * 251: 32128 -> 16064 ->
    # 8032 -> 4016, and 4016 * 4096 = 16449536 <= 16777216.
    assert chunk_shape((32128, 4096), 4) == [4016, 4096]
    assert chunk_shape((8192, 4096), 4) == [4096, 4096]
    assert chunk_shape((8192, 4096), 2) == [8192, 4096]  # bfloat16: 32 Mi elements fit
    assert chunk_shape((4096, 8192), 4) == [4096, 4096]
    assert chunk_shape((3, 5), 4) == [3, 5] and chunk_shape((), 4) == []


def test_fresh_adafactor_state_without_stored_state(tmp_path):
    """A checkpoint without optimizer state exports T5X's initial state (zeros) at
    the source step."""
    convert_t5x(TINY, tmp_path / "plain", overrides=["--config.source.step=7"])
    exported = export_t5x(tmp_path / "plain", tmp_path / "t5x")
    assert exported.name == "checkpoint_7"
    ours, fixture = flax_tree(exported / "checkpoint"), flax_tree(TINY)
    assert int(ours["optimizer/state/step"]) == 7
    for name, want in fixture.items():
        if "/param_states/" in name:
            got = ours[name]
            got = zarr_by_hand(exported, got) if isinstance(got, dict) else got
            assert got.shape == want.shape and not got.any(), name


def test_bfloat16_export_and_refusals(tmp_path, round_trip):
    root, _ = round_trip
    exported = export_t5x(root / "first", tmp_path / "bf16", dtype="bfloat16")
    spec = flax_tree(exported / "checkpoint")["optimizer/target/decoder/decoder_norm/scale"]
    assert spec["dtype"] == "bfloat16"
    with pytest.raises(CheckpointError, match="already exists"):
        export_t5x(root / "first", tmp_path / "bf16", dtype="bfloat16")
    with pytest.raises(CheckpointError, match="Adafactor state is at step 0"):
        export_t5x(root / "first", tmp_path / "other", step=5)


def test_step_of_a_fresh_state_counts_from_the_schedule_start(tmp_path, round_trip):
    """An Adafactor state begun fresh at optimizer.start_step 1000 (uptraining without the
    source's state) is T5X's step 1000 + its count (0 here)."""
    root, _ = round_trip
    config = json.loads((root / "first" / "config" / "config.json").read_text())
    config["train"]["init_optimizer"], config["optimizer"]["start_step"] = False, 1000
    fresh = tmp_path / "fresh"
    (fresh / "config").mkdir(parents=True)
    (fresh / "config" / "config.json").write_text(json.dumps(config))
    for item in ("params", "opt_state"):  # copies: a symlink out of a checkpoint is refused
        shutil.copytree(root / "first" / item, fresh / item)
    exported = export_t5x(fresh, tmp_path / "t5x")
    assert exported.name == "checkpoint_1000"
    assert int(flax_tree(exported / "checkpoint")["optimizer/state/step"]) == 1000


def run_cli(*args, cwd=REPO):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "jaxmoe.cli", *args],
        capture_output=True, text=True, cwd=cwd, env=env, timeout=300,
    )  # fmt: skip


def test_command_line_and_a_non_t5_checkpoint(tmp_path, round_trip):
    root, _ = round_trip
    done = run_cli("export", "t5x", str(root / "first"), str(tmp_path / "cli"))
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["checkpoint"] == str(tmp_path / "cli" / "checkpoint_0")
    config = json.loads((root / "first" / "config" / "config.json").read_text())
    config["model"]["qkv_bias"] = True
    bad = tmp_path / "biased"
    bad.mkdir()
    shutil.copytree(root / "first" / "params", bad / "params")
    (bad / "config").mkdir()
    (bad / "config" / "config.json").write_text(json.dumps(config))
    done = run_cli("export", "t5x", str(bad), str(tmp_path / "x"))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("jaxmoe export: error:") and "qkv_bias=True" in lines[-1]
    assert not (tmp_path / "x").exists()


@pytest.mark.skipif(not SHIPPED.is_dir(), reason="shipped T5X checkpoint missing")
def test_shipped_checkpoint_converts(tmp_path):
    """tests/data/t5x_tiny (the README's example): T5X's layout, converts."""
    assert sum(p.stat().st_size for p in SHIPPED.rglob("*") if p.is_file()) < 1 << 20
    ours = flax_tree(SHIPPED / "checkpoint")
    assert {name.split("/")[1] for name in ours if "/" in name} == {"state", "target"}
    config = convert_t5x(SHIPPED, tmp_path / "converted")
    m = config.model
    assert (m.vocab_size, m.d_model, m.num_layers, m.num_encoder_layers) == (2048, 8, 2, 2)
