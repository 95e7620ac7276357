"""train.loss_chunk: the output loss applied a few positions at a time equals a float64
numpy log-softmax NLL (and z-loss) over the full logits of the same hidden states and head,
in value and gradient; a training run with chunks loses what one without does."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxmoe.errors import ConfigError
from jaxmoe.models import build_model
from jaxmoe.models.spec import model_params, model_rngs, model_spec
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.parallel.options import MeshOptions
from jaxmoe.parallel.sharding import batch_spec
from jaxmoe.training.chunked_loss import chunked_output_losses
from jaxmoe.training.evaluator import to_global
from jaxmoe.training.optimizer import make_optimizer
from jaxmoe.training.state import init_state, state_shardings
from jaxmoe.training.steps import _loss, forward_hidden, jit_train_step, step_fns
from tests.helpers import TINY_T5, synthetic_batches, tiny_config

Z = 0.01  # train.logits_z_loss in the cases below


def numpy_losses(h_BLD, w_DV, scale, targets_BL, weights_BL):
    """(sum w * NLL, sum w * logsumexp^2, d/dh and d/dw of NLL + Z * z) in float64."""
    h, w = np.asarray(h_BLD, np.float64), np.asarray(w_DV, np.float64)
    weights = np.asarray(weights_BL, np.float64)
    logits = h @ w * scale
    top = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    probs = np.exp(logits - lse[..., None])
    onehot = np.eye(w.shape[1])[np.asarray(targets_BL)]
    picked = (logits * onehot).sum(-1)
    nll, z = np.sum(weights * (lse - picked)), np.sum(weights * lse**2)
    d_logits = weights[..., None] * (probs - onehot + Z * 2 * lse[..., None] * probs) * scale
    d_h = d_logits @ w.T
    d_w = np.einsum("bld,blv->dv", h, d_logits)
    return nll, z, d_h, d_w


def padded_batch(config, pad: int):
    batch = synthetic_batches(config, 1)[0]
    batch["weights"][:2, -pad:] = 0.0  # padding: not a target
    batch["weights"][3, 1] = 0.5  # and a fractional label weight
    if config.model.arch == "encoder_decoder":
        batch["encoder_inputs"] = batch["inputs"][:, ::-1] + 1  # no padding (token 0)
    return jax.tree.map(jnp.asarray, batch)


def one_device():
    return make_mesh(MeshOptions(data=1, fsdp=1, tensor=1, expert=1), jax.devices()[:1])


def hidden_and_head(config, batch):
    spec = model_spec(config.model, one_device())
    params = model_params(build_model(config.model, rngs=model_rngs(jax.random.key(0))))[1]
    hidden, (w_DV, scale), _ = forward_hidden(spec.graphdef, params, batch, train=False)
    return spec, params, hidden, w_DV, scale


@pytest.mark.parametrize(
    "overrides, chunk",
    [
        (("model.tie_embeddings=false",), 4),
        (("model.tie_embeddings=true",), 8),
        (("model.tie_embeddings=true",), 5),  # 16 positions: a zero-weight padded remainder
        ((*TINY_T5, "model.tie_embeddings=true"), 4),  # T5X's 1/sqrt(d) logit scale
        ((*TINY_T5, "model.tie_embeddings=false"), 16),
    ],
)
def test_chunked_losses_and_gradients_equal_numpy(overrides, chunk):
    config = tiny_config("model.moe.num_experts=0", *overrides)
    batch = padded_batch(config, pad=5)
    _, _, hidden, w_DV, scale = hidden_and_head(config, batch)
    t5_tied = config.model.tie_embeddings and config.model.arch == "encoder_decoder"
    assert np.isclose(scale, config.model.d_model**-0.5 if t5_tied else 1.0)

    def objective(h, w):
        nll, z = chunked_output_losses(h, w, scale, batch["targets"], batch["weights"], chunk)
        return nll + Z * z, (nll, z)

    (_, (nll, z)), (d_h, d_w) = jax.jit(jax.value_and_grad(objective, (0, 1), has_aux=True))(
        hidden, w_DV
    )
    want = numpy_losses(hidden, w_DV, scale, batch["targets"], batch["weights"])
    for got, expected in zip((nll, z, d_h, d_w), want, strict=True):
        np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("tied", [True, False])
def test_train_loss_with_chunks_equals_numpy_and_its_gradient_the_unchunked_one(tied):
    base = ("model.moe.num_experts=0", f"model.tie_embeddings={tied}", f"train.logits_z_loss={Z}")
    config = tiny_config(*base, "train.loss_chunk=4")
    batch = padded_batch(config, pad=3)
    spec, params, hidden, w_DV, scale = hidden_and_head(config, batch)
    total = jnp.sum(batch["weights"])

    def loss_of(cfg):
        fns = step_fns(cfg.train, cfg.optimizer, cfg.model, spec, None, None)
        return jax.jit(
            jax.value_and_grad(lambda p: _loss(p, batch, total, None, fns), has_aux=True)
        )

    (loss, extra), grads = loss_of(config)(params)
    nll, z, _, _ = numpy_losses(hidden, w_DV, scale, batch["targets"], batch["weights"])
    total = float(total)
    np.testing.assert_allclose(float(extra["nll_sum"]), nll, rtol=1e-5)
    np.testing.assert_allclose(float(extra["logits_z_loss"]), Z * z / total, rtol=1e-5)
    np.testing.assert_allclose(float(loss), (nll + Z * z) / total, rtol=1e-5)
    # Every parameter's gradient (embedding, norms, blocks) as without chunks.
    (_, _), plain = loss_of(tiny_config(*base))(params)
    for path, got in jax.tree_util.tree_leaves_with_path(grads):
        want = np.asarray(dict(jax.tree_util.tree_leaves_with_path(plain))[path])
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-7, err_msg=str(path))


def test_bad_chunk_sizes_fail_in_one_line():
    for override, message in [
        ("train.loss_chunk=5", "train.loss_chunk=5 does not divide train.seq_len=16"),
        ("train.loss_chunk=-1", "train.loss_chunk=-1 must be >= 0"),
    ]:
        with pytest.raises(ConfigError, match="^" + re.escape(message) + "$"):
            tiny_config(override)


def train_losses(config, devices, n_steps=3):
    """The train losses of `n_steps` jitted steps of `config` (its train.* keys) on the
    synthetic batches."""
    mesh = make_mesh(config.mesh, devices)
    spec = model_spec(config.model, mesh)
    optimizer, schedule = make_optimizer(config.optimizer, config.train.steps)
    _, shardings = state_shardings(mesh, spec, optimizer)
    state = init_state(config.model, 0, optimizer, shardings, mesh)
    batch_sh = {
        k: NamedSharding(mesh, batch_spec(mesh, 2, config.train.batch_size))
        for k in ("inputs", "targets", "weights")
    }
    losses = []
    with jax.set_mesh(mesh):
        step = jit_train_step(
            step_fns(config.train, config.optimizer, config.model, spec, optimizer, schedule),
            shardings,
            batch_sh,
        )
        for batch in synthetic_batches(config, n_steps):
            state, metrics = step(state, to_global(batch, batch_sh))
            losses.append(float(metrics["loss"]))
    return np.array(losses)


def test_training_with_chunks_loses_what_training_without_does():
    base = ("model.moe.num_experts=0", "train.logits_z_loss=0.001", "train.grad_accum=2")
    plain = train_losses(tiny_config(*base, "mesh.data=1"), jax.devices()[:1])
    chunked = train_losses(
        tiny_config(*base, "mesh.data=1", "train.loss_chunk=4"), jax.devices()[:1]
    )
    np.testing.assert_allclose(chunked, plain, rtol=1e-5, atol=1e-5)
    # Sharded over data x tensor, the chunks' vocab axis split over `tensor`: the same.
    mesh = ("mesh.data=2", "mesh.fsdp=1", "mesh.tensor=4", "mesh.expert=1")
    sharded = train_losses(tiny_config(*base, *mesh, "train.loss_chunk=8"), jax.devices())
    np.testing.assert_allclose(sharded, plain, rtol=1e-5, atol=1e-5)


def test_memory_lower_bound_counts_one_chunk_of_logits():
    from jaxmoe.training.step_memory import step_bytes_lower_bound

    config = tiny_config("model.moe.num_experts=0", "train.loss_chunk=4")
    mesh = make_mesh(config.mesh)
    optimizer, _ = make_optimizer(config.optimizer, config.train.steps)
    abstract, shardings = state_shardings(mesh, model_spec(config.model, mesh), optimizer)
    parts = step_bytes_lower_bound(config.model, config.train, mesh, abstract, shardings)
    assert parts["logits"] == 1 * 4 * 128 * 4  # rows per device x chunk x vocab, float32


def test_chunks_under_the_context_axis_take_every_devices_own_positions():
    from jaxmoe.training.chunked_loss import _strided_chunks

    # 16 positions on 4 context devices (4 each), chunks of 8: 2 from every device's part.
    chunks = np.asarray(_strided_chunks(jnp.arange(16)[None], 8, 4))[:, 0]
    assert chunks.tolist() == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    config = tiny_config("model.moe.num_experts=0", "model.tie_embeddings=false")
    batch = padded_batch(config, pad=5)
    _, _, hidden, w_DV, scale = hidden_and_head(config, batch)
    assert hidden.shape[1] % 8 == 0

    def objective(h, w):
        nll, z = chunked_output_losses(h, w, scale, batch["targets"], batch["weights"], 8)
        return nll + Z * z, (nll, z)

    mesh = make_mesh(MeshOptions(data=-1, context=4))
    with jax.set_mesh(mesh):
        (_, (nll, z)), (d_h, d_w) = jax.jit(jax.value_and_grad(objective, (0, 1), has_aux=True))(
            hidden, w_DV
        )
    want = numpy_losses(hidden, w_DV, scale, batch["targets"], batch["weights"])
    for got, expected in zip((nll, z, d_h, d_w), want, strict=True):
        np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=2e-5, atol=2e-6)
