"""LoRA (train.lora, models/lora.py, training/lora_run.py): adapters beside the weights they
adapt, the base frozen outside the train state.

References: with B = 0 the model is its base to the bit; the adapters' gradients of one
dense FFN and of one MoE layer's expert stack against formulas derived by hand and computed
in numpy (the MoE's routing and experts recomputed in numpy too); the merged weights
against the unmerged forward pass; a train step's state holding the adapters alone. The
PEFT export against peft + transformers is tests/test_lora_peft.py (slow lane).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.checkpoints.fingerprint import tree_fingerprint
from jaxmoe.checkpoints.trees import flatten, select
from jaxmoe.errors import ConfigError
from jaxmoe.models import build_model
from jaxmoe.models.layers import GatedMLP
from jaxmoe.models.lora import attach_adapters, is_adapter, merged_params
from jaxmoe.models.moe.layer import MoE
from jaxmoe.models.spec import model_params, model_rngs, model_spec
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.training.lora_options import LoraOptions
from jaxmoe.training.lora_run import LoraSplit, init_trained
from jaxmoe.training.optimizer import make_optimizer
from jaxmoe.training.state import state_shardings
from jaxmoe.training.steps import jit_train_step, step_fns
from tests.helpers import synthetic_batches, tiny_config

MOE = ("model.moe.num_experts=4", "model.moe.every=1", "model.moe.gating=top2")
TARGETS = "attention,dense_ffn,experts,router"


def lora_model(config, lora, seed=0):
    return build_model(config.model, rngs=model_rngs(jax.random.key(seed)), lora=lora)


def with_random_b(params, seed=1, scale=0.3):
    """Adapters made to matter: every B drawn at random (they start at zero)."""
    rng = np.random.default_rng(seed)
    flat = flatten(params)
    for path, value in flat.items():
        if path[-1].endswith("_lora_b"):
            flat[path] = jnp.asarray(scale * rng.standard_normal(value.shape), value.dtype)
    from jaxmoe.checkpoints.trees import unflatten

    return unflatten(flat)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_zero_b_gives_the_base_logits_to_the_bit(scan):
    config = tiny_config(*MOE, f"model.scan_layers={scan}")
    lora = LoraOptions(rank=4, targets=TARGETS)
    adapted, base = lora_model(config, lora), lora_model(config, None)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 16)), jnp.int32)
    assert np.array_equal(np.asarray(adapted(tokens)[0]), np.asarray(base(tokens)[0]))
    _, params = model_params(adapted)
    names = {p[-1] for p in flatten(params) if is_adapter(p)}
    assert {"query_lora_a", "out_lora_b", "wi_0_lora_a", "wo_lora_b", "router_lora_a"} <= names


def test_expert_adapters_are_per_expert_and_sharded_over_the_expert_axis():
    config = tiny_config(*MOE, "mesh.fsdp=2", "mesh.expert=4", "mesh.data=1")
    mesh = make_mesh(config.mesh)
    spec = model_spec(config.model, mesh, lora=LoraOptions(rank=4, targets="experts"))
    layer = flatten(spec.abstract_params)
    specs = flatten(spec.param_specs)
    a, b = ("layers", "0", "ffn", "wi_0_lora_a"), ("layers", "0", "ffn", "wi_0_lora_b")
    assert layer[a].shape == (4, 32, 4) and layer[b].shape == (4, 4, 32)  # [E, D, r], [E, r, F]
    assert specs[a][0] == specs[("layers", "0", "ffn", "wi_0")][0] == "expert"


def test_dense_ffn_adapter_gradients_match_the_hand_derived_ones():
    """y = x W_o' with W' = W + s A B on wi_0 and wo: dB = s (x A)^T g, dA = s x^T (g B^T)."""
    rng = np.random.default_rng(0)
    lora = LoraOptions(rank=3, alpha=6.0, targets="wi_0,wo")
    mlp = GatedMLP(8, 12, "silu", rngs=nnx.Rngs(0))
    assert attach_adapters(mlp, lora, nnx.Rngs(1), "layers/0/ffn") == 2
    mlp.wi_0_lora_b[...] = jnp.asarray(rng.standard_normal((3, 12)) * 0.5, jnp.float32)
    mlp.wo_lora_b[...] = jnp.asarray(rng.standard_normal((3, 8)) * 0.5, jnp.float32)
    x = rng.standard_normal((5, 8)).astype(np.float32)
    g = rng.standard_normal((5, 8)).astype(np.float32)
    graphdef, params = nnx.split(mlp, nnx.Param)

    def loss(params):
        y, _ = nnx.merge(graphdef, params)(jnp.asarray(x)[None])
        return jnp.sum(y[0] * g)

    grads = nnx.to_pure_dict(jax.grad(loss)(params))
    p = {k: np.asarray(v, np.float64) for k, v in nnx.to_pure_dict(params).items()}
    s = 2.0
    h0 = x @ p["wi_0"] + s * (x @ p["wi_0_lora_a"]) @ p["wi_0_lora_b"]
    h1 = x @ p["wi_1"]
    sig = 1 / (1 + np.exp(-h0))
    hid = h0 * sig * h1
    d_hid = g @ p["wo"].T + s * (g @ p["wo_lora_b"].T) @ p["wo_lora_a"].T
    d_h0 = d_hid * h1 * (sig + h0 * sig * (1 - sig))
    want = {
        "wo_lora_b": s * (hid @ p["wo_lora_a"]).T @ g,
        "wo_lora_a": s * hid.T @ (g @ p["wo_lora_b"].T),
        "wi_0_lora_b": s * (x @ p["wi_0_lora_a"]).T @ d_h0,
        "wi_0_lora_a": s * x.T @ (d_h0 @ p["wi_0_lora_b"].T),
    }
    for name, value in want.items():
        np.testing.assert_allclose(np.asarray(grads[name]), value, rtol=2e-4, atol=1e-5)


def test_expert_adapter_gradients_match_a_numpy_moe():
    """One expert adapter per expert on wo: dWo'_e = sum over the tokens routed to e of
    weight * hidden_e^T g, dA_e = s dWo'_e B_e^T, dB_e = s A_e^T dWo'_e."""
    config = tiny_config(*MOE, "model.moe.renormalize=true")
    lora = LoraOptions(rank=2, alpha=4.0, targets="layers/*/ffn/wo")
    moe = MoE.of_model(config.model, rngs=nnx.Rngs(0))
    attach_adapters(moe, lora, nnx.Rngs(1), "layers/0/ffn")
    rng = np.random.default_rng(3)
    moe.wo_lora_b[...] = jnp.asarray(rng.standard_normal((4, 2, 32)) * 0.3, jnp.float32)
    x = rng.standard_normal((1, 6, 32)).astype(np.float32)
    g = rng.standard_normal((1, 6, 32)).astype(np.float32)
    graphdef, params = nnx.split(moe, nnx.Param)

    def loss(params):
        y, _ = nnx.merge(graphdef, params)(jnp.asarray(x), train=False)
        return jnp.sum(y * g)

    grads = nnx.to_pure_dict(jax.grad(loss)(params))
    p = {k: np.asarray(v, np.float64) for k, v in nnx.to_pure_dict(params).items()}
    logits = x[0] @ p["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    d_wo = np.zeros_like(p["wo"])
    for t in range(6):
        top = np.argsort(-probs[t])[:2]
        weights = probs[t, top] / probs[t, top].sum()
        for e, w in zip(top, weights, strict=True):
            h0, h1 = x[0, t] @ p["wi_0"][e], x[0, t] @ p["wi_1"][e]
            hid = h0 / (1 + np.exp(-h0)) * h1
            d_wo[e] += w * np.outer(hid, g[0, t])
    s = 2.0
    want_a = s * np.einsum("efd,erd->efr", d_wo, p["wo_lora_b"])
    want_b = s * np.einsum("efr,efd->erd", p["wo_lora_a"], d_wo)
    np.testing.assert_allclose(np.asarray(grads["wo_lora_a"]), want_a, rtol=2e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grads["wo_lora_b"]), want_b, rtol=2e-4, atol=1e-5)


def test_merged_weights_give_the_unmerged_logits():
    config = tiny_config(*MOE)
    lora = LoraOptions(rank=4, targets=TARGETS)
    adapted = lora_model(config, lora)
    graphdef, params = model_params(adapted)
    params = with_random_b(params)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 16)), jnp.int32)
    unmerged = nnx.merge(graphdef, params)(tokens)[0]
    base_graph, _ = model_params(lora_model(config, None))
    merged = nnx.merge(base_graph, merged_params(params, lora.scale))(tokens)[0]
    assert float(jnp.max(jnp.abs(unmerged - lora_model(config, None)(tokens)[0]))) > 0.1
    np.testing.assert_allclose(np.asarray(merged), np.asarray(unmerged), atol=1e-5, rtol=0)


def test_a_lora_step_trains_the_adapters_alone():
    """The state is the adapters (and Adam's two moments of them); the base is an argument
    the step never changes."""
    config = tiny_config(*MOE, "train.lora.rank=4", f"train.lora.targets={TARGETS}")
    lora = config.train.lora
    mesh = make_mesh(config.mesh.replace(expert=1), jax.devices()[:1])
    spec = model_spec(config.model, mesh, lora=lora)
    split = LoraSplit.of(spec, lora, "", config.model, mesh)
    optimizer, schedule = make_optimizer(config.optimizer, 4, split.trained_spec.param_axes)
    abstract, shardings = state_shardings(mesh, split.trained_spec, optimizer)
    _, full = model_params(lora_model(config, lora, seed=5))
    base = split.cast_base(select(full, lambda p: not is_adapter(p)))
    before = jax.device_get(base)
    state = init_trained(config.model, lora, 0, split, optimizer, shardings, mesh, {})
    assert set(flatten(state["params"])) == {p for p in flatten(full) if is_adapter(p)}
    adapters = sum(x.size for x in jax.tree.leaves(state["params"]))
    assert sum(x.size for x in jax.tree.leaves(abstract["opt_state"]) if x.ndim) == 2 * adapters
    base_shardings = jax.tree.map(lambda a: a.sharding, split.base_in_memory())
    fns = step_fns(config.train, config.optimizer, config.model, spec, optimizer, schedule)
    step = jit_train_step(fns, shardings, None, {"base": base_shardings})
    b0 = jax.device_get(state["params"]["layers"]["0"]["ffn"]["wo_lora_b"])
    with jax.set_mesh(mesh):
        for batch in synthetic_batches(config, 2):
            state, metrics = step(state, batch, {"base": base})
    assert np.isfinite(float(metrics["loss"]))
    assert not np.array_equal(
        jax.device_get(state["params"]["layers"]["0"]["ffn"]["wo_lora_b"]), b0
    )
    for path, value in flatten(jax.device_get(base)).items():
        assert np.array_equal(value, flatten(before)[path]), path


def test_fingerprint_follows_values_not_storage():
    x = jnp.arange(12.0).reshape(3, 4)
    tree = {"a": x, "b": {"c": jnp.ones(3)}}
    same = tree_fingerprint({"a": x.astype(jnp.bfloat16), "b": {"c": jnp.ones(3)}})
    assert tree_fingerprint(tree) == same
    assert tree_fingerprint({"a": x.T.reshape(3, 4), "b": tree["b"]}) != same  # permuted
    assert tree_fingerprint({"a": x.at[2, 3].add(1e-6), "b": tree["b"]}) != same
    assert tree_fingerprint({"b": tree["a"], "a": {"c": tree["b"]["c"]}}) != same  # renamed


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("train.lora.rank=4", "train.lora.targets=norms"), "group 'norms' has no matrices"),
        (("train.lora.rank=4", "train.lora.targets=q_proj"), "'q_proj' is neither a group"),
        (
            ("train.lora.rank=4", "train.lora.dropout=0.1", "train.lora.targets=experts"),
            "expert and router adapters are added to the weight",
        ),
        (("train.lora.rank=4", "train.freeze=router"), "the base is frozen already"),
    ],
)
def test_bad_lora_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(*MOE, *overrides)


def test_targets_that_match_nothing_are_refused():
    config = tiny_config(*MOE)
    with pytest.raises(ValueError, match="matches no weight of the model"):
        lora_model(config, LoraOptions(rank=2, targets="layers/9/*"))
