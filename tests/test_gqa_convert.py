"""MHA -> GQA conversion: hand-computed pools, the paper's attention identity against a naive
numpy reference, which attentions an encoder-decoder converts, errors, and `train.init_from`
from a converted checkpoint."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from jaxmoe.checkpoints.manager import restore_params, save_params
from jaxmoe.config.stored import read_config
from jaxmoe.conversions.surgery import convert_gqa, gqa_params, pool_kv_heads
from jaxmoe.models import build_model
from jaxmoe.models.attention import Attention
from jaxmoe.models.spec import model_params, model_spec
from jaxmoe.training.loop import train
from tests.helpers import tiny_config

H, D = 4, 32  # query heads and width of the tiny models


def mha_config(cache_dir="", *extra):
    return tiny_config(
        "model.moe.num_experts=0",
        f"model.num_kv_heads={H}",
        "model.vocab_size=512",
        "mesh.data=-1",
        f"data.cache_dir={cache_dir}",
        *extra,
    )


def load(path):
    config = read_config(str(path))
    return config, restore_params(str(path), model_spec(config.model, _mesh()).abstract_params)


def _mesh():
    from jaxmoe.parallel.mesh import make_mesh
    from jaxmoe.parallel.options import MeshOptions

    return make_mesh(MeshOptions(data=1, fsdp=1, tensor=1, expert=1), jax.devices()[:1])


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("gqa")
    config = mha_config(str(root / "cache"))
    _, params = model_params(build_model(config.model, rngs=nnx.Rngs(0)))
    params = jax.tree.map(np.asarray, params)
    save_params(str(root / "mha"), params, config)
    return root, config, params


def test_groups_equal_to_heads_is_the_identity(source):
    """Pooling H heads into H groups changes nothing, so the command refuses to write it."""
    root, _, params = source
    for method in ("mean", "first"):
        for layer in params["layers"].values():
            for name in ("key", "value"):
                kernel = np.asarray(layer["attn"][name])
                np.testing.assert_array_equal(pool_kv_heads(kernel, H, method), kernel)
    with pytest.raises(ValueError, match="DST would equal SRC"):
        convert_gqa(str(root / "mha"), str(root / "same"), num_kv_heads=H)
    assert not (root / "same").exists()


@pytest.mark.parametrize("method", ["mean", "first"])
def test_pooled_heads_equal_hand_computed_values(source, method):
    root, _, params = source
    new_config = convert_gqa(str(root / "mha"), str(root / method), num_kv_heads=2, method=method)
    assert new_config.model.num_kv_heads == 2
    stored_config, new_params = load(root / method)
    assert stored_config.model.num_kv_heads == 2
    for layer in ("0", "1"):
        for name in ("key", "value"):
            w = params["layers"][layer]["attn"][name]  # [D, 4, d]
            if method == "mean":  # groups {0, 1} and {2, 3}
                want = np.stack([(w[:, 0] + w[:, 1]) / 2, (w[:, 2] + w[:, 3]) / 2], axis=1)
            else:
                want = np.stack([w[:, 0], w[:, 2]], axis=1)
            got = new_params["layers"][layer]["attn"][name]
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        for name in ("query", "out"):  # Q and O are kept
            np.testing.assert_array_equal(
                new_params["layers"][layer]["attn"][name], params["layers"][layer]["attn"][name]
            )
    np.testing.assert_array_equal(new_params["embed"]["embedding"], params["embed"]["embedding"])


def test_random_method_draws_fresh_heads_at_init_scale(source):
    _, config, params = source
    new = gqa_params(params, config.model, 1, method="random", seed=3)
    key = np.asarray(new["layers"]["0"]["attn"]["key"])
    assert key.shape == (D, 1, 8)
    assert not np.allclose(key[:, 0], params["layers"]["0"]["attn"]["key"][:, 0])
    assert 0.5 / D**0.5 < key.std() < 1.5 / D**0.5  # the Attention initialiser's fan-in scale


def naive_grouped_mean_attention(x, wq, wk, wv, wo, groups, mask):
    """MHA in numpy loops, each head's K and V replaced by the mean over its group's heads."""
    b, l, _ = x.shape
    h, dh = wq.shape[1], wq.shape[2]
    size = h // groups
    out = np.zeros((b, l, wo.shape[-1]))
    for bi in range(b):
        k_heads = [x[bi] @ wk[:, j] for j in range(h)]  # per original head [L, d]
        v_heads = [x[bi] @ wv[:, j] for j in range(h)]
        for hi in range(h):
            group = range(hi // size * size, (hi // size + 1) * size)
            k = sum(k_heads[j] for j in group) / size
            v = sum(v_heads[j] for j in group) / size
            q = x[bi] @ wq[:, hi]
            for i in range(l):
                logits = np.where(mask[i], k @ q[i] / np.sqrt(dh), -np.inf)
                p = np.exp(logits - logits.max())
                out[bi, i] += (p / p.sum()) @ v @ wo[hi]
    return out


@pytest.mark.parametrize("groups", [2, 1], ids=["gqa2", "mqa"])
def test_converted_attention_equals_mha_with_group_mean_kv(groups):
    mha = Attention(D, H, H, 8, rngs=nnx.Rngs(4))
    gqa = Attention(D, H, groups, 8, rngs=nnx.Rngs(5))
    gqa.query[...], gqa.out[...] = mha.query[...], mha.out[...]
    gqa.key[...] = pool_kv_heads(mha.key[...], groups, "mean")
    gqa.value[...] = pool_kv_heads(mha.value[...], groups, "mean")
    x = np.random.default_rng(6).normal(size=(2, 5, D)).astype(np.float32)
    mask = np.tril(np.ones((5, 5), bool))
    got = gqa(jnp.asarray(x), mask=jnp.asarray(mask)[None])
    weights = [np.asarray(w[...], np.float64) for w in (mha.query, mha.key, mha.value, mha.out)]
    want = naive_grouped_mean_attention(x.astype(np.float64), *weights, groups, mask)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def test_encoder_decoder_converts_decoder_attention_unless_asked():
    config = tiny_config(
        "model.moe.num_experts=0",
        "model.arch=encoder_decoder",
        "model.activation=gelu",
        "model.rope_theta=0.0",
        f"model.num_kv_heads={H}",
    )
    _, params = model_params(build_model(config.model, rngs=nnx.Rngs(7)))
    default = gqa_params(params, config.model, 2)
    both = gqa_params(params, config.model, 2, include_encoder=True)
    for module in ("self_attn", "cross_attn"):
        assert default["decoder_layers"]["0"][module]["key"].shape == (D, 2, 8)
    assert default["encoder_layers"]["0"]["attn"]["key"].shape == (D, H, 8)
    assert both["encoder_layers"]["0"]["attn"]["value"].shape == (D, 2, 8)


def test_bad_group_counts_are_one_line_errors(source, tmp_path):
    root, config, params = source
    with pytest.raises(ValueError, match=r"^--num_kv_heads=3 does not divide model.num_heads=4"):
        convert_gqa(str(root / "mha"), str(tmp_path / "x"), num_kv_heads=3)
    with pytest.raises(ValueError) as info:
        convert_gqa(str(root / "mha"), str(tmp_path / "x"), num_kv_heads=3)
    assert "\n" not in str(info.value)
    gqa2 = config.model.replace(num_kv_heads=2)
    with pytest.raises(ValueError, match=r"model.num_kv_heads=2 \(layers"):
        gqa_params(params, gqa2, 4)  # widening 2 -> 4 cannot be a pool
    with pytest.raises(ValueError, match="already exists"):
        convert_gqa(str(root / "mha"), str(root / "mha"), num_kv_heads=2)
    assert not (tmp_path / "x").exists()


def test_init_from_a_converted_checkpoint_starts_there_with_fresh_optimizer(source, tmp_path):
    """One step at learning rate 0 (the first warmup step) must leave the converted
    parameters untouched, and the optimizer's step count must start from zero."""
    root, _, _ = source
    config = mha_config(
        str(root / "cache"),
        "model.num_kv_heads=2",
        f"train.init_from={root / 'mean'}",
        "train.steps=1",
        "train.eval_batches=1",
        "train.checkpoint_every=0",
        "train.log_every=1",
        "optimizer.warmup_steps=4",
    )
    if not (root / "mean").exists():
        convert_gqa(str(root / "mha"), str(root / "mean"), num_kv_heads=2)
    train(config, str(tmp_path), progress=False)
    _, converted = load(root / "mean")
    trained = ocp.StandardCheckpointer().restore(tmp_path / "checkpoints" / "1" / "params")
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, trained), converted)
    opt_state = ocp.StandardCheckpointer().restore(tmp_path / "checkpoints" / "1" / "opt_state")
    counts = [
        int(np.asarray(leaf))
        for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]
        if "count" in jax.tree_util.keystr(path)
    ]
    assert counts and all(c == 1 for c in counts), counts
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and first["learning_rate"] == 0.0


