"""The MoE layer against a per-token, per-expert float64 numpy loop (forward and gradients)."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.models.moe import dispatch
from jaxmoe.models.moe.layer import MoE
from jaxmoe.models.options import ModelOptions
from tests.test_gates import ref_choose, ref_weights

B, L, D, F, E = 4, 16, 16, 32, 8


def moe_config(**moe) -> ModelOptions:
    """The complete default model config (as every command gets one) at this file's sizes."""
    model = ModelOptions(d_model=D, activation="silu", ffn_gated=True)
    defaults = dict(num_experts=E, ffn_dim=F, block_size=8, dispatch="blocks")
    return model.replace(moe=model.moe.replace(**(defaults | moe)))


# ---------------------------------------------------------------------------------------
# Independent reference: float64 numpy, one token and one chosen expert at a time, with
# the backward pass written out by hand.


def _silu(a):
    return a / (1.0 + np.exp(-a))


def _dsilu(a):
    s = 1.0 / (1.0 + np.exp(-a))
    return s * (1.0 + a * (1.0 - s))


def ref_kept(choices: list[list[int]], capacity: int | None) -> list[list[bool]]:
    """Per sequence of L tokens: first choices before second choices, earlier tokens first."""
    kept = [[True] * len(c) for c in choices]
    if not capacity:
        return kept
    for start in range(0, len(choices), L):
        load = [0] * E
        for slot in range(max(len(c) for c in choices)):
            for t in range(start, start + L):
                if slot < len(choices[t]):
                    load[choices[t][slot]] += 1
                    kept[t][slot] = load[choices[t][slot]] <= capacity
    return kept


def ref_layer(params, x, r, cfg, capacity=None, balance_coef=0.3, z_coef=0.7):
    """y, aux, and grads of sum(y * r) + balance_coef * balance + z_coef * z_loss."""
    router, wi_0, wi_1, wo = (
        np.asarray(params[k], np.float64) for k in ("router", "wi_0", "wi_1", "wo")
    )
    xs = np.asarray(x, np.float64).reshape(-1, D)
    rs = np.asarray(r, np.float64).reshape(-1, D)
    tokens = xs.shape[0]
    grads = {
        k: np.zeros_like(v)
        for k, v in (("router", router), ("wi_0", wi_0), ("wi_1", wi_1), ("wo", wo))
    }
    dx = np.zeros_like(xs)
    ys = np.zeros_like(xs)
    probs = np.zeros((tokens, E))
    dprobs = np.zeros((tokens, E))
    choices, weights = [], []
    for t in range(tokens):
        logits = xs[t] @ router
        p = np.exp(logits - logits.max())
        probs[t] = p / p.sum()
        choices.append(ref_choose(probs[t], cfg))
        weights.append(ref_weights(probs[t], choices[-1], cfg))
    kept = ref_kept(choices, capacity)
    for t in range(tokens):
        dweight = []
        for e, w, keep in zip(choices[t], weights[t], kept[t], strict=True):
            if not keep:
                dweight.append(0.0)
                continue
            a, b = xs[t] @ wi_0[e], xs[t] @ wi_1[e]
            h = _silu(a) * b
            out = h @ wo[e]
            ys[t] += w * out
            dweight.append(rs[t] @ out)
            dout = w * rs[t]
            grads["wo"][e] += np.outer(h, dout)
            dh = wo[e] @ dout
            da, db = dh * b * _dsilu(a), dh * _silu(a)
            grads["wi_0"][e] += np.outer(xs[t], da)
            grads["wi_1"][e] += np.outer(xs[t], db)
            dx[t] += wi_0[e] @ da + wi_1[e] @ db
        chosen = choices[t]
        if len(chosen) == 1:
            if cfg.single_weight == "prob":
                dprobs[t, chosen[0]] += dweight[0]
        elif cfg.renormalize:
            total = sum(probs[t, e] for e in chosen)
            mean = sum(g * w for g, w in zip(dweight, weights[t], strict=True))
            for e, g in zip(chosen, dweight, strict=True):
                dprobs[t, e] += (g - mean) / total
        else:
            for e, g in zip(chosen, dweight, strict=True):
                dprobs[t, e] += g
    # Balance loss: E * sum_e f_e * mean_t p_te; f from hard choices (no gradient).
    counts = np.zeros(E)
    for c in choices:
        for e in c[:1] if cfg.gating == "adaptive" else c:
            counts[e] += 1
    frac = counts / counts.sum()
    balance = E * np.sum(frac * probs.mean(axis=0))
    dprobs += balance_coef * E * frac / tokens
    logits_all = xs @ router
    lse = np.log(np.exp(logits_all).sum(axis=1))
    z = np.mean(lse**2)
    dlogits = probs * (dprobs - np.sum(probs * dprobs, axis=1, keepdims=True))
    dlogits += z_coef * 2 * lse[:, None] * probs / tokens
    grads["router"] = xs.T @ dlogits
    dx += dlogits @ router.T
    multi = np.array([len(c) >= 2 for c in choices], np.float64).reshape(-1, L)
    load = np.zeros(E)
    for c in choices:
        for e in c:
            load[e] += 1
    n_assign = sum(len(c) for c in choices)
    n_kept = sum(sum(k) for k in kept)
    aux = {
        "top2_fraction": multi.mean(),
        "top2_per_example": multi.mean(axis=1),
        "expert_load_cv": load.std() / load.mean(),
        "dropped_fraction": 1 - n_kept / n_assign,
        "balance_loss": balance,
        "router_z_loss": z,
    }
    return ys.reshape(x.shape), aux, grads, dx.reshape(x.shape)


