"""`jaxmoe compile`: the real train step compiled for TPU topologies on this CPU host.

Needs the `tpu` extra (libtpu), which makes compile-only TPU devices; no TPU is used.
References are independent of the code under test: slice shapes from the Cloud TPU tables,
per-device bytes from shapes and shardings worked out by hand below, FLOPs from XLA's own
count, HBM capacity from the compiler's error message.
"""

import json
import re

import numpy as np
import pytest

pytest.importorskip(
    "libtpu", reason="the `tpu` extra is not installed (pip install 'jaxmoe[tpu]'): no libtpu"
)

from jaxmoe.aot import compile_check as compile_module
from jaxmoe.aot.compile_check import compile_for_topology
from jaxmoe.aot.hlo_reading import all_to_all_bytes, count_collectives
from jaxmoe.aot.report import format_report
from jaxmoe.aot.topologies import parse_topology, topology_devices
from jaxmoe.cli import build_parser
from jaxmoe.errors import ConfigError
from jaxmoe.parallel.chips import GiB
from jaxmoe.parallel.mesh import make_mesh
from tests.helpers import compile_cache_off, tiny_config

# A dense decoder whose per-device shards all have a minor dim of 128, so the TPU lays them
# out without padding (only scalars get padded; see test_argument_bytes_match_hand_count).
TINY = (
    "model.moe.num_experts=0",
    "model.vocab_size=512",
    "model.d_model=256",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.head_dim=128",
    "model.ffn_dim=512",
    "train.batch_size=256",
    "train.seq_len=8",
    "mesh.data=1",
    "mesh.fsdp=2",
    "mesh.tensor=2",
    "mesh.expert=1",
)


@pytest.fixture(scope="module", autouse=True)
def _compile_cache_off():
    """Every compile here is for compile-only TPU devices, which the cache cannot load."""
    with compile_cache_off():
        yield


@pytest.fixture(scope="module")
def v5p_8():
    return compile_for_topology(tiny_config(*TINY), "v5p-8")


@pytest.mark.parametrize(
    "name, shape, chips, wrap",
    [  # Cloud TPU's slice tables: v5p/v4 name cores (2 per chip), v5e/v6e name chips.
        ("v5p-8", (2, 2, 1), 4, (False,) * 3),
        ("v5p-32", (2, 2, 4), 16, (False,) * 3),
        ("v5p-128", (4, 4, 4), 64, (True,) * 3),
        ("v5p-256", (4, 4, 8), 128, (True,) * 3),
        ("v5p-1024", (8, 8, 8), 512, (True,) * 3),
        ("v4-8", (2, 2, 1), 4, (False,) * 3),
        ("v5e-16", (4, 4), 16, (False,) * 3),
        ("v6e-8", (2, 4), 8, (False,) * 3),
        ("v6e-256", (16, 16), 256, (True, True, False)),
        ("v5p:2x4x8", (2, 4, 8), 64, (False,) * 3),
    ],
)
def test_topology_names(name, shape, chips, wrap):
    topo = parse_topology(name)
    assert (topo.shape, topo.num_chips, topo.wrap) == (shape, chips, wrap)


@pytest.mark.parametrize(
    "name, message",
    [("v7x-8", "unknown TPU generation"), ("v5p-7", "multiple of 2"), ("v6e-12", "standard")],
)
def test_bad_topology_names(name, message):
    with pytest.raises(ValueError, match=message):
        parse_topology(name)


def test_count_collectives_on_handwritten_hlo():
    hlo = """HloModule m

%all-reduce-scatter.2 (input: f32[8,128]) -> f32[4,128] {
  %input = f32[8,128]{1,0} parameter(0)
  %all-reduce.7 = f32[8,128]{1,0} all-reduce(%input), to_apply=%add
  ROOT %dynamic-slice.1 = f32[4,128]{1,0} dynamic-slice(%all-reduce.7, %c, %c)
}

ENTRY %main (p: f32[8,128]) -> f32[4,128] {
  %p = f32[8,128]{1,0} parameter(0)
  %all-gather-start = (f32[8,128], f32[16,128]) all-gather-start(%p), dimensions={0}
  %all-gather-done = f32[16,128]{1,0} all-gather-done(%all-gather-start)
  %all-reduce = (f32[8,128]{1,0}, f32[]) all-reduce(%p, %s), to_apply=%add
  %a2a = f32[8,128]{1,0} all-to-all(%p), dimensions={0}
  %r2a = f32[8,128]{1,0} ragged-all-to-all(%p, %p, %o, %s, %o, %s)
  %cp = f32[8,128]{1,0} collective-permute-start(%p), source_target_pairs={{0,1}}
  %cpd = f32[8,128]{1,0} collective-permute-done(%cp)
  %rs = f32[4,128]{1,0} reduce-scatter(%p), dimensions={0}, to_apply=%add
  ROOT %fusion = f32[4,128]{1,0} fusion(%p), kind=kCustom, calls=%all-reduce-scatter.2
}
"""
    assert count_collectives(hlo) == {
        "all-reduce": 1,
        "all-gather": 1,
        "reduce-scatter": 2,
        "all-to-all": 1,
        "ragged-all-to-all": 1,
        "collective-permute": 1,
    }
    assert all_to_all_bytes(hlo) == 8 * 128 * 4  # the ragged one's shape is only a bound


