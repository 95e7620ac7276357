"""T5.1.1's recipe: T5X's schedules continued from a step, dropout, the output-logit z-loss,
the recipe `convert t5x` stores, and one uptraining step on the converted T5X fixture.

References: schedule values and the z-loss written out by hand in numpy; the T5X step read
with flax's own msgpack reader; the uptraining step bounded by T5X's parameter scaling.
"""

import importlib.util
import json
import math
import os
import re
from pathlib import Path

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from jaxmoe.checkpoints.trees import flatten
from jaxmoe.config.loading import apply_overrides
from jaxmoe.config.schema import JobConfig
from jaxmoe.config.validation import validate
from jaxmoe.conversions.t5x.convert import convert_t5x
from jaxmoe.errors import ConfigError
from jaxmoe.models import build_model
from jaxmoe.models.layers import dropout, make_dropout
from jaxmoe.models.options import ModelOptions
from jaxmoe.models.spec import model_params, model_rngs, model_spec
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.parallel.options import MeshOptions
from jaxmoe.training.loop import train
from jaxmoe.training.optimizer import learning_rate_schedule
from jaxmoe.training.options import OptimizerOptions
from jaxmoe.training.steps import _loss, forward, step_fns
from tests.helpers import synthetic_batches, tiny_config

FIXTURES = Path(os.environ.get("JAXMOE_T5X_FIXTURES", "/work/shared/fixtures/t5x"))
TINY = FIXTURES / "test_t5_tiny.checkpoint_0"
REPO = Path(__file__).resolve().parents[1]


def optimizer_config(**values) -> OptimizerOptions:
    return OptimizerOptions(**values)


def values(schedule, steps) -> np.ndarray:
    return np.array([float(schedule(jnp.asarray(s))) for s in steps])


def test_t5x_rsqrt_is_flat_then_inverse_sqrt_and_continues_from_start_step():
    o = optimizer_config(schedule="t5x_rsqrt", learning_rate=1.0, warmup_steps=10_000)
    steps = [0, 1, 9_999, 10_000, 40_000]
    want = [0.01, 0.01, 0.01, 0.01, 0.005]  # 1 / sqrt(max(step, 10k)) by hand
    np.testing.assert_allclose(values(learning_rate_schedule(o, 600), steps), want, rtol=1e-6)
    o = o.replace(start_step=1_000_000)  # T5.1.1 uptraining resumes at 1M: lr 1e-3, no warmup
    got = values(learning_rate_schedule(o, 50_000), [0, 50_000])
    np.testing.assert_allclose(got, [1e-3, 1 / math.sqrt(1_050_000)], rtol=1e-6)


def test_continued_cosine_keeps_the_original_length():
    o = optimizer_config(schedule="cosine", learning_rate=3e-3, warmup_steps=50, min_lr_ratio=0.1)
    o = o.replace(start_step=600, schedule_steps=600)  # after a finished 600-step run: floor
    np.testing.assert_allclose(
        values(learning_rate_schedule(o, 30), [0, 15, 29]), [3e-4] * 3, rtol=1e-6
    )
    o = o.replace(start_step=300)  # mid-run: the cosine at step 300 of (600 - 50) decay steps
    cos = 0.5 * (1 + math.cos(math.pi * (300 - 50) / 550))
    want = 3e-3 * (0.1 + 0.9 * cos)
    np.testing.assert_allclose(values(learning_rate_schedule(o, 30), [0]), [want], rtol=1e-5)


def test_bad_recipe_values_fail_in_one_line():
    for override, message in [
        ("model.dropout_rate=1.0", "model.dropout_rate=1.0 not in [0, 1)"),
        ("train.logits_z_loss=-1.0", "train.logits_z_loss=-1.0 must be >= 0"),
        ("optimizer.start_step=-5", "optimizer.start_step=-5 must be >= 0"),
        ("optimizer.name=t5x", "optimizer.name='t5x' is not one of"),
    ]:
        with pytest.raises(ConfigError, match="^" + re.escape(message)):
            tiny_config(override)


def logsumexp64(logits):
    top = logits.max(-1, keepdims=True)
    return (np.log(np.exp(logits - top).sum(-1, keepdims=True)) + top)[..., 0]


