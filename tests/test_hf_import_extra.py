"""`convert hf` / `export hf` for Llama-3 RoPE scaling and Qwen2 attention biases.

The reference is transformers: tiny random LlamaForCausalLM (llama3 and linear RoPE scaling)
and Qwen2ForCausalLM models, every parameter re-drawn (biases and norm scales included) so
that one the conversion missed would show in the logits.
"""

import json

import jax
import numpy as np
import pytest
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from jaxmoe.config.stored import read_config
from jaxmoe.conversions.hf.exporter import export_hf
from jaxmoe.conversions.hf.importer import convert_hf
from jaxmoe.conversions.surgery import gqa_params
from jaxmoe.errors import ConfigError
from jaxmoe.inference.decode import Generator
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.parallel.options import MeshOptions
from tests.helpers import tiny_config
from tests.test_hf import (
    TOL,
    VOCAB,
    assert_close,
    hf_logits,
    jaxmoe_logits,
    load_converted,
    one_line_error,
    randomize,
)

# 40 positions: long enough that the rescaled low rotary frequencies turn visibly.
IDS = np.random.default_rng(1).integers(1, VOCAB, size=(2, 40))
# head_dim 8, theta 5e5: wavelengths 6.3, 167, 4.4e3, 1.2e5. With an original context of 256,
# low/high factors 1/4, they fall in all three llama3 bands: kept (< 64), smoothed, divided.
LLAMA3 = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
}  # fmt: skip
LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}


def _llama(rope: dict, seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        max_position_embeddings=2048, rope_parameters=dict(rope),
    )  # fmt: skip
    return randomize(LlamaForCausalLM(config), seed)


def _plain_rope_logits(ckpt) -> np.ndarray:
    """The converted model with the scaling switched off: what ignoring it would give."""
    cfg = read_config(str(ckpt)).model.replace(rope_type="default")
    return jaxmoe_logits(load_converted(cfg, load_converted(ckpt).params), IDS)


@pytest.mark.parametrize("rope", [LLAMA3, LINEAR], ids=["llama3", "linear"])
def test_scaled_rope_converts_to_same_logits(rope, tmp_path):
    model = _llama(rope, seed=11)
    model.save_pretrained(tmp_path / "src")
    convert_hf(str(tmp_path / "src"), str(tmp_path / "ckpt"))
    m = read_config(str(tmp_path / "ckpt")).model
    assert (m.rope_type, m.rope_factor, m.rope_theta) == (
        rope["rope_type"], rope["factor"], rope["rope_theta"],
    )  # fmt: skip
    want = hf_logits(model, IDS)
    got = jaxmoe_logits(load_converted(tmp_path / "ckpt"), IDS)
    assert_close(got, want)
    print(f"{rope['rope_type']}: max |logit diff| vs transformers {np.abs(got - want).max():.2e}")
    # The scaling matters on these positions: plain RoPE would be far outside the tolerance.
    assert np.abs(_plain_rope_logits(tmp_path / "ckpt") - want).max() > 100 * TOL


def test_llama3_round_trip_export(tmp_path):
    model = _llama(LLAMA3, seed=12)
    model.save_pretrained(tmp_path / "src")
    convert_hf(str(tmp_path / "src"), str(tmp_path / "ckpt"))
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["rope_parameters"] == LLAMA3 and written["max_position_embeddings"] == 2048
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert_close(hf_logits(reloaded, IDS), hf_logits(model, IDS))


def _qwen2(seed: int) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        use_sliding_window=False, tie_word_embeddings=False,
    )  # fmt: skip
    return randomize(Qwen2ForCausalLM(config), seed)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_qwen2_biases_convert_and_export(scan, tmp_path):
    model = _qwen2(seed=13)
    biases = [n for n, _ in model.named_parameters() if n.endswith(".bias")]
    assert len(biases) == 6 and not any("o_proj" in n for n in biases)
    model.save_pretrained(tmp_path / "src")
    overrides = ["--config.model.scan_layers=true"] if scan else []
    convert_hf(str(tmp_path / "src"), str(tmp_path / "ckpt"), overrides=overrides)
    m = read_config(str(tmp_path / "ckpt")).model
    assert (m.qkv_bias, m.scan_layers, m.rope_type) == (True, scan, "default")
    want = hf_logits(model, IDS)
    got = jaxmoe_logits(load_converted(tmp_path / "ckpt"), IDS)
    assert_close(got, want)
    print(f"qwen2 (scan={scan}): max |logit diff| vs transformers {np.abs(got - want).max():.2e}")
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(reloaded).__name__ == "Qwen2ForCausalLM"
    assert_close(hf_logits(reloaded, IDS), want)


