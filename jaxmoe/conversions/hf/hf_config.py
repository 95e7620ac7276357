"""Reading Hugging Face config.json values: sizes, numbers, activations, RoPE, windows.

Every reader raises a one-line CheckpointError naming the key; names.py (Llama, Mixtral,
T5...) and names_moe.py (Qwen2-MoE, Qwen3-MoE, OLMoE) translate configs with them.
"""

import math
import re
from typing import Any

from jaxmoe.checkpoints.manager import CheckpointError
from jaxmoe.config.schema import typed
from jaxmoe.models.options import ModelOptions

# HF activation names whose function jaxmoe computes exactly (jaxmoe's gelu is the tanh form).
_ACT_FROM_HF = {
    "silu": "silu",
    "swish": "silu",
    "gelu_new": "gelu",
    "gelu_pytorch_tanh": "gelu",
    "relu": "relu",
}

# Above any real model's dimension (XLA indexes with int32); the sizes below it are checked
# against the tensors in the files, whose bytes bound them.
_MAX_SIZE = 2**31 - 1


# The `model` keys read from a config.json, model.moe's under "moe": a reader sets what the
# file says; model_options types and checks them once, the schema's defaults for the rest.
ModelKeys = dict[str, Any]


def model_keys() -> ModelKeys:
    """No key read yet."""
    return {"moe": {}}


def model_options(keys: ModelKeys) -> ModelOptions:
    """The typed, checked model section of `keys`."""
    return typed({"model": keys}).model


def config_size(hf: dict, key: str, default=None) -> int:
    """A positive integer size from config.json (`default` when absent or null)."""
    value = hf.get(key)
    if value is None:
        if default is None:
            raise CheckpointError(f"config.json: missing key {key!r}")
        return default
    # JSON true parses as a bool (an int subclass); "4096" and 4096.5 are not sizes either.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"config.json: {key}={value!r} is not a positive integer")
    if value > _MAX_SIZE:
        raise CheckpointError(f"config.json: {key}={value} is not a plausible size (> 2**31 - 1)")
    return value