def test_logits_z_loss_equals_numpy_and_adds_to_the_loss():
    config = tiny_config("model.moe.num_experts=0", "train.logits_z_loss=0.01")
    spec = model_spec(config.model, one_device())
    params = init_params(config)
    batch = synthetic_batches(config, 1)[0]
    batch["weights"][:, -5:] = 0.0  # padding is not a target
    batch = jax.tree.map(jnp.asarray, batch)
    fns = step_fns(config.train, config.optimizer, config.model, spec, None, None)
    weight = jnp.sum(batch["weights"])
    loss, extra = _loss(params, batch, weight, jax.random.key(0), fns)

    logits = np.asarray(forward(spec.graphdef, params, batch, train=False)[0], np.float64)
    w = np.asarray(batch["weights"], np.float64)
    lse = logsumexp64(logits)
    z = 0.01 * np.sum(w * lse**2) / w.sum()
    picked = np.take_along_axis(logits, np.asarray(batch["targets"])[..., None], -1)[..., 0]
    nll = np.sum(w * (lse - picked)) / w.sum()
    np.testing.assert_allclose(float(extra["logits_z_loss"]), z, rtol=1e-5)
    np.testing.assert_allclose(float(loss), nll + z, rtol=1e-5)


def one_device():
    return make_mesh(MeshOptions(data=1, fsdp=1, tensor=1, expert=1), jax.devices()[:1])


def init_params(config):
    return model_params(build_model(config.model, rngs=model_rngs(jax.random.key(0))))[1]


ARCHS = {
    "decoder": ("model.moe.num_experts=0",),
    "encoder_decoder": (
        "model.arch=encoder_decoder",
        "model.activation=gelu",
        "model.rope_theta=0.0",
        "model.moe.num_experts=0",
    ),
}


def t5_batch(config, batch):
    if config.model.arch == "encoder_decoder":
        batch = dict(batch, encoder_inputs=batch["inputs"] + 1)  # no padding id 0
    return jax.tree.map(jnp.asarray, batch)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_dropout_is_off_at_eval_and_on_in_training(arch):
    plain = tiny_config(*ARCHS[arch])
    dropped = tiny_config(*ARCHS[arch], "model.dropout_rate=0.3")
    params = init_params(plain)
    batch = t5_batch(plain, synthetic_batches(plain, 1)[0])
    spec, spec_plain = (
        model_spec(dropped.model, one_device()),
        model_spec(plain.model, one_device()),
    )
    assert spec.rest and not spec_plain.rest  # rate 0 adds no RNG state

    def logits(spec, train, rng=None):
        return np.asarray(
            forward(spec.graphdef, params, batch, train=train, rest=spec.rest, rng=rng)[0]
        )

    reference = logits(spec_plain, False)
    np.testing.assert_array_equal(logits(spec, False), reference)
    np.testing.assert_array_equal(logits(spec_plain, True, jax.random.key(1)), reference)
    first = logits(spec, True, jax.random.key(1))
    assert np.abs(first - reference).max() > 1e-2
    np.testing.assert_array_equal(logits(spec, True, jax.random.key(1)), first)  # per-step key
    assert np.abs(logits(spec, True, jax.random.key(2)) - first).max() > 1e-2


def test_dropout_scales_kept_values_and_shares_the_mask_along_the_sequence():
    cfg = ModelOptions(dropout_rate=0.25)
    module = make_dropout(cfg, nnx.Rngs(dropout=0))
    x = jnp.ones((64, 5, 512))
    np.testing.assert_array_equal(dropout(module, x, train=False), x)
    y = np.asarray(dropout(module, x, train=True))
    assert set(np.unique(y)) == {0.0, np.float32(1 / 0.75)}
    np.testing.assert_array_equal(y, np.broadcast_to(y[:, :1], y.shape))  # T5X's (-2,)
    assert abs((y[:, 0] == 0).mean() - 0.25) < 0.01  # 32768 draws: 4.2 sigma
    assert make_dropout(ModelOptions(dropout_rate=0.0), nnx.Rngs(dropout=0)) is None


# --- The converted fixture: recipe, source step, and one uptraining step ---


def t5x_step_by_hand(path: Path) -> int:
    tree = flax.serialization.msgpack_restore(path.read_bytes())  # a bare msgpack file
    return int(np.asarray(tree["optimizer"]["state"]["step"]))


