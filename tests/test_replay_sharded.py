"""Router replay of a model's own routing, for every gate, on one device and under
expert parallelism (fsdp x expert on the 8 simulated devices): the loss and every gradient
equal the live run's to the bit (tests/test_replay.py covers two gates in the fast lane).
Each gate runs one dispatch: dropless (the expert exchange sized to the routing) or with a
capacity (whose drops the replayed routing must reproduce)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxmoe.models import build_model
from jaxmoe.models.spec import model_params, model_rngs, model_spec
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.parallel.sharding import named
from tests.test_replay import GATES, loss_and_grads, replay_config

CAPACITY = {"top1": 1.0, "top2": 0.0, "topk": 1.5, "adaptive": 0.0, "top_p": 1.0, "adaptive_k": 0.0}


# One device for the gates tests/test_replay.py leaves out (it runs adaptive dropless and
# top_p with a capacity, CAPACITY's settings), fsdp x expert for every gate.
CASES = [(g, 1) for g in GATES if g not in ("adaptive", "top_p")] + [(g, 8) for g in GATES]


@pytest.mark.slow  # 10 cases of two compiles each (~5 s each on a quiet 2-core host)
@pytest.mark.parametrize(("gating", "devices"), CASES, ids=[f"{g}-{d}" for g, d in CASES])
def test_replaying_its_own_routing_is_bit_identical(gating, devices):
    capacity = f"model.moe.capacity_factor={CAPACITY[gating]}"
    config = replay_config(gating, capacity)
    axes = config.mesh.replace(
        data=1, fsdp=2 if devices == 8 else 1, tensor=1, expert=4 if devices == 8 else 1
    )
    mesh = make_mesh(axes, jax.devices()[:devices])
    _, params = model_params(build_model(config.model, rngs=model_rngs(jax.random.key(1))))
    params = jax.device_put(params, named(mesh, model_spec(config.model, mesh).param_specs))
    inputs = np.random.default_rng(2).integers(0, 128, (8, 16)).astype(np.int32)
    batch_axes = ("data", "fsdp", "expert")
    batch = {"inputs": jax.device_put(inputs, NamedSharding(mesh, PartitionSpec(batch_axes)))}
    with jax.set_mesh(mesh):
        live_loss, live_grads, record = loss_and_grads(config, params, batch, record=True)
        replay = replay_config(gating, capacity, "model.moe.replay=true")
        loss, grads = loss_and_grads(replay, params, batch | {"routing": jnp.asarray(record)})
    assert np.asarray(loss).tobytes() == np.asarray(live_loss).tobytes()
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(live_grads), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
