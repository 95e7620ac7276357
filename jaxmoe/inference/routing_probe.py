"""The device side of `jaxmoe analyze-routing`: per-token gate decisions of every MoE layer.

Each MoE FFN of the restored model is wrapped in a RoutingProbe, whose aux adds
`top2_mask_BL`: the decision the gate of gates.py makes on the layer's own input. The jitted
program returns these masks (replicated, so any process can read them) and the host feeds
them, batch by batch, to the counters of routing_counts.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxmoe.inference.choices import GATE_CHOICES
from jaxmoe.inference.routing_counts import RoutingCounts
from jaxmoe.models.moe import gates
from jaxmoe.models.moe.layer import MoE
from jaxmoe.models.stack import stack_modules


class RoutingProbe(nnx.Module):
    """An MoE layer plus `top2_mask_BL` in its aux: bool [B, L], True where `gate_cfg` keeps
    two or more experts for the token (the layer's own output is unchanged)."""

    def __init__(self, moe: MoE, gate_cfg: gates.GateOptions):
        self.moe = moe
        self.gate_cfg = gate_cfg

    def __call__(self, x_BLD, *, train: bool, token_mask_BL=None):
        y_BLD, aux = self.moe(x_BLD, train=train, token_mask_BL=token_mask_BL)
        batch, length, _ = x_BLD.shape
        # The layer's own router code: borderline gaps fall on the same side of the threshold.
        _, _, routing = self.moe.route(x_BLD, train=False, gate_cfg=self.gate_cfg)
        top2_BL = (jnp.sum(routing.mask, axis=-1) >= 2).reshape(batch, length)
        return y_BLD, {**aux, "top2_mask_BL": top2_BL}


def attach_probes(model, gate: str) -> None:
    """Wrap every MoE FFN of a DecoderLM or EncoderDecoderLM in a RoutingProbe (in place)."""
    if gate not in GATE_CHOICES:
        raise ValueError(f"gate={gate!r}: expected one of {GATE_CHOICES}")
    for stack in ("layers", "encoder_layers", "decoder_layers"):
        # A scanned stack's period blocks hold all periods' MoE layers: one probe each.
        for block in stack_modules(getattr(model, stack, ())):
            if isinstance(block.ffn, MoE):
                gate_cfg = block.ffn.train_gate if gate == "train" else block.ffn.eval_gate
                block.ffn = RoutingProbe(block.ffn, gate_cfg)


def layer_name(aux_key) -> tuple[str, str, int]:
    """(name, stack, index) of a model aux key: int i (decoder-only) -> "layer_i", as the
    training metrics name it; "encoder_i" / "decoder_i" (encoder-decoder) as they are."""
    if isinstance(aux_key, int):
        return f"layer_{aux_key}", "decoder", aux_key
    stack, _, index = aux_key.rpartition("_")
    return aux_key, stack, int(index)


def routing_masks(params, batch, graphdef, gate: str, rest=None) -> dict:
    """{aux key as str: top2_mask_BL} for every MoE layer on one batch."""
    from jaxmoe.models.spec import merge_model

    model = merge_model(graphdef, params, rest)
    attach_probes(model, gate)
    segments = batch.get("segment_ids")  # packed rows route as training routed them
    if "encoder_inputs" in batch:
        _, aux = model(
            batch["encoder_inputs"],
            batch["inputs"],
            train=False,
            segment_ids_BL=segments,
            encoder_segment_ids_BS=batch.get("encoder_segment_ids"),
        )
    else:
        _, aux = model(
            batch["inputs"],
            train=False,
            segment_ids_BL=segments,
            positions_BL=batch.get("positions"),
        )
    # The logits are unused: XLA drops the output layer from this program.
    return {layer_name(key)[0]: value["top2_mask_BL"] for key, value in aux.items()}


def moe_layers(config) -> list[tuple[str, str]]:
    """(name, stack) of the model's MoE layers in model order (encoder first)."""
    from jaxmoe.models.layer_kinds import is_moe_layer

    m = config.model
    if m.arch == "encoder_decoder":
        layers = [(f"encoder_{i}", "encoder") for i in range(m.num_encoder_layers or m.num_layers)]
        layers += [(f"decoder_{i}", "decoder") for i in range(m.num_layers)]
        return [(name, stack) for name, stack in layers if is_moe_layer(m, layer_name(name)[2])]
    return [(f"layer_{i}", "decoder") for i in range(m.num_layers) if is_moe_layer(m, i)]


def _count_batch(counts: RoutingCounts, batch: dict, masks: dict) -> None:
    """Feed one batch's host masks to the counters, stack by stack."""
    for stack in counts.stacks:
        names = [counts.layers[m] for m in counts.layers_of(stack)]
        top2_MBL = np.stack([masks[name] for name in names])
        if stack == "encoder":
            tokens_BL = batch["encoder_inputs"]
            valid_BL = tokens_BL != 0  # id 0 pads the encoder (T5)
        else:
            tokens_BL, valid_BL = batch["inputs"], batch["weights"] > 0
        counts.add(stack, tokens_BL, valid_BL, top2_MBL)


def collect_counts(model, batches, gate: str, max_batches: int = 0):
    """RoutingCounts of `model` (an opened TrainedModel) over `batches` (an iterable of
    global host batches), computed on its mesh; returns (counts, number of batches)."""
    from jaxmoe.parallel.sharding import batch_spec

    config, mesh, spec = model.config, model.mesh, model.spec
    layers = moe_layers(config)
    if not layers:
        raise ValueError(
            f"model.moe.num_experts={config.model.moe.num_experts}: the checkpoint's model "
            f"has no MoE layer to analyse"
        )
    if config.model.vocab_size < 1:
        raise ValueError(
            f"model.vocab_size={config.model.vocab_size}: the analysis needs the trained size "
            f"(use the config stored with the checkpoint, or set --config.model.vocab_size)"
        )
    params = model.params
    # Replicated outputs: every process can read the whole batch's masks.
    step = jax.jit(
        lambda p, b: routing_masks(p, b, spec.graphdef, gate, spec.rest),
        out_shardings=NamedSharding(mesh, PartitionSpec()),
    )
    counts = RoutingCounts(
        [name for name, _ in layers], [stack for _, stack in layers], config.model.vocab_size
    )
    pending, num_batches = None, 0
    with jax.set_mesh(mesh):
        for batch in batches:
            if max_batches and num_batches >= max_batches:
                break
            device_batch = {
                key: jax.device_put(value, NamedSharding(mesh, batch_spec(mesh, *_dims(value))))
                for key, value in batch.items()
            }
            masks = step(params, device_batch)
            # Count the previous batch while this one runs on the devices.
            if pending is not None:
                _count_batch(counts, pending[0], jax.device_get(pending[1]))
            pending, num_batches = (batch, masks), num_batches + 1
        if pending is not None:
            _count_batch(counts, pending[0], jax.device_get(pending[1]))
    return counts, num_batches


def _dims(value) -> tuple[int, int]:
    return np.ndim(value), np.shape(value)[0]
