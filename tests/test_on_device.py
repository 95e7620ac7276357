"""Tests for a lent accelerator: `pytest -m gpu` on a GPU machine, `pytest -m tpu` on a TPU
VM (tests/conftest.py lets jax see the device then, and runs f32 matmuls in full precision).
Elsewhere they are skipped, saying so. The references are the host's CPU backend in the same
process and jaxmoe's XLA attention: what the device computes must be what the CPU computes.

Other files mark the tests that also check a device where one is present and run on the CPU
otherwise: the MoE layer against its float64 loop (test_moe.py) and the Pallas kernels
against theirs (test_tpu_kernels.py: Mosaic on a TPU, interpret mode on the CPU).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.aot.hlo_reading import gpu_kernels
from jaxmoe.models import build_model
from jaxmoe.models.attention_kernel import fallback_counts
from jaxmoe.models.spec import model_params, model_rngs
from jaxmoe.training.steps import forward
from tests.helpers import tiny_config


def _loss_and_grads_fn(config):
    """The training loss's model part (NLL of the next token, the MoE aux losses) and its
    gradients as one jitted program, with the routing each MoE layer chose."""
    graphdef, params = model_params(build_model(config.model, rngs=model_rngs(jax.random.key(0))))

    @jax.jit
    def loss_and_grads(params, inputs_BL):
        def loss(params):
            logits, aux = forward(
                graphdef, params, {"inputs": inputs_BL}, train=True, record_routing=True
            )
            logp = jax.nn.log_softmax(logits.astype(jnp.float32))
            targets = jnp.roll(inputs_BL, -1, axis=1)
            nll = -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
            extra = sum(a["balance_loss"] + a["router_z_loss"] for a in aux.values())
            return nll + extra, (logits, [a["experts"] for a in aux.values()])

        return jax.value_and_grad(loss, has_aux=True)(params)

    return loss_and_grads, params


def _tokens(config, seed=0):
    rng = np.random.default_rng(seed)
    shape = (config.train.batch_size, config.train.seq_len)
    return rng.integers(0, config.model.vocab_size, shape).astype(np.int32)


@pytest.mark.gpu
@pytest.mark.tpu
def test_moe_loss_and_gradients_on_the_device_equal_the_host_cpus():
    """A tiny GQA decoder with adaptive-gated MoE layers (the default config, shrunk): the
    loss, logits, routing and every gradient computed on the accelerator equal those of the
    same jitted program on the host's CPU backend."""
    config = tiny_config("model.moe.num_experts=4", "model.moe.threshold=0.3")
    loss_and_grads, params = _loss_and_grads_fn(config)
    tokens = _tokens(config)
    device = jax.devices()[0]
    cpu = jax.devices("cpu")[0]

    (loss, (logits, experts)), grads = loss_and_grads(
        jax.device_put(params, device), jax.device_put(tokens, device)
    )
    assert next(iter(loss.devices())).platform == device.platform
    (want_loss, (want_logits, want_experts)), want_grads = loss_and_grads(
        jax.device_put(params, cpu), jax.device_put(tokens, cpu)
    )
    assert next(iter(want_loss.devices())).platform == "cpu"

    for got, want in zip(experts, want_experts, strict=True):  # routing first: it explains
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), rtol=1e-4, atol=1e-5)
    flat, want_flat = jax.tree.leaves_with_path(grads), jax.tree.leaves(want_grads)
    for (path, got), want in zip(flat, want_flat, strict=True):
        name = jax.tree_util.keystr(path)
        np.testing.assert_allclose(
            np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6, err_msg=name
        )


@pytest.mark.gpu
def test_cudnn_flash_attention_takes_every_attention_and_matches_the_xla_path():
    """In bfloat16 (cuDNN's flash attention takes fp16/bf16 only) the tiny decoder's causal
    GQA attentions run through cuDNN, forward and backward, with no fallback, and give the
    logits and gradients of jaxmoe's XLA attention to bfloat16's precision."""
    results = {}
    for kernel in ("xla", "dot_product_attention"):
        config = tiny_config("model.dtype=bfloat16", f"model.attention_kernel={kernel}")
        loss_and_grads, params = _loss_and_grads_fn(config)
        tokens = jnp.asarray(_tokens(config))
        before = fallback_counts()
        hlo = loss_and_grads.lower(params, tokens).compile().as_text()
        assert fallback_counts() == before, fallback_counts()
        (loss, (logits, _)), grads = loss_and_grads(params, tokens)
        results[kernel] = (hlo, float(loss), np.asarray(logits, np.float32), grads)

    hlo, loss, logits, grads = results["dot_product_attention"]
    _, want_loss, want_logits, want_grads = results["xla"]
    if jax.default_backend() == "gpu":
        kernels = gpu_kernels(hlo)
        layers = tiny_config().model.num_layers
        assert kernels["cudnn_attention_forward"] >= layers, kernels
        assert kernels["cudnn_attention_backward"] >= layers, kernels
        assert gpu_kernels(results["xla"][0])["cudnn_attention_forward"] == 0
    np.testing.assert_allclose(loss, want_loss, rtol=2e-2)
    scale = np.abs(want_logits).max()
    assert np.abs(logits - want_logits).max() <= 3e-2 * scale
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.linalg.norm(got - want) <= 5e-2 * np.linalg.norm(want) + 1e-6


def test_a_device_run_is_read_from_the_mark_expression():
    from tests.conftest import _device_run

    for argv in (["-m", "gpu"], ["-q", "-mtpu", "tests"], ["-m", "gpu or tpu"], ["-m", " tpu "]):
        assert _device_run(argv), argv
    for argv in ([], ["-m", "not slow"], ["-m", "not gpu"], ["-m", "slow"], ["-m", "gpu and slow"]):
        assert not _device_run(argv), argv
    assert not _device_run(["-k", "gpu"])  # a keyword, not a mark expression