def test_tiny_step_fits_v5p_8(v5p_8):
    assert v5p_8["verdict"] == "fits"
    assert v5p_8["mesh"] == {"data": 1, "fsdp": 2, "context": 1, "tensor": 2, "expert": 1}
    assert v5p_8["num_chips"] == 4
    assert v5p_8["hbm_bytes"] == int(95.74 * GiB)
    assert 0 < v5p_8["peak_hbm_bytes"] < v5p_8["hbm_bytes"]
    assert v5p_8["headroom_bytes"] == v5p_8["hbm_bytes"] - v5p_8["peak_hbm_bytes"]
    # FSDP gathers weights in the forward pass and reduce-scatters their gradients.
    assert v5p_8["collectives"]["all-gather"] > 0
    assert v5p_8["collectives"]["reduce-scatter"] > 0


def test_argument_bytes_match_hand_count(v5p_8):
    # Shards per device on fsdp=2 (embed) x tensor=2 (vocab, heads, kv_heads, mlp):
    embedding = 256 * 128  # [V=512, D=256] -> [256, 128]
    lm_head = 128 * 256  # [D, V] -> [128, 256]
    norm = 256  # [D], replicated
    query = out = 128 * 2 * 128  # [D, H=4, 128] -> [128, 2, 128]; out [H, 128, D] likewise
    key = value = 128 * 1 * 128  # [D, K=2, 128] -> [128, 1, 128]
    mlp = 3 * 128 * 256  # wi_0, wi_1 [D, F=512] -> [128, 256]; wo [F, D] -> [256, 128]
    layer = 2 * norm + query + key + value + out + mlp
    param_bytes = 4 * (embedding + 2 * layer + norm + lm_head)
    # AdamW: mu and nu like the params plus two int32 step counts (adam, lr schedule).
    optimizer_bytes = 2 * param_bytes + 2 * 4
    # inputs / targets / weights [256/2, 8] 4-byte values, example_ids [128] int32.
    batch_bytes = 3 * 128 * 8 * 4 + 128 * 4
    assert v5p_8["param_bytes_per_device"] == param_bytes == 1_840_128
    assert v5p_8["optimizer_bytes_per_device"] == optimizer_bytes
    assert v5p_8["batch_bytes_per_device"] == batch_bytes
    # The compiler's count: the same, except that the TPU lays each scalar (the step, and
    # the two counts) out in a 128-lane tile of 4-byte words, 512 bytes instead of 4, and
    # that jit drops example_ids, which the train step does not read.
    state = 4 + param_bytes + optimizer_bytes + 3 * (512 - 4)
    assert v5p_8["argument_bytes"] == state + batch_bytes - 128 * 4


def test_a_lora_step_holds_the_adapters_state_and_the_frozen_base(v5p_8):
    """train.lora (rank 8 on attention): the state is the adapters and their two moments;
    the base, an argument of the step, is the whole model's parameters (float32 here)."""
    lora = compile_for_topology(
        tiny_config(*TINY, "train.lora.rank=8", "train.lora.targets=attention"), "v5p-8"
    )
    assert lora["verdict"] == "fits"
    assert lora["frozen_base_bytes_per_device"] == v5p_8["param_bytes_per_device"]
    adapters = lora["param_bytes_per_device"]
    assert 0 < adapters < v5p_8["param_bytes_per_device"] / 10
    assert lora["optimizer_bytes_per_device"] == 2 * adapters + 2 * 4
    # The step's inputs: base + adapters + their moments, against the weights and both of
    # their moments (this tiny model's peak is its activations', the same in both).
    assert lora["argument_bytes"] < 0.4 * v5p_8["argument_bytes"]