def _uptrain_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("uptrain_gqa", "configs/uptrain_gqa.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_uptrain_config_takes_model_and_recipe_from_the_converted_checkpoint(source):
    root, original, _ = source
    if not (root / "mean").exists():
        convert_gqa(str(root / "mha"), str(root / "mean"), num_kv_heads=2)
    uptrain = _uptrain_module()
    config = uptrain.get_config(str(root / "mean"))
    assert config.train.init_from == str(root / "mean")
    assert config.model.num_kv_heads == 2 and config.model.d_model == original.model.d_model
    assert config.uptrain.original_steps == original.train.steps == 4
    uptrain.finalize(config)
    assert config.train.steps == 1  # max(1, round(0.05 * 4))
    # The schedule continues where the source stopped: step 4 of its 4-step cosine.
    assert (config.optimizer.start_step, config.optimizer.schedule_steps) == (4, 4)
    assert config.optimizer.warmup_steps == original.optimizer.warmup_steps
    config.uptrain.alpha, config.uptrain.original_steps = 0.1, 600  # as if overridden
    uptrain.finalize(config)
    assert config.train.steps == 60
    assert (config.optimizer.start_step, config.optimizer.schedule_steps) == (600, 600)
    without_variant = uptrain.get_config(None)  # init_from may still come as an override
    with pytest.raises(ValueError, match=r"^train.init_from is empty"):
        uptrain.finalize(without_variant)


def test_uptrain_alpha_override_reaches_train_steps(source):
    from jaxmoe.config.loading import load_config

    root, _, _ = source
    if not (root / "mean").exists():
        convert_gqa(str(root / "mha"), str(root / "mean"), num_kv_heads=2)
    config = load_config(f"configs/uptrain_gqa.py:{root / 'mean'}", ["--config.uptrain.alpha=0.5"])
    assert config.train.steps == 2


def test_pooling_to_the_head_count_a_model_has_is_refused():
    """It would write SRC again under a new name (an identical eval loss, to the last digit)."""
    from jaxmoe.conversions.surgery import check_num_kv_heads

    decoder = tiny_config("model.num_heads=4", "model.num_kv_heads=2").model
    with pytest.raises(ValueError, match=r"already has 2 KV heads .* DST would equal SRC"):
        check_num_kv_heads(decoder, 2, "mean", include_encoder=False)
    check_num_kv_heads(decoder, 1, "mean", include_encoder=False)  # fewer: pooled
    check_num_kv_heads(decoder, 2, "random", include_encoder=False)  # fresh K/V: a change
    t5 = tiny_config("model.arch=encoder_decoder", "model.num_heads=4", "model.num_kv_heads=2")
    with pytest.raises(ValueError, match="already has 2 KV heads"):
        check_num_kv_heads(t5.model, 2, "mean", include_encoder=False)
    check_num_kv_heads(t5.model, 2, "mean", include_encoder=True)  # its encoder has 4: pooled
