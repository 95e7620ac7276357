"""Checks of the GPT-OSS model keys (options.py declares them): attention windows and kinds,
sinks, the output bias, the clamped SwiGLU, expert biases and YaRN on GQA attention."""

from jaxmoe.errors import ConfigError
from jaxmoe.fields import need
from jaxmoe.models.attention_window import parse_layer_types
from jaxmoe.models.layer_kinds import is_moe_layer
from jaxmoe.models.moe.glu import CLAMPED_SWIGLU


def check_gpt_oss_options(m) -> None:
    """One ConfigError line naming the key for a value or combination jaxmoe cannot run."""
    need(m.sliding_window >= 0, f"model.sliding_window={m.sliding_window} must be >= 0 (0 = none)")
    try:
        kinds = parse_layer_types(m.layer_types, m.num_layers, m.sliding_window)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    windowed = m.sliding_window > 0 and "sliding" in kinds
    need(
        not m.layer_types or m.sliding_window > 0,
        f"model.layer_types={m.layer_types!r} needs model.sliding_window > 0",
    )
    gqa_decoder = m.arch == "decoder" and m.attention != "mla"
    for key, used in (
        ("sliding_window", windowed),
        ("attention_sinks", m.attention_sinks),
        ("out_bias", m.out_bias),
    ):
        need(
            not used or gqa_decoder,
            f"model.{key} is implemented for decoder GQA attention only (model.arch='decoder', "
            "model.attention='gqa')",
        )
    if windowed and m.scan_layers:
        from jaxmoe.models.stack import head_of, period_of  # stack pulls in the layer code

        period, head = period_of(m), head_of(m)  # the unrolled head may differ
        need(
            all(kinds[i] == kinds[head + (i - head) % period] for i in range(head, m.num_layers)),
            f"model.scan_layers=True needs the layer_types to repeat every {period} layers "
            f"(model.moe.every); got {','.join(kinds)}: set model.scan_layers=False",
        )
    if m.rope_type == "yarn" and m.attention != "mla":
        need(
            not m.rope_mscale and not m.rope_mscale_all_dim,
            "model.rope_mscale / rope_mscale_all_dim are implemented for model.attention='mla' "
            "only (GQA YaRN takes rope_attention_factor)",
        )
    if m.activation == CLAMPED_SWIGLU:
        need(m.swiglu_limit > 0, f"model.swiglu_limit={m.swiglu_limit} must be positive")

        need(
            m.ffn_gated
            and m.arch == "decoder"
            and all(is_moe_layer(m, i) for i in range(m.num_layers)),
            "model.activation='swiglu_clamped' is implemented for the experts of gated MoE "
            "decoders with an MoE FFN in every layer (GPT-OSS)",
        )
    if m.moe.num_experts and m.moe.expert_bias:
        need(m.ffn_gated, "model.moe.expert_bias needs gated experts (model.ffn_gated=True)")
