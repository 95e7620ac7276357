"""Streaming HF export/import: sharded safetensors out, sharded safetensors in, bounded memory.

References: transformers loads the sharded export (its logits must equal jaxmoe's) and
writes the sharded checkpoints that are imported (`save_pretrained(max_shard_size=...)`);
the memory test compares peak resident memory with the model's and its largest tensor's
sizes.
"""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from jaxmoe.checkpoints.leafwise import StoredParams
from jaxmoe.checkpoints.manager import (
    TrainCheckpoints,
    restore_params,
    save_params,
)
from jaxmoe.checkpoints.trees import flatten
from jaxmoe.config.stored import read_config
from jaxmoe.conversions.hf.exporter import export_hf, parse_size, plan_shards
from jaxmoe.conversions.hf.importer import convert_hf
from jaxmoe.models.spec import abstract_params
from jaxmoe.models.stack import layer_layouts, stack_layers, unrolled_config
from tests import test_hf
from tests.helpers import tiny_config
from tests.test_hf import (
    IDS,
    assert_close,
    hf_logits,
    jaxmoe_logits,
    load_converted,
    one_line_error,
)

mixtral = test_hf.mixtral  # fixture: (tiny transformers Mixtral, its one-file directory)
MIXTRAL = (
    "model.vocab_size=64",
    "model.norm_eps=1e-5",
    "model.num_layers=3",
    "model.moe.num_experts=4",
    "model.moe.gating=top2",
    "model.moe.renormalize=True",
    "model.moe.capacity_factor=0.0",
)


