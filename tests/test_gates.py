"""Gates and router losses against per-token numpy references and hand-computed values."""

import math

import jax
import numpy as np
import pytest

from jaxmoe.models.moe import gates
from jaxmoe.models.moe.gates import GateOptions

# ---------------------------------------------------------------------------------------
# Independent reference: one token at a time, plain Python / numpy, no jax.


def ref_choose(p: np.ndarray, cfg: GateOptions) -> list[int]:
    """The experts one token goes to, most probable first (ties: lower index first)."""
    order = sorted(range(len(p)), key=lambda e: (-p[e], e))
    if cfg.gating in ("top1", "top2", "topk"):
        k = {"top1": 1, "top2": 2, "topk": cfg.top_k}[cfg.gating]
        return order[:k]
    if cfg.gating == "adaptive":
        p1, p2 = p[order[0]], p[order[1]]
        gap = (p1 - p2) / (p1 + p2) if cfg.gap_normalization == "top2" else p1 - p2
        return order[:2] if gap < cfg.threshold else order[:1]
    chosen, total = [], 0.0  # top_p
    for e in order[: cfg.max_k]:
        if total >= cfg.top_p:
            break
        chosen.append(e)
        total += p[e]
    return chosen


def ref_weights(p: np.ndarray, chosen: list[int], cfg: GateOptions) -> list[float]:
    if len(chosen) == 1:
        return [p[chosen[0]] if cfg.single_weight == "prob" else 1.0]
    total = sum(p[e] for e in chosen)
    return [p[e] / total if cfg.renormalize else p[e] for e in chosen]


def ref_route(probs: np.ndarray, cfg: GateOptions) -> list[list[tuple[int, float]]]:
    """Per token: [(expert, weight), ...] in slot order."""
    out = []
    for p in probs:
        chosen = ref_choose(p, cfg)
        out.append(list(zip(chosen, ref_weights(p, chosen, cfg), strict=True)))
    return out


def as_token_lists(routing: gates.Routing) -> list[list[tuple[int, float]]]:
    indices, weights, mask = (np.asarray(a) for a in routing)
    return [
        [(int(i), float(w)) for i, w, m in zip(ii, ww, mm, strict=True) if m]
        for ii, ww, mm in zip(indices, weights, mask, strict=True)
    ]


def assert_same_routing(got, want, atol=1e-6):
    assert len(got) == len(want)
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        assert [e for e, _ in g] == [e for e, _ in w], f"token {t}: {g} != {w}"
        np.testing.assert_allclose([x for _, x in g], [x for _, x in w], atol=atol, err_msg=f"{t}")


def random_probs(seed: int, tokens: int = 256, experts: int = 8, temperature: float = 1.0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(tokens, experts)) / temperature
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


# ---------------------------------------------------------------------------------------

CASES = [
    GateOptions(gating="top1"),
    GateOptions(gating="top1", single_weight="one"),
    GateOptions(gating="top2"),
    GateOptions(gating="top2", renormalize=True),
    GateOptions(gating="topk", top_k=3),
    GateOptions(gating="topk", top_k=3, renormalize=True),
    GateOptions(gating="adaptive"),
    GateOptions(gating="adaptive", threshold=0.3, renormalize=True, single_weight="one"),
    GateOptions(gating="adaptive", threshold=0.05, gap_normalization="none"),
    GateOptions(gating="top_p", top_p=0.4, max_k=3),
    GateOptions(gating="top_p", top_p=0.5, max_k=2, renormalize=True),
]


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: f"{c.gating}-{c}")
def test_gate_matches_per_token_reference(cfg):
    probs = random_probs(seed=1, temperature=0.7)
    got = gates.route(probs, cfg)
    assert got.indices.shape == got.weights.shape == got.mask.shape == (256, gates.num_slots(cfg))
    assert_same_routing(as_token_lists(got), ref_route(probs, cfg))
    # Masked slots carry no weight.
    assert np.all(np.asarray(got.weights)[~np.asarray(got.mask)] == 0)


