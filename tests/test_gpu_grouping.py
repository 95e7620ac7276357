"""The ragged dispatch's GPU grouping (grouping.group_rows): every expert's group padded to
whole row tiles gives the numpy loop's outputs and gradients (tests/test_fine_grained_dispatch
reference), and the groups ragged_dot receives start on tile boundaries."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.models.moe import dispatch
from jaxmoe.models.moe.grouping import group_rows
from tests.test_fine_grained_dispatch import case  # noqa: F401
from tests.test_fine_grained_dispatch import test_grouping_matches_numpy_loop as loop_check


@pytest.fixture
def on_gpu(monkeypatch):
    monkeypatch.setattr(dispatch, "mesh_platform", lambda: "gpu")


@pytest.mark.parametrize("tile", [16, 128])
def test_padded_groups_equal_the_numpy_loop(case, tile, monkeypatch):  # noqa: F811
    """E = 64 / 128, skewed loads, empty experts, masked assignments, groups padded to
    `tile` rows (more padding than rows): outputs and gradients."""
    monkeypatch.setattr(dispatch, "group_rows", lambda *args: tile)
    loop_check(case, "ragged", 256)


def test_ragged_dot_gets_tile_aligned_groups(on_gpu, monkeypatch):
    """Mixtral-like routing (8 experts, top-2, 512 tokens): 32-row tiles, and the output
    equals every expert on every token (the dense dispatch)."""
    seen = []
    ragged_dot = jax.lax.ragged_dot

    def record(lhs, rhs, group_sizes, **kwargs):
        seen.append((lhs.shape[0], np.asarray(group_sizes)))
        return ragged_dot(lhs, rhs, group_sizes, **kwargs)

    monkeypatch.setattr(jax.lax, "ragged_dot", record)
    rng = np.random.default_rng(0)
    tokens, dim, ffn, experts = 512, 8, 128, 8
    x = jnp.asarray(rng.normal(size=(tokens, dim)), jnp.float32)
    src = jnp.repeat(jnp.arange(tokens, dtype=jnp.int32), 2)
    expert = jnp.asarray(np.stack([rng.permutation(experts)[:2] for _ in range(tokens)]).ravel())
    weight = jnp.asarray(rng.uniform(0.1, 1.0, 2 * tokens), jnp.float32)
    valid = jnp.asarray(rng.random(2 * tokens) > 0.1)
    weights = tuple(
        jnp.asarray(rng.normal(size=s) / np.sqrt(s[1]), jnp.float32)
        for s in ((experts, dim, ffn), (experts, dim, ffn), (experts, ffn, dim))
    )
    args = (x, src, expert, weight, valid, weights)
    got = dispatch.ragged_ffn(*args, act=jax.nn.silu)
    want = dispatch.dense_ffn(*args, act=jax.nn.silu)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    tile = group_rows(2 * tokens, experts, "gpu")
    assert tile == 32
    counts = np.bincount(np.asarray(expert)[np.asarray(valid)], minlength=experts)
    assert len(seen) == 3
    for rows, sizes in seen:
        assert rows == 2 * tokens + experts * (tile - 1)
        np.testing.assert_array_equal(sizes, -(-counts // tile) * tile)


@pytest.mark.parametrize(
    ("assignments", "experts", "platform", "want"),
    [
        (8 * 4096 * 2, 8, "gpu", 128),  # Mixtral, 8 x 4096 tokens: 8192 rows per expert
        (4096 * 8, 128, "gpu", 64),  # Qwen3-MoE on 4096 tokens: 256 rows per expert
        (8 * 2, 8, "gpu", 1),  # decoding 8 sequences: 2 rows per expert stay exact
        (4096 * 8, 512, "gpu", 16),  # 64 rows per expert: the smallest tile
        (8 * 4096 * 2, 8, "cpu", 1),  # exact groups off GPU
        (8 * 4096 * 2, 8, "tpu", 1),
    ],
)
def test_group_rows_follow_rows_per_expert(assignments, experts, platform, want):
    assert group_rows(assignments, experts, platform) == want
