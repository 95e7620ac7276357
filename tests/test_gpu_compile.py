"""`jaxmoe compile` for NVIDIA GPU clusters on a host without a GPU (docs/gpu.md).

Everywhere: GPU cluster names, the GPU description handed to the compiler against XLA's own
record of an H100 SXM, the replica groups and kernels read from HLO text written by hand,
the mesh over NVLink domains, and the CPU fallback when a GPU plugin finds no GPU.
Where JAX's CUDA plugin is installed (the `gpu` extra, CI's Python 3.12 lane): the CUDA
library versions against the installed wheels, the compile-only devices' layout, and a tiny
MoE train step compiled for one deviceless 8-GPU H100 node, with cuDNN flash attention
and the grouped matmuls in its program.
"""

import importlib.metadata
import math
import re

import pytest

from jaxmoe.aot import gpu_topologies
from jaxmoe.aot.gpu_topologies import (
    cuda_plugin_installed,
    nvlink_domains,
    parse_gpu_topology,
    target_config,
)
from jaxmoe.aot.hlo_reading import collectives_across, gpu_kernels, replica_groups
from jaxmoe.aot.topologies import parse_target
from jaxmoe.errors import ConfigError
from jaxmoe.parallel import platforms
from jaxmoe.parallel.chips import GPUS, GiB, gpu_of_kind
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.parallel.options import MeshOptions

needs_plugin = pytest.mark.skipif(
    not cuda_plugin_installed(),
    reason="JAX's CUDA plugin is not installed (pip install 'jaxmoe[gpu]')",
)


@pytest.mark.parametrize(
    "name, domains, hosts, per_host",
    [
        ("h100-32", 4, 1, 8),  # 4 HGX nodes, each its own NVLink domain
        ("h100:4x8", 4, 1, 8),
        ("h100-4", 1, 1, 4),  # half a node
        ("h200:2x8", 2, 1, 8),
        ("b200-16", 2, 1, 8),
        ("a100-80g-8", 1, 1, 8),
        ("gb200-72", 1, 18, 4),  # one NVL72 rack: 18 hosts of 4 in one NVLink domain
        ("gb200-144", 2, 18, 4),
        ("gb200:2x18x4", 2, 18, 4),
        ("gb200-8", 1, 2, 4),
    ],
)
def test_gpu_topology_names(name, domains, hosts, per_host):
    topo = parse_target(name)
    assert (topo.domains, topo.hosts_per_domain, topo.gpus_per_host) == (domains, hosts, per_host)
    assert topo.num_chips == domains * hosts * per_host
    assert topo.device_topology == f"{domains}x{hosts}x{per_host}"
    assert topo.platform == "gpu"


@pytest.mark.parametrize(
    "name, message",
    [
        ("h100-12", "multiple of 8"),
        ("h100:2x16", "at most 8 GPUs"),
        ("gb200-80", "whole NVLink domains of 18 hosts"),
        ("gb200:1x20x4", "at most 72 GPUs"),
        ("h100:4", "nodes x GPUs per node"),
        ("h100-0", "expected e.g."),
    ],
)
def test_bad_gpu_topology_names(name, message):
    with pytest.raises(ValueError, match=message):
        parse_target(name)


def test_slices_repeat_nvlink_domains_and_memory_share(monkeypatch):
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    topo = parse_gpu_topology("h100-8", num_slices=3)
    assert (topo.num_chips, topo.num_slices, topo.name) == (24, 3, "h100-24")
    # JAX's allocator takes 75% of a GPU's memory unless told otherwise.
    assert topo.hbm_bytes == int(84_942_979_072 * 0.75)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert parse_gpu_topology("h100-8").hbm_bytes == int(84_942_979_072 * 0.9)
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "lots")
    with pytest.raises(ValueError, match="XLA_CLIENT_MEM_FRACTION='lots' is not a number"):
        parse_gpu_topology("h100-8")