def test_reference_cases_are_not_degenerate():
    """The random probabilities exercise both branches of every dynamic gate."""
    probs = random_probs(seed=1, temperature=0.7)
    for cfg in CASES:
        sizes = {len(ref_choose(p, cfg)) for p in probs}
        if cfg.gating in ("adaptive", "top_p"):
            assert len(sizes) > 1, cfg


def test_adaptive_hand_made_gaps():
    probs = np.array(
        [
            [0.50, 0.45, 0.05, 0.00],  # normalised gap 0.05/0.95 = 0.053: two experts
            [0.10, 0.60, 0.30, 0.00],  # gap 0.3/0.9 = 0.333: expert 1 alone
            [0.20, 0.20, 0.35, 0.25],  # gap 0.1/0.6 = 0.167: expert 2 alone
        ],
        np.float32,
    )
    got = as_token_lists(gates.route(probs, GateOptions(gating="adaptive", threshold=0.1)))
    assert_same_routing(got, [[(0, 0.50), (1, 0.45)], [(1, 0.60)], [(2, 0.35)]])
    # Raw gaps 0.05, 0.3, 0.1 against threshold 0.08: only the first takes two experts.
    raw = GateOptions(gating="adaptive", threshold=0.08, gap_normalization="none")
    got = as_token_lists(gates.route(probs, raw))
    assert_same_routing(got, [[(0, 0.50), (1, 0.45)], [(1, 0.60)], [(2, 0.35)]])
    # Renormalised weights and weight one for a single expert.
    opts = GateOptions(gating="adaptive", threshold=0.1, renormalize=True, single_weight="one")
    got = as_token_lists(gates.route(probs, opts))
    assert_same_routing(got, [[(0, 0.50 / 0.95), (1, 0.45 / 0.95)], [(1, 1.0)], [(2, 1.0)]])


def test_adaptive_threshold_limits_are_top1_and_top2():
    probs = random_probs(seed=2, temperature=0.5)
    for opts in ({}, {"renormalize": True}, {"single_weight": "one"}):
        top1 = gates.route(probs, GateOptions(gating="top1", **opts))
        top2 = gates.route(probs, GateOptions(gating="top2", **opts))
        zero = gates.route(probs, GateOptions(gating="adaptive", threshold=0.0, **opts))
        one = gates.route(probs, GateOptions(gating="adaptive", threshold=1.0, **opts))
        assert_same_routing(as_token_lists(zero), as_token_lists(top1), atol=0)
        assert_same_routing(as_token_lists(one), as_token_lists(top2), atol=0)


def test_top_p_hand_made():
    probs = np.array(
        [
            [0.45, 0.30, 0.25],  # 0.45 >= 0.4 alone
            [0.30, 0.25, 0.45],  # expert 2 alone
            [0.35, 0.33, 0.32],  # 0.35 < 0.4: add 0.33 -> 0.68
            [0.39, 0.005, 0.605],  # expert 2 alone
        ],
        np.float32,
    )
    got = as_token_lists(gates.route(probs, GateOptions(gating="top_p", top_p=0.4, max_k=3)))
    assert_same_routing(got, [[(0, 0.45)], [(2, 0.45)], [(0, 0.35), (1, 0.33)], [(2, 0.605)]])
    # p = 0.9 needs all three for token 2 but max_k = 2 caps the set.
    got = as_token_lists(gates.route(probs, GateOptions(gating="top_p", top_p=0.9, max_k=2)))
    assert [len(t) for t in got] == [2, 2, 2, 2]


