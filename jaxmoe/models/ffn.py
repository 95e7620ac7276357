"""The FFN slot of a block: a dense MLP (gated unless `model.ffn_gated` is False), or the MoE
layer in every `moe.every`-th layer.

Decoder, encoder-decoder, FLOP counts, converters and routing analysis all ask `is_moe_layer`,
so which layers are MoE is decided here once.
"""

from flax import nnx

from jaxmoe.models.layers import MLP, GatedMLP


def is_moe_layer(cfg, layer_index: int) -> bool:
    """MoE in every `moe.every`-th layer, counting from the last of each group (GShard style)."""
    moe = cfg.moe
    return moe.num_experts > 0 and (layer_index + 1) % moe.every == 0


def build_ffn(cfg, layer_index: int, rngs: nnx.Rngs):
    """The FFN slot: a dense (gated unless `ffn_gated` is False) MLP, or the MoE layer where
    `is_moe_layer`."""
    if is_moe_layer(cfg, layer_index):
        from jaxmoe.models.moe.layer import MoE  # the MoE module pulls in dispatch code

        return MoE(cfg, rngs=rngs)
    mlp = GatedMLP if cfg.ffn_gated else MLP
    return mlp(cfg.d_model, cfg.ffn_dim, cfg.activation, rngs=rngs)