# ---------------------------------------------------------------------------------------


def layer_and_grads(cfg, x, r, *, train=True, seed=0):
    """Jitted y, aux and grads (params, x) of sum(y * r) + 0.3 balance + 0.7 z."""
    model = MoE.of_model(cfg, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model)

    @jax.jit
    def run(params, x):
        def loss(params, x):
            y, aux = nnx.merge(graphdef, params)(x, train=train)
            total = jnp.sum(y * r) + 0.3 * aux["balance_loss"] + 0.7 * aux["router_z_loss"]
            return total, (y, aux)

        return jax.grad(loss, argnums=(0, 1), has_aux=True)(params, x)

    (dparams, dx), (y, aux) = run(params, x)
    plain = {k: np.asarray(v[...]) for k, v in nnx.to_pure_dict(params).items()}
    dplain = {k: np.asarray(v) for k, v in nnx.to_pure_dict(dparams).items()}
    return plain, y, aux, dplain, dx


@pytest.fixture(scope="module")
def data():
    kx, kr = jax.random.split(jax.random.key(42))
    return jax.random.normal(kx, (B, L, D)), jax.random.normal(kr, (B, L, D))


def check_against_reference(cfg, data, *, capacity=None):
    x, r = data
    params, y, aux, dparams, dx = layer_and_grads(cfg, x, r)
    gate = cfg.moe.gate
    want_y, want_aux, want_grads, want_dx = ref_layer(params, x, r, gate, capacity)
    tol = dict(rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(np.asarray(y), want_y, **tol, err_msg="y")
    np.testing.assert_allclose(np.asarray(dx), want_dx, **tol, err_msg="dx")
    for name, want in want_grads.items():
        np.testing.assert_allclose(dparams[name], want, **tol, err_msg=f"d{name}")
    for name, want in want_aux.items():
        np.testing.assert_allclose(np.asarray(aux[name]), want, rtol=1e-5, atol=1e-6, err_msg=name)
    return want_aux


LAYER_CASES = {
    "blocks-adaptive": dict(),
    "dense-top1-one": dict(gating="top1", single_weight="one", dispatch="dense"),
    "dense-top2-renorm": dict(gating="top2", renormalize=True, dispatch="dense"),
    "dense-top3": dict(gating="topk", top_k=3, dispatch="dense"),
    "blocks-top_p-renorm": dict(gating="top_p", top_p=0.4, max_k=3, renormalize=True),
    "dense-adaptive-raw-gap": dict(dispatch="dense", threshold=0.05, gap_normalization="none"),
    "ragged-adaptive-renorm": dict(dispatch="ragged", threshold=0.3, renormalize=True),
}


@pytest.mark.gpu(also_on_cpu=True)  # `pytest -m gpu`: the dispatches' GPU lowerings
@pytest.mark.tpu(also_on_cpu=True)
@pytest.mark.parametrize("case", LAYER_CASES)
def test_layer_matches_per_token_loop(case, data):
    aux = check_against_reference(moe_config(**LAYER_CASES[case]), data)
    if "adaptive" in case or "top_p" in case:
        assert 0 < aux["top2_fraction"] < 1  # both branches of the gate are exercised


@pytest.mark.parametrize("impl", ["blocks", "capacity"])
def test_capacity_mode_matches_reference(impl, data):
    cfg = moe_config(gating="top2", capacity_factor=1.0, dispatch=impl)
    capacity = dispatch.expert_capacity(1.0, L, 2, E)
    aux = check_against_reference(cfg, data, capacity=capacity)
    assert 0 < aux["dropped_fraction"] < 0.5


def test_capacity_drops_exactly_the_overflow():
    # One sequence of 5 tokens, 2 slots, 3 experts, capacity 2; all first choices are
    # queued before any second choice.
    # Slot 0: e0 <- t0, t2, then t4 overflows; e2 <- t1; e1 <- t3.
    # Slot 1: e1 <- t0; e0 <- t1 overflows; (t2 masked); e2 <- t3; e2 <- t4 overflows.
    indices = np.array([[[0, 1], [2, 0], [0, 1], [1, 2], [0, 2]]], np.int32)
    mask = np.array([[[1, 1], [1, 1], [1, 0], [1, 1], [1, 1]]], bool)
    keep = np.asarray(dispatch.capacity_keep(indices, mask, 3, capacity=2))
    want = np.array([[[1, 1], [1, 0], [1, 0], [1, 1], [0, 0]]], bool)
    np.testing.assert_array_equal(keep, want)

    # The layer's output drops exactly those assignments (both capacity implementations).
    rng = np.random.default_rng(0)
    experts = tuple(
        rng.normal(size=s).astype(np.float32) / 3 for s in ((3, 4, 6), (3, 4, 6), (3, 6, 4))
    )
    x = rng.normal(size=(1, 5, 4)).astype(np.float32)
    weights = rng.uniform(size=(1, 5, 2)).astype(np.float32)
    want_y = np.zeros((5, 4))
    for t in range(5):
        for k in range(2):
            if want[0, t, k]:
                e = indices[0, t, k]
                h = _silu(x[0, t] @ experts[0][e]) * (x[0, t] @ experts[1][e])
                want_y[t] += weights[0, t, k] * (h @ experts[2][e])
    for impl in ("blocks", "capacity", "dense"):
        ffn = jax.jit(
            partial(dispatch.local_moe_ffn, act=jax.nn.silu, impl=impl, block_size=2, capacity=2)
        )
        y = ffn(x, indices, weights, keep, experts)
        np.testing.assert_allclose(np.asarray(y)[0], want_y, rtol=1e-5, atol=1e-6, err_msg=impl)


def test_block_dispatch_with_skewed_routing():
    """Empty experts, an expert with many full blocks, and every tail block size."""
    rng = np.random.default_rng(1)
    tokens, dim, ffn, num_experts = 40, 4, 6, 4
    # Expert 0 gets 37 assignments (blocks of 8, 4, 1), expert 3 gets 3, experts 1, 2 none.
    expert = np.array([0] * 37 + [3] * 3, np.int32)
    rng.shuffle(expert)
    x = rng.normal(size=(tokens, dim)).astype(np.float32)
    weight = rng.uniform(size=tokens).astype(np.float32)
    experts = tuple(
        rng.normal(size=s).astype(np.float32) / 2
        for s in ((num_experts, dim, ffn), (num_experts, dim, ffn), (num_experts, ffn, dim))
    )
    want = np.zeros((tokens, dim))
    for t in range(tokens):
        e = expert[t]
        h = _silu(x[t] @ experts[0][e]) * (x[t] @ experts[1][e])
        want[t] = weight[t] * (h @ experts[2][e])
    src = np.arange(tokens, dtype=np.int32)
    valid = np.ones(tokens, bool)
    ffn = jax.jit(partial(dispatch.grouped_ffn, act=jax.nn.silu, impl="blocks", block_size=8))
    y = ffn(x, src, expert, weight, valid, experts)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-6)