def _refused(model, tmp_path, edit=None) -> str:
    model.save_pretrained(tmp_path / "src")
    if edit:
        path = tmp_path / "src" / "config.json"
        path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    message = one_line_error(convert_hf, str(tmp_path / "src"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    return message


def test_unsupported_rope_scaling_is_refused(tmp_path):
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    message = _refused(_llama(LINEAR, seed=14), tmp_path, lambda c: c | {"rope_parameters": yarn})
    assert "'yarn'" in message and "llama3" in message


def test_sliding_window_and_output_bias_are_refused(tmp_path):
    config = MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=1, sliding_window=16,
        max_position_embeddings=64,
    )  # fmt: skip
    message = _refused(MistralForCausalLM(config), tmp_path / "mistral")
    assert "sliding_window=16" in message and "max_position_embeddings=64" in message
    biased = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
            num_attention_heads=4, attention_bias=True,
        )
    )  # fmt: skip
    assert "attention_bias=true" in _refused(biased, tmp_path / "llama")


@pytest.mark.parametrize(
    ("overrides", "culprit"),
    [
        (("model.rope_type=ntk",), "model.rope_type='ntk'"),
        (("model.rope_type=linear", "model.rope_theta=0.0"), "needs model.rope_theta > 0"),
        (("model.rope_type=llama3", "model.rope_high_freq_factor=1.0"), "0 < low < high"),
        (("model.arch=encoder_decoder", "model.qkv_bias=true"), "model.qkv_bias=True"),
    ],
)
def test_bad_rope_and_bias_settings_are_one_line_errors(overrides, culprit):
    with pytest.raises(ConfigError) as info:
        tiny_config(*overrides)
    assert culprit in str(info.value) and "\n" not in str(info.value)


def _hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Reference: transformers' full forward re-run on the whole sequence per new token."""
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(np.argmax(hf_logits(model, [seq])[0, -1])))
    return seq[len(prompt) :]


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_kv_cache_decoding_matches_transformers(kind, tmp_path):
    """The cached decode path (prefill, then one token a step) applies the scaling and the
    biases as transformers' full forward does."""
    model = _llama(LLAMA3, seed=15) if kind == "llama3" else _qwen2(seed=16)
    model.save_pretrained(tmp_path / "src")
    convert_hf(str(tmp_path / "src"), str(tmp_path / "ckpt"))
    loaded = load_converted(tmp_path / "ckpt")
    # Tensor-parallel: the heads (and so the q/k/v biases) split over 2 devices.
    mesh = make_mesh(MeshOptions(data=1, fsdp=1, tensor=2, expert=1), jax.devices()[:2])
    generator = Generator(loaded.cfg, loaded.params, mesh, eos_id=-1)
    prompts = [IDS[0, :30].tolist(), IDS[1, :17].tolist()]  # positions up to 40
    result = generator.generate(prompts, 10)
    for prompt, new in zip(prompts, result.tokens, strict=True):
        assert new == _hf_greedy(model, prompt, 10)


def test_gqa_pooling_pools_the_kv_biases(tmp_path):
    """`convert gqa` on a Qwen2 import: the biases pool with their kernels (the mean of the
    affine maps), checked by hand in numpy; a random widening restarts them at zero."""
    model = _qwen2(seed=17)
    model.save_pretrained(tmp_path / "src")
    convert_hf(str(tmp_path / "src"), str(tmp_path / "ckpt"))
    loaded = load_converted(tmp_path / "ckpt")
    params = jax.tree.map(np.asarray, loaded.params)
    pooled = gqa_params(params, loaded.cfg, 1)
    hf_bias = model.model.layers[1].self_attn.k_proj.bias.detach().numpy()  # [K * d]
    want = hf_bias.reshape(2, 8).mean(axis=0, keepdims=True)
    np.testing.assert_allclose(pooled["layers"]["1"]["attn"]["key_bias"], want, rtol=1e-6)
    widened = gqa_params(params, loaded.cfg, 4, method="random")
    assert np.array_equal(widened["layers"]["0"]["attn"]["value_bias"], np.zeros((4, 8)))
