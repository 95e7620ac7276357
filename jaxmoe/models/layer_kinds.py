"""Which layers hold an MoE FFN: decided here once, for the model, the FLOP counts, the
converters, routing analysis and the config checks (it imports nothing of jaxmoe, so the
options module can check with it)."""


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
        and layer_index >= moe.first_dense_layers
        and layer_index not in dense_layer_ids(moe.dense_layers)
    )
