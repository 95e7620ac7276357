"""Adaptive, top-p and unnormalised top-k MoEs exported with their own modeling file
(`jaxmoe_moe`): transformers, loading it with trust_remote_code, must give jaxmoe's logits on
inputs where tokens take different numbers of experts."""

import json

import numpy as np
import pytest
from flax import nnx
from transformers import AutoModelForCausalLM

from jaxmoe.checkpoints.manager import save_params
from jaxmoe.cli import main
from jaxmoe.config.stored import read_config
from jaxmoe.conversions.hf.exporter import export_hf
from jaxmoe.conversions.hf.importer import convert_hf
from tests.helpers import tiny_config, unit_scale_params
from tests.test_hf import IDS, assert_close, hf_logits, jaxmoe_logits, load_converted

GATES = {
    "adaptive": ("model.moe.gating=adaptive", "model.moe.threshold=0.3"),
    "adaptive_raw_gap_renormalized": (
        "model.moe.gating=adaptive",
        "model.moe.threshold=0.2",
        "model.moe.gap_normalization=none",
        "model.moe.renormalize=True",
        "model.moe.single_weight=one",
    ),
    "top_p": ("model.moe.gating=top_p", "model.moe.top_p=0.5", "model.moe.max_k=3"),
    "top2_unnormalized": ("model.moe.gating=top2",),
    "eval_gating_adaptive": ("model.moe.gating=top2", "model.moe.eval_gating=adaptive"),
}


def _config(*overrides):
    return tiny_config("model.vocab_size=64", "model.moe.num_experts=4", *overrides)


def _random_checkpoint(path, *overrides):
    """(config, params) of a tiny 4-expert MoE with unit-scale random weights, saved at path."""
    config = _config(*overrides)
    params = unit_scale_params(config.model, seed=7)
    save_params(str(path), params, config)
    return config, params


def _experts_per_token(config, params) -> list[float]:
    """Per layer, the share of tokens of IDS that jaxmoe routes to two or more experts."""
    loaded = load_converted(config.model, params)
    _, aux = nnx.merge(loaded.graphdef, loaded.params)(IDS, train=False)
    return [float(layer["top2_fraction"]) for layer in aux.values()]


@pytest.mark.parametrize("name", list(GATES))
def test_exported_gate_matches_jaxmoe_in_transformers(tmp_path, name):
    config, params = _random_checkpoint(tmp_path / "ckpt", *GATES[name])
    hf_config = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert hf_config["model_type"] == "jaxmoe_moe"
    assert (tmp_path / "hf" / "modeling_jaxmoe_moe.py").is_file()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    want = jaxmoe_logits(load_converted(config.model, params), IDS)
    assert_close(hf_logits(model, IDS), want)
    if name != "top2_unnormalized":  # a per-token expert count: both counts must occur
        shares = _experts_per_token(config, params)
        assert any(0.0 < s < 1.0 for s in shares), shares
    # The gate matters on these inputs: Mixtral's own rule (top-2, renormalised) differs.
    stock = _config(*GATES[name], "model.moe.gating=top2", "model.moe.eval_gating=",
                    "model.moe.renormalize=True")  # fmt: skip
    other = jaxmoe_logits(load_converted(stock.model, params), IDS)
    assert np.abs(other - want).max() > 1e-2


def test_folder_refuses_to_load_without_trust_remote_code(tmp_path, capsys):
    """...and `jaxmoe export hf` says so when it writes one (a Mixtral-gated one: nothing)."""
    _random_checkpoint(tmp_path / "ckpt", *GATES["adaptive"])
    assert main(["export", "hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["trust_remote_code"] is True
    assert err == (
        f"note: {tmp_path / 'hf'} holds JaxmoeMoeForCausalLM, whose gate is Python code it "
        "carries (modeling_jaxmoe_moe.py): transformers loads it, and its tokenizer, with "
        "trust_remote_code=True\n"
    )
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=False)
    _random_checkpoint(tmp_path / "mixtral", "model.moe.gating=top2", "model.moe.renormalize=True")
    assert main(["export", "hf", str(tmp_path / "mixtral"), str(tmp_path / "hf2")]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["trust_remote_code"] is False and not err


def test_convert_hf_reads_an_exported_gate_back(tmp_path):
    _random_checkpoint(tmp_path / "ckpt", *GATES["top_p"])
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    convert_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    moe = read_config(str(tmp_path / "back")).model.moe
    assert (moe.gate.gating, moe.gate.top_p, moe.gate.max_k, moe.gate.renormalize) == (
        "top_p",
        0.5,
        3,
        False,
    )
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    assert_close(jaxmoe_logits(load_converted(tmp_path / "back"), IDS), hf_logits(model, IDS))
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    hf_config["jaxmoe_gate"]["threshold"] = "high"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(ValueError, match=r"jaxmoe_gate\.threshold='high'"):
        convert_hf(str(tmp_path / "hf"), str(tmp_path / "bad"))