def test_model_flops_match_the_compilers_count(v5p_8):
    # No loops in this program, so XLA's count (all ops, per device) is complete; model
    # FLOPs leave out only the elementwise work (norms, softmax, the optimizer update).
    compiled = v5p_8["hlo_flops_per_device"] * v5p_8["num_chips"]
    assert v5p_8["model_flops_per_step"] == pytest.approx(compiled, rel=0.05)
    assert v5p_8["model_flops_per_step"] < compiled


def test_two_v6e_slices_join_over_data():
    # A T5-style encoder-decoder: batches as span corruption makes them.
    config = tiny_config(
        "model.arch=encoder_decoder",
        "model.moe.num_experts=0",
        "model.d_model=128",
        "model.head_dim=64",  # so matmuls, not softmax and norms, dominate the FLOPs
        "model.ffn_dim=256",
        "train.batch_size=64",  # and the optimizer's per-parameter work is a small share
        "train.seq_len=64",
        "mesh.data=2",
        "mesh.fsdp=-1",
    )
    topo = parse_topology("v6e-4", num_slices=2)
    devices = topology_devices(topo)
    mesh = make_mesh(config.mesh, devices)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "context": 1, "tensor": 1, "expert": 1}
    slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
    assert (slices[0] == 0).all() and (slices[1] == 1).all()

    result = compile_for_topology(config, "v6e-4", num_slices=2, step_time_s=1.0)
    assert result["verdict"] == "fits"
    assert (result["num_chips"], result["num_slices"]) == (8, 2)
    assert result["hbm_bytes"] == int(31.25 * GiB)
    assert result["collectives"]["all-reduce"] > 0  # gradients summed across the slices
    # 64 encoder tokens hold 70 raw ones, of which round(0.15 * 70) = 10 are masked in
    # round(10 / 3) = 3 spans: encoder 60 + 3 sentinels + EOS, decoder 10 + 3 sentinels + EOS.
    assert result["tokens_per_step"] == 64 * (64 + 14)
    compiled = result["hlo_flops_per_device"] * result["num_chips"]
    assert result["model_flops_per_step"] == pytest.approx(compiled, rel=0.1)
    assert result["mfu"] == pytest.approx(result["model_flops_per_step"] / (8 * 918e12))


def test_slices_must_divide_data_or_fsdp():
    config = tiny_config("mesh.data=1", "mesh.tensor=-1")
    devices = topology_devices(parse_topology("v6e-4", num_slices=2))
    with pytest.raises(ConfigError, match="slices"):
        make_mesh(config.mesh, devices)


def _cli(*argv: str):
    """Parsed `jaxmoe compile ARGV` (its `run` reports its errors itself)."""
    args = build_parser().parse_args(
        ["compile", *(a for a in argv if not a.startswith("--config."))]
    )
    args.overrides = [a for a in argv if a.startswith("--config.")]
    return args


# Attention probabilities alone, [B/4, H, L, L] f32 per chip, are 64 GiB here.
OVERSIZED = (
    "--config=configs/default.py:dense",
    "--topology=v5e-4",
    "--config.model.vocab_size=512",
    "--config.train.batch_size=4096",
    "--config.train.seq_len=2048",
)


def test_oom_gives_a_verdict_and_exit_code_2(capsys):
    args = _cli(*OVERSIZED)
    assert args.run(args) == 2
    out, err = capsys.readouterr()
    assert "verdict: OUT OF MEMORY on v5e-4" in out
    assert "15.75 GiB usable" in out
    assert "Traceback" not in out + err

    args = _cli(*OVERSIZED, "--json")
    assert args.run(args) == 2
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "oom"
    assert report["available_bytes"] == pytest.approx(15.75 * GiB, rel=1e-3)
    assert report["required_bytes"] > report["available_bytes"]


def test_config_mistake_is_one_line_and_exit_code_2(capsys):
    args = _cli("--config=configs/default.py", "--topology=v5p-8", "--config.mesh.tensor=3")
    assert args.run(args) == 2
    _, err = capsys.readouterr()
    assert err.startswith("jaxmoe compile: error: mesh") and err.count("\n") == 1


@pytest.mark.parametrize("remat", ["none", "full", "dots_saveable", "offload_dots"])
def test_scanned_step_compiles_with_every_remat_policy(v5p_8, remat):
    """The scanned stack holds the same bytes per device (the `layers` axis is never split)
    and compiles for TPU under each remat policy, offloading to host memory included."""
    scanned = compile_for_topology(
        tiny_config(*TINY, "model.scan_layers=true", f"model.remat={remat}"), "v5p-8"
    )
    assert scanned["verdict"] == "fits"
    assert scanned["argument_bytes"] == v5p_8["argument_bytes"]
    assert scanned["model_flops_per_step"] == v5p_8["model_flops_per_step"]


