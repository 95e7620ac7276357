"""GPT-OSS both ways, against transformers' GptOssForCausalLM (PyTorch, eager attention).

A tiny random model (4 layers alternating sliding_attention / full_attention with a
window of 4, shorter than the 11-token test sequences; learned sinks; q/k/v/o biases; a
router bias; per-expert biases; YaRN rotary scaling with truncate=false; a SwiGLU limit
of 1 so the clamps are active) converts with the same per-example NLL (1e-4 relative),
exports back to a checkpoint transformers loads with its own class, and greedy decoding
with jaxmoe's cache (ring buffers on the sliding layers) equals transformers' `generate`
for a generation longer than the window. Adaptive gating then trains on the converted model.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM

from jaxmoe.config.stored import read_config
from jaxmoe.conversions.hf.exporter import export_hf
from jaxmoe.conversions.hf.importer import convert_hf
from jaxmoe.models.kv_cache import init_cache
from tests.test_hf import IDS, hf_logits, jaxmoe_logits, load_converted, randomize
from tests.test_hf_moe_families import assert_same_nll

WINDOW = 4


def gpt_oss_model(seed: int = 0) -> GptOssForCausalLM:
    config = GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=128,
        rms_norm_eps=1e-5, swiglu_limit=1.0, router_aux_loss_coef=0.02,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "beta_fast": 8.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16,
        },
    )  # fmt: skip
    config._attn_implementation = "eager"
    model = randomize(GptOssForCausalLM(config), seed)
    with torch.no_grad():  # routers at 3x unit scale: a wrong routing rule shows
        for name, p in model.named_parameters():
            if name.endswith("mlp.router.weight"):
                p.mul_(3.0)
    return model


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(HF model, jaxmoe checkpoint dir, temporary dir)."""
    tmp = tmp_path_factory.mktemp("gpt_oss")
    model = gpt_oss_model()
    assert model.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    model.save_pretrained(tmp / "src")
    convert_hf(str(tmp / "src"), str(tmp / "ckpt"))
    return model, tmp / "ckpt", tmp


def test_convert_keys(converted):
    _, ckpt, _ = converted
    m = read_config(str(ckpt)).model
    assert (m.sliding_window, m.layer_types) == (
        WINDOW,
        ",".join(["sliding_attention", "full_attention"] * 2),
    )
    assert m.attention_sinks and m.out_bias and m.qkv_bias
    assert (m.activation, m.swiglu_limit, m.rope_type, m.rope_truncate) == (
        "swiglu_clamped",
        1.0,
        "yarn",
        False,
    )
    assert m.moe.router_bias and m.moe.expert_bias and m.moe.gate.renormalize


def test_convert_matches_transformers_nll(converted):
    model, ckpt, _ = converted
    ids = np.random.default_rng(1).integers(1, 64, size=(3, 13))  # longer than the window
    want = hf_logits(model, ids)
    assert_same_nll(jaxmoe_logits(load_converted(ckpt), ids), want, ids)


def test_export_loads_in_transformers(converted):
    model, ckpt, tmp = converted
    export_hf(str(ckpt), str(tmp / "hf"))
    hf = json.loads((tmp / "hf" / "config.json").read_text())
    assert hf["model_type"] == "gpt_oss" and "auto_map" not in hf
    reloaded = AutoModelForCausalLM.from_pretrained(tmp / "hf", attn_implementation="eager")
    assert type(reloaded).__name__ == "GptOssForCausalLM"
    assert_same_nll(hf_logits(reloaded.eval(), IDS), hf_logits(model, IDS))
    for name, p in model.state_dict().items():  # the very same tensors came back
        np.testing.assert_array_equal(reloaded.state_dict()[name].numpy(), p.numpy(), name)


def jaxmoe_greedy(loaded, prompt: np.ndarray, new_tokens: int, cache_len: int) -> np.ndarray:
    """Greedy continuation through DecoderLM's cached forward (prefill, then one token)."""
    model = nnx.merge(loaded.graphdef, loaded.params)
    step = nnx.jit(lambda model, tokens, cache: model(tokens, cache=cache, last_only=True))
    cache = init_cache(loaded.cfg, prompt.shape[0], cache_len)
    logits, _, cache = step(model, jnp.asarray(prompt), cache)
    out = []
    for _ in range(new_tokens):
        token = jnp.argmax(logits[:, -1], axis=-1)[:, None].astype(jnp.int32)
        out.append(np.asarray(token))
        logits, _, cache = step(model, token, cache)
    ring_slots = [c.v.shape[-2] for c in cache.layers]
    assert ring_slots == [WINDOW, cache_len] * 2, ring_slots  # sliding layers: the window only
    return np.concatenate(out, axis=1)


def test_greedy_decode_equals_generate(converted):
    model, ckpt, _ = converted
    prompt = np.random.default_rng(2).integers(1, 64, size=(2, 6))
    new = 14  # 6 + 14 tokens: far past the window of 4
    with torch.no_grad():
        want = model.generate(
            torch.tensor(prompt), max_new_tokens=new, do_sample=False, min_new_tokens=new
        )[:, prompt.shape[1] :].numpy()
    got = jaxmoe_greedy(load_converted(ckpt), prompt, new, cache_len=32)
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_adaptive_gating_trains_after_convert(converted, tmp_path):
    _, _, tmp = converted
    overrides = ["--config.model.moe.gating=adaptive"]
    convert_hf(str(tmp / "src"), str(tmp_path / "adaptive"), overrides=overrides)
    loaded = load_converted(tmp_path / "adaptive")
    assert loaded.cfg.moe.gate.gating == "adaptive"
    ids = jnp.asarray(IDS)

    def loss(params):
        logits, _ = nnx.merge(loaded.graphdef, params)(ids[:, :-1], train=True)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], -1))

    before, grads = jax.jit(jax.value_and_grad(loss))(loaded.params)
    stepped = jax.tree.map(lambda p, g: p - 0.05 * g, loaded.params, grads)
    after = jax.jit(loss)(stepped)
    assert np.isfinite(float(before)) and float(after) < float(before)
    sinks = grads["layers"]["0"]["attn"]["sinks"]
    assert float(jnp.abs(sinks).sum()) > 0  # the sinks learn


@pytest.mark.slow
def test_sharded_generator_with_left_padding_equals_generate(converted):
    """`jaxmoe decode`'s Generator: prompts of different lengths (left padding in the rings),
    the cache rows split over a data x tensor mesh, each row as transformers alone gives."""
    from jaxmoe.inference.decode import Generator
    from jaxmoe.parallel.mesh import make_mesh
    from jaxmoe.parallel.options import MeshOptions

    model, ckpt, _ = converted
    loaded = load_converted(ckpt)
    mesh = make_mesh(MeshOptions(data=4, fsdp=1, tensor=2, expert=1))
    generator = Generator(loaded.cfg, loaded.params, mesh, eos_id=-1)
    prompts = [[5, 9, 17, 3, 22, 41, 7], [40, 2, 57]]
    result = generator.generate(prompts, 10)
    for prompt, new in zip(prompts, result.tokens, strict=True):
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)
        assert new == want[0, len(prompt) :].tolist()
