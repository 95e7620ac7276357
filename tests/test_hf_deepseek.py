"""DeepSeek-V3 / V2: `convert hf` against transformers' models, and latent-cache decoding.

The reference is transformers (PyTorch): tiny random DeepseekV3ForCausalLM /
DeepseekV2ForCausalLM built with its own classes and saved with `save_pretrained` (f32),
covering full-rank and low-rank queries, YaRN rotary with both mscales, a first dense
layer, shared experts, the sigmoid router with a random selection bias and group-limited
routing (V3), and V2's softmax top-k. The converted model must give transformers'
per-example NLL (1e-4 relative); greedy decoding through jaxmoe's latent cache must give
transformers' `generate` token for token. Each holds in the scanned layout too (`:scanned`
cases: the dense first layer unrolled ahead of the scanned MoE layers).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
)

from jaxmoe.checkpoints.manager import CheckpointError
from jaxmoe.config.stored import read_config
from jaxmoe.conversions.hf.exporter import export_hf
from jaxmoe.conversions.hf.importer import convert_hf
from jaxmoe.inference.decode import Generator
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.parallel.options import MeshOptions
from tests.test_hf import VOCAB, hf_logits, jaxmoe_logits, load_converted, randomize
from tests.test_hf_moe_families import ROUTER_SCALE, nll_per_example

REL_TOL = 1e-4
IDS = np.random.default_rng(3).integers(1, VOCAB, size=(3, 13))
SMALL = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
    n_routed_experts=8, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12,
    qk_nope_head_dim=10, num_experts_per_tok=2, first_k_dense_replace=1,
    max_position_embeddings=128, rms_norm_eps=1e-5,
)  # fmt: skip
YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
    "original_max_position_embeddings": 8, "mscale": 1.0, "mscale_all_dim": 0.8,
    "beta_fast": 8.0, "beta_slow": 1.0,
}  # fmt: skip
CASES = {
    "v3_full_rank_q": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(q_lora_rank=None)),
    "v3_low_rank_q_yarn": (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        dict(q_lora_rank=12, rope_parameters=YARN, norm_topk_prob=False, n_group=4, topk_group=2),
    ),
    "v2_softmax": (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        dict(q_lora_rank=None, routed_scaling_factor=1.5),
    ),
}


def build(name: str):
    config_class, model_class, extra = CASES[name]
    kwargs = {**SMALL, "n_group": 2, "topk_group": 1, **extra}
    if config_class is DeepseekV2Config:
        kwargs.pop("n_group"), kwargs.pop("topk_group")
    model = randomize(model_class(config_class(**kwargs)), seed=len(name))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for module_name, module in model.named_modules():
            if module_name.endswith("mlp.gate"):
                module.weight.mul_(ROUTER_SCALE)
                if hasattr(module, "e_score_correction_bias"):  # chooses, never weighs
                    bias = module.e_score_correction_bias
                    bias.copy_(0.3 * torch.randn(bias.shape, generator=gen))
    return model


# Converted with --config.model.scan_layers=true: the dense layer 0 unrolled (the stack's
# head), the two MoE layers one scanned block stacked 2 deep (models/stack.py).
SCANNED = ("v3_low_rank_q_yarn", "v2_softmax")


@pytest.fixture(scope="module", params=[*CASES, *(f"{name}:scanned" for name in SCANNED)])
def converted(request, tmp_path_factory):
    name, _, layout = request.param.partition(":")
    model = build(name)
    src = tmp_path_factory.mktemp(f"hf_{name}")
    model.save_pretrained(src, safe_serialization=True)
    dst = src.parent / f"{src.name}_jaxmoe"
    overrides = ["--config.model.scan_layers=true"] if layout else []
    convert_hf(str(src), str(dst), overrides=overrides)
    if layout:  # stored stacked: the head apart, the MoE layers as rows
        tree = (dst / "params" / "_METADATA").read_text()
        assert '"head"' in tree and '"period"' in tree
    return name, model, dst


def test_nll_matches_transformers(converted):
    name, model, dst = converted
    m = read_config(str(dst)).model
    assert (m.attention, m.moe.first_dense_layers, m.moe.num_shared_experts) == ("mla", 1, 1)
    want = hf_logits(model, IDS)
    got = jaxmoe_logits(load_converted(dst), IDS)
    assert np.std(want) > 0.1
    np.testing.assert_allclose(
        nll_per_example(got, IDS), nll_per_example(want, IDS), rtol=REL_TOL, atol=0
    )
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    if name == "v3_low_rank_q_yarn":
        assert (m.rope_type, m.q_lora_rank, m.moe.router.n_group, m.moe.router.topk_group) == (
            "yarn",
            12,
            4,
            2,
        )
        assert (m.rope_mscale_all_dim, m.moe.gate.renormalize) == (0.8, False)


def test_export_loads_with_transformers_own_class(converted, tmp_path):
    _, model, dst = converted
    export_hf(str(dst), str(tmp_path / "hf"))
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "auto_map" not in hf_config
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(reloaded) is type(model)
    want = hf_logits(model, IDS)
    np.testing.assert_allclose(
        nll_per_example(hf_logits(reloaded, IDS), IDS),
        nll_per_example(want, IDS),
        rtol=REL_TOL,
        atol=0,
    )


def test_adaptive_gating_trains_after_convert(tmp_path):
    """`--config.model.moe.gating=adaptive` on a converted DeepSeek-V2 (softmax router):
    one SGD step lowers the loss, and the latent attention learns."""
    build("v2_softmax").save_pretrained(tmp_path / "src")
    overrides = ["--config.model.moe.gating=adaptive"]
    convert_hf(str(tmp_path / "src"), str(tmp_path / "adaptive"), overrides=overrides)
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
    kv_up = grads["layers"]["1"]["attn"]["kv_up"]
    assert float(jnp.abs(kv_up).sum()) > 0


def test_partial_mtp_layer_is_refused(tmp_path):
    """config.json announces one MTP layer (transformers' default) and the files hold one of
    its tensors: the rest are named as missing (full MTP layers convert: test_mtp.py)."""
    model = build("v3_full_rank_q")
    model.save_pretrained(tmp_path / "src")
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(tmp_path / "src" / "model.safetensors"))
    tensors["model.layers.3.enorm.weight"] = np.ones(32, np.float32)
    save_file(tensors, str(tmp_path / "src" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as info:
        convert_hf(str(tmp_path / "src"), str(tmp_path / "dst"))
    message = str(info.value)
    assert "missing" in message and "model.layers.3." in message
    assert "\n" not in message


def test_greedy_decoding_with_latent_cache_matches_generate(converted):
    """Left-padded prompts of two lengths on a data x tensor mesh, 12 new tokens each."""
    name, model, dst = converted
    if name == "v2_softmax":
        pytest.skip("the V3 cases cover both query paths")
    prompts = [list(map(int, IDS[0, :5])), list(map(int, IDS[1, :9]))]
    new = 12
    model.generation_config.eos_token_id = None  # no early stop: every token compared
    want = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
        want.append(out[0, len(prompt) :].tolist())
    loaded = load_converted(dst)
    mesh = make_mesh(MeshOptions(data=-1, fsdp=1, tensor=2, expert=1))
    generator = Generator(loaded.cfg, loaded.params, mesh, eos_id=-1)
    assert generator.generate(prompts, new).tokens == want
