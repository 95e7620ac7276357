"""T5X's Adafactor (`optimizer.name = "t5x_adafactor"`) against a per-formula numpy reference.

The reference is written from T5X's `Adafactor.apply_param_gradient` (t5x/adafactor.py) in
float64 on T5X's 2-D kernels as the fixture stores them; the optimizer under test runs on
jaxmoe's layouts ([D, H, dh], [H, dh, D]), so the reference also checks the matrix views.
"""

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.checkpoints.trees import unflatten
from jaxmoe.conversions.t5x.reader import open_t5x
from jaxmoe.training.adafactor import matrix_view, t5x_adafactor

FIXTURES = Path(os.environ.get("JAXMOE_T5X_FIXTURES", "/work/shared/fixtures/t5x"))
TINY = FIXTURES / "test_t5_tiny.checkpoint_0"
HEADS, HEAD_DIM = 4, 3  # the fixture's attention (README of the fixtures)
STEPS = 5


def t5x_lr(step: int) -> float:
    """T5.1.1's schedule, continued from step 20: 1 / sqrt(max(step, 10_000))."""
    return 1.0 / np.sqrt(max(step + 20, 10_000))


def reference_step(param, grad, state, step, lr, min_dim):
    """One T5X Adafactor update of one 2-D (or 1-D) parameter, float64, T5X defaults."""
    g2 = grad * grad + 1e-30
    # T5X computes the decay in float32 (`_decay_rate_pow`); late in training 1 - decay
    # loses digits there, and the moments follow T5X's rounded value.
    decay = np.float32(1.0) - np.float32(step + 1.0) ** np.float32(-0.8)
    decay = float(decay)
    factored = None
    if param.ndim >= 2:
        order = np.argsort(param.shape, kind="stable")
        if param.shape[order[-2]] >= min_dim:
            factored = (int(order[-2]), int(order[-1]))  # (row axis, column axis)
    if factored:
        row, col = factored
        state["v_row"] = decay * state["v_row"] + (1 - decay) * g2.mean(axis=col)
        state["v_col"] = decay * state["v_col"] + (1 - decay) * g2.mean(axis=row)
        row_factor = (state["v_row"] / state["v_row"].mean()) ** -0.5
        col_factor = state["v_col"] ** -0.5
        y = grad * np.expand_dims(row_factor, col) * np.expand_dims(col_factor, row)
    else:
        state["v"] = decay * state["v"] + (1 - decay) * g2
        y = grad / np.sqrt(state["v"])
    y = y / max(1.0, np.sqrt(np.mean(y * y)) / 1.0)
    scale = max(np.sqrt(np.mean(param * param)), 1e-3)
    return param - lr * scale * y


def reference_state(param):
    """Zero moments; v_row drops the column (larger) axis, v_col the row axis."""
    state = {"v": np.zeros(param.shape)}
    if param.ndim >= 2:
        order = np.argsort(param.shape, kind="stable")
        state["v_row"] = np.zeros(np.delete(param.shape, order[-1]))
        state["v_col"] = np.zeros(np.delete(param.shape, order[-2]))
    return state


def jaxmoe_layout(name: str, array: np.ndarray, heads: int = HEADS):
    """(path, array) of a T5X tensor as jaxmoe holds it: attention heads as their own axis."""
    parts = name.split("/")
    if parts[-1] == "kernel" and parts[-2] in ("query", "key", "value"):
        return (*parts[:-1],), array.reshape(array.shape[0], heads, -1)
    if parts[-1] == "kernel" and parts[-2] == "out":
        return (*parts[:-1],), array.reshape(heads, -1, array.shape[1])
    return tuple(parts), array


def leaf(tree, path):
    for key in path:
        tree = tree[key]
    return tree


@pytest.fixture(scope="module")
def fixture_params():
    if not TINY.exists():
        pytest.skip(f"T5X fixture not found at {TINY}")
    checkpoint = open_t5x(TINY)
    return {name: checkpoint.read(name).astype(np.float64) for name in checkpoint.names()}


