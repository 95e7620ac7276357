"""The adaptive_k gate against a per-token, per-rank numpy loop, and the MoE layer with it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tests.test_moe as test_moe
from jaxmoe.models.moe import dispatch, gates
from jaxmoe.models.moe.gates import GateOptions
from jaxmoe.models.moe.layer import MoE
from tests.helpers import tiny_config
from tests.test_gates import (
    as_token_lists,
    assert_same_routing,
    random_probs,
    ref_choose,
    ref_weights,
)
from tests.test_moe import E, L, check_against_reference, layer_and_grads, moe_config, ref_layer


def ref_adaptive_k(p: np.ndarray, cfg: GateOptions) -> list[int]:
    """The rule written plainly: the top-1 expert, then the next ranks while unsure."""
    order = sorted(range(len(p)), key=lambda e: (-float(p[e]), e))
    p1 = float(p[order[0]])
    chosen = [order[0]]
    for e in order[1 : cfg.max_k]:
        pj = float(p[e])
        gap = (p1 - pj) / (p1 + pj) if cfg.gap_normalization == "top2" else p1 - pj
        if not gap < cfg.threshold:
            break
        chosen.append(e)
    return chosen


def ref_route(probs, cfg):
    out = []
    for p in np.asarray(probs, np.float64):
        chosen = ref_adaptive_k(p, cfg)
        out.append(list(zip(chosen, ref_weights(p, chosen, cfg), strict=True)))
    return out


def route(probs, **options):
    return gates.route(jnp.asarray(probs, jnp.float32), GateOptions(gating="adaptive_k", **options))


# ---------------------------------------------------------------------------------------
# Hand-built routers: confident, flat, two-peaked (8 experts, max_k 4, threshold 0.1, so an
# expert joins when pj / p1 > 0.9 / 1.1 = 0.818).

CONFIDENT = [0.65, 0.10, 0.08, 0.06, 0.05, 0.03, 0.02, 0.01]
FLAT = [0.13, 0.125, 0.125, 0.125, 0.125, 0.125, 0.125, 0.12]
TWO_PEAKED = [0.02, 0.40, 0.03, 0.38, 0.05, 0.04, 0.05, 0.03]
# Decays by 0.85 per rank: every neighbour gap is 0.081 < 0.1, but rank 3 is at 0.72 p1.
GEOMETRIC = [0.85**j for j in range(8)]


def test_hand_built_routers():
    probs = np.array([CONFIDENT, FLAT, TWO_PEAKED, np.array(GEOMETRIC) / sum(GEOMETRIC)])
    got = as_token_lists(route(probs, threshold=0.1, max_k=4))
    g = np.array(GEOMETRIC) / sum(GEOMETRIC)
    want = [
        [(0, 0.65)],  # (0.65 - 0.10) / 0.75 = 0.73
        [(0, 0.13), (1, 0.125), (2, 0.125), (3, 0.125)],  # gaps 0.0196: all of max_k
        [(1, 0.40), (3, 0.38)],  # 0.02 / 0.78 = 0.026 takes rank 2; rank 3: 0.35 / 0.45
        [(0, g[0]), (1, g[1])],  # 0.15 / 1.85 = 0.081 takes rank 2; rank 3: 0.28 / 1.72
    ]
    assert_same_routing(got, want)
    # Raw gaps p1 - pj: threshold 0.3 keeps the flat router whole and the confident one alone.
    got = as_token_lists(route(probs[:3], threshold=0.3, max_k=4, gap_normalization="none"))
    assert [len(t) for t in got] == [1, 4, 2]  # two-peaked: 0.40 - 0.05 = 0.35 stops rank 3
    # Renormalised weights, and weight one for a token with one expert.
    got = as_token_lists(
        route(probs[:3], threshold=0.1, max_k=4, renormalize=True, single_weight="one")
    )
    assert_same_routing(
        got,
        [[(0, 1.0)], [(e, w / 0.505) for e, w in want[1]], [(1, 0.40 / 0.78), (3, 0.38 / 0.78)]],
    )


CASES = [
    GateOptions(gating="adaptive_k", max_k=4, threshold=0.1),
    GateOptions(gating="adaptive_k", max_k=4, threshold=0.3, renormalize=True),
    GateOptions(gating="adaptive_k", max_k=3, threshold=0.5, single_weight="one"),
    GateOptions(gating="adaptive_k", max_k=8, threshold=0.2, gap_normalization="none"),
    GateOptions(gating="adaptive_k", max_k=8, threshold=0.6, renormalize=True),
    GateOptions(gating="adaptive_k", max_k=1, threshold=0.9),
    GateOptions(gating="adaptive_k", max_k=5, threshold=0.0),
    GateOptions(gating="adaptive_k", max_k=5, threshold=1.0),
]


@pytest.mark.parametrize("cfg", CASES, ids=str)
def test_matches_per_token_loop(cfg):
    probs = random_probs(seed=3, temperature=0.6)
    got = jax.jit(gates.route, static_argnums=1)(probs, cfg)
    assert got.indices.shape == (256, gates.num_slots(cfg)) == (256, cfg.max_k)
    assert_same_routing(as_token_lists(got), ref_route(probs, cfg))
    mask = np.asarray(got.mask)
    assert np.all(np.asarray(got.weights)[~mask] == 0)
    # The kept slots are a prefix of the ranking.
    assert np.all(mask[:, :1]) and np.all(mask[:, 1:] <= mask[:, :-1])


def test_random_rows_exercise_every_count():
    probs = random_probs(seed=3, temperature=0.6)
    sizes = {len(ref_adaptive_k(p, CASES[1])) for p in probs}
    assert sizes == {1, 2, 3, 4}
    # Threshold 0 is top-1; threshold 1 is top-max_k (no probability underflows to 0 here).
    assert {len(ref_adaptive_k(p, CASES[6])) for p in probs} == {1}
    assert {len(ref_adaptive_k(p, CASES[7])) for p in probs} == {5}


@pytest.mark.parametrize(
    "options",
    [
        dict(threshold=0.1),
        dict(threshold=0.3, renormalize=True, single_weight="one"),
        dict(threshold=0.05, gap_normalization="none"),
        dict(threshold=0.0),
        dict(threshold=1.0, renormalize=True),
    ],
    ids=str,
)
def test_max_k_2_is_the_adaptive_gate(options):
    probs = np.concatenate(
        [random_probs(seed, temperature=t) for seed, t in ((5, 0.3), (6, 1.0), (7, 3.0))]
    )
    adaptive = gates.route(probs, GateOptions(gating="adaptive", **options))
    ours = gates.route(probs, GateOptions(gating="adaptive_k", max_k=2, **options))
    for name, a, b in zip(gates.Routing._fields, adaptive, ours, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    # The same token lists as the adaptive gate's own reference loop.
    want = [ref_choose(p, GateOptions(gating="adaptive", **options)) for p in probs]
    assert [[e for e, _ in t] for t in as_token_lists(ours)] == want


def test_max_k_equal_to_num_experts():
    probs = random_probs(seed=8, tokens=64, experts=6, temperature=3.0)
    cfg = GateOptions(gating="adaptive_k", max_k=6, threshold=0.4)
    got = gates.route(probs, cfg)
    assert got.indices.shape == (64, 6)
    assert_same_routing(as_token_lists(got), ref_route(probs, cfg))
    assert 6 in {len(t) for t in as_token_lists(got)}  # every expert, for some token


def test_ties():
    probs = np.array(
        [
            [0.25, 0.0, 0.25, 0.25, 0.25, 0.0],  # four-way tie: ranks by lower index
            [0.1, 0.3, 0.1, 0.3, 0.1, 0.1],  # tied top-1: the lower index leads
            [0.2, 0.4, 0.2, 0.2, 0.0, 0.0],  # a tie at the rank where max_k cuts
        ]
    )
    got = as_token_lists(route(probs, threshold=0.1, max_k=3))
    assert [[e for e, _ in t] for t in got] == [[0, 2, 3], [1, 3], [1]]
    got = as_token_lists(route(probs, threshold=0.5, max_k=3))
    assert [[e for e, _ in t] for t in got] == [[0, 2, 3], [1, 3], [1, 0, 2]]
    # Threshold 0: a tied expert's gap is 0, not below 0, so only the top-1 expert.
    got = as_token_lists(route(probs, threshold=0.0, max_k=3))
    assert [[e for e, _ in t] for t in got] == [[0], [1], [1]]


def test_balance_loss_counts_every_chosen_expert():
    """auto for adaptive_k = every kept assignment (as topk and top_p count them)."""
    probs = random_probs(seed=9, tokens=64, temperature=0.6)
    cfg = GateOptions(gating="adaptive_k", max_k=4, threshold=0.3)
    counts = np.zeros(8)
    for p in probs:
        for e in ref_adaptive_k(p, cfg):
            counts[e] += 1
    want = 8 * np.sum(counts / counts.sum() * probs.mean(axis=0))
    got = gates.balance_loss(probs, gates.route(probs, cfg), "adaptive_k")
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    # fractions=top1 gives the paper's form (top-1 choices only).
    top1 = np.bincount(probs.argmax(axis=1), minlength=8) / 64
    got = gates.balance_loss(probs, gates.route(probs, cfg), "adaptive_k", "top1")
    np.testing.assert_allclose(float(got), 8 * np.sum(top1 * probs.mean(axis=0)), rtol=1e-5)


def test_padded_tokens():
    """Padding changes neither the real tokens' routing nor the losses of the real tokens."""
    real = random_probs(seed=10, tokens=48, temperature=0.6)
    pad = random_probs(seed=11, tokens=16, temperature=0.1)  # very different routers
    probs = np.concatenate([real[:20], pad, real[20:]])
    token_mask = np.arange(64) < 20
    token_mask[36:] = True
    cfg = GateOptions(gating="adaptive_k", max_k=4, threshold=0.3)
    routing = gates.route(probs, cfg)
    assert_same_routing(
        [t for t, m in zip(as_token_lists(routing), token_mask, strict=True) if m],
        ref_route(real, cfg),
    )
    got = gates.balance_loss(probs, routing, "adaptive_k", token_mask_T=jnp.asarray(token_mask))
    want = gates.balance_loss(real, gates.route(real, cfg), "adaptive_k")
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)

    # The layer: top2_fraction (two or more experts) over the real tokens only.
    moe_cfg = moe_config(gating="adaptive_k", max_k=4, threshold=0.3, dispatch="dense")
    model = MoE.of_model(moe_cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, L, test_moe.D))
    mask_BL = np.ones((2, L), bool)
    mask_BL[1, L // 2 :] = False
    y, aux = model(x, train=False, token_mask_BL=jnp.asarray(mask_BL))
    # Routing is per token: the mask changes no real token's output.
    y_unmasked, _ = model(x, train=False)
    np.testing.assert_allclose(np.asarray(y)[mask_BL], np.asarray(y_unmasked)[mask_BL], rtol=1e-6)
    gate = moe_cfg.moe.gate.replace(gating="adaptive_k")
    _, probs_TE = model.route_probs(x, train=False)
    sizes = np.array([len(ref_adaptive_k(p, gate)) for p in np.asarray(probs_TE)])
    want = np.mean(sizes.reshape(2, L)[mask_BL] >= 2)
    np.testing.assert_allclose(float(aux["top2_fraction"]), want, rtol=1e-6)


# ---------------------------------------------------------------------------------------
# The MoE layer: forward and gradients against test_moe's float64 loop, every dispatch.


@pytest.fixture
def adaptive_k_reference(monkeypatch):
    """test_moe.ref_layer picks experts with ref_choose; teach it adaptive_k."""

    def choose(p, cfg):
        return ref_adaptive_k(p, cfg) if cfg.gating == "adaptive_k" else ref_choose(p, cfg)

    monkeypatch.setattr(test_moe, "ref_choose", choose)


LAYER_CASES = {
    "blocks": dict(),
    "ragged-renorm": dict(dispatch="ragged", renormalize=True),
    "dense-one": dict(dispatch="dense", single_weight="one"),
    # Capacity 4 per expert (factor 0.5 of 4 slots): about two experts a token overflow some.
    "capacity": dict(dispatch="capacity", capacity_factor=0.5),
    "blocks-capacity": dict(dispatch="blocks", capacity_factor=0.5),
}


@pytest.mark.parametrize("case", LAYER_CASES)
def test_layer_matches_per_token_loop(case, data, adaptive_k_reference):
    options = dict(gating="adaptive_k", max_k=4, threshold=0.3, **LAYER_CASES[case])
    cfg = moe_config(**options)
    capacity = None
    if options.get("capacity_factor"):
        capacity = dispatch.expert_capacity(options["capacity_factor"], L, 4, E)
    aux = check_against_reference(cfg, data, capacity=capacity)
    assert 0 < aux["top2_fraction"] < 1
    if capacity:
        assert 0 < aux["dropped_fraction"] < 0.5
    # Every dispatch gives the dense dispatch's output for the same routing.
    x, r = data
    _, y, _, _, dx = layer_and_grads(cfg, x, r)
    dense = dict(options, dispatch="dense")
    _, y_dense, _, _, dx_dense = layer_and_grads(moe_config(**dense), x, r)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_dense), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(dx_dense), rtol=1e-5, atol=1e-6)