def test_h100_description_matches_xla_record():
    """The H100 handed to the compiler has the numbers XLA records for an H100 SXM
    (openxla/xla xla/backends/gpu/target_config/specs/h100_sxm.txtpb, copied here)."""
    text = target_config(GPUS["h100"], {"cuda_runtime": (13, 0), "cudnn": (9, 20, 0)})
    fields = dict(re.findall(r"(\w+): (\S+)", text))
    xla_h100_sxm = {
        "core_count": "132",
        "fpus_per_core": "128",
        "memory_bandwidth": "3352320000000",
        "l2_cache_size": "52428800",
        "clock_rate_ghz": "1.98",
        "device_memory_size": "84942979072",
        "shared_memory_per_core": "233472",
        "shared_memory_per_block_optin": "232448",
        "shared_memory_per_block": "49152",
        "threads_per_core_limit": "2048",
        "registers_per_core_limit": "65536",
    }
    assert {key: fields[key] for key in xla_h100_sxm} == xla_h100_sxm
    assert "cuda_compute_capability { major: 9 minor: 0 feature_extension: ACCELERATED" in text
    assert 'dnn_version: "9.20.0"' in text  # what XLA's compiler reads
    assert "dnn_version_info { major: 9 minor: 20 patch: 0 }" in text
    assert "runtime_version { major: 13 minor: 0 }" in text
    assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in text
    assert gpu_of_kind("NVIDIA H100 80GB HBM3") is GPUS["h100"]
    assert gpu_of_kind("NVIDIA L4") is None


def test_replica_groups_of_each_form():
    mesh_form = "replica_groups=mesh['data'=1,'fsdp'=2,'tensor'=1,'expert'=4] {'expert'}, x"
    assert replica_groups(mesh_form) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    across = "replica_groups=mesh['data'=1,'fsdp'=2,'tensor'=1,'expert'=4] {'fsdp'}, x"
    assert replica_groups(across) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    both = "replica_groups=mesh['fsdp'=2,'expert'=2] {'fsdp','expert'}, x"
    assert replica_groups(both) == [[0, 1, 2, 3]]
    # iota: arange(8) as [2, 4], transposed, as 4 groups of 2
    assert replica_groups("replica_groups=[4,2]<=[2,4]T(1,0), x") == [
        [0, 4],
        [1, 5],
        [2, 6],
        [3, 7],
    ]
    assert replica_groups("replica_groups=[2,4]<=[8], x") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert replica_groups("replica_groups={{0,2},{1,3}}, x") == [[0, 2], [1, 3]]
    assert replica_groups("replica_groups={}, x") == []
    assert replica_groups("source_target_pairs={{0,1},{7,0}}, x") == [[0, 1], [7, 0]]
    assert replica_groups("replica_groups=mesh['a'=4] {'a':(1)2}, x") is None


HLO = """HloModule m
ENTRY %main (p: bf16[8,128]) -> bf16[8,128] {
  %ag = bf16[16,128] all-gather-start(%p), replica_groups=mesh['fsdp'=2,'expert'=4] {'fsdp'}
  %ar = bf16[8,128]{1,0} all-reduce(%p), replica_groups=[2,4]<=[8], to_apply=%add
  %a2a = bf16[8,128]{1,0} all-to-all(%p), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %cp = bf16[8,128]{1,0} collective-permute(%p), source_target_pairs={{3,4},{4,3}}
  %rs = bf16[4,128]{1,0} reduce-scatter(%p), replica_groups={}, dimensions={0}
  %fa = (bf16[8,128], u8[0]) custom-call(%p, %p, %p), custom_call_target="__cudnn$fmhaSoftmax"
  %fb = (bf16[8,128], u8[0]) custom-call(%p, %p), custom_call_target="__cudnn$fmhaSoftmaxBackward"
  %d = bf16[4,8,128]{2,1,0} dot(%p, %w), metadata={op_name="jit(f)/ragged_dot_general"}
  ROOT %d2 = bf16[8,128]{1,0} dot(%p, %w), metadata={op_name="jit(f)/dot_general"}
}
"""
# A loop iteration the collective pipeliner peeled out of a scanned backward pass.
PEELED = """
%region_64.sunk.clone (loop_peel_param: (s32[], bf16[8,128])) -> bf16[8,128] {
  %fb = (bf16[8,128], u8[0]) custom-call(%p, %p), custom_call_target="__cudnn$fmhaSoftmaxBackward"
}
"""