def test_eval_gating_and_jitter(data):
    x, _ = data
    cfg = moe_config(eval_gating="top1", jitter=0.1, dispatch="dense")
    model = MoE.of_model(cfg, rngs=nnx.Rngs(params=0, jitter=1))
    run = nnx.jit(lambda m, x, train: m(x, train=train), static_argnames="train")
    y1, aux_train = run(model, x, True)
    y2, _ = run(model, x, True)
    e1, aux_eval = run(model, x, False)
    e2, _ = run(model, x, False)
    assert float(aux_train["top2_fraction"]) > 0
    assert float(aux_eval["top2_fraction"]) == 0  # evaluated with top-1
    # Jitter: only in training, and fresh noise every call.
    assert not np.allclose(np.asarray(y1), np.asarray(y2))
    np.testing.assert_array_equal(np.asarray(e1), np.asarray(e2))


@pytest.mark.parametrize("impl", ["blocks", "ragged"])
def test_bfloat16_compute(impl, data, monkeypatch):
    """bf16 activations and expert matmuls, f32 router: close to the float64 reference
    (the ragged dispatch in 4 slices of the expert width, combined in bf16)."""
    monkeypatch.setattr(dispatch, "RAGGED_CHUNK_BYTES", 1)
    monkeypatch.setattr(dispatch, "RAGGED_CHUNK_LANES", 8)
    x, r = data
    cfg = moe_config(threshold=0.3, dispatch=impl)
    params, y, aux, dparams, dx = layer_and_grads(cfg, x.astype(jnp.bfloat16), r)
    assert y.dtype == dx.dtype == jnp.bfloat16
    assert aux["balance_loss"].dtype == jnp.float32
    x16 = np.asarray(x.astype(jnp.bfloat16), np.float64)
    gate = cfg.moe.gate
    want_y, _, want_grads, want_dx = ref_layer(params, x16, r, gate)
    scale = np.abs(want_y).max()
    np.testing.assert_allclose(np.asarray(y, np.float32), want_y, atol=0.03 * scale)
    np.testing.assert_allclose(
        np.asarray(dx, np.float32), want_dx, atol=0.03 * np.abs(want_dx).max()
    )
    for name, want in want_grads.items():
        np.testing.assert_allclose(
            dparams[name], want, atol=0.03 * np.abs(want).max(), err_msg=name
        )


