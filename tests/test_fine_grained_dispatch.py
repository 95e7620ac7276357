"""Fine-grained experts (E = 64 / 128, top-8): every dropless grouping against a numpy loop.

The reference runs one (token, expert) assignment at a time in float64 and derives the
gradients by hand; loads are skewed (Zipf-like), some experts get no rows and some
assignments are masked out.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.models.moe import grouped_ffn as grouped_ffn_module
from jaxmoe.models.moe.dispatch import grouped_ffn, local_moe_ffn
from jaxmoe.models.moe.grouped_ffn import expert_ranks
from jaxmoe.models.moe.grouping import block_rows, grouping_summary

N, D, F, K = 48, 8, 4, 8


def _sigmoid(a):
    return 1 / (1 + np.exp(-a))


def reference(x, src, expert, weight, valid, wi_0, wi_1, wo, cot):
    """(y, grads of sum(y * cot) in x, weight, wi_0, wi_1, wo), one assignment at a time."""
    y = np.zeros_like(x)
    dx, dweight = np.zeros_like(x), np.zeros_like(weight)
    dwi_0, dwi_1, dwo = np.zeros_like(wi_0), np.zeros_like(wi_1), np.zeros_like(wo)
    for a in range(len(src)):
        if not valid[a]:
            continue
        n, e, w = src[a], expert[a], weight[a]
        gate, up = x[n] @ wi_0[e], x[n] @ wi_1[e]
        sig = _sigmoid(gate)
        hidden = gate * sig * up
        out = hidden @ wo[e]
        y[n] += w * out
        dy = cot[n]
        dweight[a] = dy @ out
        dwo[e] += np.outer(hidden, w * dy)
        dhidden = wo[e] @ (w * dy)
        dup = dhidden * gate * sig
        dgate = dhidden * up * (sig + gate * sig * (1 - sig))
        dwi_0[e] += np.outer(x[n], dgate)
        dwi_1[e] += np.outer(x[n], dup)
        dx[n] += wi_0[e] @ dgate + wi_1[e] @ dup
    return y, (dx, dweight, dwi_0, dwi_1, dwo)


def skewed_routing(num_experts: int, seed: int):
    """K distinct experts per token drawn with Zipf-like weights from 3/4 of the experts
    (the rest stay empty); about a tenth of the assignments masked out."""
    rng = np.random.default_rng(seed)
    used = rng.permutation(num_experts)[: num_experts * 3 // 4]
    prob = 1.0 / np.arange(1, len(used) + 1)
    prob /= prob.sum()
    expert = np.stack([rng.choice(used, K, replace=False, p=prob) for _ in range(N)])
    valid = rng.random((N, K)) > 0.1
    return expert.reshape(-1).astype(np.int32), valid.reshape(-1)


@pytest.fixture(scope="module", params=[64, 128])
def case(request):
    num_experts = request.param
    rng = np.random.default_rng(num_experts)
    expert, valid = skewed_routing(num_experts, seed=num_experts)
    arrays = {
        "x": rng.normal(size=(N, D)),
        "src": np.repeat(np.arange(N, dtype=np.int32), K),
        "expert": expert,
        "weight": rng.uniform(0.1, 1.0, N * K),
        "valid": valid,
        "wi_0": rng.normal(size=(num_experts, D, F)) / np.sqrt(D),
        "wi_1": rng.normal(size=(num_experts, D, F)) / np.sqrt(D),
        "wo": rng.normal(size=(num_experts, F, D)) / np.sqrt(F),
        "cot": rng.normal(size=(N, D)),
    }
    counts = np.bincount(expert[valid], minlength=num_experts)
    assert (counts == 0).sum() >= num_experts // 4 and counts.max() >= 4 * counts.mean()
    return arrays, reference(*(arrays[k] for k in arrays))


GROUPINGS = [
    ("blocks", 256),  # shrinks to 8-row blocks: 6 or 3 rows per expert on average
    ("blocks", 4),
    pytest.param("blocks", 1, marks=pytest.mark.slow),  # one row per block
    ("ragged", 256),
    ("dense", 256),
]


@pytest.mark.parametrize(("impl", "block_size"), GROUPINGS)
def test_grouping_matches_numpy_loop(case, impl, block_size):
    arrays, (y_ref, grads_ref) = case
    f32 = {k: jnp.asarray(v, jnp.float32) for k, v in arrays.items() if k not in ("src", "expert")}
    src, expert, valid = (jnp.asarray(arrays[k]) for k in ("src", "expert", "valid"))

    def loss(x, weight, wi_0, wi_1, wo):
        y = grouped_ffn(
            x, src, expert, weight, valid, (wi_0, wi_1, wo),
            act=jax.nn.silu, impl=impl, block_size=block_size,
        )  # fmt: skip
        return jnp.sum(y * f32["cot"]), y

    params = tuple(f32[k] for k in ("x", "weight", "wi_0", "wi_1", "wo"))
    grads, y = jax.jit(jax.grad(loss, argnums=range(5), has_aux=True))(*params)
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-5)
    names = ("x", "weight", "wi_0", "wi_1", "wo")
    for name, got, want in zip(names, grads, grads_ref, strict=True):
        if name == "weight":  # masked assignments have no gradient to speak of
            got, want = np.where(arrays["valid"], got, 0), want
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("impl", ["blocks", "ragged"])
def test_sorted_ranks_match_numpy_loop(case, impl, monkeypatch):
    """Ranks from the stable argsort (the many-experts path) give the same layer."""
    monkeypatch.setattr(grouped_ffn_module, "ONE_HOT_RANKS_MAX", 0)
    test_grouping_matches_numpy_loop(case, impl, 256)


def test_expert_ranks_both_ways_equal_a_loop():
    rng = np.random.default_rng(3)
    expert, valid = rng.integers(0, 128, 4096), rng.random(4096) > 0.2
    seen, want = {}, []
    for e, v in zip(expert, valid, strict=True):
        want.append(seen.get(e, 0) if v else -1)
        seen[e] = seen.get(e, 0) + int(v)
    counts = np.bincount(expert[valid], minlength=128)
    for limit in (0, 2**30):  # the argsort, then the one-hot cumsum
        grouped_ffn_module.ONE_HOT_RANKS_MAX, saved = limit, grouped_ffn_module.ONE_HOT_RANKS_MAX
        try:
            rank, got_counts = expert_ranks(jnp.asarray(expert), jnp.asarray(valid), 128)
        finally:
            grouped_ffn_module.ONE_HOT_RANKS_MAX = saved
        np.testing.assert_array_equal(rank, want)
        np.testing.assert_array_equal(got_counts, counts)


def test_layer_level_blocks_equal_reference(case):
    """local_moe_ffn (the layer's call) with the [B, L, K] layout of the routing."""
    arrays, (y_ref, _) = case
    experts = tuple(jnp.asarray(arrays[k], jnp.float32) for k in ("wi_0", "wi_1", "wo"))
    y = local_moe_ffn(
        jnp.asarray(arrays["x"], jnp.float32).reshape(2, N // 2, D),
        jnp.asarray(arrays["expert"]).reshape(2, N // 2, K),
        jnp.asarray(arrays["weight"], jnp.float32).reshape(2, N // 2, K),
        jnp.asarray(arrays["valid"]).reshape(2, N // 2, K),
        experts, act=jax.nn.silu, impl="blocks", block_size=256, capacity=0,
    )  # fmt: skip
    np.testing.assert_allclose(y.reshape(N, D), y_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("tokens", "experts", "want"),
    [
        (4096, 8, 256),  # top-8 of 8: 4096 rows per expert, capped by block_size
        (4096, 64, 256),  # 512 rows per expert
        (4096, 128, 256),  # 256
        (2048, 128, 128),  # 128: one full block, tails of 32
        (1024, 128, 64),  # 64: the case that padded 256-row blocks
        (32, 128, 8),  # 2 rows per expert: 8-row blocks with 2-row tails (as decoding)
    ],
)
def test_block_rows_follow_rows_per_expert(tokens, experts, want):
    assert block_rows(tokens * K, experts, 256) == want


def test_decode_blocks_unchanged():
    """8 sequences decoding over 8 top-2 experts: 2 rows each ran 8-row blocks before."""
    assert block_rows(16, 8, 256) == 8


def test_summary_names_the_grouping():
    line = grouping_summary("blocks", tokens=1024, slots=8, num_experts=128, block_size=256)
    assert line.startswith("blocks of 64 + tails of 16 rows") and "64 rows/expert" in line
    assert "no padding" in grouping_summary(
        "ragged", tokens=1024, slots=8, num_experts=128, block_size=256
    )
