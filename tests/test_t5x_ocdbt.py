"""T5X checkpoints of T5X's Orbax manager (OCDBT) convert like the msgpack ones.

The OCDBT checkpoint is written here with Orbax's own CheckpointManager configured as T5X
configures it (step prefix `checkpoint`, item `state` saved by an OCDBT PyTree handler),
holding T5X's train-state dict built from the real fixture's arrays with flax's reader.
Reference: the conversion of the fixture's msgpack file, compared bit for bit.
"""

import os
from pathlib import Path

import flax.serialization
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import traverse_util

from jaxmoe.checkpoints.manager import CheckpointError
from jaxmoe.conversions.t5x.convert import convert_t5x
from jaxmoe.conversions.t5x.reader import open_t5x
from tests.test_t5x_reader import KERNEL, TINY, TINY_T5, kernel_by_hand


def jaxmoe_arrays(checkpoint: Path) -> dict:
    """{'a.b.c': numpy array} of a jaxmoe checkpoint's params, read by Orbax directly."""
    tree = ocp.PyTreeCheckpointer().restore(checkpoint / "params")
    flat = traverse_util.flatten_dict(tree, sep=".")
    return {name: np.asarray(value) for name, value in flat.items()}


def save_like_t5x(model_dir: Path, step: int, state_dict: dict) -> Path:
    """T5X's OrbaxCheckpointManagerInterface.save, reduced to its Orbax calls."""
    options = ocp.CheckpointManagerOptions(step_prefix="checkpoint", create=True)
    handlers = {"state": ocp.PyTreeCheckpointHandler(use_ocdbt=True)}
    with ocp.CheckpointManager(model_dir, item_handlers=handlers, options=options) as manager:
        manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state_dict)))
        manager.wait_until_finished()
    return model_dir / f"checkpoint_{step}"


@pytest.fixture(scope="module")
def fixture_tree():
    """The fixture's train-state dict (`target`, `state/{step, param_states}`)."""
    return flax.serialization.msgpack_restore(TINY.read_bytes())["optimizer"]


@pytest.fixture(scope="module")
def ocdbt_tiny(tmp_path_factory, fixture_tree):
    state = {"target": fixture_tree["target"], "state": dict(fixture_tree["state"])}
    state["state"]["step"] = np.int32(1000)  # something other than 0, to see it read
    return save_like_t5x(tmp_path_factory.mktemp("t5x_ocdbt"), 1000, state)


def test_layout_is_t5x_orbax_managers(ocdbt_tiny):
    state = ocdbt_tiny / "state"
    assert (ocdbt_tiny / "_CHECKPOINT_METADATA").is_file()
    assert (state / "_METADATA").is_file() and (state / "manifest.ocdbt").is_file()
    assert not (ocdbt_tiny / "checkpoint").exists()  # no msgpack index: arrays only in OCDBT


def test_reader_equals_msgpack_reader(ocdbt_tiny):
    ocdbt, legacy = open_t5x(ocdbt_tiny), open_t5x(TINY)
    assert ocdbt.layout == "ocdbt" and ocdbt.step == 1000 and legacy.step == 0
    assert ocdbt.names() == legacy.names() and len(ocdbt) == 52
    assert ocdbt.optimizer_state_names() == legacy.optimizer_state_names()
    for table_a, table_b in ((ocdbt, legacy), (ocdbt.optimizer_state, legacy.optimizer_state)):
        for name in table_b.names():
            if name == "step":
                continue
            got, want = table_a.read(name), table_b.read(name)
            assert (table_a.shape(name), table_a.dtype(name)) == (want.shape, want.dtype)
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name
    # The item directory itself opens too.
    assert open_t5x(ocdbt_tiny / "state").names() == legacy.names()


def test_conversion_equals_msgpack_conversion_bit_exactly(tmp_path, ocdbt_tiny):
    config_a = convert_t5x(ocdbt_tiny, tmp_path / "from_ocdbt", keep_optimizer=True)
    config_b = convert_t5x(TINY, tmp_path / "from_msgpack", keep_optimizer=True)
    assert config_a.extra["source"]["step"] == 1000 and config_b.extra["source"]["step"] == 0
    assert config_a.model.to_dict() == config_b.model.to_dict()
    a, b = jaxmoe_arrays(tmp_path / "from_ocdbt"), jaxmoe_arrays(tmp_path / "from_msgpack")
    assert sorted(a) == sorted(b) and len(a) == 52
    for path in a:
        assert a[path].dtype == b[path].dtype and a[path].tobytes() == b[path].tobytes(), path


def test_toy_state_through_orbax_equals_gunzip(tmp_path):
    """tiny_t5's TensorStore-backed toy state, re-saved through the T5X Orbax layout."""
    legacy = open_t5x(TINY_T5)
    states = {
        name.split("/")[1]: legacy.optimizer_state.read(name)
        for name in legacy.optimizer_state_names()
        if name.startswith("param_states/")
    }
    tree = {"target": {}, "state": {"step": np.int32(1), "param_states": states}}
    checkpoint = save_like_t5x(tmp_path, 1, tree)
    got = open_t5x(checkpoint).optimizer_state.read(KERNEL)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, kernel_by_hand(TINY_T5))


def test_symlink_out_of_the_checkpoint_is_refused(tmp_path, ocdbt_tiny):
    import shutil

    copy = tmp_path / "checkpoint_1000"
    shutil.copytree(ocdbt_tiny, copy)
    outside = tmp_path / "outside"
    outside.mkdir()
    data = next((copy / "state" / "d").iterdir())
    shutil.move(data, outside / data.name)
    os.symlink(outside / data.name, data)
    with pytest.raises(ValueError, match="outside"):
        open_t5x(copy)


def test_a_tree_without_t5x_items_is_refused(tmp_path):
    checkpoint = save_like_t5x(tmp_path, 3, {"params": {"w": np.ones((2, 2), np.float32)}})
    with pytest.raises((ValueError, CheckpointError), match=r"no target/\.\.\. or state/\.\.\."):
        open_t5x(checkpoint)


def test_a_key_that_is_not_a_name_is_refused(tmp_path):
    """A crafted `_METADATA` whose key would name a directory outside the item."""
    import json

    checkpoint = save_like_t5x(tmp_path, 2, {"target": {"w": np.ones((2, 2), np.float32)}})
    metadata_file = checkpoint / "state" / "_METADATA"
    metadata = json.loads(metadata_file.read_text())
    (entry,) = metadata["tree_metadata"].values()
    entry["key_metadata"][1]["key"] = ".."
    metadata["tree_metadata"] = {"('target', '..')": entry}
    metadata_file.write_text(json.dumps(metadata))
    with pytest.raises(ValueError, match=r"'\.\.' in target/\.\. is not a name"):
        open_t5x(checkpoint)


def test_older_orbax_manager_layout_with_msgpack_index_in_state(tmp_path):
    """`checkpoint_S/state/checkpoint` (Orbax before `_METADATA`), as T5X's own restore
    looks for it: the tiny_orbax toy moved into a `state` item."""
    from tests.test_t5x_reader import TINY_ORBAX, copy_tree

    checkpoint = tmp_path / "checkpoint_1"
    checkpoint.mkdir()
    copy_tree(TINY_ORBAX, checkpoint / "state")
    opened = open_t5x(checkpoint)
    assert opened.layout == "orbax" and "param_states/kernel" in opened.optimizer_state_names()
