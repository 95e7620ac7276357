"""`convert t5x --keep_optimizer`: T5X's Adafactor state continues exactly in jaxmoe.

Checkpoints are written here with flax's serializer as T5X lays them out (moments factored
by T5X's heuristic, written out independently); the reference for one continued update is
the float64 numpy transcription of T5X's formulas in test_t5x_adafactor.py.
"""

import json
import math
from pathlib import Path

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from jaxmoe.checkpoints.manager import restore_opt_state
from jaxmoe.checkpoints.trees import flatten, unflatten
from jaxmoe.config.validation import validate
from jaxmoe.conversions.t5x.convert import convert_t5x
from jaxmoe.conversions.t5x.reader import open_t5x
from jaxmoe.training.loop import train
from jaxmoe.training.optimizer import make_optimizer
from tests.test_t5x_adafactor import jaxmoe_layout, reference_step
from tests.test_t5x_recipe import TINY, tiny_uptrain, uptrain_module


def write_t5x_with_moments(path: Path, params: dict, step: int, seed: int = 0) -> dict:
    """A legacy T5X checkpoint file (flax's serializer) of `params` as T5X's Adafactor leaves
    it after `step` steps: positive second moments, factored by T5X's heuristic (when the
    second-largest axis is >= 128; v_row drops the largest axis, v_col the other). Returns
    {name: its moments}."""
    rng = np.random.default_rng(seed)
    placeholder = np.zeros((1,), np.float32)
    states, moments = {}, {}
    for name, param in params.items():
        state = {"m": placeholder, "v_row": placeholder, "v_col": placeholder, "v": placeholder}
        order = np.argsort(param.shape, kind="stable")
        if param.ndim >= 2 and param.shape[order[-2]] >= 128:
            state["v_row"] = np.delete(param.shape, order[-1])
            state["v_col"] = np.delete(param.shape, order[-2])
        else:
            state["v"] = param.shape
        for key in ("v_row", "v_col", "v"):
            if state[key] is not placeholder:
                state[key] = rng.uniform(1e-6, 1e-3, state[key]).astype(np.float32)
        moments[name] = {k: v.astype(np.float64) for k, v in state.items() if v.size > 1}
        for key, value in state.items():
            states[(*name.split("/"), key)] = value
    target = {tuple(name.split("/")): value for name, value in params.items()}
    tree = {
        "version": 3,
        "optimizer": {
            "target": unflatten(target),
            "state": {"step": np.asarray(step, np.int32), "param_states": unflatten(states)},
        },
    }
    path.write_bytes(flax.serialization.msgpack_serialize(tree))
    return moments


def t5_1_1_params(d: int, heads: int, head_dim: int, ff: int, vocab: int, seed: int = 0):
    """Random parameters of a one-layer T5.1.1 under T5X's names and 2-D shapes."""
    rng = np.random.default_rng(seed)
    hd = heads * head_dim
    shapes = {"token_embedder/embedding": (vocab, d), "decoder/logits_dense/kernel": (d, vocab)}
    for stack, norm in (("encoder", "encoder_norm"), ("decoder", "decoder_norm")):
        shapes[f"{stack}/relpos_bias/rel_embedding"] = (heads, 32)
        shapes[f"{stack}/{norm}/scale"] = (d,)
        mlp = {"wi_0": (d, ff), "wi_1": (d, ff), "wo": (ff, d)}
        for key, shape in mlp.items():
            shapes[f"{stack}/layers_0/mlp/{key}/kernel"] = shape
    attention = {"query": (d, hd), "key": (d, hd), "value": (d, hd), "out": (hd, d)}
    blocks = {
        "encoder": ["attention"],
        "decoder": ["self_attention", "encoder_decoder_attention"],
    }
    norms = {
        "encoder": ["pre_attention", "pre_mlp"],
        "decoder": ["pre_self_attention", "pre_cross_attention", "pre_mlp"],
    }
    for stack in ("encoder", "decoder"):
        for block in blocks[stack]:
            for key, shape in attention.items():
                shapes[f"{stack}/layers_0/{block}/{key}/kernel"] = shape
        for norm in norms[stack]:
            shapes[f"{stack}/layers_0/{norm}_layer_norm/scale"] = (d,)
    return {n: (rng.standard_normal(s) * 0.05).astype(np.float32) for n, s in shapes.items()}


