"""Frozen parts (train.freeze / train.trainable, training/freezing.py) and the paper's
random-expert upcycling (`convert upcycle --init random`).

The groups of every parameter of a tiny MoE decoder (a dense layer, a shared expert) and a
T5 MoE are written out by hand; two optimizer steps must leave exactly the frozen leaves
as they were, keep no optimizer state for them, and move every other leaf."""

import jax
import numpy as np
import pytest

from jaxmoe.checkpoints.trees import flatten
from jaxmoe.conversions.surgery import upcycle_config, upcycle_params
from jaxmoe.errors import ConfigError
from jaxmoe.models.spec import model_spec
from jaxmoe.training.freezing import frozen_tree, group_of, with_frozen
from jaxmoe.training.optimizer import make_optimizer
from jaxmoe.training.state import init_state, state_shardings
from jaxmoe.training.steps import jit_train_step, step_fns
from tests.helpers import TINY_T5, synthetic_batches, tiny_config
from tests.test_upcycle import dense, one_device_mesh  # noqa: F401  (a fixture)

MOE = ("model.moe.num_experts=4", "model.moe.every=2", "model.moe.num_shared_experts=1",
       "model.moe.shared_expert_gate=true", "model.moe.router_bias=true")  # fmt: skip
DECODER_GROUPS = {
    "embed.embedding": "embeddings",
    "lm_head": "head",
    "final_norm.scale": "norms",
    "layers.0.attn_norm.scale": "norms",
    "layers.0.attn.query": "attention",
    "layers.0.attn.out": "attention",
    "layers.0.ffn.wi_0": "dense_ffn",
    "layers.0.ffn.wo": "dense_ffn",
    "layers.1.ffn_norm.scale": "norms",
    "layers.1.ffn.router": "router",
    "layers.1.ffn.router_bias": "router",
    "layers.1.ffn.wi_0": "experts",
    "layers.1.ffn.wo": "experts",
    "layers.1.ffn.shared.wi_1": "shared_experts",
    "layers.1.ffn.shared_gate.kernel": "shared_experts",
}
T5_GROUPS = {
    "token_embed.embedding": "embeddings",
    "encoder_relpos.rel_embedding": "attention",
    "decoder_layers.0.cross_attn.key": "attention",
    "decoder_layers.0.self_attn_norm.scale": "norms",
    "encoder_layers.1.ffn.router": "router",
    "decoder_layers.1.ffn.wo": "experts",
    "decoder_layers.0.ffn.wi_0": "dense_ffn",
}


def groups_of(config) -> dict[str, str]:
    params = model_spec(config.model, one_device_mesh()).abstract_params
    paths = list(flatten(params))
    moe_ffns = {p[: p.index("router")] for p in paths if "router" in p}
    return {".".join(p): group_of(p, moe_ffns) for p in paths}


@pytest.mark.parametrize(
    ("overrides", "want"),
    [
        (MOE, DECODER_GROUPS),
        ((*TINY_T5, "model.moe.num_experts=4", "model.moe.every=2"), T5_GROUPS),
    ],
    ids=["decoder", "t5"],
)
def test_every_parameter_has_its_group(overrides, want):
    got = groups_of(tiny_config(*overrides))
    for path, group in want.items():
        assert got[path] == group, path


def test_frozen_groups_are_the_named_ones():
    config = tiny_config(*MOE)
    params = model_spec(config.model, one_device_mesh()).abstract_params
    groups = groups_of(config)
    for freeze, trainable, frozen_groups in (
        ("router,embeddings", "", {"router", "embeddings"}),
        ("", "experts,norms", set(DECODER_GROUPS.values()) - {"experts", "norms"}),
    ):
        flags = flatten(frozen_tree(params, freeze, trainable))
        assert {".".join(p) for p, f in flags.items() if f} == {
            name for name, group in groups.items() if group in frozen_groups
        }
    assert frozen_tree(params, "", "") is None


def test_frozen_parameters_keep_their_values_and_get_no_state():
    """train.trainable=experts: two optimizer steps move the experts alone."""
    config = tiny_config(*MOE, "train.trainable=experts")
    frozen_groups = set(DECODER_GROUPS.values()) - {"experts"}
    mesh = one_device_mesh()
    spec = model_spec(config.model, mesh)
    optimizer, schedule = make_optimizer(config.optimizer, 4)
    frozen = frozen_tree(spec.abstract_params, "", "experts")
    optimizer = with_frozen(optimizer, frozen)
    abstract, shardings = state_shardings(mesh, spec, optimizer)
    state = init_state(config.model, 0, optimizer, shardings, mesh)
    before = jax.device_get(flatten(state["params"]))
    step = jit_train_step(
        step_fns(config.train, config.optimizer, config.model, spec, optimizer, schedule, frozen),
        shardings,
        None,
    )
    with jax.set_mesh(mesh):
        for batch in synthetic_batches(config, 2):
            state, metrics = step(state, batch)
    after = jax.device_get(flatten(state["params"]))
    groups = groups_of(config)
    for path, value in after.items():
        name = ".".join(path)
        moved = not np.array_equal(value, before[path])
        assert moved != (groups[name] in frozen_groups), name
    # Adam's two moments for the trained leaves only (frozen leaves hold no state).
    state_size = sum(x.size for x in jax.tree.leaves(abstract["opt_state"]) if x.ndim)
    trained = sum(v.size for p, v in after.items() if groups[".".join(p)] not in frozen_groups)
    assert state_size == 2 * trained
    assert np.isfinite(float(metrics["grad_norm"]))


def test_unknown_or_conflicting_groups_are_one_line():
    with pytest.raises(ConfigError, match=r"^train.freeze='routers': unknown group 'routers'"):
        tiny_config("train.freeze=routers")
    with pytest.raises(ConfigError, match=r"set one"):
        tiny_config("train.freeze=router", "train.trainable=experts")


def test_upcycle_random_init_draws_experts_like_a_fresh_moe_layer(dense):  # noqa: F811
    config, params, _, _ = dense
    moe_config = upcycle_config(config, 4, every=1, gating="top2")
    abstract = model_spec(moe_config.model, one_device_mesh()).abstract_params
    moe = upcycle_params(params, abstract, seed=3, init="random")
    copied = upcycle_params(params, abstract, seed=3, init="copy")
    for path, value in flatten(moe).items():
        if path[-1] in ("wi_0", "wi_1", "wo"):
            fan_in = value.shape[1]  # [E, in, out]: each expert's own fan-in
            assert abs(np.std(value) * fan_in**0.5 - 1) < 0.15, path
            assert not np.allclose(value[0], value[1])  # experts differ from each other
            dense_kernel = flatten(params)[path]
            assert not np.allclose(value[0], dense_kernel)
        else:  # attention, norms, embeddings, routers: as with copies
            np.testing.assert_array_equal(value, flatten(copied)[path])
    # Copies combine with weights summing to one (the dense function kept); random experts
    # keep the config's rule, router probabilities the router learns through.
    random_moe = upcycle_config(config, 4, init="random").model.moe
    assert (random_moe.gate.renormalize, random_moe.gate.single_weight) == (False, "prob")
    assert moe_config.model.moe.gate.single_weight == "one"
