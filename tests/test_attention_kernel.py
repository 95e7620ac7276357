"""model.attention_kernel: jax.nn.dot_product_attention (XLA lowering on CPU) against a
float64 numpy softmax and jaxmoe's own XLA path, outputs and gradients; what the GPU
path passes to cuDNN, and its fallback when cuDNN refuses."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.errors import ConfigError
from jaxmoe.models import attention_kernel
from jaxmoe.models.attention import Attention, query_chunked_attention
from jaxmoe.models.attention_kernel import (
    cudnn_refusal,
    kernel_attention,
    mesh_platform,
    resolve_attention_kernel,
)
from jaxmoe.models.transformer import DecoderLM
from tests.helpers import tiny_config

B, L, H, D = 2, 12, 4, 8


def numpy_attention(q, k, v, allowed_BLS, scale):
    """float64 softmax(q k^T scale) v per head, K/V head h // (H // K), masked keys out."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    logits = np.einsum("blhd,bshd->bhls", q, k) * scale
    logits = np.where(allowed_BLS[:, None], logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhls,bshd->blhd", probs, v)


def operands(kv_heads, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, L, H, D))
    k, v = (rng.normal(size=(B, L, kv_heads, D)) for _ in range(2))
    return [jnp.asarray(x, dtype) for x in (q, k, v)]


def masks(kind, window=0):
    """(allowed [B, L, S] numpy, causal?): causal (with a window), or key padding."""
    pos = np.arange(L)
    if kind == "causal":
        delta = pos[:, None] - pos[None, :]
        band = (delta >= 0) & ((delta < window) if window else True)
        return np.broadcast_to(band, (B, L, L)), True
    valid = pos[None, :] < np.array([[L], [7]])  # row 1: keys 7.. are padding
    return np.broadcast_to(valid[:, None, :], (B, L, L)), False


CASES = [("causal", 0), ("causal", 5), ("padding", 0)]
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def run_kernel(impl, q, k, v, allowed, causal, window):
    mask = None if causal else jnp.asarray(allowed)
    if impl == "kernel":  # jaxmoe's call of jax.nn.dot_product_attention (CPU: XLA's)
        return kernel_attention(
            q, k, v, mask=mask, causal=causal, window=window, scale=D**-0.5, platform="cpu"
        )
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=None if mask is None else mask[:, None],
        is_causal=causal,
        local_window_size=(window - 1, 0) if window else None,
        implementation=impl,
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("case", CASES, ids=["causal", "window5", "padding"])
@pytest.mark.parametrize("impl", ["kernel", "xla", None], ids=["kernel", "xla", "none"])
def test_dot_product_attention_equals_numpy_and_jaxmoe(impl, case, kv_heads, dtype):
    q, k, v = operands(kv_heads, dtype)
    allowed, causal = masks(*case)
    got = run_kernel(impl, q, k, v, allowed, causal, case[1])
    want = numpy_attention(q.astype(jnp.float32), k.astype(jnp.float32), v, allowed, D**-0.5)
    ours = query_chunked_attention(q, k, v, jnp.asarray(allowed), scale=D**-0.5)
    assert got.dtype == dtype and got.shape == (B, L, H, D)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=TOL[dtype])
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(ours, np.float32), atol=TOL[dtype]
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=["causal", "window5", "padding"])
def test_gradients_equal_jaxmoe_path(case, dtype):
    """d(q, k, v) of a weighted sum: dot_product_attention vs jaxmoe's XLA path (GQA)."""
    q, k, v = operands(2, dtype, seed=1)
    allowed, causal = masks(*case)
    weights = jnp.asarray(np.random.default_rng(2).normal(size=(B, L, H, D)), jnp.float32)

    def loss(fn):
        return lambda *qkv: jnp.sum(fn(*qkv).astype(jnp.float32) * weights)

    kernel = loss(lambda *qkv: run_kernel("kernel", *qkv, allowed, causal, case[1]))
    ours = loss(lambda *qkv: query_chunked_attention(*qkv, jnp.asarray(allowed), scale=D**-0.5))
    got = jax.jit(jax.grad(kernel, argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(q, k, v)
    for name, g, w in zip("qkv", got, want, strict=True):
        w = np.asarray(w, np.float32)
        scale = 1.0 if dtype == jnp.float32 else float(np.abs(w).max())
        np.testing.assert_allclose(
            np.asarray(g, np.float32), w, atol=TOL[dtype] * scale, err_msg=f"d{name}"
        )


def test_decoder_with_the_kernel_equals_the_xla_path():
    """A tiny GQA decoder with a sliding layer: logits and parameter gradients."""
    overrides = (
        "model.sliding_window=5",
        "model.layer_types=sliding,full",
        "model.moe.num_experts=0",
    )
    models = {}
    for kernel in ("xla", "dot_product_attention"):
        cfg = tiny_config(*overrides, f"model.attention_kernel={kernel}").model
        models[kernel] = DecoderLM(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 16)), jnp.int32)

    def loss(model):
        logits, _ = model(tokens)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits

    results = {}
    for kernel, model in models.items():
        graph, params = nnx.split(model)
        fn = jax.jit(jax.value_and_grad(lambda p, g=graph: loss(nnx.merge(g, p)), has_aux=True))
        results[kernel] = fn(params)
    (_, want_logits), want_grads = results["xla"]
    (_, got_logits), got_grads = results["dot_product_attention"]
    np.testing.assert_allclose(got_logits, want_logits, atol=1e-5)
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_auto_is_dot_product_attention_on_gpu_only():
    assert resolve_attention_kernel("auto", "gpu") == "dot_product_attention"
    assert resolve_attention_kernel("auto", "cpu") == "xla"
    assert resolve_attention_kernel("auto", "tpu") == "xla"
    assert resolve_attention_kernel("xla", "gpu") == "xla"
    with pytest.raises(ValueError, match=r"model\.attention_kernel: got 'flash'"):
        resolve_attention_kernel("flash", "gpu")
    with pytest.raises(ConfigError, match=r"model\.attention_kernel"):
        tiny_config("model.attention_kernel=flash")