SOURCES = {
    # The fixture (d_model 8: every moment unfactored) and a d_model-128 T5 (factored).
    "fixture": lambda: (flatten_t5x(TINY), 4),
    "d_model_128": lambda: (t5_1_1_params(128, 2, 64, 256, 512), 2),
}


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_keep_optimizer_continues_t5x_adafactor_exactly(tmp_path, source):
    """One update from the kept state equals T5X's formulas (float64 numpy) continued at step
    N with the stored moments, on every parameter, in jaxmoe's layouts."""
    if not TINY.exists():
        pytest.skip(f"T5X fixture not found at {TINY}")
    t5x, heads = SOURCES[source]()
    step = 150_000
    src = tmp_path / "checkpoint_150000"
    moments = write_t5x_with_moments(src, t5x, step)
    dst = tmp_path / "kept"
    convert_t5x(src, dst, keep_optimizer=True)
    uptrain = uptrain_module()
    config = uptrain.get_config(str(dst))
    uptrain.finalize(config)
    assert config.train.init_optimizer and config.optimizer.start_step == step

    optimizer, _ = make_optimizer(config.optimizer, config.train.steps)
    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(dst / "params")
    opt_state = restore_opt_state(str(dst), jax.eval_shape(optimizer.init, params))
    t5x = {name: np.asarray(a, np.float64) for name, a in t5x.items()}
    rng = np.random.default_rng(3)
    grads_t5x = {n: rng.standard_normal(a.shape) * 1e-2 for n, a in t5x.items()}
    layouts = {n: jaxmoe_layout(n, t5x[n], heads) for n in t5x}
    by_jaxmoe_path = {jaxmoe_path(path): name for name, (path, _) in layouts.items()}
    grads = unflatten(
        {
            jaxmoe_path(layouts[n][0]): jnp.asarray(g.reshape(layouts[n][1].shape), jnp.float32)
            for n, g in grads_t5x.items()
        }
    )
    updates, _ = jax.jit(optimizer.update)(grads, opt_state, params)
    lr = 1 / math.sqrt(step)
    factored = 0
    for path, update in flatten(jax.tree.map(np.asarray, updates)).items():
        name = by_jaxmoe_path[path]
        factored += "v_row" in moments[name]
        state = dict(moments[name])
        want = reference_step(t5x[name], grads_t5x[name], state, step, lr, 128) - t5x[name]
        np.testing.assert_allclose(update.reshape(want.shape), want, rtol=1e-6, err_msg=name)
    # d_model 128: embedding, output layer and the 18 attention and FFN kernels (not relpos)
    assert factored == (0 if source == "fixture" else 20)


def flatten_t5x(path: Path) -> dict:
    checkpoint = open_t5x(path)
    return {name: checkpoint.read(name) for name in checkpoint.names()}


# T5X module names -> jaxmoe's, written out by hand for the tiny T5.1.1 (test-only mapping).
_MODULES = {
    "token_embedder/embedding": ("token_embed", "embedding"),
    "encoder/relpos_bias/rel_embedding": ("encoder_relpos", "rel_embedding"),
    "decoder/relpos_bias/rel_embedding": ("decoder_relpos", "rel_embedding"),
    "encoder/encoder_norm/scale": ("encoder_norm", "scale"),
    "decoder/decoder_norm/scale": ("decoder_norm", "scale"),
    "decoder/logits_dense/kernel": ("lm_head",),
}
_LAYER_MODULES = {
    "attention": "attn",
    "pre_attention_layer_norm": "attn_norm",
    "pre_mlp_layer_norm": "ffn_norm",
    "mlp": "ffn",
    "self_attention": "self_attn",
    "pre_self_attention_layer_norm": "self_attn_norm",
    "encoder_decoder_attention": "cross_attn",
    "pre_cross_attention_layer_norm": "cross_attn_norm",
}


def jaxmoe_path(t5x_path: tuple[str, ...]) -> tuple[str, ...]:
    """jaxmoe's parameter path of a T5X path as `jaxmoe_layout` returns it."""
    joined = "/".join(t5x_path)
    if joined in _MODULES:
        return _MODULES[joined]
    stack, layer, module, *rest = t5x_path  # encoder/layers_0/attention/query
    leaf = rest[0] if rest[0] != "scale" else "scale"
    return (f"{stack}_layers", layer.removeprefix("layers_"), _LAYER_MODULES[module], leaf)


