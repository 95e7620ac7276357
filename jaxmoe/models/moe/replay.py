"""Router replay (model.moe.replay): a record of each token's experts per MoE layer, laid out
for the layer stack.

A batch's `routing` field (data/batch_fields.py) is int [B, L, M, K]: for each position, each
of the decoder's M MoE layers in model order (`moe_layer_ids`) and each of the gate's K
slots, an expert id or -1 (an unused slot: the adaptive gates choose a variable number). The
MoE layers take their [B, L, K] column (router.replay); a scanned stack carries the columns
of its period layers stacked [P, B, L, K] and each scan step takes its row.
"""

import jax.numpy as jnp

from jaxmoe.models.ffn import is_moe_layer
from jaxmoe.models.moe.gates import num_slots
from jaxmoe.models.options import ModelOptions
from jaxmoe.models.stack import ScannedStack, stack_layout


def moe_layer_ids(cfg: ModelOptions) -> list[int]:
    """The decoder layers that are MoE, in model order (the record's layer axis)."""
    return [i for i in range(cfg.num_layers) if is_moe_layer(cfg, i)]


def stack_replays(cfg, stack, routing_BLMK) -> list:
    """Per stack module (models.stack.stack_modules order): the replayed experts of its
    layer [B, L, K], of its scanned rows [P, B, L, K], or None for a dense layer."""
    column = {layer: m for m, layer in enumerate(moe_layer_ids(cfg))}
    if routing_BLMK.shape[2] != len(column):
        raise ValueError(
            f"routing: {routing_BLMK.shape[2]} MoE layers recorded, the model has {len(column)}"
        )

    def of(layer):
        return routing_BLMK[:, :, column[layer]] if layer in column else None

    if not isinstance(stack, ScannedStack):
        return [of(i) for i in range(len(stack))]
    layout = stack_layout(cfg)
    out = []
    for first, rows in zip(layout.module_layers(), layout.module_counts(), strict=True):
        if rows is None:
            out.append(of(first))
        elif first not in column:
            out.append(None)
        else:
            out.append(jnp.stack([of(first + p * layout.period) for p in range(rows)]))
    return out


def record_shape(cfg) -> tuple[int, int]:
    """(M, K) of a routing record: the decoder's MoE layers, the evaluation gate's slots."""
    if cfg.arch == "encoder_decoder" or not cfg.moe.num_experts:
        raise ValueError("--record_routing records the routing of an MoE decoder")
    return len(moe_layer_ids(cfg)), num_slots(cfg.moe.eval_gate)


def row_of(replay, row):
    """A block's own replayed experts: its stacked row inside a scan, else as given."""
    if replay is None or row is None:
        return replay
    return replay[row]