def run_both(t5x_params: dict, min_dim: int):
    """Run STEPS updates with the same gradients through jaxmoe and the reference; return
    [(name, jaxmoe update, reference update)] of the last step."""
    rng = np.random.default_rng(0)
    names = sorted(t5x_params)
    # Gradients of varied scale per tensor, and per row, so the factored rows differ.
    scales = {n: 10.0 ** rng.uniform(-4, 0) for n in names}
    layouts = {n: jaxmoe_layout(n, t5x_params[n]) for n in names}
    params = unflatten({path: jnp.asarray(a, jnp.float32) for path, a in layouts.values()})
    optimizer = t5x_adafactor(
        lambda count: 1.0 / jnp.sqrt(jnp.maximum(count + 20.0, 10_000.0)),
        min_dim_size_to_factor=min_dim,
    )
    state = optimizer.init(params)
    update_fn = jax.jit(optimizer.update)
    ref_params = dict(t5x_params)
    ref_states = {n: reference_state(a) for n, a in t5x_params.items()}
    for step in range(STEPS):
        grads_t5x = {}
        for n in names:
            shape = t5x_params[n].shape
            rows = rng.uniform(1, 4, shape[0]).reshape(-1, *([1] * (len(shape) - 1)))
            grads_t5x[n] = rng.standard_normal(shape) * scales[n] * rows
        grads = unflatten(
            {
                layouts[n][0]: jnp.asarray(g.reshape(layouts[n][1].shape), jnp.float32)
                for n, g in grads_t5x.items()
            }
        )
        updates, state = update_fn(grads, state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
        results = []
        for n in names:
            new = reference_step(
                ref_params[n], grads_t5x[n], ref_states[n], step, t5x_lr(step), min_dim
            )
            ref_update = new - ref_params[n]
            ref_params[n] = new
            got = np.asarray(leaf(updates, layouts[n][0]), np.float64).reshape(new.shape)
            results.append((n, got, ref_update))
    return results


@pytest.mark.parametrize("min_dim", [128, 4], ids=["t5x_default_unfactored", "factored"])
def test_updates_equal_the_numpy_reference_over_several_steps(fixture_params, min_dim):
    """min_dim 128 (T5X's default) leaves every kernel of this d_model=8 model unfactored;
    4 factors every matrix: attention [8, 12] and [12, 8], embedding [32128, 8], relpos."""
    for name, got, want in run_both(fixture_params, min_dim):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, err_msg=name)


def test_stacked_matrices_are_independent(fixture_params):
    """A leading axis (scanned layers, experts) is a batch of matrices: stacking two layers'
    query kernels gives each the update it gets alone (per-matrix scale and clipping)."""
    names = [f"encoder/layers_{i}/attention/query/kernel" for i in range(2)]
    kernels = [fixture_params[n].reshape(8, HEADS, HEAD_DIM) for n in names]
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal(k.shape) * s for k, s in zip(kernels, (1e-3, 10.0), strict=True)]
    optimizer = t5x_adafactor(0.01, min_dim_size_to_factor=4)

    def one(kernel, grad):
        params = {"query": jnp.asarray(kernel, jnp.float32)}
        updates, _ = optimizer.update(
            {"query": jnp.asarray(grad, jnp.float32)}, optimizer.init(params), params
        )
        return np.asarray(updates["query"])

    stacked = one(np.stack(kernels), np.stack(grads))
    for i in range(2):
        np.testing.assert_allclose(stacked[i], one(kernels[i], grads[i]), rtol=1e-6)
        kernel = fixture_params[names[i]]
        state = reference_state(kernel)
        want = reference_step(kernel, grads[i].reshape(8, -1), state, 0, 0.01, 4) - kernel
        np.testing.assert_allclose(stacked[i].reshape(8, -1), want, rtol=1e-6)