def uptrain_module():
    spec = importlib.util.spec_from_file_location("uptrain_gqa", REPO / "configs/uptrain_gqa.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    if not TINY.exists():
        pytest.skip(f"T5X fixture not found at {TINY}")
    dst = tmp_path_factory.mktemp("t5x_recipe") / "t5"
    convert_t5x(TINY, dst)
    return dst


def test_converted_config_carries_the_t5_1_1_recipe_and_source_step(converted):
    stored = json.loads((converted / "config" / "config.json").read_text())
    o = stored["optimizer"]
    assert (o["name"], o["schedule"], o["learning_rate"], o["warmup_steps"]) == (
        "t5x_adafactor",
        "t5x_rsqrt",
        1.0,
        10_000,
    )
    assert (o["weight_decay"], o["grad_clip_norm"], o["momentum"]) == (0.0, 0.0, 0.0)
    assert (o["decay_rate"], o["clipping_threshold"]) == (0.8, 1.0)
    assert stored["train"]["logits_z_loss"] == 1e-4
    assert (stored["data"]["noise_density"], stored["data"]["mean_noise_span"]) == (0.15, 3.0)
    assert stored["model"]["dropout_rate"] == 0.0
    assert stored["source"] == {"format": "t5x", "step": t5x_step_by_hand(TINY)}


def test_uptraining_runs_alpha_times_the_source_steps_on_the_continued_schedule(
    converted, tmp_path
):
    dst = tmp_path / "t5"
    convert_t5x(TINY, dst, overrides=["source.step=200000"])  # as if T5X had run 200k steps
    uptrain = uptrain_module()
    config = uptrain.get_config(str(dst))
    uptrain.finalize(config)
    assert "source" not in config  # it described the checkpoint, not this run
    assert config.train.steps == 10_000  # 0.05 x 200k
    assert config.optimizer.start_step == 200_000
    schedule = learning_rate_schedule(config.optimizer, config.train.steps)
    np.testing.assert_allclose(float(schedule(0)), 1 / math.sqrt(200_000), rtol=1e-6)
    step0 = uptrain.get_config(str(converted))  # T5X's step 0: nothing to take 5% of
    with pytest.raises(ValueError, match=r"^uptrain.original_steps=0 must be >= 1"):
        uptrain.finalize(step0)


def rms(x) -> float:
    return float(np.sqrt(np.mean(np.square(np.asarray(x, np.float64)))))


def tiny_uptrain(checkpoint: Path, cache: Path, *overrides: str) -> JobConfig:
    """configs/uptrain_gqa.py on `checkpoint`, with small batches of the embedded corpus
    (its data cache: `cache`)."""
    uptrain = uptrain_module()
    config = uptrain.get_config(str(checkpoint))
    apply_overrides(
        config,
        [
            *overrides,
            "train.batch_size=8",
            "train.seq_len=32",
            "train.eval_batches=1",
            "train.log_every=1",
            "data.vocab_size=512",
            f"data.cache_dir={cache}",
        ],
    )
    uptrain.finalize(config)
    return validate(config)


def test_one_uptraining_step_moves_each_kernel_by_at_most_lr_times_its_scale(
    converted, data_cache, tmp_path
):
    """T5X's parameter scaling and update clipping: after one step of T5X's Adafactor every
    parameter moves by RMS <= lr x max(RMS(param), 1e-3), lr = 1/sqrt(max(20, 10k)) = 0.01."""
    # The fixture is T5X's step 0: as if at step 20, 0.05 x 20 = 1 step.
    config = tiny_uptrain(converted, data_cache, "uptrain.original_steps=20")
    assert config.train.steps == 1 and config.optimizer.start_step == 20
    train(config, str(tmp_path / "run"), progress=False)

    with ocp.StandardCheckpointer() as checkpointer:
        before = flatten(checkpointer.restore(converted / "params"))
        after = flatten(checkpointer.restore(tmp_path / "run" / "checkpoints" / "1" / "params"))
    assert before.keys() == after.keys()
    lr = 0.01
    ratios = {
        "/".join(path): rms(after[path] - before[path]) / (lr * max(rms(before[path]), 1e-3))
        for path in before
    }
    assert max(ratios.values()) <= 1 + 1e-5, max(ratios.items(), key=lambda kv: kv[1])
    assert min(ratios.values()) > 0  # every parameter moved
    # Norm scales get a gradient everywhere, so y = sign(g) exactly: the bound is reached.
    scales = [r for name, r in ratios.items() if "scale" in name]
    np.testing.assert_allclose(scales, 1.0, rtol=1e-4)
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    np.testing.assert_allclose(line["learning_rate"], lr, rtol=1e-6)
    assert line["logits_z_loss"] > 0


def test_t5x_recipe_resumes_exactly_on_a_sharded_mesh(data_cache, tmp_path):
    """T5X's Adafactor state, dropout drawn from (seed, step) and the z-loss on a
    data x fsdp x tensor mesh: stopping at step 3 and resuming gives the same losses."""

    def config(steps):
        return tiny_config(
            "model.moe.num_experts=0",
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.tensor=2",
            f"train.steps={steps}",
            "train.log_every=1",
            "train.checkpoint_every=3",
            "train.eval_every=0",
            "train.eval_batches=1",
            "train.seq_len=32",
            "train.logits_z_loss=1e-4",
            "model.dropout_rate=0.1",
            "optimizer.name=t5x_adafactor",
            "optimizer.schedule=t5x_rsqrt",
            "optimizer.learning_rate=0.1",
            "optimizer.warmup_steps=2",
            "optimizer.grad_clip_norm=0.0",
            f"data.cache_dir={data_cache}",
            "model.vocab_size=0",
            "data.vocab_size=512",
        )

    def losses(workdir):
        lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in lines if r["split"] == "train"}

    train(config(6), str(tmp_path / "full"), progress=False)
    train(config(3), str(tmp_path / "resumed"), progress=False)
    train(config(6), str(tmp_path / "resumed"), progress=False)
    full, resumed = losses(tmp_path / "full"), losses(tmp_path / "resumed")
    assert full[6] < full[1]
    for step in range(4, 7):
        assert resumed[step] == pytest.approx(full[step], abs=1e-5), step


