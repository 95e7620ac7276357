"""Ungated FFNs (`model.ffn_gated=False`: act(x wi) wo, T5 v1.0 / Switch Base): the MoE layer
runs them through the gated dispatch as (wi, wi, wo) with a gate s where act(h) = s(h) h.
Checked in value and gradient against a plain per-token jnp loop that calls the activation
itself, for every dispatch."""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.checkpoints.manager import CheckpointError
from jaxmoe.conversions.hf.export_config import export_plan
from jaxmoe.conversions.t5x.exporter import check_exportable
from jaxmoe.models.layers import MLP, activation_fn, ungated_gate_fn
from jaxmoe.models.moe.layer import MoE
from tests.helpers import tiny_config
from tests.test_moe import B, D, L, moe_config


@pytest.mark.parametrize("name", ["relu", "silu", "gelu"])
def test_gate_times_input_is_the_activation(name):
    h = np.linspace(-6, 6, 1001).astype(np.float32)
    want = {
        "relu": np.maximum(h, 0),
        "silu": h / (1 + np.exp(-h)),
        "gelu": 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3))),
    }[name]
    got = np.asarray(ungated_gate_fn(name)(jnp.asarray(h)) * h)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _reference(params, x, act_name, k):
    """Top-k routing, raw probabilities as weights, act(x wi[e]) wo[e], one token at a time."""
    act = activation_fn(act_name)
    xs = x.reshape(-1, x.shape[-1])
    probs = jax.nn.softmax(xs @ params["router"], axis=-1)
    rows = []
    for t in range(xs.shape[0]):
        order = jnp.argsort(-probs[t])[:k]
        y = 0.0
        for e in order:
            y = y + probs[t, e] * (act(xs[t] @ params["wi"][e]) @ params["wo"][e])
        rows.append(y)
    return jnp.stack(rows).reshape(x.shape)


_REFERENCE_CACHE: dict[str, tuple] = {}


def _reference_value_and_grads(params, x, r, act_name):
    """The plain loop's sum(y * r) and its gradients in (params, x). The loop runs op by op
    (seconds per call), and every dispatch gets the same initial weights, so it runs once per
    activation and weights: keyed by the arrays' bytes, not by the test's parameters."""
    digest = hashlib.sha256(act_name.encode())
    for leaf in (params["router"], params["wi"], params["wo"], x, r):
        digest.update(np.asarray(leaf).tobytes())
    key = digest.hexdigest()
    if key not in _REFERENCE_CACHE:

        def loss(p, x):
            return jnp.sum(_reference(p, x, act_name, 2) * r)

        _REFERENCE_CACHE[key] = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
    return _REFERENCE_CACHE[key]


@pytest.mark.parametrize("impl", ["blocks", "dense", "ragged", "capacity"])
@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_ungated_moe_matches_plain_loop(impl, act):
    cfg = moe_config(
        gating="top2", dispatch=impl, capacity_factor=4.0 if impl == "capacity" else 0.0
    )
    cfg = cfg.replace(activation=act, ffn_gated=False)
    model = MoE.of_model(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    plain = {k: v[...] for k, v in nnx.to_pure_dict(params).items()}
    assert set(plain) == {"router", "wi", "wo"}
    kx, kr = jax.random.split(jax.random.key(1))
    x, r = jax.random.normal(kx, (B, L, D)), jax.random.normal(kr, (B, L, D))

    def ours(p, x):
        y, aux = nnx.merge(graphdef, p)(x, train=True)
        return jnp.sum(y * r), aux["dropped_fraction"]

    # One program for the layer's value and gradients, as training runs it.
    ours_grad = jax.jit(jax.value_and_grad(ours, argnums=(0, 1), has_aux=True))
    (got, dropped), got_grads = ours_grad(plain, x)
    assert float(dropped) == 0.0
    want, want_grads = _reference_value_and_grads(plain, x, r, act)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for name in ("wi", "wo"):
        np.testing.assert_allclose(
            got_grads[0][name], want_grads[0][name], rtol=1e-4, atol=1e-5, err_msg=name
        )
    np.testing.assert_allclose(got_grads[1], want_grads[1], rtol=1e-4, atol=1e-5)


def test_dense_ungated_mlp():
    mlp = MLP(4, 6, "relu", rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (2, 3, 4))
    y, aux = mlp(x)
    want = np.maximum(np.asarray(x) @ np.asarray(mlp.wi[...]), 0) @ np.asarray(mlp.wo[...])
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-6)
    assert aux == {}


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_exporters_refuse_ungated_ffns(arch):
    """Neither the Hugging Face families nor T5X's T5.1.1 have an ungated FFN: one line."""
    config = tiny_config(
        f"model.arch={arch}",
        "model.moe.num_experts=0",
        "model.activation=gelu",
        "model.rope_theta=0.0" if arch == "encoder_decoder" else "model.rope_theta=10000.0",
        "model.ffn_gated=false",
    )
    with pytest.raises(CheckpointError, match=r"model\.ffn_gated=False"):
        export_plan(config.model)
    if arch == "encoder_decoder":
        with pytest.raises(CheckpointError, match=r"model\.ffn_gated=False"):
            check_exportable(config.model)


def test_hf_export_refuses_a_router_bias():
    config = tiny_config("model.moe.num_experts=4", "model.moe.router_bias=true")
    with pytest.raises(CheckpointError, match=r"model\.moe\.router_bias=True"):
        export_plan(config.model)