def test_matrix_views_follow_t5x_layouts():
    assert matrix_view(("layers", "0", "attn", "query"), (16, 4, 8)) == ((16, 32), 0)
    assert matrix_view(("layers", "0", "attn", "out"), (4, 8, 16)) == ((32, 16), 0)
    assert matrix_view(("layers", "attn", "key"), (6, 16, 2, 8)) == ((6, 16, 16), 1)
    assert matrix_view(("layers", "attn", "out"), (6, 4, 8, 16)) == ((6, 32, 16), 1)
    assert matrix_view(("ffn", "wi_0"), (8, 16, 64)) == ((8, 16, 64), 1)  # experts
    assert matrix_view(("attn_norm", "scale"), (16,)) == ((16,), 0)
    assert matrix_view(("attn_norm", "scale"), (6, 16)) == ((6, 16), 1)
    assert matrix_view(("token_embed", "embedding"), (100, 16)) == ((100, 16), 0)


def rule_step(param, grad, state, step, lr, row_axis, col_axis):
    """One T5X update of a matrix under an explicit factor rule (ROW on `row_axis`, COLUMN on
    `col_axis`), as `_parse_rule` gives it for a batched parameter: factored whatever the
    sizes. float64, T5X defaults, as `reference_step`."""
    g2 = grad * grad + 1e-30
    decay = float(np.float32(1.0) - np.float32(step + 1.0) ** np.float32(-0.8))
    state["v_row"] = decay * state["v_row"] + (1 - decay) * g2.mean(axis=col_axis)
    state["v_col"] = decay * state["v_col"] + (1 - decay) * g2.mean(axis=row_axis)
    row_factor = (state["v_row"] / state["v_row"].mean()) ** -0.5
    col_factor = state["v_col"] ** -0.5
    y = grad * np.expand_dims(row_factor, col_axis) * np.expand_dims(col_factor, row_axis)
    y = y / max(1.0, np.sqrt(np.mean(y * y)))
    return param - lr * max(np.sqrt(np.mean(param * param)), 1e-3) * y


@pytest.mark.parametrize(
    ("name", "shape", "row_axis"),
    # T5X MoE rules: wi [E, embed (ROW), expert_mlp (COLUMN)], wo [E, expert_mlp, embed]:
    # wo's ROW is its larger axis, the opposite of the size heuristic's naming.
    [("wi_0", (3, 8, 12), 0), ("wo", (3, 6, 8), 1)],
)
def test_batched_matrices_are_factored_whatever_their_size(name, shape, row_axis):
    """Experts (and scanned layers) hold matrices under 128 on a side: T5X's explicit BATCH
    rule factors them anyway, where a lone matrix of the same size stays unfactored."""
    rng = np.random.default_rng(2)
    params = rng.standard_normal(shape) * 0.1
    optimizer = t5x_adafactor(0.01)  # T5X's default min_dim_size_to_factor=128
    tree = {"ffn": {name: jnp.asarray(params, jnp.float32)}}
    state = optimizer.init(tree)
    update_fn = jax.jit(optimizer.update)
    ref = [params[e].copy() for e in range(shape[0])]
    matrix = shape[1:]
    ref_states = [
        {"v_row": np.zeros(matrix[row_axis]), "v_col": np.zeros(matrix[1 - row_axis])} for _ in ref
    ]
    lone_state = reference_state(params[0])  # the heuristic: unfactored (8, 12 < 128)
    lone = params[0].copy()
    for step in range(4):
        grads = rng.standard_normal(shape) * rng.uniform(0.1, 3.0, (shape[0], shape[1], 1))
        updates, state = update_fn({"ffn": {name: jnp.asarray(grads, jnp.float32)}}, state, tree)
        tree = jax.tree.map(lambda p, u: p + u, tree, updates)
        got = np.asarray(updates["ffn"][name], np.float64)
        for e in range(shape[0]):
            new = rule_step(ref[e], grads[e], ref_states[e], step, 0.01, row_axis, 1 - row_axis)
            np.testing.assert_allclose(got[e], new - ref[e], rtol=2e-5, err_msg=f"{name}[{e}]")
            ref[e] = new
        lone_new = reference_step(lone, grads[0], lone_state, step, 0.01, 128)
        lone_update, lone = lone_new - lone, lone_new
    # The heuristic's unfactored update of the same matrix differs well beyond rounding.
    assert np.abs(lone_update - got[0]).max() > 1e-2 * np.abs(got[0]).max()
