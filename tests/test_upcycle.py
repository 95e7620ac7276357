"""Dense -> MoE upcycling: at initialisation the MoE model computes the dense model's
function (gates whose combine weights sum to one), checked against the dense model itself;
the written checkpoint and config; one-line errors."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxmoe.checkpoints.manager import restore_params, save_params
from jaxmoe.config.loading import with_overrides
from jaxmoe.config.stored import read_config
from jaxmoe.conversions.surgery import convert_upcycle, upcycle_config, upcycle_params
from jaxmoe.models import build_model
from jaxmoe.models.spec import model_params, model_spec
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.parallel.options import MeshOptions
from tests.helpers import tiny_config

E = 4


def one_device_mesh():
    return make_mesh(MeshOptions(data=1, fsdp=1, tensor=1, expert=1), jax.devices()[:1])


@pytest.fixture(scope="module")
def dense():
    config = tiny_config("model.moe.num_experts=0")
    model = build_model(config.model, rngs=nnx.Rngs(0))
    graphdef, params = model_params(model)
    params = jax.device_get(params)  # host arrays, as save_params expects
    tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (2, 16))
    logits = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t)[0])(params, tokens)
    return config, params, tokens, np.asarray(logits)


def upcycled_logits(config, params, tokens):
    """(logits, aux) of the upcycled model on `tokens`."""
    spec = model_spec(config.model, one_device_mesh())
    moe_params = upcycle_params(params, spec.abstract_params, seed=1)
    logits, aux = jax.jit(lambda p, t: nnx.merge(spec.graphdef, p)(t))(moe_params, tokens)
    return np.asarray(logits), aux, moe_params


@pytest.mark.parametrize(
    "gating, every", [("top1", 2), ("top2", 1), ("adaptive", 1)], ids=["top1", "top2", "adaptive"]
)
def test_upcycled_moe_at_init_equals_dense(dense, gating, every):
    config, params, tokens, want = dense
    moe_config = upcycle_config(config, E, every=every, gating=gating)
    got, aux, moe_params = upcycled_logits(moe_config, params, tokens)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    moe_layers = [i for i in range(config.model.num_layers) if (i + 1) % every == 0]
    assert sorted(aux) == moe_layers
    for i in moe_layers:
        ffn = moe_params["layers"][str(i)]["ffn"]
        assert ffn["router"].shape == (config.model.d_model, E)
        for name in ("wi_0", "wi_1", "wo"):
            dense_kernel = np.asarray(params["layers"][str(i)]["ffn"][name])
            for expert in range(E):
                np.testing.assert_array_equal(ffn[name][expert], dense_kernel)
    if gating == "adaptive":  # both the one-expert and the two-expert paths were taken
        fraction = float(aux[0]["top2_fraction"])
        assert 0.0 < fraction < 1.0, fraction


def test_weights_not_summing_to_one_would_change_the_function(dense):
    """The equality above is not automatic: raw top-2 probabilities scale the FFN down."""
    config, params, tokens, want = dense
    moe_config = with_overrides(
        upcycle_config(config, E, gating="top2"), ["model.moe.renormalize=false"]
    )
    got, _, _ = upcycled_logits(moe_config, params, tokens)
    assert np.max(np.abs(got - want)) > 1e-2


def test_convert_upcycle_writes_checkpoint_and_config(dense, tmp_path):
    config, params, _, _ = dense
    save_params(str(tmp_path / "dense"), params, config)
    returned = convert_upcycle(str(tmp_path / "dense"), str(tmp_path / "moe"), E, every=2)
    stored = read_config(str(tmp_path / "moe"))
    moe = stored.model.moe
    assert stored.to_dict() == returned.to_dict()
    assert (moe.num_experts, moe.every, moe.ffn_dim) == (E, 2, config.model.ffn_dim)
    assert (moe.gate.renormalize, moe.gate.single_weight) == (True, "one")
    restored = restore_params(
        str(tmp_path / "moe"), model_spec(stored.model, one_device_mesh()).abstract_params
    )
    assert restored["layers"]["1"]["ffn"]["wi_0"].shape == (E, 32, 64)
    assert restored["layers"]["0"]["ffn"]["wi_0"].shape == (32, 64)  # dense layer kept


def test_upcycle_errors_are_one_line(dense):
    config, _, _, _ = dense
    with pytest.raises(ValueError, match=r"^--num_experts=1 must be >= 2"):
        upcycle_config(config, 1)
    with pytest.raises(ValueError, match=r"^--every=3 must be in \[1, model.num_layers=2\]"):
        upcycle_config(config, E, every=3)
    with pytest.raises(ValueError, match=r"already a mixture of experts \(model.moe.num_exp"):
        upcycle_config(upcycle_config(config, E), E)