@pytest.mark.parametrize("name", ["t5_1_1_large_gqa8", "t5_1_1_xxl_gqa8"])
def test_t5_1_1_configs_use_t5x_adafactor_on_the_continued_rsqrt(name):
    """The T5.1.1 GQA configs: the recipe `convert t5x` writes, T5.1.1's 2048 x 512 / 114
    batch, and the rsqrt schedule resumed at step 1M (lr 1e-3 by hand, not a new warmup)."""
    from jaxmoe.config.loading import load_config
    from jaxmoe.data.seq2seq import corrupted_lengths, raw_length_for

    config = load_config(str(REPO / "configs" / f"{name}.py"))
    o, t = config.optimizer, config.train
    assert (o.name, o.schedule, o.learning_rate, o.warmup_steps) == (
        "t5x_adafactor",
        "t5x_rsqrt",
        1.0,
        10_000,
    )
    assert (o.weight_decay, o.grad_clip_norm, o.decay_rate, o.clipping_threshold) == (
        0.0,
        0.0,
        0.8,
        1.0,
    )
    assert (o.momentum, config.train.logits_z_loss, config.model.dropout_rate) == (0.0, 1e-4, 0)
    assert (t.batch_size, t.seq_len, t.steps, o.start_step) == (2048, 512, 50_000, 1_000_000)
    d = config.data
    raw = raw_length_for(t.seq_len, d.noise_density, d.mean_noise_span)
    assert corrupted_lengths(raw, d.noise_density, d.mean_noise_span) == (512, 114)
    got = values(learning_rate_schedule(o, t.steps), [0, t.steps])
    np.testing.assert_allclose(got, [1e-3, 1 / math.sqrt(1_050_000)], rtol=1e-6)


def test_t5_1_1_large_optimizer_state_is_factored_like_t5x():
    """T5X factors every kernel of T5.1.1-Large (both 2-D sides >= 128): the second moments
    are row and column vectors, under 1% of the 733M parameters (an unfactored Adafactor or
    Adam would hold one value per parameter)."""
    from jaxmoe.config.loading import load_config
    from jaxmoe.training.optimizer import make_optimizer

    config = load_config(str(REPO / "configs" / "t5_1_1_large_gqa8.py"))
    spec = model_spec(config.model, make_mesh(config.mesh))
    optimizer, _ = make_optimizer(config.optimizer, config.train.steps)
    state = jax.eval_shape(optimizer.init, spec.abstract_params)
    count = lambda tree: sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
    assert 700e6 < count(spec.abstract_params) < 760e6
    assert count(state) < 0.01 * count(spec.abstract_params)
