"""`export t5x` of MoE checkpoints: T5X (Switch layout) -> jaxmoe -> T5X, bit for bit.

The source is the Switch-layout checkpoint test_t5x_moe.py writes (no T5X MoE fixture
ships): Switch XXL (gated GELU, untied logits), with and without a router bias, and
Switch Base (ReLU `wi`, tied logits). The reference is the source's own arrays.
"""

import json

import pytest

from jaxmoe.checkpoints.manager import CheckpointError
from jaxmoe.conversions.t5x.convert import convert_t5x
from jaxmoe.conversions.t5x.exporter import export_t5x
from jaxmoe.conversions.t5x.reader import open_t5x
from tests.test_t5x_moe import switch_arrays, write_t5x_tensorstore
from tests.test_t5x_ocdbt import jaxmoe_arrays


@pytest.mark.parametrize(
    "router_bias, base",
    [(False, False), (True, False), (False, True)],
    ids=["xxl", "xxl_router_bias", "base_relu_tied"],
)
def test_switch_checkpoint_round_trips_bit_exactly(tmp_path, router_bias, base):
    arrays = switch_arrays(seed=4, router_bias=router_bias, base=base)
    src = write_t5x_tensorstore(tmp_path / "checkpoint_7000", arrays, step=7000)
    convert_t5x(src, tmp_path / "first")
    exported = export_t5x(tmp_path / "first", tmp_path / "t5x")
    assert exported.name == "checkpoint_7000"

    table = open_t5x(exported)
    assert sorted(table.names()) == sorted(arrays)
    for name, value in arrays.items():
        got = table.read(name)
        assert got.dtype == value.dtype and got.shape == value.shape, name
        assert got.tobytes() == value.tobytes(), name

    convert_t5x(exported, tmp_path / "second")
    first, second = jaxmoe_arrays(tmp_path / "first"), jaxmoe_arrays(tmp_path / "second")
    assert sorted(first) == sorted(second)
    assert all(first[k].tobytes() == second[k].tobytes() for k in first)


def test_moe_layouts_t5x_cannot_hold_are_refused(tmp_path):
    src = write_t5x_tensorstore(tmp_path / "checkpoint_1", switch_arrays(), step=1)
    convert_t5x(src, tmp_path / "switch")
    config_file = tmp_path / "switch" / "config" / "config.json"
    config = json.loads(config_file.read_text())
    config["model"]["moe"]["dense_layers"] = "1"
    config_file.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"model\.moe\.dense_layers .*MIXED"):
        export_t5x(tmp_path / "switch", tmp_path / "out")
    assert not (tmp_path / "out").exists()