def test_platform_is_the_mesh_s_inside_jit():
    seen = []
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices("cpu")[:1])
    with jax.set_mesh(mesh):
        jax.jit(lambda x: seen.append(mesh_platform()) or x)(1.0)
    assert seen == ["cpu"]


def test_gpu_path_passes_cudnn_causal_and_window(monkeypatch):
    """What a GPU trace hands jax.nn.dot_product_attention for a sliding causal layer."""
    calls = []

    def record(q, k, v, **kwargs):
        calls.append(kwargs)
        return jnp.zeros(q.shape, q.dtype)

    monkeypatch.setattr(attention_kernel.jax.nn, "dot_product_attention", record)
    q, k, v = operands(2, jnp.bfloat16)
    out = kernel_attention(
        q, k, v, mask=jnp.ones((1, L, L), bool), causal=True, window=5, scale=0.5, platform="gpu"
    )
    assert out is not None
    assert calls == [
        {
            "mask": None,  # the causal mode replaces the mask
            "scale": 0.5,
            "is_causal": True,
            "local_window_size": (4, 0),
            "implementation": "cudnn",
        }
    ]
    kernel_attention(
        q, k, v, mask=jnp.ones((B, L, L), bool), causal=False, window=0, scale=None, platform="gpu"
    )
    assert calls[1]["mask"].shape == (B, 1, L, L) and calls[1]["implementation"] == "cudnn"
    assert calls[1]["is_causal"] is False and calls[1]["scale"] == 1.0


