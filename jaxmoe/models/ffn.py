"""The FFN slot of a block: a dense MLP (gated unless `model.ffn_gated` is False), or the MoE
layer where `is_moe_layer` says.

Which layers are MoE is decided once, in layer_kinds.py.
"""

from flax import nnx

from jaxmoe.models.layer_kinds import dense_layer_ids, is_moe_layer
from jaxmoe.models.layers import MLP, GatedMLP
from jaxmoe.models.quantization import Quantization

__all__ = ["build_ffn", "dense_layer_ids", "is_moe_layer"]


def build_ffn(cfg, layer_index: int, rngs: nnx.Rngs):
    """The FFN slot: a dense (gated unless `ffn_gated` is False) MLP, or the MoE layer where
    `is_moe_layer`."""
    if is_moe_layer(cfg, layer_index):
        from jaxmoe.models.moe.layer import MoE  # the MoE module pulls in dispatch code

        return MoE.of_model(cfg, rngs=rngs)
    mlp = GatedMLP if cfg.ffn_gated else MLP
    return mlp(
        cfg.d_model,
        cfg.ffn_dim,
        cfg.activation,
        dropout_rate=cfg.dropout_rate,
        quant=Quantization.from_config(cfg),
        rngs=rngs,
    )
