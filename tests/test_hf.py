"""Hugging Face conversion: `convert hf` and `export hf` against transformers' own models.

The reference is transformers (PyTorch): tiny randomly initialised Llama (GQA), Mixtral
(top-2 MoE) and T5 v1.1 models saved with `save_pretrained`; the converted jaxmoe model must
give the same logits on fixed ids. Weights are re-drawn at unit scale first: HF's default
init (std 0.02) gives near-zero logits that would hide a wrong layout inside the tolerance.
"""

import json
import pickle
import shutil
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import SingleDeviceSharding
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

from jaxmoe.checkpoints.manager import restore_params, save_params
from jaxmoe.cli import build_parser
from jaxmoe.config.stored import read_config
from jaxmoe.conversions.hf.export_config import export_plan
from jaxmoe.conversions.hf.exporter import export_hf
from jaxmoe.conversions.hf.importer import abstract_params, convert_hf
from jaxmoe.models import build_model
from jaxmoe.models.spec import str_keys
from tests.helpers import tiny_config

TOL = 1e-4
VOCAB = 64
torch.set_num_threads(2)


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Unit-scale random weights: matrices ~ N(0, 1/fan_in), norm scales ~ 1 + N(0, 0.2)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if p.ndim == 1 else noise * p.shape[-1] ** -0.5)
    return model.eval()


class Loaded(NamedTuple):
    cfg: object
    graphdef: nnx.GraphDef
    params: dict


def load_converted(path, params=None) -> Loaded:
    """The jaxmoe model of checkpoint `path`, built from its stored config alone (or of
    config `path` with `params` given)."""
    cfg = path if params is not None else read_config(str(path)).model
    model = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model, nnx.Param)
    if params is None:
        device = SingleDeviceSharding(jax.devices()[0])
        abstract = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
            str_keys(nnx.to_pure_dict(state)),
        )
        params = restore_params(str(path), abstract)
    return Loaded(cfg, graphdef, params)


_FORWARDS = {}


def jaxmoe_logits(loaded: Loaded, *tokens) -> np.ndarray:
    """Logits of the jaxmoe model, jitted once per model config (eager dispatch would
    compile every op separately, which costs seconds here)."""
    key = json.dumps(loaded.cfg.to_dict(), sort_keys=True)
    if key not in _FORWARDS:
        graphdef = loaded.graphdef
        _FORWARDS[key] = jax.jit(lambda p, *t: nnx.merge(graphdef, p)(*t)[0])
    return np.asarray(_FORWARDS[key](loaded.params, *tokens))


def hf_logits(model, ids, **kwargs) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids), **kwargs).logits.float().numpy()


def assert_close(got, want):
    assert np.std(want) > 0.1, "reference logits too flat to test anything"
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def one_line_error(fn, *args) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args)
    message = str(info.value)
    assert "\n" not in message
    return message


IDS = np.random.default_rng(0).integers(1, VOCAB, size=(2, 11))


