"""The typed config schema: the generated defaults are the documented ones, each section's
checks give one line naming the key, overrides parse to the schema's types, a checkpoint
config written by older code (keys missing, a key since removed) still loads and evaluates,
and `typed()` refuses what no section allows. Expected values and lines are written out by
hand."""

import dataclasses
import json
import logging
import shutil
import textwrap
from pathlib import Path

import pytest
from ml_collections import ConfigDict

from jaxmoe.config import JobConfig, typed
from jaxmoe.config.defaults import base_config
from jaxmoe.config.loading import apply_overrides, load_config
from jaxmoe.config.schema import describe
from jaxmoe.config.stored import complete_stored
from jaxmoe.config.validation import validate
from jaxmoe.errors import ConfigError
from tests.fixtures_data import copy_data_cache

# (key, value) as docs/configs.md and the one-line docs state them; the type matters too.
DOCUMENTED = [
    ("model.arch", "decoder"),
    ("model.vocab_size", 0),
    ("model.d_model", 128),
    ("model.num_kv_heads", 2),
    ("model.norm_eps", 1e-6),
    ("model.rope_theta", 10000.0),
    ("model.rope_original_max_len", 8192),
    ("model.ffn_gated", True),
    ("model.remat", "none"),
    ("model.moe.num_experts", 8),
    ("model.moe.gating", "adaptive"),
    ("model.moe.threshold", 0.1),
    ("model.moe.capacity_factor", 0.0),
    ("model.moe.ep_buffer_factor", 2.0),
    ("train.steps", 600),
    ("train.max_skipped_steps", 10),
    ("train.peak_flops", 0.0),
    ("train.profile_steps", ""),
    ("optimizer.name", "adamw"),
    ("optimizer.learning_rate", 0.003),
    ("optimizer.b2", 0.95),
    ("optimizer.warmup_steps", 50),
    ("mesh.data", -1),
    ("mesh.dcn_fsdp", 1),
    ("data.source", "embedded"),
    ("data.prepare_timeout_s", 3600),
    ("data.shuffle", True),
    ("data.mean_noise_span", 3.0),
]


def _get(config, key):
    for part in key.split("."):
        config = config[part]
    return config


def _leaves(config, prefix=""):
    out = []
    for key, value in config.items():
        nested = isinstance(value, ConfigDict)
        out += _leaves(value, f"{prefix}{key}.") if nested else [prefix + key]
    return out


@pytest.mark.parametrize("key, value", DOCUMENTED, ids=[k for k, _ in DOCUMENTED])
def test_generated_defaults_are_the_documented_ones(key, value):
    got = _get(base_config(), key)
    assert got == value and type(got) is type(value)


def test_every_key_has_a_one_line_doc_and_the_typed_view_matches_the_dict():
    config = base_config()
    # The keys jaxmoe had before the schema (109), plus issue 27's model.qk_norm and 12 moe
    # keys, issue 31's model.moe.expert_dropout_rate and data.curriculum_reference, and issue
    # 28's 19: MLA (attention, q_lora_rank, kv_lora_rank, qk_nope/qk_rope/v_head_dim), YaRN
    # (rope_beta_fast/slow, rope_mscale, rope_mscale_all_dim, rope_attention_factor,
    # rope_truncate) and GPT-OSS (sliding_window, layer_types, attention_sinks, out_bias,
    # swiglu_alpha, swiglu_limit, moe.expert_bias), and issue 29's model.attention_kernel and
    # issue 32's data.workers and data.shards, and issue 44's fine-tuning keys: data.format, its
    # five field keys, chat_template, truncation, targets_len, packing; train.freeze/trainable;
    # issue 50's model.quantization, quantization_scaling, context_strategy and mesh.context;
    # issue 51's 7:
    # model.mtp_depth, mtp_weight, optimizer.muon_momentum, muon_nesterov, muon_ns_steps,
    # muon_rms, qk_clip; issue 45's 11: train.lora.{rank, alpha, dropout, targets, base_dtype},
    # train.objective, dpo_beta, dpo_label_smoothing, model.moe.replay, data.chosen_key and
    # data.rejected_key.
    assert len(_leaves(config)) == 181
    assert set(config.keys()) == {"model", "train", "optimizer", "mesh", "data"}
    lines = describe()
    assert len(lines) == 181 and all("\n" not in line and "): " in line for line in lines)
    arch = "model.arch (str, 'decoder'): the architecture ['decoder' | 'encoder_decoder']"
    assert lines[0] == arch
    view = typed(config)
    assert view == JobConfig()
    assert view.model.moe.num_experts == 8 and view.optimizer.learning_rate == 0.003
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.train.steps = 1


