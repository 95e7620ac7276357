"""TPU kernels: splash attention (model.attention_kernel=splash) and the megablox grouped
matmul (model.moe.dispatch=megablox).

On CPU both run in Pallas' interpret mode, the same kernel code: compared with a numpy
loop (outputs) and with plain-jnp references written here (gradients). With libtpu they
are compiled ahead of time for v5p: the train step holds their Mosaic kernels and fits.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

from jaxmoe.models import build_model
from jaxmoe.models.moe.dispatch import grouped_ffn
from jaxmoe.models.splash_attention import splash_attention, splash_refusal
from jaxmoe.parallel.mesh import MESH_AXES
from tests.helpers import tiny_config


def _qkv(batch=2, length=128, heads=4, kv_heads=2, dim=32, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(
        rng.normal(size=(batch, length, n, dim)).astype(np.float32)
        for n in (heads, kv_heads, kv_heads)
    )


def _attention_loop(q, k, v, scale, window):
    """Causal GQA attention, one (example, head, query) at a time, in float64."""
    batch, length, heads, _ = q.shape
    groups = heads // k.shape[2]
    out = np.zeros(q.shape)
    for b in range(batch):
        for h in range(heads):
            for i in range(length):
                first = max(0, i - window + 1) if window else 0
                keys = k[b, first : i + 1, h // groups].astype(np.float64)
                logits = keys @ q[b, i, h].astype(np.float64) * scale
                p = np.exp(logits - logits.max())
                out[b, i, h] = (p / p.sum()) @ v[b, first : i + 1, h // groups]
    return out


def _attention_jnp(q, k, v, scale, window):
    """The same attention as dense jnp ops (K/V repeated per group), for gradients."""
    groups = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(a, groups, axis=2) for a in (k, v))
    logits = jnp.einsum("blhd,bshd->bhls", q, k) * scale
    i, j = np.arange(q.shape[1])[:, None], np.arange(q.shape[1])[None]
    allowed = (j <= i) & ((i - j < window) if window else True)
    probs = jax.nn.softmax(jnp.where(allowed, logits, -1e30), axis=-1)
    return jnp.einsum("bhls,bshd->blhd", probs, v)


@pytest.mark.tpu(also_on_cpu=True)  # `pytest -m tpu`: the Mosaic kernel itself
@pytest.mark.parametrize("window", [0, 40])
def test_splash_matches_loop_and_gradients(window):
    q, k, v = _qkv()
    scale = q.shape[-1] ** -0.5
    out = jax.jit(lambda q, k, v: splash_attention(q, k, v, scale=scale, window=window))(q, k, v)
    np.testing.assert_allclose(out, _attention_loop(q, k, v, scale, window), atol=2e-5)

    cotangent = np.random.default_rng(1).normal(size=q.shape).astype(np.float32)

    def grads(fn):
        return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * cotangent), argnums=(0, 1, 2))

    got = jax.jit(grads(lambda q, k, v: splash_attention(q, k, v, scale=scale, window=window)))
    want = grads(lambda q, k, v: _attention_jnp(q, k, v, scale, window))
    for g, w in zip(got(q, k, v), want(q, k, v), strict=True):
        np.testing.assert_allclose(g, w, atol=5e-5)


def test_splash_refuses_lengths_off_the_lanes():
    assert splash_refusal(128) == "" and splash_refusal(1024) == ""
    assert "multiple of 128" in splash_refusal(100)
    assert "block 512" in splash_refusal(640)
    assert splash_attention(*_qkv(length=96)) is None


def _assignments(rows=50, slots=2, experts=4, seed=0):
    rng = np.random.default_rng(seed)
    src = np.repeat(np.arange(rows), slots).astype(np.int32)
    expert = rng.integers(0, experts, rows * slots).astype(np.int32)
    weight = rng.random(rows * slots).astype(np.float32)
    valid = rng.random(rows * slots) > 0.25
    return src, expert, weight, valid


def _ffn_loop(x, src, expert, weight, valid, experts):
    """y[n] = sum over valid assignments a of n: weight * FFN_e(x[n]), one at a time."""
    wi_0, wi_1, wo = (np.asarray(w, np.float64) for w in experts)
    y = np.zeros(x.shape)
    for a in np.flatnonzero(valid):
        h = x[src[a]].astype(np.float64)
        gate = h @ wi_0[expert[a]]
        hidden = gate / (1 + np.exp(-gate)) * (h @ wi_1[expert[a]])
        y[src[a]] += weight[a] * (hidden @ wo[expert[a]])
    return y


def _ffn_jnp(x, src, expert, weight, valid, experts):
    """The same sum with each assignment's expert weights gathered (plain jnp)."""
    wi_0, wi_1, wo = (w[expert] for w in experts)
    h = x[src]
    hidden = jax.nn.silu(jnp.einsum("ad,adf->af", h, wi_0)) * jnp.einsum("ad,adf->af", h, wi_1)
    out = jnp.einsum("af,afd->ad", hidden, wo) * jnp.where(valid, weight, 0)[:, None]
    return jnp.zeros_like(x).at[src].add(out)