# ----------------------------------------------------------------------------- Llama


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(HF model, its save_pretrained dir): GQA 4 heads / 2 KV heads, sharded on disk."""
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500.0,
    )  # fmt: skip
    model = randomize(LlamaForCausalLM(config), seed=1)
    src = tmp_path_factory.mktemp("hf_llama")
    model.save_pretrained(src, safe_serialization=True, max_shard_size="20KB")
    assert (src / "model.safetensors.index.json").is_file()
    return model, src


def test_llama_gqa_converts_to_same_logits(llama, tmp_path, capsys):
    model, src = llama
    dst = tmp_path / "ckpt"
    args = build_parser().parse_args(["convert", "hf", str(src), str(dst), "--dtype", "float32"])
    args.overrides = []
    assert args.run(args) == 0
    assert json.loads(capsys.readouterr().out)["heads"] == [4, 2, 8]
    config = read_config(str(dst))
    m = config.model
    assert (m.arch, m.num_kv_heads, m.head_dim, m.moe.num_experts) == ("decoder", 2, 8, 0)
    assert (m.rope_theta, m.norm_eps, m.tie_embeddings) == (500.0, 1e-5, False)
    assert config.data.tokenizer == ""  # the source has no tokenizer files: none kept
    assert_close(jaxmoe_logits(load_converted(dst), IDS), hf_logits(model, IDS))
    assert "already exists" in one_line_error(convert_hf, str(src), str(dst))


def test_mistral_with_tied_embeddings(tmp_path):
    config = MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
        sliding_window=None,
    )  # fmt: skip
    model = randomize(MistralForCausalLM(config), seed=5)
    model.save_pretrained(tmp_path / "src")
    convert_hf(str(tmp_path / "src"), str(tmp_path / "ckpt"))
    m = read_config(str(tmp_path / "ckpt")).model
    assert (m.tie_embeddings, m.num_kv_heads) == (True, 1)
    assert_close(jaxmoe_logits(load_converted(tmp_path / "ckpt"), IDS), hf_logits(model, IDS))


def test_llama_bfloat16_output(llama, tmp_path):
    model, src = llama
    convert_hf(str(src), str(tmp_path / "ckpt"), "bfloat16")
    got = jaxmoe_logits(load_converted(tmp_path / "ckpt"), IDS)
    # bf16 weights (8-bit mantissa): close to, not equal to, the f32 logits.
    np.testing.assert_allclose(got, hf_logits(model, IDS), atol=0.15)
    assert np.abs(got - hf_logits(model, IDS)).max() > TOL


def test_bfloat16_source_decodes_exactly(llama, tmp_path):
    """bf16 tensors on disk (decoded here by torch, independently) arrive bit-exact."""
    model, _ = llama
    half = LlamaForCausalLM(model.config).to(torch.bfloat16)
    half.load_state_dict(model.state_dict())
    half.save_pretrained(tmp_path / "src")
    with safe_open(tmp_path / "src" / "model.safetensors", "pt") as f:
        assert f.get_slice("model.norm.weight").get_dtype() == "BF16"
    convert_hf(str(tmp_path / "src"), str(tmp_path / "ckpt"))
    params = load_converted(tmp_path / "ckpt").params
    weights = {k: v.float().numpy() for k, v in half.state_dict().items()}
    np.testing.assert_array_equal(
        params["embed"]["embedding"], weights["model.embed_tokens.weight"]
    )
    q = weights["model.layers.1.self_attn.q_proj.weight"]  # [H * dh, D] -> [D, H, dh]
    np.testing.assert_array_equal(params["layers"]["1"]["attn"]["query"], q.T.reshape(32, 4, 8))


# ----------------------------------------------------------------------------- Mixtral


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1000.0,
    )  # fmt: skip
    model = randomize(MixtralForCausalLM(config), seed=2)
    src = tmp_path_factory.mktemp("hf_mixtral")
    model.save_pretrained(src, safe_serialization=True)
    return model, src


def test_mixtral_converts_to_same_logits(mixtral, tmp_path):
    model, src = mixtral
    with safe_open(src / "model.safetensors", "np") as f:  # what transformers 5.x writes
        names = f.keys()
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names
    convert_hf(str(src), str(tmp_path / "ckpt"))
    moe = read_config(str(tmp_path / "ckpt")).model.moe
    assert (moe.num_experts, moe.gate.gating, moe.gate.renormalize, moe.every) == (
        4,
        "top2",
        True,
        1,
    )
    got = jaxmoe_logits(load_converted(tmp_path / "ckpt"), IDS)
    assert_close(got, hf_logits(model, IDS))


def test_mixtral_fused_expert_names(mixtral, tmp_path):
    """transformers 5.x in-memory names (mlp.experts.gate_up_proj [E, 2F, D]) also read."""
    model, src = mixtral
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    fused = tmp_path / "fused"
    fused.mkdir()
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", fused / "config.json")
    convert_hf(str(fused), str(tmp_path / "ckpt"))
    got = jaxmoe_logits(load_converted(tmp_path / "ckpt"), IDS)
    assert_close(got, hf_logits(model, IDS))


def test_mixtral_round_trip_export(mixtral, tmp_path):
    model, src = mixtral
    convert_hf(str(src), str(tmp_path / "ckpt"))
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(reloaded).__name__ == "MixtralForCausalLM"
    assert_close(hf_logits(reloaded, IDS), hf_logits(model, IDS))


# ----------------------------------------------------------------------------- T5 v1.1


def _t5(tie: bool | None, seed: int):
    kwargs = {} if tie is None else {"tie_word_embeddings": tie}
    config = T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=40, num_layers=2, num_decoder_layers=3,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        feed_forward_proj="gated-gelu", dropout_rate=0.0, **kwargs,
    )  # fmt: skip
    model = T5ForConditionalGeneration(config)
    if tie is False:  # T5 v1.1: an output layer of its own
        model.lm_head.weight = torch.nn.Parameter(torch.empty(VOCAB, 32))
    return randomize(model, seed)


ENC = np.array([[5, 9, 13, 2, 7, 33, 1, 0, 0], [8, 3, 3, 41, 60, 12, 22, 17, 1]])
TARGETS = np.array([[4, 19, 23, 1, 0, 0, 0], [30, 2, 9, 9, 14, 50, 1]])
DEC = np.concatenate([np.zeros((2, 1), int), TARGETS[:, :-1]], axis=1)  # shifted right, start 0


def t5_logits(model, ids=ENC, dec=DEC) -> np.ndarray:
    """HF T5 logits with encoder padding (id 0) masked, as jaxmoe masks it."""
    mask = torch.tensor(ids != 0)
    return hf_logits(model, ids, attention_mask=mask, decoder_input_ids=torch.tensor(dec))


def test_t5_v1_1_converts_and_exports(tmp_path):
    model = _t5(tie=False, seed=3)
    model.save_pretrained(tmp_path / "src")
    convert_hf(str(tmp_path / "src"), str(tmp_path / "ckpt"))
    m = read_config(str(tmp_path / "ckpt")).model
    assert (m.arch, m.num_encoder_layers, m.num_layers, m.activation) == (
        "encoder_decoder", 2, 3, "gelu",
    )  # fmt: skip
    want = t5_logits(model)
    assert_close(jaxmoe_logits(load_converted(tmp_path / "ckpt"), ENC, DEC), want)
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    reloaded = T5ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    assert not torch.equal(reloaded.lm_head.weight, reloaded.shared.weight)
    assert_close(t5_logits(reloaded), want)


def test_t5_tied_scaled_output_layer(tmp_path):
    """Original-T5 style config (tied, decoder output scaled by d**-0.5) folds into lm_head."""
    model = _t5(tie=None, seed=4)
    assert model.config.scale_decoder_outputs
    model.save_pretrained(tmp_path / "src")
    convert_hf(str(tmp_path / "src"), str(tmp_path / "ckpt"))
    assert_close(jaxmoe_logits(load_converted(tmp_path / "ckpt"), ENC, DEC), t5_logits(model))


# ----------------------------------------------------------------------------- export


def test_export_jaxmoe_llama_loads_in_transformers(tmp_path, capsys):
    config = tiny_config("model.moe.num_experts=0", "model.vocab_size=64", "model.norm_eps=1e-5")
    rng = np.random.default_rng(7)  # random weights at unit scale, norm scales ~ 1 + N(0, 0.2)
    params = jax.tree.map(
        lambda a: (a.ndim == 1) + rng.standard_normal(a.shape, np.float32) / a.shape[0] ** 0.5,
        abstract_params(config.model),
    )
    save_params(str(tmp_path / "ckpt"), params, config)
    args = build_parser().parse_args(["export", "hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")])
    args.overrides = ["--config.model.dtype=bfloat16"]
    assert "no --config" in one_line_error(args.run, args)
    args.overrides = []
    assert args.run(args) == 0
    assert json.loads(capsys.readouterr().out)["architecture"] == "LlamaForCausalLM"
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.num_key_value_heads == 2
    want = jaxmoe_logits(load_converted(config.model, params), IDS)
    assert_close(hf_logits(hf, IDS), want)
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf16"), "bfloat16")
    with safe_open(tmp_path / "hf16" / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    assert json.loads((tmp_path / "hf16" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (("model.moe.gating=top2", "model.moe.every=2"), "model.moe.every=2"),
        (("model.moe.capacity_factor=1.25",), "model.moe.capacity_factor=1.25"),
        (("model.moe.num_experts=0", "model.rope_theta=0.0"), "model.rope_theta=0"),
        (("model.arch=encoder_decoder", "model.moe.num_experts=0"), "num_kv_heads=2"),
    ],
)
def test_export_refuses_what_hf_cannot_express(overrides, reason):
    config = tiny_config(*overrides)
    message = one_line_error(export_plan, config.model)
    assert "not expressible" in message and reason in message


# ----------------------------------------------------------------------------- bad inputs


def _rewrite(llama_src, dst, edit):
    """A single-file copy of the Llama checkpoint with `edit(tensors)` applied."""
    tensors = {}
    for file in sorted(llama_src.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    edit(tensors)
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(llama_src / "config.json", dst / "config.json")
    return str(dst)


class _TouchOnLoad:
    """Unpickling this creates `marker`: a pickle that would show it was ever loaded."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_refuses_pickle_only_directory(llama, tmp_path):
    src, marker = tmp_path / "src", tmp_path / "unpickled"
    src.mkdir()
    # The payload is live: loading it in this test does create a marker.
    pickle.loads(pickle.dumps(_TouchOnLoad(tmp_path / "probe")))
    assert (tmp_path / "probe").exists()
    (src / "pytorch_model.bin").write_bytes(pickle.dumps(_TouchOnLoad(marker)))
    shutil.copy(llama[1] / "config.json", src / "config.json")
    message = one_line_error(convert_hf, str(src), str(tmp_path / "out"))
    assert "pytorch_model.bin" in message and "pickle" in message
    assert not marker.exists()