def test_uptraining_from_a_kept_state_continues_its_step_count(data_cache, tmp_path):
    if not TINY.exists():
        pytest.skip(f"T5X fixture not found at {TINY}")
    src = tmp_path / "checkpoint_40"
    write_t5x_with_moments(src, flatten_t5x(TINY), 40)
    with pytest.raises(ValueError, match=r"^--keep_optimizer keeps T5X's Adafactor state"):
        convert_t5x(
            src, tmp_path / "adamw", keep_optimizer=True, overrides=["optimizer.name=adamw"]
        )
    dst = tmp_path / "kept"
    convert_t5x(src, dst, keep_optimizer=True)
    config = tiny_uptrain(dst, data_cache)
    assert config.train.steps == 2 and config.train.init_optimizer  # 0.05 x 40
    train(config, str(tmp_path / "run"), progress=False)
    step_dir = tmp_path / "run" / "checkpoints" / "2"
    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(step_dir / "params")
        optimizer, _ = make_optimizer(config.optimizer, config.train.steps)
        abstract = jax.eval_shape(optimizer.init, params)
        opt_state = checkpointer.restore(step_dir / "opt_state", abstract)
    kinds = (optax.FactoredState, optax.ScaleByScheduleState)
    nodes = jax.tree.leaves(opt_state, is_leaf=lambda n: isinstance(n, kinds))
    moments = {int(n.count) for n in nodes if isinstance(n, optax.FactoredState)}
    schedule = {int(n.count) for n in nodes if isinstance(n, optax.ScaleByScheduleState)}
    assert (moments, schedule) == ({42}, {2})  # T5X's 40 continued; the schedule restarted
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lr = [r["learning_rate"] for r in lines if r["split"] == "train"]
    np.testing.assert_allclose(lr, [0.01, 0.01], rtol=1e-6)  # 1 / sqrt(max(40, 10k))


def test_init_optimizer_from_a_jaxmoe_run_continues_adam_and_offsets_the_schedule(
    trained_dense, tmp_path
):
    """train.init_optimizer from a jaxmoe run: Adam's moment count continues (4 + 1) while
    the schedule's own count restarts, the schedule being offset by start_step instead."""
    from jaxmoe.config.loading import apply_overrides
    from jaxmoe.config.stored import read_config
    from tests.fixtures_data import copy_data_cache

    source = trained_dense / "run"  # tests/fixtures_checkpoints.py: read-only
    stored = read_config(str(source / "checkpoints" / "4"), tokenizer=False)
    adam = stored.optimizer  # the source run the counts and the learning rate below follow
    assert (stored.train.steps, adam.name, adam.schedule) == (4, "adamw", "cosine")
    assert (adam.learning_rate, adam.min_lr_ratio, adam.warmup_steps) == (3e-3, 0.1, 1)
    uptrain = uptrain_module()
    config = uptrain.get_config(str(source))
    cache = copy_data_cache(trained_dense / "cache", tmp_path / "cache")
    apply_overrides(
        config, ["train.init_optimizer=true", "uptrain.alpha=0.25", f"data.cache_dir={cache}"]
    )
    uptrain.finalize(config)
    assert (config.train.steps, config.optimizer.start_step) == (1, 4)
    train(validate(config), str(tmp_path / "up"), progress=False)

    step_dir = tmp_path / "up" / "checkpoints" / "1"
    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(step_dir / "params")
        optimizer, _ = make_optimizer(config.optimizer, config.train.steps)
        opt_state = checkpointer.restore(
            step_dir / "opt_state", jax.eval_shape(optimizer.init, params)
        )
    kinds = (optax.ScaleByAdamState, optax.ScaleByScheduleState)
    nodes = jax.tree.leaves(opt_state, is_leaf=lambda n: isinstance(n, kinds))
    assert {int(n.count) for n in nodes if isinstance(n, optax.ScaleByAdamState)} == {5}
    assert {int(n.count) for n in nodes if isinstance(n, optax.ScaleByScheduleState)} == {1}
    line = json.loads((tmp_path / "up" / "metrics.jsonl").read_text().splitlines()[0])
    # The source's 4-step cosine ended at its floor: 0.1 x the peak 3e-3.
    np.testing.assert_allclose(line["learning_rate"], 3e-4, rtol=1e-5)