@pytest.mark.tpu(also_on_cpu=True)  # `pytest -m tpu`: the Mosaic kernel itself
def test_megablox_matches_loop_and_gradients():
    rng = np.random.default_rng(2)
    rows, dim, ffn, num_experts = 50, 32, 64, 4
    x = rng.normal(size=(rows, dim)).astype(np.float32)
    experts = tuple(
        (rng.normal(size=s) * 0.2).astype(np.float32)
        for s in ((num_experts, dim, ffn), (num_experts, dim, ffn), (num_experts, ffn, dim))
    )
    routing = _assignments(rows, 2, num_experts)

    def megablox(x, experts):
        return grouped_ffn(x, *routing, experts, act=jax.nn.silu, impl="megablox", block_size=8)

    # 100 assignments: rows padded to 104, the last group of 29+ rows has no weights.
    np.testing.assert_allclose(
        jax.jit(megablox)(x, experts), _ffn_loop(x, *routing, experts), atol=2e-5
    )
    cotangent = rng.normal(size=x.shape).astype(np.float32)

    def grads(fn):
        return jax.grad(lambda x, e: jnp.sum(fn(x, e) * cotangent), argnums=(0, 1))

    got = jax.jit(grads(megablox))(x, experts)
    want = grads(lambda x, e: _ffn_jnp(x, *routing, e))(x, experts)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, atol=5e-5)


MODEL = (
    "model.num_layers=2",
    "model.d_model=64",
    "model.head_dim=16",
    "model.moe.num_experts=4",
    "model.moe.ffn_dim=32",
    "model.moe.gating=topk",
    "train.seq_len=128",
)


def _loss_and_grads(config, tokens, mesh):
    model = build_model(config.model, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(params):
        logits, _ = nnx.merge(graphdef, params)(tokens)
        return -jnp.mean(jax.nn.log_softmax(logits)[:, :-1].max(-1))

    with jax.set_mesh(mesh):
        kernels = "pallas_call" in str(jax.make_jaxpr(loss)(params))
        return kernels, *jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.slow  # interpret-mode kernels in a sharded forward and backward: ~1-2 min
def test_model_with_kernels_matches_xla_on_a_mesh():
    """A tiny MoE decoder on data 2 x tensor 2 x expert 2 CPU devices: the same loss and
    gradients with splash attention and megablox as with the XLA attention and ragged_dot."""
    mesh = jax.make_mesh((2, 1, 1, 2, 2), MESH_AXES, axis_types=(AxisType.Auto,) * 5)
    tokens = np.random.default_rng(3).integers(0, 128, (4, 128)).astype(np.int32)
    xla = tiny_config(*MODEL, "model.attention_kernel=xla", "model.moe.dispatch=ragged")
    kernels = tiny_config(*MODEL, "model.attention_kernel=splash", "model.moe.dispatch=megablox")
    xla_kernels, want_loss, want = _loss_and_grads(xla, tokens, mesh)
    pallas, got_loss, got = _loss_and_grads(kernels, tokens, mesh)
    assert pallas and not xla_kernels
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-4)


# A tiny MoE decoder whose shapes suit both kernels: 256-token sequences (splash blocks of
# 256), head_dim 128, expert widths in whole lanes; fsdp 2 x expert 2 on v5p-8.
AOT = (
    "model.vocab_size=512",
    "model.d_model=256",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.head_dim=128",
    "model.moe.num_experts=4",
    "model.moe.ffn_dim=512",
    "model.dtype=bfloat16",
    "model.scan_layers=True",
    "model.remat=full",
    "train.batch_size=8",
    "train.seq_len=256",
    "mesh.data=1",
    "mesh.fsdp=2",
    "mesh.tensor=1",
    "mesh.expert=2",
    "model.attention_kernel=splash",
    "model.moe.dispatch=megablox",
)


@pytest.mark.slow  # one TPU compile with Mosaic kernels: ~50 s idle, 150 s under load
def test_kernels_compile_for_v5p():
    pytest.importorskip("libtpu", reason="the `tpu` extra is not installed: no libtpu")
    from jaxmoe.aot.compile_check import compile_for_topology
    from tests.helpers import compile_cache_off

    with compile_cache_off():
        result = compile_for_topology(tiny_config(*AOT), "v5p-8")
    assert result["verdict"] == "fits" and result["moe_dispatch"] == "megablox"
    kernels = result["pallas_kernels"]
    # Splash's forward and its two backward kernels; megablox's gmm (forward and input
    # gradient) and tgmm (weight gradient).
    for name in ("splash_mha_fwd_residuals", "splash_mha_dq_no_residuals", "gmm", "tgmm"):
        assert kernels.get(name, 0) >= 1, kernels
    assert result["estimated_step_s"] is None and "Pallas kernels" in result["estimate_note"]


@pytest.mark.slow  # one TPU compile with Mosaic kernels, as the test above
@pytest.mark.parametrize("strategy", ["all_gather", "ulysses"])
def test_splash_inside_context_chunks_compiles_for_v5p(strategy):
    """mesh.context=2 on v5p-8: each device's early and late chunk run splash attention
    (all-gather: its query rows of the split layout's mask; Ulysses: the whole sequence for
    half the heads), no attention falls back to XLA, and the keys/values or heads cross the
    context axis (all-gathers or all-to-alls in the step)."""
    pytest.importorskip("libtpu", reason="the `tpu` extra is not installed: no libtpu")
    from jaxmoe.aot.compile_check import compile_for_topology
    from tests.helpers import compile_cache_off

    context = ("mesh.fsdp=1", "mesh.context=2", "model.moe.capacity_factor=0.0")
    config = tiny_config(*AOT, *context, f"model.context_strategy={strategy}")
    with compile_cache_off():
        result = compile_for_topology(config, "v5p-8")
    assert result["verdict"] == "fits" and result["attention_fallbacks"] == []
    kernels = result["pallas_kernels"]
    for name in ("splash_mha_fwd_residuals", "splash_mha_dq_no_residuals"):
        assert kernels.get(name, 0) >= 1, kernels
    exchange = "all-to-all" if strategy == "ulysses" else "all-gather"
    assert result["collectives"][exchange] > 0