def test_expert_parallel_adaptive_step_exchanges_with_ragged_all_to_all():
    """For TPU the dropless expert-parallel exchange is sized to the routing: ragged
    all-to-alls carry the tokens; plain all-to-alls carry only the per-(device, expert)
    counts and offsets, at most ep x E_local int32 = 4 x 2 x 4 bytes each."""
    config = tiny_config(
        "model.moe.gating=adaptive", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1",
        "mesh.expert=4",
    )  # fmt: skip
    result = compile_for_topology(config, "v5p-8")
    assert result["verdict"] == "fits" and result["mesh"]["expert"] == 4
    assert result["moe_dispatch"] == "ragged"  # ragged_dot for the grouped matmuls
    assert result["collectives"]["ragged-all-to-all"] > 0
    # Besides those, the embedding lookup and its gradient reshard one f32 activation each
    # (the table's embed dim is split over expert too): [B/ep = 2, L = 16, D = 32] x 4 bytes.
    lookup = 2 * 2 * 16 * 32 * 4
    counts = result["collectives"]["all-to-all"] - 2
    assert 0 < result["all_to_all_bytes"] <= 32 * counts + lookup


def _ici_groups(hlo_text: str) -> list[list[int]]:
    groups = []
    for text in re.findall(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", hlo_text):
        groups += [[int(i) for i in g.split(",") if i] for g in re.findall(r"\{([\d,]*)\}", text)]
    return groups


@pytest.mark.parametrize(
    ("dcn", "crossing"),
    [
        # Slices joined over data: only the gradient all-reduce crosses the DCN.
        (("mesh.dcn_data=2", "mesh.dcn_fsdp=1"), {"ALL_REDUCE"}),
        # Joined over fsdp instead: parameter gathers cross it too (what data avoids).
        (("mesh.dcn_data=1", "mesh.dcn_fsdp=2"), {"ALL_GATHER"}),
    ],
)
def test_two_v5p_slices_cross_only_on_the_dcn_axis(monkeypatch, dcn, crossing):
    config = tiny_config("mesh.data=2", "mesh.fsdp=-1", "train.batch_size=16", *dcn)
    texts = []
    real = compile_module.count_collectives
    monkeypatch.setattr(
        compile_module, "count_collectives", lambda text: texts.append(text) or real(text)
    )
    result = compile_for_topology(config, "v5p-8", num_slices=2)
    assert result["verdict"] == "fits" and result["num_chips"] == 8
    assert result["mesh"] == {"data": 2, "fsdp": 4, "context": 1, "tensor": 1, "expert": 1}
    # The program is one slice's: its own collectives name only that slice's 4 chips...
    groups = _ici_groups(texts[0])
    assert groups and all(max(g) < 4 for g in groups)
    assert sum(result["collectives"].values()) > 0
    # ...and every cross-slice exchange is a runtime transfer of the expected kind.
    assert result["dcn_transfers"] and crossing <= set(result["dcn_transfers"])
    if crossing == {"ALL_REDUCE"}:
        assert set(result["dcn_transfers"]) == {"ALL_REDUCE"}


def test_dcn_sizes_must_match_the_slices():
    config = tiny_config("mesh.data=2", "mesh.fsdp=-1", "mesh.dcn_data=4")
    devices = topology_devices(parse_topology("v5p-8", num_slices=2))
    with pytest.raises(ConfigError, match="dcn_data=4 x dcn_fsdp=1 cannot span 2 slices"):
        make_mesh(config.mesh, devices)


def test_loop_free_step_reports_the_compilers_estimate(v5p_8):
    """The tiny step has no loop and no Pallas kernel: the compiler's optimal_seconds is
    the estimated step time (tests/test_cost_estimate.py checks what that rests on)."""
    assert v5p_8["while_loops"] == 0 and v5p_8["pallas_kernels"] == {}
    seconds = v5p_8["estimated_step_s"]
    assert seconds == v5p_8["optimal_seconds"] > 0 and v5p_8["estimate_note"] == ""
    assert seconds >= v5p_8["hlo_flops_per_device"] / 459e12  # no faster than v5p's peak
    mfu = v5p_8["model_flops_per_step"] / (seconds * 4 * 459e12)  # 4 chips
    assert v5p_8["estimated_mfu"] == pytest.approx(mfu)
    assert "compiler's step estimate" in format_report(v5p_8)