def test_layer_takes_one_to_max_k_experts(data):
    """The layer case above really routes tokens to 1, 2, 3 and 4 experts."""
    x, _ = data
    cfg = moe_config(gating="adaptive_k", max_k=4, threshold=0.3)
    model = MoE.of_model(cfg, rngs=nnx.Rngs(0))
    _, probs_TE = model.route_probs(x, train=False)
    gate = cfg.moe.gate.replace(gating="adaptive_k")
    assert {len(ref_adaptive_k(p, gate)) for p in np.asarray(probs_TE)} == {1, 2, 3, 4}


def test_eval_with_the_original_top_k(data):
    """A model trained with adaptive_k can be evaluated with the fixed top-k it came from."""
    x, r = data
    cfg = moe_config(gating="adaptive_k", max_k=4, top_k=4, threshold=0.3, eval_gating="topk")
    params, y, aux, _, _ = layer_and_grads(cfg, x, r, train=False)
    want_y, want_aux, _, _ = ref_layer(params, x, r, cfg.moe.gate.replace(gating="topk"))
    np.testing.assert_allclose(np.asarray(y), want_y, rtol=1e-4, atol=2e-5)
    assert float(aux["top2_fraction"]) == 1.0 == want_aux["top2_fraction"]
    # Training still routes adaptively (same parameters: same seed).
    _, _, train_aux, _, _ = layer_and_grads(cfg, x, r, train=True)
    assert float(train_aux["top2_fraction"]) < 1.0
    # The config loads and validates with these keys.
    config = tiny_config(
        "model.moe.gating=adaptive_k",
        "model.moe.max_k=4",
        "model.moe.top_k=4",
        "model.moe.eval_gating=topk",
    )
    assert (config.model.moe.gate.gating, config.model.moe.eval_gating) == ("adaptive_k", "topk")


data = test_moe.data