def random_params(config, seed: int) -> dict:
    """Unit-scale random weights, norm scales ~ 1 + N(0, 0.2) (per-layer paths)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda a: (a.ndim == 1) + rng.standard_normal(a.shape, np.float32) / a.shape[0] ** 0.5,
        abstract_params(unrolled_config(config.model)),
    )


@pytest.mark.parametrize("scan", [False, True])
def test_sharded_export_loads_in_transformers(scan, tmp_path):
    config = tiny_config(*MIXTRAL, f"model.scan_layers={scan}")
    params = random_params(config, seed=11)
    stored = stack_layers(params, config.model) if scan else params  # scanned: [L, E, ...]
    save_params(str(tmp_path / "ckpt"), stored, config)
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), max_shard_size="20KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(files) > 3 and set(index["weight_map"].values()) == set(files)
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    data = []  # tensor bytes per file: file size - 8-byte length - JSON header
    for f in files:
        raw = (tmp_path / "hf" / f).read_bytes()
        data.append(len(raw) - 8 - int.from_bytes(raw[:8], "little"))
    assert max(data) <= 20_000 and sum(data) == index["metadata"]["total_size"]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    want = jaxmoe_logits(load_converted(unrolled_config(config.model), params), IDS)
    assert_close(hf_logits(hf, IDS), want)
    # One expert of one layer, against the array it came from (HF w2 [D, F] = wo[e].T).
    name = "model.layers.2.block_sparse_moe.experts.3.w2.weight"
    with safe_open(tmp_path / "hf" / index["weight_map"][name], "np") as f:
        np.testing.assert_array_equal(f.get_tensor(name), params["layers"]["2"]["ffn"]["wo"][3].T)


def test_export_reads_a_training_runs_sharded_checkpoint(tmp_path):
    """A training checkpoint (TrainCheckpoints, scanned layout, arrays sharded over the 8
    devices: one storage chunk per shard) exports to the same files as the same parameters
    written whole by save_params."""
    config = tiny_config(*MIXTRAL, "model.scan_layers=True")
    params = random_params(config, seed=13)
    save_params(str(tmp_path / "whole"), stack_layers(params, config.model), config)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))

    def shard(a):  # the largest axis that 8 divides, as fsdp would
        axes = [i for i in np.argsort(a.shape)[::-1] if a.shape[i] % 8 == 0][:1]
        spec = [("x" if i in axes else None) for i in range(a.ndim)]
        return jax.device_put(a, NamedSharding(mesh, PartitionSpec(*spec)))

    stacked = jax.tree.map(shard, stack_layers(params, config.model))
    run = TrainCheckpoints(str(tmp_path / "run"), max_to_keep=1)
    state = {"params": stacked, "opt_state": {"count": jax.numpy.zeros(())}}
    run.save(5, state, {"step": 5, "data": {}}, config)
    run.wait()
    run.close()
    wo = ("layers", "period", "0", "ffn", "wo")
    assert StoredParams(str(tmp_path / "run")).chunk_shape(wo) == (3, 4, 32, 4)  # D / 8
    export_hf(str(tmp_path / "run"), str(tmp_path / "hf_run"), max_shard_size="20KB")
    export_hf(str(tmp_path / "whole"), str(tmp_path / "hf_whole"), max_shard_size="20KB")
    files = sorted(p.name for p in (tmp_path / "hf_whole").iterdir())
    assert len(files) > 4 and files == sorted(p.name for p in (tmp_path / "hf_run").iterdir())
    for name in files:
        assert (tmp_path / "hf_run" / name).read_bytes() == (
            tmp_path / "hf_whole" / name
        ).read_bytes(), name


def restored(path: Path) -> dict:
    """Per-layer parameters of a checkpoint, whichever layout it stores."""
    m = unrolled_config(read_config(str(path)).model)
    device = SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract_params(m)
    )
    return flatten(jax.device_get(restore_params(str(path), abstract, layer_layouts(m))))


def test_sharded_import_equals_single_file_import(mixtral, tmp_path):
    """The same model saved by transformers as one file and as shards of 10 kB."""
    model, single = mixtral
    sharded = tmp_path / "hf_sharded"
    model.save_pretrained(sharded, safe_serialization=True, max_shard_size="10KB")
    assert len(list(sharded.glob("*.safetensors"))) > 3
    convert_hf(single, tmp_path / "single")
    convert_hf(sharded, tmp_path / "sharded")
    convert_hf(sharded, tmp_path / "scanned", overrides=["--config.model.scan_layers=True"])
    want = restored(tmp_path / "single")
    for name in ("sharded", "scanned"):
        got = restored(tmp_path / name)
        assert got.keys() == want.keys()
        for path in want:
            np.testing.assert_array_equal(got[path], want[path], err_msg=".".join(path))
    # The scanned import stores experts stacked [L, E, D, F], one chunk per HF tensor.
    stored = StoredParams(str(tmp_path / "scanned"))
    wo = ("layers", "period", "0", "ffn", "wo")
    assert stored.chunk_shape(wo) == (1, 1, 40, 32)
    w2 = model.state_dict()["model.layers.1.mlp.experts.down_proj"][2].numpy()  # [D, F]
    np.testing.assert_array_equal(stored.read(wo, (1, 2)), w2.T)
    assert_close(jaxmoe_logits(load_converted(tmp_path / "scanned"), IDS), hf_logits(model, IDS))


def test_shard_sizes_and_plan():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("1.5MB") == 1_500_000 and parse_size(1000) == 1000
    for bad in ("", "5XB", "-1GB", "0", "GB"):
        assert "--max_shard_size" in one_line_error(parse_size, bad)
    # In order; a new file when the next tensor would overflow; an oversized tensor alone.
    sizes = {"a": 4, "b": 4, "c": 3, "d": 20, "e": 1}
    assert plan_shards(sizes, 10) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert plan_shards(sizes, 100) == [list(sizes)]


@pytest.mark.slow
def test_export_and_import_hold_about_one_tensor(tmp_path):
    """A 250 MB model streams: each step's peak resident memory exceeds that of the same
    step on a tiny model by a small multiple of the largest tensor (16 MB), far less than
    the model. Measured in subprocesses (benchmarks/hf_stream_memory.py)."""
    from benchmarks.hf_stream_memory import run_steps

    results = {}
    for preset in ("tiny", "200MB"):
        (tmp_path / preset).mkdir()
        results[preset] = run_steps(tmp_path / preset, preset)
    big, tiny = results["200MB"], results["tiny"]
    assert big["safetensors_files"] > 3 and big["round_trip_identical"]
    largest, model = big["largest_tensor_bytes"], big["model_bytes"]
    assert model > 12 * largest
    for step, peak in big["peak_bytes"].items():
        increase = peak - tiny["peak_bytes"][step]
        assert increase < min(10 * largest, 0.7 * model), (step, increase / largest)
