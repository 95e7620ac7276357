"""The FFN slot of a block: a dense MLP (gated unless `model.ffn_gated` is False), or the MoE
layer where `is_moe_layer` says.

Decoder, encoder-decoder, FLOP counts, converters and routing analysis all ask `is_moe_layer`,
so which layers are MoE is decided here once.
"""

from flax import nnx

from jaxmoe.models.layers import MLP, GatedMLP
from jaxmoe.models.quantization import Quantization


def dense_layer_ids(spec: str, num_layers: int | None = None) -> frozenset[int]:
    """`moe.dense_layers` ("0,3", "" = none) as layer ids; ValueError naming the key for a
    malformed list or (given num_layers) an id outside the model."""
    ids = set()
    for part in str(spec).split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit():
            raise ValueError(
                f"model.moe.dense_layers={spec!r}: expected comma-separated layer ids, got {part!r}"
            )
        if num_layers is not None and int(part) >= num_layers:
            raise ValueError(
                f"model.moe.dense_layers={spec!r}: layer {part} >= num_layers={num_layers}"
            )
        ids.add(int(part))
    return frozenset(ids)


def is_moe_layer(cfg, layer_index: int) -> bool:
    """MoE in every `moe.every`-th layer, counting from the last of each group (GShard style,
    HF `decoder_sparse_step`), except the first `moe.first_dense_layers` (DeepSeek
    `first_k_dense_replace`) and the ids in `moe.dense_layers` (Qwen `mlp_only_layers`)."""
    moe = cfg.moe
    return (
        moe.num_experts > 0
        and (layer_index + 1) % moe.every == 0
        and layer_index >= int(moe.first_dense_layers)
        and layer_index not in dense_layer_ids(moe.dense_layers)
    )


def build_ffn(cfg, layer_index: int, rngs: nnx.Rngs):
    """The FFN slot: a dense (gated unless `ffn_gated` is False) MLP, or the MoE layer where
    `is_moe_layer`."""
    if is_moe_layer(cfg, layer_index):
        from jaxmoe.models.moe.layer import MoE  # the MoE module pulls in dispatch code

        return MoE(cfg, rngs=rngs)
    mlp = GatedMLP if cfg.ffn_gated else MLP
    return mlp(
        cfg.d_model,
        cfg.ffn_dim,
        cfg.activation,
        dropout_rate=cfg.dropout_rate,
        quant=Quantization.from_config(cfg),
        rngs=rngs,
    )
