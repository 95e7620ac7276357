"""model.quantization: the quantized products against numpy references of the same
quantization (forward and backward), and a tiny model that trains with each."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxmoe.errors import ConfigError
from jaxmoe.models.quantization import (
    Quantization,
    batched_matmul,
    quantized_matmul,
    quantized_ragged_dot,
)

MODES = [Quantization(k, s) for k in ("int8", "fp8") for s in ("channel", "tensor")]
NARROW = {"int8": np.int8, "e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
LIMIT = {"int8": 127.0, "e4m3": 448.0, "e5m2": 57344.0}


def np_quantize(x, axes, fmt):
    """numpy: x ~= q * scale with scale = amax / limit over `axes`."""
    x = np.asarray(x, np.float32)
    amax = np.abs(x).max(axis=axes, keepdims=True)
    scale = np.where(amax > 0, amax / LIMIT[fmt], 1.0).astype(np.float32)
    scaled = x / scale
    if fmt == "int8":
        scaled = np.round(scaled)
    q = np.clip(scaled, -LIMIT[fmt], LIMIT[fmt]).astype(NARROW[fmt]).astype(np.float32)
    return q, scale


def formats(mode):
    return ("int8", "int8") if mode.kind == "int8" else ("e4m3", "e5m2")


def np_dot(a, b, mode, a_fmt):
    """a b with a per row / b per column (channel) or one scale each (tensor)."""
    a_axes = (1,) if mode.scaling == "channel" else (0, 1)
    b_axes = (0,) if mode.scaling == "channel" else (0, 1)
    qa, sa = np_quantize(a, a_axes, a_fmt)
    qb, sb = np_quantize(b, b_axes, formats(mode)[0])
    return (qa.astype(np.float64) @ qb.astype(np.float64)) * sa * sb


@pytest.fixture(scope="module")
def operands():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 16)).astype(np.float32)
    x[2] *= 40.0  # an outlier row: per-channel scales keep the other rows' precision
    w = rng.standard_normal((16, 5)).astype(np.float32) * 0.1
    dy = rng.standard_normal((6, 5)).astype(np.float32)
    return x, w, dy


@pytest.mark.parametrize("mode", MODES, ids=lambda m: f"{m.kind}-{m.scaling}")
def test_matmul_forward_backward_match_numpy(operands, mode):
    x, w, dy = operands
    fwd_fmt, grad_fmt = formats(mode)
    y, vjp = jax.vjp(lambda x, w: quantized_matmul(x, w, mode), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(dy))
    np.testing.assert_allclose(y, np_dot(x, w, mode, fwd_fmt), rtol=1e-5, atol=1e-5)
    # Input gradient: dy (gradient format) times w^T (forward format), both quantized again.
    np.testing.assert_allclose(dx, np_dot(dy, w.T, mode, grad_fmt), rtol=1e-5, atol=1e-5)
    # Weight gradient straight through: the plain x^T dy.
    np.testing.assert_allclose(dw, x.T @ dy, rtol=1e-5, atol=1e-5)
    # And the quantized product is near the exact one (the rounding is what it claims).
    exact = x @ w
    tol = 0.02 if mode.kind == "int8" else 0.1
    assert np.abs(np.asarray(y) - exact).max() < tol * np.abs(exact).max()


@pytest.mark.parametrize("mode", MODES[::3], ids=lambda m: f"{m.kind}-{m.scaling}")
def test_ragged_dot_forward_backward_match_numpy(mode):
    rng = np.random.default_rng(1)
    sizes = np.array([3, 0, 4], np.int32)  # an empty group; 2 rows past the groups
    x = rng.standard_normal((9, 8)).astype(np.float32)
    w = rng.standard_normal((3, 8, 4)).astype(np.float32)
    dy = rng.standard_normal((9, 4)).astype(np.float32)
    fwd_fmt, grad_fmt = formats(mode)
    y, vjp = jax.vjp(
        lambda x, w: quantized_ragged_dot(x, w, jnp.asarray(sizes), mode),
        jnp.asarray(x),
        jnp.asarray(w),
    )
    dx, dw = vjp(jnp.asarray(dy))
    want_y, want_dx, want_dw = np.zeros((9, 4)), np.zeros((9, 8)), np.zeros((3, 8, 4))
    start = 0
    for e, size in enumerate(sizes):
        rows = slice(start, start + size)
        if size:
            # Per-channel activation scales are per row, so a group's rows alone give the
            # same numbers; a per-tensor activation scale spans every row of the buffer.
            if mode.scaling == "channel":
                want_y[rows] = np_dot(x[rows], w[e], mode, fwd_fmt)
                want_dx[rows] = np_dot(dy[rows], w[e].T, mode, grad_fmt)
            else:
                qx, sx = np_quantize(x, (0, 1), fwd_fmt)
                qw, sw = np_quantize(w[e], (0, 1), fwd_fmt)
                want_y[rows] = (qx[rows] @ qw) * sx * sw
                qdy, sdy = np_quantize(dy, (0, 1), grad_fmt)
                qwt, swt = np_quantize(w[e].T, (0, 1), fwd_fmt)
                want_dx[rows] = (qdy[rows] @ qwt) * sdy * swt
            want_dw[e] = x[rows].T @ dy[rows]
        start += size
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-5)


def test_batched_matmul_is_per_expert_quantized_matmul(operands):
    x, w, _ = operands
    mode = Quantization("int8")
    got = batched_matmul(jnp.stack([x, 2 * x]), jnp.stack([w, -w]), mode)
    np.testing.assert_allclose(got[0], np_dot(x, w, mode, "int8"), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], np_dot(2 * x, -w, mode, "int8"), rtol=1e-5, atol=1e-5)


def test_int8_products_in_the_hlo():
    mode = Quantization("int8")
    x, w = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 2), jnp.bfloat16)

    def loss(x, w):
        return quantized_matmul(x, w, mode).astype(jnp.float32).sum()

    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    # Forward and input-gradient products: s8 x s8 -> s32; the weight gradient in bf16.
    assert sum("xi8>) -> tensor<" in d and "xi32>" in d for d in dots) == 2, dots
    assert sum("xbf16>, tensor<" in d for d in dots) == 1, dots


def _tiny(quantization, dispatch="auto"):
    from jaxmoe.config.defaults import base_config
    from jaxmoe.config.schema import typed

    c = base_config()
    m = c.model
    m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.num_kv_heads = 64, 32, 2, 4, 2
    m.head_dim, m.ffn_dim, m.moe.ffn_dim, m.moe.num_experts = 8, 64, 32, 4
    m.quantization, m.moe.dispatch = quantization, dispatch
    return typed(c)


def test_blocks_dispatch_refused_with_quantization():
    with pytest.raises(ConfigError, match=r"dispatch='blocks' has no quantized"):
        _tiny("int8", "blocks")


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_tiny_moe_loss_and_grads_near_unquantized(kind):
    from flax import nnx

    from jaxmoe.models.transformer import DecoderLM

    def loss_and_grads(quantization):
        cfg = _tiny(quantization, "ragged").model
        model = DecoderLM(cfg, rngs=nnx.Rngs(0))
        ids = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)

        def loss(model):
            logits, _ = model(ids, train=True)
            logp = jax.nn.log_softmax(logits[:, :-1])
            return -jnp.take_along_axis(logp, ids[:, 1:, None], -1).mean()

        # One compiled program (as training runs it), not hundreds of op-by-op ones.
        return nnx.jit(nnx.value_and_grad(loss))(model)

    base_loss, base_grads = loss_and_grads("none")
    q_loss, q_grads = loss_and_grads(kind)
    assert abs(float(q_loss) - float(base_loss)) < 0.02 * float(base_loss)
    base_leaves = jax.tree.leaves(nnx.state(base_grads))
    q_leaves = jax.tree.leaves(nnx.state(q_grads))
    for b, q in zip(base_leaves, q_leaves, strict=True):
        assert np.all(np.isfinite(np.asarray(q)))
        cos = np.vdot(b, q) / (np.linalg.norm(b) * np.linalg.norm(q) + 1e-30)
        # fp8's 3-bit mantissa and e5m2 gradients (2 bits) move small gradients more: the
        # least-aligned leaves at this seed: int8 the router (0.989), fp8 a norm scale (0.82).
        assert cos > (0.97 if kind == "int8" else 0.75), (b.shape, cos)


def test_compile_report_counts_dots_by_operand_types():
    from jaxmoe.aot.hlo_reading import count_dot_types

    mode = Quantization("int8")

    def step(x, w):
        return quantized_matmul(x, w, mode).astype(jnp.float32).sum()

    # Shapes XLA:CPU keeps as dots (it rewrites very small ones as reductions).
    x, w = jnp.ones((64, 32), jnp.bfloat16), jnp.ones((32, 16), jnp.bfloat16)
    text = jax.jit(jax.value_and_grad(step, argnums=(0, 1))).lower(x, w).compile().as_text()
    assert count_dot_types(text)["s8 x s8 -> s32"] == 2
    # The older text form prints each operand's type in the call.
    typed = (
        "  %p = f8e4m3fn[4,8]{1,0} parameter(0)\n"
        "  ROOT %d = f32[4,2]{1,0} dot(f8e4m3fn[4,8]{1,0} %p, f8e5m2[8,2]{1,0} %q), "
        "lhs_contracting_dims={1}\n"
    )
    assert count_dot_types(typed) == {"f8e4m3fn x f8e5m2 -> f32": 1}
