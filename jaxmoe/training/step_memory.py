"""Refuse a train step that cannot fit in device memory before anything is compiled.

The estimate is a lower bound from the model and train sections and the state's shardings
alone, so it never refuses a step that fits: the exact parameters + optimizer state each
device holds, their gradients, the float32 logits of one micro-batch (of one
train.loss_chunk) and one residual-stream activation per layer (what even a fully
rematerialised backward pass keeps). Anything it misses only makes the real step bigger.
Without it, an impossible step costs a full compile before XLA (or the kernel) reports an
out-of-memory error.
"""

from jax.sharding import Mesh

from jaxmoe.models.options import ModelOptions
from jaxmoe.parallel.device_memory import refuse_over_memory, state_bytes_per_device
from jaxmoe.parallel.sharding import data_parallel_size
from jaxmoe.training.options import TrainOptions


def step_bytes_lower_bound(
    model: ModelOptions, train: TrainOptions, mesh: Mesh, abstract_state, shardings
) -> dict[str, float]:
    """Per-device bytes a train step needs at least, by part."""
    rows = max(1.0, train.batch_size / train.grad_accum / data_parallel_size(mesh))
    tensor = dict(mesh.shape).get("tensor", 1)
    itemsize = 2 if model.dtype == "bfloat16" else 4
    layers = model.num_layers
    if model.arch == "encoder_decoder":
        layers += model.num_encoder_layers or model.num_layers
    seq_len, chunk = train.seq_len, train.loss_chunk or train.seq_len
    return {
        "state": state_bytes_per_device(abstract_state, shardings),
        "gradients": state_bytes_per_device(abstract_state["params"], shardings["params"]),
        # train.loss_chunk: the loss holds one chunk's logits at a time (chunked_loss.py)
        "logits": rows * min(chunk, seq_len) * model.vocab_size * 4 / tensor,
        "activations": rows * seq_len * model.d_model * itemsize * layers,
    }


def check_step_fits(
    model: ModelOptions, train: TrainOptions, mesh: Mesh, abstract_state, shardings
) -> None:
    """A one-line ConfigError when the lower bound exceeds one device's memory."""
    refuse_over_memory(
        step_bytes_lower_bound(model, train, mesh, abstract_state, shardings),
        f"train.batch_size={train.batch_size} x train.seq_len={train.seq_len} with this model",
        "lower train.batch_size or train.seq_len, raise train.grad_accum, or shard over "
        "more devices (mesh.fsdp)",
    )