def test_balance_loss_hand_computed():
    probs = np.array([[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.1, 0.5, 0.4], [0.3, 0.3, 0.4]])
    probs = probs.astype(np.float32)
    mean_p = [1.7 / 4, 1.3 / 4, 1.0 / 4]
    # Adaptive (T = 0.1): top-1 experts are 0, 0, 1, 2 -> f1 = [1/2, 1/4, 1/4].
    adaptive = GateOptions(gating="adaptive", threshold=0.1)
    want = 3 * (0.5 * mean_p[0] + 0.25 * mean_p[1] + 0.25 * mean_p[2])
    routing = gates.route(probs, adaptive)
    assert math.isclose(float(gates.balance_loss(probs, routing, "adaptive")), want, rel_tol=1e-6)
    # Top-2: assignments {0,1}, {0,1}, {1,2}, {2, 0} (token 3: 0.4 then 0.3 tie -> expert 0)
    # -> counts [3, 3, 2] of 8.
    routing = gates.route(probs, GateOptions(gating="top2"))
    want = 3 * (3 / 8 * mean_p[0] + 3 / 8 * mean_p[1] + 2 / 8 * mean_p[2])
    assert math.isclose(float(gates.balance_loss(probs, routing, "top2")), want, rel_tol=1e-6)
    # The same top-2 routing counted on top-1 choices only (GShard's implementation):
    # top-1 experts 0, 0, 1, 2 -> f = [1/2, 1/4, 1/4].
    want_top1 = 3 * (0.5 * mean_p[0] + 0.25 * mean_p[1] + 0.25 * mean_p[2])
    got = float(gates.balance_loss(probs, routing, "top2", fractions="top1"))
    assert math.isclose(got, want_top1, rel_tol=1e-6)
    # Top-1 (Switch): f = [2/4, 1/4, 1/4], the same as the adaptive top-1 fractions.
    routing = gates.route(probs, GateOptions(gating="top1"))
    want = 3 * (0.5 * mean_p[0] + 0.25 * mean_p[1] + 0.25 * mean_p[2])
    assert math.isclose(float(gates.balance_loss(probs, routing, "top1")), want, rel_tol=1e-6)
    # Perfect balance gives exactly 1.
    uniform = np.full((4, 4), 0.25, np.float32)
    routing = gates.Routing(
        np.arange(4, dtype=np.int32)[:, None], np.ones((4, 1)), np.ones((4, 1), bool)
    )
    assert math.isclose(float(gates.balance_loss(uniform, routing, "top1")), 1.0, rel_tol=1e-6)


def test_balance_loss_counts_only_unmasked_assignments():
    probs = random_probs(seed=3, tokens=64, experts=4)
    cfg = GateOptions(gating="top_p", top_p=0.4, max_k=3)
    counts = np.zeros(4)
    for token in ref_route(probs, cfg):
        for e, _ in token:
            counts[e] += 1
    want = 4 * np.sum(counts / counts.sum() * probs.mean(axis=0))
    got = gates.balance_loss(probs, gates.route(probs, cfg), "top_p")
    np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_z_loss_and_balance_gradient():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(16, 4)).astype(np.float32) * 3
    lse = np.log(np.exp(logits.astype(np.float64)).sum(axis=1))
    np.testing.assert_allclose(float(gates.z_loss(logits)), np.mean(lse**2), rtol=1e-6)

    # d balance / d probs[t, e] = E * f_e / T: the hard fractions carry no gradient.
    probs = random_probs(seed=5, tokens=16, experts=4)
    routing = gates.route(probs, GateOptions(gating="top2"))
    grad = jax.grad(lambda p: gates.balance_loss(p, routing, "top2"))(probs)
    counts = np.zeros(4)
    for token in ref_route(probs, GateOptions(gating="top2")):
        for e, _ in token:
            counts[e] += 1
    want = np.broadcast_to(4 * (counts / counts.sum()) / 16, (16, 4))
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-6)


@pytest.mark.parametrize(
    "field,value",
    [
        ("gating", "top3"),
        ("gap_normalization", "softmax"),
        ("single_weight", "half"),
        ("top_p", 0.0),
        ("max_k", 0),
        ("threshold", -0.1),
    ],
)
def test_bad_options_name_the_key(field, value):
    with pytest.raises(ValueError, match=f"model.moe.{field}"):
        GateOptions(**{field: value})


def test_paper_config_says_what_the_paper_did():
    from jaxmoe.config.loading import load_config

    adaptive = load_config("configs/moe16_gpt2_medium.py")
    moe = adaptive.model.moe
    assert (moe.gate.gating, moe.gate.threshold, moe.z_loss_weight, moe.eval_gating) == (
        "adaptive",
        0.1,
        0.0,
        "top1",
    )
    top2 = load_config("configs/moe16_gpt2_medium.py:top2").model.moe
    assert (top2.gate.gating, top2.balance_fractions, top2.eval_gating) == ("top2", "top1", "top1")