def test_missing_tensor_is_named(llama, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    src = _rewrite(llama[1], tmp_path / "src", lambda t: t.pop(name))
    message = one_line_error(convert_hf, src, str(tmp_path / "out"))
    assert "missing" in message and name in message
    assert not (tmp_path / "out").exists()


def test_wrong_shape_names_tensor_and_shapes(llama, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"  # GQA: [2 * 8, 32]; give it MHA's shape

    def edit(t):
        t[name] = np.zeros((32, 32), np.float32)

    message = one_line_error(
        convert_hf, _rewrite(llama[1], tmp_path / "src", edit), str(tmp_path / "out")
    )
    assert name in message and "(32, 32)" in message and "(16, 32)" in message


def test_unknown_tensor_is_named(llama, tmp_path):
    name = "model.layers.0.self_attn.q_proj.bias"

    def edit(t):
        t[name] = np.zeros((32,), np.float32)

    message = one_line_error(
        convert_hf, _rewrite(llama[1], tmp_path / "src", edit), str(tmp_path / "out")
    )
    assert "unknown" in message and name in message


def test_index_cannot_point_outside_the_checkpoint(llama, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(llama[1], src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../outside.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    message = one_line_error(convert_hf, str(src), str(tmp_path / "out"))
    assert "../outside.safetensors" in message


def test_truncated_file_and_unknown_model_type(llama, tmp_path):
    src = _rewrite(llama[1], tmp_path / "src", lambda t: None)
    data = (tmp_path / "src" / "model.safetensors").read_bytes()
    (tmp_path / "src" / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "model.safetensors" in one_line_error(convert_hf, src, str(tmp_path / "out"))
    other = _rewrite(llama[1], tmp_path / "gpt", lambda t: None)
    config = json.loads((tmp_path / "gpt" / "config.json").read_text()) | {"model_type": "gpt2"}
    (tmp_path / "gpt" / "config.json").write_text(json.dumps(config))
    assert "'gpt2'" in one_line_error(convert_hf, other, str(tmp_path / "out"))