# One bad value per section (and one across sections): the section's own one line.
SECTION_CHECKS = [
    ("model.num_heads=3", "model.num_heads=3 is not divisible by model.num_kv_heads=2"),
    ("model.dropout_rate=1.0", "model.dropout_rate=1.0 not in [0, 1)"),
    (
        "model.activation=tanh",
        "model.activation='tanh' is not one of ['silu', 'gelu', 'relu', 'swiglu_clamped']",
    ),
    (
        "model.moe.every=9",
        "model.moe.every=9 exceeds model.num_layers=4: no layer would be MoE "
        "(model.moe.num_experts=0 is the dense model)",
    ),
    ("model.moe.top_k=9", "model.moe.top_k=9 exceeds model.moe.num_experts=8"),
    ("model.moe.ep_buffer_factor=0.0", "model.moe.ep_buffer_factor=0.0 must be > 0"),
    ("train.grad_accum=3", "train.batch_size=16 is not divisible by train.grad_accum=3"),
    ("train.max_to_keep=0", "train.max_to_keep=0 must be >= 1"),
    ("train.nonfinite=ignore", "train.nonfinite='ignore' is not one of ['stop', 'skip']"),
    ("optimizer.decay_rate=0.0", "optimizer.decay_rate=0.0 not in (0, 1]"),
    ("optimizer.learning_rate=0", "optimizer.learning_rate=0.0 must be positive"),
    (
        "optimizer.schedule=linear",
        "optimizer.schedule='linear' is not one of ['cosine', 'rsqrt', 'constant', 't5x_rsqrt']",
    ),
    ("mesh.tensor=0", "mesh.tensor=0 must be positive or -1"),
    ("mesh.dcn_data=-2", "mesh.dcn_data=-2 must be positive or -1"),
    ("data.vocab_size=100", "data.vocab_size=100 < 260 (byte fallback)"),
    (
        "data.curriculum_source=oracle",
        "data.curriculum_source='oracle' is not one of ['previous_epoch', 'scoring_pass']",
    ),
    ("mesh.expert=3", "mesh.expert=3 does not divide model.moe.num_experts=8"),
]


@pytest.mark.parametrize("override, line", SECTION_CHECKS, ids=[o for o, _ in SECTION_CHECKS])
def test_each_section_check_is_one_line_naming_the_key(override, line):
    config = base_config()
    apply_overrides(config, [override])
    with pytest.raises(ConfigError) as error:
        validate(config)
    assert str(error.value) == line


def test_a_zero_expert_axis_is_the_mesh_line_not_a_division_by_zero():
    config = base_config()
    apply_overrides(config, ["mesh.expert=0"])
    with pytest.raises(ConfigError, match=r"^mesh.expert=0 must be positive or -1$"):
        validate(config)


def _config_file(tmp_path, body: str) -> str:
    path = tmp_path / "own.py"
    path.write_text(
        "from ml_collections import ConfigDict\n\n\ndef get_config(variant=None):\n"
        + textwrap.indent(textwrap.dedent(body).strip(), "    ")
        + "\n"
    )
    return str(path)


def test_overrides_parse_to_the_schemas_types_not_the_files(tmp_path):
    # A file that builds its own ConfigDict and writes a float key as an int.
    spec = _config_file(
        tmp_path,
        """
        c = ConfigDict()
        c.optimizer = ConfigDict({"learning_rate": 1, "warmup_steps": 5})
        c.model = ConfigDict({"d_model": 64})
        return c
        """,
    )
    config = load_config(spec, ["optimizer.learning_rate=0.5", "model.moe.threshold=1"])
    assert config.optimizer.learning_rate == 0.5 and type(config.optimizer.learning_rate) is float
    assert config.model.moe.gate.threshold == 1.0 and type(config.model.moe.gate.threshold) is float
    # Keys the file left out are there at their defaults.
    assert (config.model.d_model, config.model.num_heads, config.train.steps) == (64, 4, 600)
    assert type(load_config(spec).optimizer.learning_rate) is float  # 1 became 1.0
    with pytest.raises(ConfigError, match=r"^--config.train.steps=2.0: expected int, got float$"):
        load_config(spec, ["train.steps=2.0"])
    with pytest.raises(ConfigError, match=r"^--config.model.scan_layers=maybe: expected a bool"):
        load_config(spec, ["model.scan_layers=maybe"])
    assert load_config(spec, ["model.scan_layers=yes"]).model.scan_layers is True