@pytest.mark.parametrize(
    "override,key",
    [
        (dict(num_experts=1), "num_experts"),
        (dict(top_k=9), "top_k"),
        (dict(max_k=9), "max_k"),
        (dict(dispatch="sorted"), "dispatch"),
        (dict(dispatch="capacity"), "dispatch"),
        (dict(eval_gating="top3"), "eval_gating"),
        (dict(gating="expert_choice"), "gating"),
        (dict(capacity_factor=-1.0), "capacity_factor"),
        (dict(jitter=1.0), "jitter"),
    ],
)
def test_bad_config_names_the_key(override, key):
    with pytest.raises(ValueError, match=f"model.moe.{key}"):
        MoE.of_model(moe_config(**override), rngs=nnx.Rngs(0))


def test_few_tokens_with_large_blocks_match_dense():
    """Decoding-sized inputs (a row buffer shorter than a block) still run the block dispatch.

    5 tokens: up to dispatch.ALL_EXPERTS_MAX_ROWS an inference call would run "dense" itself.
    """
    from tests.helpers import tiny_config

    cfg = tiny_config(
        "model.moe.block_size=256", "model.moe.dispatch=blocks", "model.moe.num_experts=2"
    ).model
    layer = MoE.of_model(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (1, dispatch.ALL_EXPERTS_MAX_ROWS + 1, cfg.d_model))
    got = layer(x, train=False)[0]
    cfg = cfg.replace(moe=cfg.moe.replace(dispatch="dense"))
    dense = MoE.of_model(cfg, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(np.asarray(got), np.asarray(dense(x, train=False)[0]), atol=1e-5)
    assert jnp.isfinite(got).all()


def test_inference_on_a_few_tokens_runs_every_expert():
    few = dispatch.ALL_EXPERTS_MAX_ROWS
    assert dispatch.inference_dispatch("blocks", few, capacity=0) == "dense"
    assert dispatch.inference_dispatch("blocks", few + 1, capacity=0) == "blocks"
    # A capacity drops assignments, which the dense path would not; other dispatches stay.
    assert dispatch.inference_dispatch("blocks", 1, capacity=2) == "blocks"
    assert dispatch.inference_dispatch("ragged", 1, capacity=0) == "ragged"


def test_ragged_chunk_count_by_hand():
    # Mixtral's expert width on 16384 received rows of bf16: halves (7168 columns) would be
    # 224 MiB each, quarters (3584 = 28 lanes of 128) 112 MiB, under the 128 MiB budget.
    assert dispatch.ffn_chunks(16384, 14336, 2) == 4
    assert dispatch.ffn_chunks(1024, 14336, 2) == 1  # 28 MiB in one piece
    assert dispatch.ffn_chunks(10**9, 384, 2) == 3  # as small as the lanes allow
    assert dispatch.ffn_chunks(10**9, 100, 4) == 1  # no split into whole lanes


def test_ragged_in_width_chunks_matches_reference(monkeypatch, data):
    """The ragged dispatch run in 4 slices of the expert width (each rematerialised)."""
    monkeypatch.setattr(dispatch, "RAGGED_CHUNK_BYTES", 1)
    monkeypatch.setattr(dispatch, "RAGGED_CHUNK_LANES", 8)
    assert dispatch.ffn_chunks(B * L * 2, F, 4) == 4
    check_against_reference(moe_config(dispatch="ragged", gating="top2"), data)