def config_number(hf: dict, key: str, default: float | None = None) -> float:
    value = hf.get(key)
    if value is None:
        if default is None:
            raise CheckpointError(f"config.json: missing key {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise CheckpointError(f"config.json: {key}={value!r} is not a finite number")
    return float(value)


def check_layer_count(present: set[str], pattern: str, key: str, count: int) -> None:
    """`count` layers in config.json must be the layers whose tensors the files hold, checked
    before anything is built per layer (a config claiming 10**6 layers would hang there)."""
    regex = re.compile(pattern)
    found = {int(match.group(1)) for name in present if (match := regex.match(name))}
    if len(found) != count or found != set(range(count)):  # no range of 10**9 built first
        unit = "experts" if "experts" in key else "layers"
        held = f"{len(found)} {unit}, indices {min(found)}..{max(found)}" if found else "none"
        raise CheckpointError(
            f"config.json: {key}={count}, but the checkpoint holds tensors of {held}"
        )


def read_activation(hf_name: str, key: str) -> str:
    if hf_name not in _ACT_FROM_HF:
        raise CheckpointError(
            f"config.json: {key}={hf_name!r} is not supported "
            f"(one of {sorted(_ACT_FROM_HF)}; jaxmoe's gelu is the tanh approximation)"
        )
    return _ACT_FROM_HF[hf_name]


def read_rope(hf: dict, m: ModelKeys) -> None:
    """The RoPE base and scaling: transformers 5.x's `rope_parameters` or 4.x's
    `rope_scaling` (+ top-level `rope_theta`); llama3 and linear scaling are implemented,
    others (dynamic NTK, yarn, longrope...) refused, and so are values transformers only
    warns about (factor < 1, high_freq_factor <= low_freq_factor: a division by zero)."""
    params = _rope_params(hf)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise CheckpointError(
            f"config.json: rope_type {rope_type!r} (RoPE scaling) is not supported; "
            "jaxmoe implements default, linear and llama3"
        )
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError("config.json: partial_rotary_factor != 1 is not supported")
    m["rope_theta"] = config_number(params if "rope_theta" in params else hf, "rope_theta", 10000.0)
    m["rope_type"] = rope_type
    if rope_type == "default":
        return
    m["rope_factor"] = config_number(params, "factor")
    if m["rope_factor"] < 1:
        raise CheckpointError(
            f"config.json: {rope_type} RoPE factor={m['rope_factor']} must be >= 1 (it stretches "
            "positions; transformers warns about the same)"
        )
    if rope_type == "llama3":
        m["rope_low_freq_factor"] = config_number(params, "low_freq_factor")
        m["rope_high_freq_factor"] = config_number(params, "high_freq_factor")
        if m["rope_high_freq_factor"] <= m["rope_low_freq_factor"]:
            raise CheckpointError(
                f"config.json: llama3 RoPE high_freq_factor={m['rope_high_freq_factor']} must be "
                f"greater than low_freq_factor={m['rope_low_freq_factor']}"
            )
        m["rope_original_max_len"] = config_size(params, "original_max_position_embeddings")


def _rope_params(hf: dict) -> dict:
    """`rope_parameters` or `rope_scaling`; both may be written (transformers 5.x keeps
    the old name too), but not saying different things: which would apply is unclear."""
    new, old = hf.get("rope_parameters"), hf.get("rope_scaling")
    for key, value in (("rope_parameters", new), ("rope_scaling", old)):
        if value is not None and not isinstance(value, dict):
            raise CheckpointError(f"config.json: {key}={value!r} is not an object")
    if new and old:
        kinds = [p.get("rope_type", p.get("type", "default")) for p in (new, old)]
        differ = sorted(k for k in set(new) & set(old) if new[k] != old[k])
        if kinds[0] != kinds[1] or differ:
            what = ", ".join(differ) if differ else "rope_type"
            raise CheckpointError(
                f"config.json: rope_parameters={new!r} and rope_scaling={old!r} disagree "
                f"({what}); keep one"
            )
    return new or old or {}


# Qwen families write a `sliding_window` that applies only where the layers use it.
QWEN_WINDOWED = ("qwen2", "qwen2_moe", "qwen3_moe")


def sliding_window(hf: dict) -> int | None:
    """The attention window config.json asks for, or None. Qwen2 writes a window that only
    applies with use_sliding_window (transformers 5.x: layers typed sliding_attention)."""
    window = hf.get("sliding_window")
    if hf["model_type"] in QWEN_WINDOWED:
        sliding = "sliding_attention" in (hf.get("layer_types") or ())
        if not (sliding or (hf.get("use_sliding_window") and not hf.get("layer_types"))):
            return None
    return window


def read_decoder_sizes(hf: dict, present: set[str], m: ModelKeys) -> None:
    """A decoder's vocabulary, layers (checked against the tensors `present`), width and
    attention heads, as every HF decoder family names them."""
    heads = config_size(hf, "num_attention_heads")
    m["arch"] = "decoder"
    m["vocab_size"] = config_size(hf, "vocab_size")
    m["num_layers"] = config_size(hf, "num_hidden_layers")
    check_layer_count(present, r"model\.layers\.(\d+)\.", "num_hidden_layers", m["num_layers"])
    m["d_model"] = config_size(hf, "hidden_size")
    m["num_heads"] = heads
    m["num_kv_heads"] = config_size(hf, "num_key_value_heads", heads)
    m["head_dim"] = config_size(hf, "head_dim", m["d_model"] // heads)


def read_decoder_basics(hf: dict, present: set[str], m: ModelKeys) -> None:
    """The sizes every Llama-like decoder shares: read_decoder_sizes, then the FFN width,
    activation, norm eps, RoPE, context and embedding tying."""
    read_decoder_sizes(hf, present, m)
    m["ffn_dim"] = config_size(hf, "intermediate_size")
    m["activation"] = read_activation(hf.get("hidden_act", "silu"), "hidden_act")
    m["norm_eps"] = config_number(hf, "rms_norm_eps")
    read_rope(hf, m)
    m["max_len"] = config_size(hf, "max_position_embeddings", 0)
    window = sliding_window(hf)
    if window is not None and (not m["max_len"] or window < m["max_len"]):
        raise CheckpointError(
            f"config.json: sliding_window={window} is shorter than max_position_embeddings="
            f"{m['max_len']}; jaxmoe attends to the whole context (no sliding windows)"
        )
    # A tied config whose file still holds lm_head.weight converts untied: same logits.
    m["tie_embeddings"] = bool(hf.get("tie_word_embeddings", False)) and (
        "lm_head.weight" not in present
    )
