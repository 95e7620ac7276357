"""The first train steps give the same losses on 1 device and on several mesh layouts."""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxmoe.models.spec import model_spec
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.parallel.sharding import batch_spec
from jaxmoe.training.evaluator import to_global
from jaxmoe.training.optimizer import make_optimizer
from jaxmoe.training.state import init_state, state_shardings
from jaxmoe.training.steps import StepFns, train_step
from tests.helpers import synthetic_batches, tiny_config


def run_steps(config, devices, n_steps=3):
    mesh = make_mesh(config.mesh, devices)
    spec = model_spec(config.model, mesh)
    optimizer, schedule = make_optimizer(config.optimizer, config.train.steps)
    _, shardings = state_shardings(mesh, spec, optimizer)
    state = init_state(config.model, 0, optimizer, shardings, mesh)
    fns = StepFns(
        spec.graphdef,
        optimizer,
        schedule,
        0.01,
        0.001,
        config.train.grad_accum,
        False,
        rest=spec.rest,
        seed=config.train.seed,
    )
    batch_sh = {
        k: NamedSharding(mesh, batch_spec(mesh, 2, config.train.batch_size))
        for k in ("inputs", "targets", "weights")
    }
    step = jax.jit(
        functools.partial(train_step, fns=fns),
        in_shardings=(shardings, batch_sh),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )
    losses = []
    with jax.set_mesh(mesh):
        for batch in synthetic_batches(config, n_steps):
            state, metrics = step(state, to_global(batch, batch_sh))
            losses.append(float(metrics["loss"]))
    return np.array(losses), state


MESHES = {
    "data8": (8, 1, 1, 1),
    "data2_fsdp4": (2, 4, 1, 1),
    "data2_tensor4": (2, 1, 4, 1),
}


@pytest.fixture(scope="module")
def dense_reference():
    config = tiny_config("model.moe.num_experts=0", "mesh.data=1")
    return run_steps(config, jax.devices()[:1])


@pytest.mark.parametrize("name", list(MESHES))
def test_dense_losses_match_one_device(name, dense_reference):
    data, fsdp, tensor, expert = MESHES[name]
    config = tiny_config(
        "model.moe.num_experts=0",
        f"mesh.data={data}",
        f"mesh.fsdp={fsdp}",
        f"mesh.tensor={tensor}",
        f"mesh.expert={expert}",
    )
    losses, state = run_steps(config, jax.devices())
    np.testing.assert_allclose(losses, dense_reference[0], rtol=1e-5, atol=1e-5)
    # The layout really is sharded: a sharded weight is split across devices.
    kernel = state["params"]["layers"]["0"]["ffn"]["wi_0"]
    if fsdp > 1 or tensor > 1:
        assert kernel.addressable_shards[0].data.shape != kernel.shape


def test_loss_falls_on_a_learnable_pattern(dense_reference):
    config = tiny_config(
        "model.moe.num_experts=0", "mesh.data=1", "train.steps=30", "optimizer.learning_rate=1e-2"
    )
    losses, _ = run_steps(config, jax.devices()[:1], n_steps=30)
    assert losses[-1] < 0.5 * losses[0]


def test_grad_accumulation_equals_one_big_batch(dense_reference):
    config = tiny_config("model.moe.num_experts=0", "mesh.data=1", "train.grad_accum=2")
    losses, _ = run_steps(config, jax.devices()[:1])
    np.testing.assert_allclose(losses, dense_reference[0], rtol=1e-5, atol=1e-5)


def test_router_jitter_is_per_step_and_mesh_independent():
    """Jitter noise is drawn from (seed, step): the same on any mesh, and it changes training."""
    plain = tiny_config("mesh.data=1", "model.moe.dispatch=dense")
    jittered = tiny_config("mesh.data=1", "model.moe.dispatch=dense", "model.moe.jitter=0.5")
    base, _ = run_steps(plain, jax.devices()[:1])
    one, _ = run_steps(jittered, jax.devices()[:1])
    jittered = jittered.replace(mesh=jittered.mesh.replace(data=2, expert=4))
    many, _ = run_steps(jittered, jax.devices())
    np.testing.assert_allclose(one, many, rtol=1e-5, atol=1e-5)
    assert np.abs(one[1:] - base[1:]).max() > 1e-4