def test_cudnn_refusals_fall_back_with_one_line_each(caplog):
    attention_kernel._logged.clear()
    q32, k32, v32 = operands(2, jnp.float32)
    with caplog.at_level(logging.WARNING, logger="jaxmoe"):
        for _ in range(2):  # f32: refused up front
            args = dict(mask=None, causal=True, window=0, scale=None, platform="gpu")
            assert kernel_attention(q32, k32, v32, **args) is None
        q, k, v = operands(2, jnp.bfloat16)
        for _ in range(2):  # bf16 on this CPU host: jax finds no cuDNN and raises
            assert kernel_attention(q, k, v, **args) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "dtype float32" in lines[0] and "keeps the XLA path" in lines[0]
    assert "bfloat16" in lines[1]
    wide = jnp.zeros((1, 8, 2, 136), jnp.bfloat16)
    assert "head_dim 136" in cudnn_refusal(wide, wide, wide, masked=False)
    odd = jnp.zeros((1, 7, 2, 64), jnp.bfloat16)
    assert "odd lengths" in cudnn_refusal(odd, odd, odd, masked=True)
    assert cudnn_refusal(odd, odd, odd, masked=False) == ""


def test_sinks_and_dropout_keep_the_xla_path(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the kernel was called")

    monkeypatch.setattr(attention_kernel, "kernel_attention", refuse)
    monkeypatch.setattr("jaxmoe.models.attention.kernel_attention", refuse)
    x = jnp.ones((1, 6, 16))
    mask = jnp.tril(jnp.ones((6, 6), bool))[None]
    sinks = Attention(
        16, 4, 2, 8, sinks=True, kernel="dot_product_attention", causal=True, rngs=nnx.Rngs(0)
    )
    sinks(x, mask=mask)
    dropout = Attention(
        16, 4, 2, 8, dropout_rate=0.5, kernel="dot_product_attention", causal=True, rngs=nnx.Rngs(0)
    )
    dropout(x, mask=mask, train=True)


@pytest.fixture
def cudnn_lowering(monkeypatch):
    """Lowering for a CUDA target on this CPU host: jax's cuDNN wrapper asks the installed
    cuDNN for its version and the GPU for its capability; answer as a cuDNN 9.10 Hopper
    would (private jax names: skipped where a jax release has moved them)."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fused
    except ImportError:
        pytest.skip("jax's cuDNN attention module moved")
    for name, value in (
        ("check_cudnn_version", lambda: 91000),
        ("check_compute_capability", lambda capability: True),
        ("is_cuda_compute_capability_equal", lambda capability: False),
    ):
        if not hasattr(fused, name):
            pytest.skip(f"jax's cuDNN wrapper has no {name}")
        monkeypatch.setattr(fused, name, value)


def cuda_program(cfg, dtype_tokens):
    """The StableHLO of a decoder's loss gradient lowered for CUDA, traced as on a GPU."""
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))
    graph, params = nnx.split(model)

    def loss(p, tokens):
        logits, _ = nnx.merge(graph, p)(tokens)
        return jnp.mean(logits)

    with pytest.MonkeyPatch.context() as patch:  # trace as the GPU would (the mesh's platform)
        patch.setattr("jaxmoe.models.attention.mesh_platform", lambda: "gpu")
        traced = jax.jit(jax.grad(loss)).trace(params, dtype_tokens)
    return traced.lower(lowering_platforms=("cuda",)).as_text()


def test_gpu_lowering_is_cudnn_flash_attention(cudnn_lowering):
    """bf16 GQA decoder, a sliding and a full layer: each layer's attention lowers to
    cuDNN's fused attention, forward and backward, causal, the sliding one windowed; the
    f32 model keeps the XLA path (no cuDNN call)."""
    import re

    overrides = ("model.sliding_window=5", "model.layer_types=sliding,full")
    tokens = jnp.zeros((2, 16), jnp.int32)
    bf16 = tiny_config(*overrides, "model.dtype=bfloat16", "model.moe.num_experts=0").model
    text = cuda_program(bf16, tokens)
    calls = re.findall(r"custom_call @([\w$]+)", text)
    assert calls.count("__cudnn$fmhaSoftmax") == 2, sorted(set(calls))
    assert calls.count("__cudnn$fmhaSoftmaxBackward") == 2
    assert set(re.findall(r"mask_type\\22: \\22(\w+)", text)) == {"CAUSAL"}
    windows = re.findall(r"sliding_window_length\\22: (\d+)", text)
    assert sorted(set(windows)) == ["0", "5"], windows
    f32 = tiny_config(*overrides, "model.moe.num_experts=0").model
    assert "__cudnn$fmha" not in cuda_program(f32, tokens)
