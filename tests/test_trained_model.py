"""`jaxmoe.TrainedModel.open`: the one way every inference command opens a checkpoint, as a
notebook uses it."""

import jax
import numpy as np
import pytest
from flax import nnx

import jaxmoe
from jaxmoe.checkpoints.manager import save_params
from jaxmoe.checkpoints.trees import flatten
from jaxmoe.config.loading import with_overrides
from jaxmoe.data.sources import load_tokenizer
from jaxmoe.errors import ConfigError
from jaxmoe.models import build_model
from jaxmoe.models.spec import model_params
from jaxmoe.parallel.mesh import make_mesh
from tests.fixtures_data import copy_data_cache
from tests.helpers import tiny_config


@pytest.fixture(scope="module")
def saved(tmp_path_factory, embedded_data_cache):
    """(checkpoint dir, the parameters written into it) of a tiny MoE with a tokenizer."""
    tmp = tmp_path_factory.mktemp("trained_model")
    copy_data_cache(embedded_data_cache, tmp / "cache")  # its tokenizer, trained once
    config = tiny_config("model.vocab_size=512", f"data.cache_dir={tmp / 'cache'}")
    config = with_overrides(config, [f"data.tokenizer={load_tokenizer(config.data).path}"])
    _, params = model_params(build_model(config.model, rngs=nnx.Rngs(7)))
    params = jax.device_get(params)
    run = tmp / "run" / "checkpoints" / "12"
    save_params(str(run), params, config)
    return tmp / "run", params


def test_open_gives_config_tokenizer_mesh_and_the_saved_parameters(saved):
    run, written = saved
    model = jaxmoe.TrainedModel.open(str(run))
    assert model.step == 12 and model.checkpoint == str(run / "checkpoints" / "12")
    assert model.tokenizer.vocab_size == 512
    assert model.tokenizer.path == str(run / "checkpoints/12/tokenizer/tokenizer.model")
    assert model.config.model.vocab_size == 512 and not model.encoder_decoder
    got, want = flatten(jax.device_get(model.params)), flatten(written)
    assert got.keys() == want.keys()
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=".".join(key))


def test_open_on_a_mesh_of_the_callers_choice(saved):
    run, _ = saved
    mesh = make_mesh(tiny_config("mesh.data=2", "mesh.expert=4").mesh)
    model = jaxmoe.TrainedModel.open(str(run), mesh)
    assert dict(model.mesh.shape)["expert"] == 4
    expert_kernel = flatten(model.params)[("layers", "0", "ffn", "wi_0")]  # [E, D, F]
    assert expert_kernel.sharding.spec[0] == "expert"
    ids = model.tokenizer.encode("The router")
    result = model.generator().generate([ids], max_new_tokens=3)
    assert len(result.tokens[0]) == 3


def test_overrides_and_a_strict_mesh(saved):
    run, _ = saved
    model = jaxmoe.TrainedModel.open(str(run), overrides=["model.dtype=bfloat16"])
    assert model.config.model.dtype == "bfloat16"
    with pytest.raises(ConfigError, match="does not divide tensor"):
        jaxmoe.TrainedModel.open(str(run), overrides=["mesh.tensor=8"], strict_mesh=True)