def test_collectives_across_hosts_of_four():
    """Positions 0-3 on host 0, 4-7 on host 1: the fsdp all-gather (pairs 0/4, ...), the
    permute 3<->4 and the all-device reduce-scatter leave a host; the rest stay on one."""
    counts = collectives_across(HLO, [0, 0, 0, 0, 1, 1, 1, 1])
    assert {k: v for k, v in counts.items() if v} == {
        "all-gather": 1,
        "collective-permute": 1,
        "reduce-scatter": 1,
    }
    assert not any(collectives_across(HLO, [0] * 8).values())


def test_gpu_kernels_read_from_hlo():
    kernels = gpu_kernels(HLO)
    assert kernels["cudnn_attention_forward"] == 1
    assert kernels["cudnn_attention_backward"] == 1
    assert kernels["cudnn_attention_peeled"] == 0
    peeled = gpu_kernels(PEELED + HLO)
    assert (peeled["cudnn_attention_backward"], peeled["cudnn_attention_peeled"]) == (1, 1)
    assert (kernels["grouped_gemms"], kernels["ragged_dot_dense_dots"]) == (0, 1)
    assert kernels["ragged_dot_lowering"].startswith("dense dots")
    fused = "%rd = bf16[8,128]{1,0} ragged-dot(%p, %w, %g), lhs_ragged_dims={0}\n"
    assert gpu_kernels(fused)["ragged_dot_lowering"] == "cuDNN grouped GEMM"


def test_mesh_keeps_expert_axis_inside_nvlink_domains():
    """8 devices in 2 domains of 4 (reversed in the device list): fsdp=2 spans the domains,
    expert=4 stays inside each; an expert axis over both domains is refused."""
    import jax

    devices = jax.devices()[:8]
    domains = [1, 1, 1, 1, 0, 0, 0, 0]
    mesh = make_mesh(MeshOptions(data=1, fsdp=2, expert=4), devices, domains)
    grid = mesh.devices.reshape(2, 4)
    assert [d.id for d in grid[0]] == [d.id for d in devices[4:]]  # domain 0 first
    assert [d.id for d in grid[1]] == [d.id for d in devices[:4]]
    with pytest.raises(ConfigError, match="does not divide"):
        make_mesh(MeshOptions(data=1, expert=8), devices, domains)


def test_cpu_backend_when_the_gpu_plugin_finds_no_gpu(monkeypatch):
    """With a GPU plugin but no GPU, jaxmoe asks JAX for the CPU backend (the plugin would
    print a traceback on start); with a GPU attached, it leaves the choice to JAX."""
    import jax

    chosen = []
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("JAX_FORCE_TPU_INIT", raising=False)
    monkeypatch.setattr(jax.config, "update", lambda key, value: chosen.append((key, value)))
    monkeypatch.setattr(platforms, "gpu_plugin_installed", lambda: True)
    monkeypatch.setattr(platforms, "tpu_attached", lambda: False)
    monkeypatch.setattr(platforms, "gpu_attached", lambda: False)
    assert platforms.skip_absent_tpu()
    assert chosen == [("jax_platforms", "cpu")]
    monkeypatch.setattr(platforms, "gpu_attached", lambda: True)
    assert not platforms.skip_absent_tpu()


# ------------------------------------------------- with JAX's CUDA plugin (the `gpu` extra)


@needs_plugin
def test_cuda_versions_are_the_installed_wheels():
    """The CUDA runtime and cuDNN the plugin loads are those of the installed wheels."""
    from jaxmoe.compat.private_apis import cuda_library_versions

    versions = cuda_library_versions()
    major = versions["cuda_runtime"][0]
    suffix = {13: "cu13", 12: "cu12"}[major]
    cudnn = importlib.metadata.version(f"nvidia-cudnn-{suffix}").split(".")
    assert versions["cudnn"] == tuple(int(part) for part in cudnn[:3])
    runtime_wheel = "nvidia-cuda-runtime" if major == 13 else "nvidia-cuda-runtime-cu12"
    runtime = importlib.metadata.version(runtime_wheel).split(".")
    assert versions["cuda_runtime"] == (int(runtime[0]), int(runtime[1]))


