"""The MoE layer on device meshes gives the single-device outputs and gradients.

Meshes are (data, fsdp, tensor, expert) over the 8 simulated CPU devices of conftest.py;
parameters are placed by the project's rules table, activations split over the batch axes,
as the trainer does.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmoe.models.moe.layer import MoE
from jaxmoe.parallel import sharding
from jaxmoe.parallel.mesh import MESH_AXES
from tests.test_moe import moe_config

B, L, D = 8, 8, 16
CONFIGS = {
    "dropless": dict(gating="adaptive", threshold=0.2, dispatch="blocks"),
    "capacity": dict(gating="top2", capacity_factor=1.0, dispatch="capacity"),
}
# Data-parallel-only layouts (expert size 1) are covered by the fallback test below.
MESHES = {
    "dropless": [(1, 1, 1, 8), (2, 1, 1, 4), (2, 2, 1, 2), (1, 2, 2, 2)],
    "capacity": [(1, 1, 1, 8)],
}


def _with_context(shape):
    """(data, fsdp, tensor, expert) -> the mesh's five axis sizes, context 1."""
    return (*shape[:2], 1, *shape[2:])


def make_step(graphdef, r):
    def loss(params, x):
        y, aux = nnx.merge(graphdef, params)(x, train=True)
        return jnp.sum(y * r) + 0.3 * aux["balance_loss"] + 0.7 * aux["router_z_loss"], (y, aux)

    return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))


@pytest.fixture(scope="module")
def inputs():
    kx, kr = jax.random.split(jax.random.key(7))
    return jax.random.normal(kx, (B, L, 16)), jax.random.normal(kr, (B, L, 16))


@pytest.fixture(scope="module")
def single_device(inputs):
    """Reference results per config without any mesh, from the dense dispatch (every expert
    on every token, masked: independent of the block and all_to_all code under test)."""
    x, r = inputs
    results = {}
    for name, overrides in CONFIGS.items():
        graphdef, params = nnx.split(MoE.of_model(moe_config(**overrides), rngs=nnx.Rngs(3)))
        dense_cfg = moe_config(**{**overrides, "dispatch": "dense"})
        dense = nnx.graphdef(MoE.of_model(dense_cfg, rngs=nnx.Rngs(3)))
        results[name] = (graphdef, params, make_step(dense, r)(params, x))
    return results


def _assert_tree_close(got, want, what):
    got_leaves = jax.tree.leaves_with_path(got)
    want_leaves = jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for (path, g), w in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6, err_msg=f"{what}{path}"
        )


@pytest.mark.parametrize(
    "name,shape", [(n, s) for n, shapes in MESHES.items() for s in shapes], ids=str
)
def test_mesh_matches_single_device(name, shape, inputs, single_device):
    x, r = inputs
    graphdef, params, ((want_dparams, want_dx), (want_y, want_aux)) = single_device[name]
    mesh = jax.make_mesh(_with_context(shape), MESH_AXES, axis_types=(AxisType.Auto,) * 5)
    param_shardings = sharding.named(mesh, sharding.param_specs(params, mesh))
    params = jax.device_put(params, param_shardings)
    x = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp", "expert"))))
    step = make_step(graphdef, r)
    with jax.set_mesh(mesh):
        (dparams, dx), (y, aux) = step(params, x)
        text = step.lower(params, x).as_text() if shape[1] > 1 or shape[3] > 1 else ""
        if shape[3] > 1:  # the tokens really travel to the expert devices
            assert "all_to_all" in text
        if shape[1] > 1:  # fsdp-sharded expert stacks: gathered inside, gradients scattered
            assert "reduce_scatter" in text
    if name == "capacity":
        assert 0 < float(want_aux["dropped_fraction"]) < 0.5
    else:
        assert 0 < float(want_aux["top2_fraction"]) < 1
    _assert_tree_close(y, want_y, "y")
    _assert_tree_close(aux, want_aux, "aux")
    _assert_tree_close(dx, want_dx, "dx")
    _assert_tree_close(nnx.to_pure_dict(dparams), nnx.to_pure_dict(want_dparams), "d")


def test_small_batches_fall_back_to_repeated_work(inputs, single_device):
    """B = 2 on (data, fsdp, tensor, expert) = (2, 1, 2, 2) with L = 5: the batch splits over
    data only and the length not at all; outputs and gradients must not change."""
    x, r = (a[:2, :5] for a in inputs)
    graphdef, params, _ = single_device["dropless"]
    want = make_step(graphdef, r)(params, x)
    mesh = jax.make_mesh((2, 1, 1, 2, 2), MESH_AXES, axis_types=(AxisType.Auto,) * 5)
    with jax.set_mesh(mesh):
        (dparams, dx), (y, aux) = make_step(graphdef, r)(params, x)
    (want_dparams, want_dx), (want_y, want_aux) = want
    _assert_tree_close((y, aux, dx), (want_y, want_aux, want_dx), "")
    _assert_tree_close(nnx.to_pure_dict(dparams), nnx.to_pure_dict(want_dparams), "d")
