"""The routing-sized expert-parallel exchange (parallel/ragged_exchange.py) on 8 CPU devices.

XLA:CPU has no ragged-all-to-all, so the ragged path runs through `reference`, which is
checked first against the worked example of `jax.lax.ragged_all_to_all`'s documentation.
The layer is then compared with today's padded exchange and with the float64 per-token
numpy loop of test_moe.py (outputs and gradients), with the receive buffer large enough,
and so small that the dropless layer must fall back to the worst-case buffer.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmoe.errors import ConfigError
from jaxmoe.models.moe import dispatch, gates
from jaxmoe.models.moe.layer import MoE
from jaxmoe.models.moe.ragged_exchange import reference
from jaxmoe.parallel import sharding
from jaxmoe.parallel.mesh import MESH_AXES
from tests.helpers import tiny_config
from tests.test_moe import D, E, L, _silu, moe_config, ref_layer

B = 8  # sequences of L tokens: one per device on an expert axis of 8


def _with_context(shape):
    """(data, fsdp, tensor, expert) -> the mesh's five axis sizes, context 1."""
    return (*shape[:2], 1, *shape[2:])


def test_reference_gives_the_documented_example():
    """The two-device example of jax.lax.ragged_all_to_all's docstring, by hand."""
    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,))
    args = [
        [[1, 2, 2], [3, 4, 0]],  # operand
        [[0, 0, 0, 0], [0, 0, 0, 0]],  # output
        [[0, 1], [0, 1]],  # input_offsets
        [[1, 2], [1, 1]],  # send_sizes
        [[0, 0], [1, 2]],  # output_offsets
        [[1, 1], [2, 1]],  # recv_sizes
    ]
    args = [jax.device_put(jnp.array(a, jnp.int32), NamedSharding(mesh, P("x"))) for a in args]

    def per_device(*a):
        return reference(*(v[0] for v in a), axis="x")[None]

    run = jax.shard_map(per_device, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    np.testing.assert_array_equal(jax.jit(run)(*args), [[1, 3, 0, 0], [2, 2, 4, 0]])


def _mesh(shape):
    return jax.make_mesh(_with_context(shape), MESH_AXES, axis_types=(AxisType.Auto,) * 5)


def _run(cfg, x, r, mesh):
    """y, aux, plain params, plain grads, dx of sum(y * r) + 0.3 balance + 0.7 z on `mesh`."""
    graphdef, params = nnx.split(MoE.of_model(cfg, rngs=nnx.Rngs(0)))
    params = jax.device_put(params, sharding.named(mesh, sharding.param_specs(params, mesh)))
    x = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp", "expert"))))

    @jax.jit
    def step(params, x):
        def loss(params, x):
            y, aux = nnx.merge(graphdef, params)(x, train=True)
            return jnp.sum(y * r) + 0.3 * aux["balance_loss"] + 0.7 * aux["router_z_loss"], (y, aux)

        return jax.grad(loss, argnums=(0, 1), has_aux=True)(params, x)

    with jax.set_mesh(mesh):
        (dparams, dx), (y, aux) = step(params, x)
        text = step.lower(params, x).as_text()
    plain = {k: np.asarray(v[...]) for k, v in nnx.to_pure_dict(params).items()}
    dplain = {k: np.asarray(v) for k, v in nnx.to_pure_dict(dparams).items()}
    return y, aux, plain, dplain, dx, text


@pytest.fixture(scope="module")
def data():
    kx, kr = jax.random.split(jax.random.key(5))
    return jax.random.normal(kx, (B, L, D)), jax.random.normal(kr, (B, L, D))


@pytest.mark.parametrize(
    "shape, factor, impl",
    [
        ((1, 1, 1, 8), 2.0, "blocks"),  # the bound holds: one ragged exchange
        ((1, 1, 1, 8), 0.25, "blocks"),  # overflow: 16 rounds of 8 rows, nothing lost
        ((2, 1, 1, 4), 1.0, "blocks"),
        ((2, 2, 1, 2), 0.5, "blocks"),
        # What GPU/TPU run: ragged_dot on the received rows (it exists on CPU).
        ((1, 2, 1, 4), 0.5, "ragged"),
    ],
    ids=str,
)
def test_ragged_matches_padded_and_numpy(shape, factor, impl, data):
    x, r = data
    mesh = _mesh(shape)
    base = dict(gating="adaptive", threshold=0.2, dispatch=impl, ep_buffer_factor=factor)
    got = _run(moe_config(**base, ep_exchange="ragged"), x, r, mesh)
    padded = _run(moe_config(**base, ep_exchange="padded"), x, r, mesh)
    y, aux, params, dparams, dx, text = got
    assert "all_to_all" in text  # the tokens really travel (the CPU's emulation)
    assert 0 < float(aux["top2_fraction"]) < 1
    assert float(aux["dropped_fraction"]) == 0
    if factor < 1:
        assert float(aux["exchange_overflow"]) > 0
    else:
        assert float(aux["exchange_overflow"]) == 0
    # Same as today's exchange...
    for name, g, w in zip(("y", "dx"), (y, dx), (padded[0], padded[4]), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6, err_msg=name)
    for k in dparams:
        np.testing.assert_allclose(dparams[k], padded[3][k], rtol=1e-5, atol=1e-6, err_msg=k)
    # ...and as the float64 per-token loop.
    gate = moe_config(**base).moe.gate.replace(gating="adaptive")
    want_y, want_aux, want_grads, want_dx = ref_layer(params, x, r, gate)
    tol = dict(rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(np.asarray(y), want_y, **tol, err_msg="y")
    np.testing.assert_allclose(np.asarray(dx), want_dx, **tol, err_msg="dx")
    for name, want in want_grads.items():
        np.testing.assert_allclose(dparams[name], want, **tol, err_msg=f"d{name}")
    np.testing.assert_allclose(float(aux["top2_fraction"]), want_aux["top2_fraction"], rtol=1e-6)


def _overflow_loop(expert_TK, keep_TK, ep: int, rows: int) -> np.ndarray:
    """Which kept assignments miss a receive buffer of `rows` rows, one token at a time.

    Device d holds tokens [d * T, (d + 1) * T) and experts [d * E / ep, ...). Receiver j
    takes source 0's rows, then source 1's, ...; each source's by expert, then token, slot.
    """
    tokens, slots = expert_TK.shape
    per_device, local = tokens // ep, E // ep
    overflow = np.zeros_like(keep_TK)
    for j in range(ep):
        filled = 0
        for src in range(ep):
            for e in range(j * local, (j + 1) * local):
                for t in range(src * per_device, (src + 1) * per_device):
                    for k in range(slots):
                        if keep_TK[t, k] and expert_TK[t, k] == e:
                            overflow[t, k] = filled >= rows
                            filled += 1
    return overflow


def test_capacity_mode_drops_overflow_and_counts_it(data):
    """With a capacity the user chose drops: what misses the buffer is dropped, counted in
    dropped_fraction, and the output is that of the kept assignments."""
    x, r = data
    cfg = moe_config(
        gating="top2", capacity_factor=2.0, dispatch="blocks", ep_exchange="ragged",
        ep_buffer_factor=0.5,
    )  # fmt: skip
    y, aux, params, _, _, _ = _run(cfg, x, r, _mesh((1, 1, 1, 8)))
    xs = np.asarray(x, np.float64).reshape(-1, D)
    probs = jax.nn.softmax(jnp.asarray(xs @ params["router"], jnp.float32), axis=-1)
    routing = gates.route(probs, cfg.moe.gate.replace(gating="top2"))
    indices = np.asarray(routing.indices).reshape(B, L, 2)
    capacity = dispatch.expert_capacity(2.0, L, 2, E)
    mask = np.asarray(routing.mask).reshape(B, L, 2)
    keep = np.asarray(dispatch.capacity_keep(indices, mask, E, capacity))
    expert_TK, keep_TK = indices.reshape(-1, 2), keep.reshape(-1, 2)
    rows = int(np.ceil(0.5 * L * 2))  # 0.5 x (16 local tokens x 2 slots)
    overflow = _overflow_loop(expert_TK, keep_TK, 8, rows)
    assert overflow.any() and keep_TK.sum() > overflow.sum()
    kept = keep_TK & ~overflow
    np.testing.assert_allclose(float(aux["dropped_fraction"]), 1 - kept.sum() / mask.sum())
    np.testing.assert_allclose(float(aux["exchange_overflow"]), overflow.sum() / mask.sum())
    weights = np.asarray(routing.weights, np.float64)
    want = np.zeros_like(xs)
    wi_0, wi_1, wo = (np.asarray(params[k], np.float64) for k in ("wi_0", "wi_1", "wo"))
    for t in range(xs.shape[0]):
        for k in range(2):
            if kept[t, k]:
                e = expert_TK[t, k]
                hidden = _silu(xs[t] @ wi_0[e]) * (xs[t] @ wi_1[e])
                want[t] += weights[t, k] * (hidden @ wo[e])
    np.testing.assert_allclose(np.asarray(y).reshape(-1, D), want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.moe.ep_buffer_factor=0", "model.moe.ep_buffer_factor=0.0 must be > 0"),
        (
            "model.moe.ep_exchange=dense",
            "model.moe.ep_exchange='dense' is not one of ['auto', 'ragged', 'padded']",
        ),
    ],
)
def test_bad_exchange_settings_name_the_key(override, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        tiny_config(override)


@pytest.mark.parametrize("gating", ["adaptive_k", "topk"])
def test_only_kept_assignments_travel(gating, data, monkeypatch):
    """An adaptive_k token sends one row per expert it keeps, not max_k: the rows each
    device hands the ragged exchange add up to the kept assignments of the rule written
    plainly (tests/test_adaptive_k.py), over every round of a buffer too small for one."""
    from jaxmoe.models.moe import ragged_exchange
    from tests.test_adaptive_k import ref_adaptive_k

    trips = {"to_experts": [], "back": []}
    primitive = ragged_exchange.ragged_all_to_all

    def counted(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis):
        # The trip to the experts writes a receive buffer of `rows` rows; the trip back
        # writes the send buffer, one row per slot (num_assign = 16 tokens x 8 slots = 128).
        trip = "back" if output.shape[0] == 16 * 8 else "to_experts"
        jax.debug.callback(lambda s: trips[trip].append(int(np.sum(s))), send_sizes)
        return primitive(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis=axis
        )

    monkeypatch.setattr(ragged_exchange, "ragged_all_to_all", counted)
    x, _ = data
    options = dict(gating=gating, max_k=8, top_k=8, threshold=0.3, renormalize=True)
    # 0.75 x 16 tokens x 8 slots = 96 rows a round: dropless needs more than one round.
    cfg = moe_config(**options, ep_exchange="ragged", ep_buffer_factor=0.75)
    graphdef, params = nnx.split(MoE.of_model(cfg, rngs=nnx.Rngs(0)))
    mesh = _mesh((2, 1, 1, 4))  # 4 expert devices with 2 experts each, data 2
    params = jax.device_put(params, sharding.named(mesh, sharding.param_specs(params, mesh)))
    x_sharded = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp", "expert"))))
    with jax.set_mesh(mesh):
        _, aux = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x, train=False))(params, x_sharded)
        jax.effects_barrier()

    probs_TE = jax.nn.softmax(np.asarray(x).reshape(-1, D) @ np.asarray(params["router"][...]))
    gate = cfg.moe.gate.replace(gating="adaptive_k")
    per_token = [len(ref_adaptive_k(p, gate)) if gating == "adaptive_k" else 8 for p in probs_TE]
    kept = sum(per_token)
    slots = len(per_token) * 8
    assert sum(trips["to_experts"]) == kept  # every device, every round
    assert sum(trips["back"]) == kept
    np.testing.assert_allclose(float(aux["kept_fraction"]), kept / slots, rtol=1e-6)
    if gating == "adaptive_k":
        assert set(per_token) > {1, 2} and kept < slots / 2  # 1..8 experts, well under max_k
    else:
        assert kept == slots
