"""Padding tokens count in no MoE loss or routing statistic (balance loss, z-loss, the
top-2 fractions the curriculum stores as complexity vectors): hand-computed values, and a
padded batch against the same batch without its padding."""

import math

import jax
import numpy as np
import pytest
from flax import nnx

from jaxmoe.models import build_model
from jaxmoe.models.moe import gates
from jaxmoe.models.moe.gates import GateOptions
from jaxmoe.training.steps import forward
from tests.helpers import TINY_T5, tiny_config

# The four real tokens of test_gates' hand-computed example, then two padding tokens whose
# probabilities would move every expert's mean and count if they were included.
REAL = np.array([[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.1, 0.5, 0.4], [0.3, 0.3, 0.4]])
PAD = np.array([[0.05, 0.05, 0.9], [0.0, 0.1, 0.9]])
PROBS = np.concatenate([REAL, PAD]).astype(np.float32)
MASK = np.array([True, True, True, True, False, False])
MEAN_P = [1.7 / 4, 1.3 / 4, 1.0 / 4]  # over the real tokens only


def test_balance_loss_ignores_padding_hand_computed():
    # Top-1 / adaptive (T = 0.1): real top-1 experts 0, 0, 1, 2 -> f = [1/2, 1/4, 1/4].
    want_top1 = 3 * (0.5 * MEAN_P[0] + 0.25 * MEAN_P[1] + 0.25 * MEAN_P[2])
    for gating in ("top1", "adaptive"):
        routing = gates.route(PROBS, GateOptions(gating=gating, threshold=0.1))
        got = float(gates.balance_loss(PROBS, routing, gating, token_mask_T=MASK))
        assert math.isclose(got, want_top1, rel_tol=1e-6), gating
    # Top-2: real assignments {0,1}, {0,1}, {1,2}, {2,0} -> counts [3, 3, 2] of 8.
    routing = gates.route(PROBS, GateOptions(gating="top2"))
    want = 3 * (3 / 8 * MEAN_P[0] + 3 / 8 * MEAN_P[1] + 2 / 8 * MEAN_P[2])
    got = float(gates.balance_loss(PROBS, routing, "top2", token_mask_T=MASK))
    assert math.isclose(got, want, rel_tol=1e-6)
    # Without the mask the padding counts (expert 2 gets both padding tokens).
    unmasked = float(gates.balance_loss(PROBS, gates.route(PROBS, GateOptions("top1")), "top1"))
    assert not math.isclose(unmasked, want_top1, rel_tol=1e-3)


def test_z_loss_ignores_padding():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 3)).astype(np.float32) * 3
    lse = np.log(np.exp(logits[:4].astype(np.float64)).sum(axis=1))
    got = float(gates.z_loss(logits, MASK))
    np.testing.assert_allclose(got, np.mean(lse**2), rtol=1e-6)
    assert float(gates.z_loss(logits, np.zeros(6, bool))) == 0.0  # all padding: 0, not NaN


def _moe_model(arch_overrides, gating="adaptive"):
    config = tiny_config(
        *arch_overrides,
        "model.moe.num_experts=4",
        "model.moe.every=1",
        f"model.moe.gating={gating}",
        "model.moe.threshold=0.3",
        "model.moe.dispatch=dense",
        "model.dtype=float32",
    )
    model = build_model(config.model, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, nnx.to_pure_dict(params), rest


def _aux(graphdef, params, rest, batch):
    _, aux = jax.jit(lambda p, b: forward(graphdef, p, b, train=True, rest=rest))(params, batch)
    return jax.device_get(aux)


def _check_same_aux(padded, cut):
    assert list(padded) == list(cut)
    for layer in padded:
        for key in ("balance_loss", "router_z_loss", "top2_fraction", "top2_per_example"):
            np.testing.assert_allclose(
                padded[layer][key], cut[layer][key], rtol=2e-5, atol=1e-6, err_msg=f"{layer} {key}"
            )


@pytest.mark.parametrize(
    "gating, layout",
    [("adaptive", ()), ("top2", ()), ("adaptive", ("model.scan_layers=true", "model.remat=full"))],
    ids=["adaptive", "top2", "adaptive-scanned-remat"],
)
def test_decoder_padding_changes_no_moe_loss(gating, layout):
    """Right-padded windows (weight 0 after 10 real positions) against the same windows cut
    to their 10 real positions: causal attention keeps the real positions' states equal.
    The mask reaches scanned and rematerialised stacks too."""
    graphdef, params, rest = _moe_model(layout, gating)
    rng = np.random.default_rng(1)
    b, l, n = 4, 16, 10
    tokens = rng.integers(1, 128, size=(b, l + 1)).astype(np.int32)
    weights = np.zeros((b, l), np.float32)
    weights[:, :n] = 1.0
    padded = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights}
    cut = {key: value[:, :n] for key, value in padded.items()}
    got, want = _aux(graphdef, params, rest, padded), _aux(graphdef, params, rest, cut)
    _check_same_aux(got, want)
    # The unmasked statistics would differ: padding positions do route.
    no_mask = dict(padded, weights=np.ones((b, l), np.float32))
    other = _aux(graphdef, params, rest, no_mask)
    assert any(
        not np.allclose(other[i]["balance_loss"], want[i]["balance_loss"], rtol=1e-4) for i in want
    )


def test_encoder_decoder_padding_changes_no_moe_loss():
    """T5 with MoE in encoder and decoder: encoder padding (token 0) and decoder positions
    of weight 0 count nowhere; the per-example top-2 fractions (complexity vectors) too."""
    graphdef, params, rest = _moe_model(TINY_T5[:1] + TINY_T5[2:])
    rng = np.random.default_rng(2)
    b, s, l, n_enc, n_dec = 4, 12, 8, 7, 5
    encoder = np.zeros((b, s), np.int32)
    encoder[:, :n_enc] = rng.integers(1, 128, size=(b, n_enc))
    targets = rng.integers(1, 128, size=(b, l)).astype(np.int32)
    targets[:, n_dec:] = 0
    inputs = np.zeros_like(targets)
    inputs[:, 1:] = targets[:, :-1]
    weights = (np.arange(l) < n_dec)[None].repeat(b, 0).astype(np.float32)
    padded = {"encoder_inputs": encoder, "inputs": inputs, "targets": targets, "weights": weights}
    cut = {
        "encoder_inputs": encoder[:, :n_enc],
        "inputs": inputs[:, :n_dec],
        "targets": targets[:, :n_dec],
        "weights": weights[:, :n_dec],
    }
    got, want = _aux(graphdef, params, rest, padded), _aux(graphdef, params, rest, cut)
    assert {"encoder_0", "decoder_0"} <= set(got)
    _check_same_aux(got, want)