@pytest.mark.parametrize(
    "values, line",
    [
        (
            {"model": {"d_modle": 64}},
            "unknown config key 'model.d_modle' (did you mean 'model.d_model'?)",
        ),
        ({"model": {"d_model": "64"}}, "model.d_model='64': expected int, got str"),
        ({"model": {"tie_embeddings": 1}}, "model.tie_embeddings=1: expected bool, got int"),
        ({"train": {"steps": True}}, "train.steps=True: expected int, got bool"),
        ({"model": {"moe": 8}}, "model.moe=8: expected a section of keys"),
        (
            {"data": {"shuffle": False, "curriculum": "hardest"}},
            "data.curriculum='hardest' is not one of ['none', 'paper', 'magnitude']",
        ),
        ({"optimizer": {"momentum": 1.0}}, "optimizer.momentum=1.0 not in [0, 1)"),
    ],
)
def test_typed_refuses_bad_values(values, line):
    with pytest.raises(ConfigError) as error:
        typed(values)
    assert str(error.value) == line


def test_typed_takes_defaults_and_ignores_a_files_own_sections():
    view = typed({"model": {"moe": {"num_experts": 0}}, "uptrain": {"kv_heads": 1}})
    assert view.model.moe.num_experts == 0 and view.model.d_model == 128
    assert view.optimizer == JobConfig().optimizer


def test_stored_config_of_older_code_completes_from_the_defaults(caplog):
    stored = base_config().to_dict()
    del stored["model"]["moe"]["ep_exchange"], stored["train"]["max_skipped_steps"]
    del stored["mesh"]
    stored["model"]["remat"] = True  # a bool before remat took a policy name
    stored["model"]["old_knob"] = 3
    stored["source"] = {"format": "t5x", "step": 7}  # a converter's own section: kept
    with caplog.at_level(logging.WARNING):
        config = complete_stored(stored, "ckpt/config.json")
    assert config.model.moe.ep_exchange == "auto" and config.train.max_skipped_steps == 10
    assert config.mesh.data == -1 and config.model.remat == "full"
    assert "old_knob" not in config.model and config.source.step == 7  # a ConfigDict
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ["ckpt/config.json: ignoring keys no jaxmoe config has: model.old_knob"]
    validate(config)
    with pytest.raises(ConfigError) as error:
        complete_stored({"train": {"steps": "600"}}, "ckpt/config.json")
    assert str(error.value) == "ckpt/config.json: train.steps='600': expected int, got str"


def test_checkpoint_config_of_older_code_loads_and_evaluates(trained_dense, tmp_path, caplog):
    from jaxmoe.inference.evaluate import evaluate

    # A copy of a run `train()` wrote (tests/fixtures_checkpoints.py), its data cache beside.
    cache = copy_data_cache(trained_dense / "cache", tmp_path / "cache")
    step = Path(shutil.copytree(trained_dense / "run", tmp_path / "run")) / "checkpoints" / "4"
    overrides = [f"data.cache_dir={cache}", "train.eval_batches=1"]
    today = evaluate(str(step), "embedded", overrides=overrides)

    stored_file = step / "config" / "metadata"
    stored = json.loads(stored_file.read_text())
    # Keys added after older checkpoints were written, and one older code wrote since removed.
    removed = [
        ("model", "max_len"),
        ("train", "max_skipped_steps"),
        ("train", "logits_z_loss"),
        ("data", "eos_token"),
        ("data", "curriculum_source"),
        ("optimizer", "schedule_steps"),
    ]
    for section, key in removed:
        del stored[section][key]
    del stored["model"]["moe"]["ep_exchange"], stored["mesh"]["dcn_data"]
    stored["train"]["retired_key"] = 1
    stored_file.write_text(json.dumps(stored))

    with caplog.at_level(logging.WARNING):
        older = evaluate(str(step), "embedded", overrides=overrides)
    assert older["loss"] == today["loss"] and older["num_tokens"] == today["num_tokens"]
    assert any(
        "ignoring keys no jaxmoe config has: train.retired_key" in r.getMessage()
        for r in caplog.records
    )