@needs_plugin
def test_compile_only_devices_by_domain_and_host():
    """GB200, 2 NVL72-style domains of 2 hosts of 4: the plugin lists devices domain by
    domain (their coords: domain, host, GPU), each host its own process."""
    topo = parse_gpu_topology("gb200:2x2x4")
    devices = gpu_topologies.gpu_topology_devices(topo)
    assert len(devices) == 16
    assert {d.device_kind for d in devices} == {"NVIDIA GB200"}
    assert [d.coords[0] for d in devices] == nvlink_domains(topo)
    assert [d.process_index for d in devices] == [i // 4 for i in range(16)]


TINY_MOE = (
    "model.dtype=bfloat16",  # cuDNN attention takes bf16/f16
    "model.head_dim=64",
    "model.d_model=64",
    "model.moe.num_experts=8",
    "model.moe.gating=top2",
    "model.moe.capacity_factor=0.0",  # dropless: ragged_dot grouped matmuls
    "train.seq_len=64",
    "mesh.data=1",
    "mesh.expert=8",
)


@pytest.fixture(scope="module")
def h100_node():
    from jaxmoe.aot.compile_check import compile_for_topology
    from tests.helpers import compile_cache_off, tiny_config

    with compile_cache_off():
        return compile_for_topology(tiny_config(*TINY_MOE), "h100-8")


@needs_plugin
def test_tiny_moe_compiles_for_an_h100_node(h100_node):
    """One deviceless 8-GPU H100 node: it fits, each layer's attention is cuDNN's fused
    flash attention forward and backward, the expert products are grouped matmuls
    (ragged_dot, lowered as XLA chooses), experts exchange tokens with ragged all-to-alls,
    and nothing leaves the node."""
    from jaxmoe.aot.report import format_report

    report = h100_node
    assert report["verdict"] == "fits"
    assert (report["platform"], report["cuda_topology"]) == ("gpu", "1x1x8")
    assert report["gpu"]["device_kind"] == "NVIDIA H100 80GB HBM3"
    kernels = report["gpu_kernels"]
    assert kernels["cudnn_attention_forward"] == kernels["cudnn_attention_backward"] == 2
    assert kernels["grouped_gemms"] + kernels["ragged_dot_dense_dots"] > 0
    assert kernels["ragged_dot_lowering"] is not None
    assert report["collectives"]["ragged-all-to-all"] > 0
    assert not any(report["collectives_across_hosts"].values())
    assert report["hbm_bytes"] == int(GPUS["h100"].memory_bytes * report["gpu"]["memory_fraction"])
    assert 0 < report["peak_hbm_bytes"] < 1 * GiB
    # The compiler's arguments: the state and the batch as jaxmoe counts them, plus the
    # step counter and the optimizer's scalars.
    counted = sum(
        report[key]
        for key in (
            "param_bytes_per_device",
            "optimizer_bytes_per_device",
            "batch_bytes_per_device",
        )
    )
    assert math.isclose(report["argument_bytes"], counted, rel_tol=0.01)
    table = format_report(report, "tiny")
    assert "cuDNN flash attention     2 forward, 2 backward" in table
    assert table.splitlines()[-1].startswith("verdict: fits on h100-8")


def test_mla_through_dot_product_attention_equals_its_xla_path():
    """MLA pads its values to the keys' width for the kernel: through
    jax.nn.dot_product_attention (XLA's lowering of it on the CPU; cuDNN's on GPU) a tiny
    DeepSeek decoder gives the logits and gradients of jaxmoe's own XLA attention."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxmoe.config.loading import load_config
    from jaxmoe.models.transformer import DecoderLM

    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 512)
    outputs = {}
    for kernel in ("xla", "dot_product_attention"):
        cfg = load_config(
            "configs/deepseek2_16b.py:tiny", [f"model.attention_kernel={kernel}"]
        ).model
        graph, params = nnx.split(DecoderLM(cfg, rngs=nnx.Rngs(0)))

        def loss(p, graph=graph):
            logits, _ = nnx.merge(graph, p)(tokens)
            return jnp.mean(jnp.square(logits)), logits

        (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        outputs[kernel] = (logits, jax.tree.leaves(grads))
    (want, want_grads), (got, got_grads) = outputs["xla"], outputs["dot_product_attention"]
    assert jnp.allclose(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert jnp.allclose(g, w, rtol=1e-4, atol=1e-6)


def test_t5_cross_attention_through_dot_product_attention_equals_its_xla_path():
    """T5's cross-attention (padding mask, unscaled logits, no bias) takes the kernel; its
    self-attentions add the relative-position bias and keep the XLA path, saying so. A tiny
    encoder-decoder with encoder padding gives jaxmoe's XLA logits and gradients."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxmoe.models.attention_kernel import fallback_counts
    from jaxmoe.models.t5 import EncoderDecoderLM
    from tests.helpers import tiny_config

    t5 = ("model.arch=encoder_decoder", "model.activation=gelu", "model.rope_theta=0.0")
    t5 += ("model.moe.num_experts=0",)
    encoder_BS = jax.random.randint(jax.random.key(0), (2, 16), 2, 128)
    encoder_BS = encoder_BS.at[1, 11:].set(0)  # padding: the cross-attention's mask
    decoder_BL = jax.random.randint(jax.random.key(1), (2, 8), 2, 128)
    outputs = {}
    for kernel in ("xla", "dot_product_attention"):
        cfg = tiny_config(*t5, f"model.attention_kernel={kernel}").model
        graph, params = nnx.split(EncoderDecoderLM(cfg, rngs=nnx.Rngs(0)))

        def loss(p, graph=graph):
            logits, _ = nnx.merge(graph, p)(encoder_BS, decoder_BL)
            return jnp.mean(jnp.square(logits)), logits

        before = fallback_counts()
        (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        grew = [r for r, n in fallback_counts().items() if n > before.get(r, 0)]
        outputs[kernel] = (logits, jax.tree.leaves(grads), grew)
    (want, want_grads, none), (got, got_grads, logged) = outputs.values()
    assert none == [] and logged == ["dot_product_attention takes no additive bias (T5's "
                                     "relative positions)"], logged  # fmt: skip
    assert jnp.allclose(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert jnp.allclose(g, w, rtol=1e-4, atol=1e-6)


# Every model family compiled for deviceless H100s: (topology, config spec, overrides) and
# what its program must hold. Slow: 10 compiles of a minute each on a busy 2-core host.
BF16 = ("model.dtype=bfloat16", "mesh.data=1")
FAMILIES = {
    # GQA + dropless MoE, scanned layers, 2 micro-batches, 2 nodes of 4 (fsdp across them)
    "gqa_moe_scan_accum_2_nodes": ("h100:2x4", None, (
        *BF16, "model.moe.num_experts=8", "model.moe.capacity_factor=0.0", "mesh.fsdp=2",
        "mesh.expert=4", "model.scan_layers=true", "train.grad_accum=2",
        "train.batch_size=16")),
    "mha_capacity_moe": ("h100-2", None, (
        *BF16, "model.num_kv_heads=4", "model.moe.capacity_factor=1.25", "mesh.expert=2")),
    "mqa_dense": ("h100-2", None, (*BF16, "model.num_kv_heads=1", "model.moe.num_experts=0",
                                   "mesh.fsdp=2")),
    "sliding_window": ("h100-2", None, (
        *BF16, "model.moe.num_experts=0", "model.sliding_window=8",
        "model.layer_types=sliding,full", "mesh.fsdp=2")),
    "sliding_window_sinks": ("h100-2", None, (
        *BF16, "model.moe.num_experts=0", "model.sliding_window=8",
        "model.layer_types=sliding,full", "model.attention_sinks=true", "mesh.fsdp=2")),
    "mla_dense_head_scan": ("h100-2", "configs/deepseek2_16b.py:tiny", (
        *BF16, "mesh.expert=2")),
    "t5_relative_bias": ("h100-2", None, (*BF16, *("model.arch=encoder_decoder",
        "model.moe.num_experts=0", "model.activation=gelu", "model.rope_theta=0.0",
        "model.relpos_buckets=8", "model.relpos_max_distance=16"), "mesh.fsdp=2",
        "train.seq_len=32")),  # span corruption's decoder length 8: even, as cuDNN asks
    "f32": ("h100-2", None, ("model.moe.num_experts=0", "mesh.data=1", "mesh.fsdp=2")),
    # mesh.context: the sequence over 4 GPUs, cuDNN inside each device's chunks, a window too
    "context_parallel": ("h100-4", None, (
        *BF16, "model.moe.num_experts=0", "model.sliding_window=8",
        "model.layer_types=sliding,full", "mesh.context=4", "train.batch_size=2")),
    "context_ulysses": ("h100-4", None, (  # whole sequence, a share of the heads per GPU
        *BF16, "model.moe.num_experts=0", "model.sliding_window=8",
        "model.layer_types=sliding,full", "mesh.context=4", "train.batch_size=2",
        "model.context_strategy=ulysses")),
    "context_mla": ("h100-2", "configs/deepseek2_16b.py:tiny", (
        *BF16, "mesh.context=2", "model.moe.capacity_factor=0.0", "train.batch_size=2")),
    # Blackwell: an HGX B200 node, and two GB200 hosts of 4 in one NVLink domain
    "b200_moe": ("b200-8", None, (*BF16, "model.moe.capacity_factor=0.0", "mesh.expert=8")),
    "gb200_moe_2_hosts": ("gb200-8", None, (
        *BF16, "model.moe.capacity_factor=0.0", "mesh.expert=8")),
}  # fmt: skip
# What each family's attention must become: cuDNN calls (forward, backward; loop bodies
# once, peeled iterations apart), the fallback reasons `jaxmoe compile` lists (substrings),
# the MoE lowering.
EXPECTED = {
    "gqa_moe_scan_accum_2_nodes": ((1, 1), [], "dense dots"),
    "mha_capacity_moe": ((2, 2), [], None),
    "mqa_dense": ((2, 2), [], None),
    "sliding_window": ((2, 2), [], None),
    "sliding_window_sinks": ((0, 0), ["takes no learned sinks"], None),
    "mla_dense_head_scan": (None, [], "dense dots"),
    "t5_relative_bias": (None, ["takes no additive bias"], None),
    "f32": ((0, 0), ["dtype float32"], None),
    "context_parallel": ((2, 2), [], None),
    "context_ulysses": ((2, 2), [], None),
    "context_mla": (None, [], "dense dots"),
    "b200_moe": ((2, 2), [], "dense dots"),
    "gb200_moe_2_hosts": ((2, 2), [], "dense dots"),
}


@needs_plugin
@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_model_family_compiles_for_h100(family):
    from jaxmoe.aot.compile_check import compile_for_topology
    from jaxmoe.config.loading import load_config
    from tests.helpers import compile_cache_off, tiny_config

    topology, spec, overrides = FAMILIES[family]
    config = load_config(spec, overrides) if spec else tiny_config(*overrides)
    with compile_cache_off():
        report = compile_for_topology(config, topology)
    assert report["verdict"] == "fits"
    calls, reasons, moe = EXPECTED[family]
    kernels = report["gpu_kernels"]
    got = (kernels["cudnn_attention_forward"], kernels["cudnn_attention_backward"])
    if calls is None:  # some of the model's attention runs through cuDNN
        assert min(got) > 0, got
    else:
        assert got == calls, got
    for reason in reasons:
        assert any(reason in line for line in report["attention_fallbacks"]), report
    if not reasons:
        assert report["attention_fallbacks"] == []
    lowering = kernels["ragged_dot_lowering"]
    assert (lowering is None) if moe is None else lowering.startswith(moe), lowering
    if family == "gqa_moe_scan_accum_2_nodes":  # the expert exchange stays inside a node
        assert report["collectives"]["ragged-all-to-all"] > 0
        assert report["collectives_across_hosts"]["ragged-all-to-all"] == 0
        assert report["collectives_across_hosts"]["all-gather"] > 0  # fsdp spans the nodes
    if family == "gb200_moe_2_hosts":  # experts over 2 hosts, one NVLink domain
        assert report["collectives_across_hosts"]["ragged-all-to-all"] > 0
        assert not any(report["collectives_across_domains"].values())
