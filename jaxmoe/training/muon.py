"""Muon (`optimizer.name=muon`): Newton-Schulz orthogonalised momentum for the weight
matrices, AdamW for everything else, one learning-rate schedule for both.

Which parameters are matrices, and which of their axes are the matrix's rows and columns,
comes from the logical axes every parameter is created with (models/spec.py `param_axes`):
- `layers` (a scanned stack's leading axis) and `expert` (stacked experts) are batch axes:
  each layer's and each expert's matrix is orthogonalised on its own, never one
  [E * D, F] matrix;
- a matrix whose last axis is `embed` writes the residual stream (attention `out`
  [H, dh, D], FFN `wo` [F, D]): its other axes are the input, `embed` the output;
- every other matrix reads its first axis (`embed`, or an MLA latent) and writes the rest
  (query [D, H, dh] is one [D, H dh] matrix, as MaxText and Moonlight treat it);
- AdamW takes the embedding and output layer (a `vocab` axis), norm scales, biases, sinks
  and anything with fewer than two matrix axes or a matrix side of 1 (the shared-expert
  gate [D, 1]).

The update of a Muon matrix (Keller Jordan's Muon, Moonlight's scaling): momentum
buf = beta buf + g and its Nesterov look-ahead g + beta buf (optax.trace), normalised by
its Frobenius norm and sent through `muon_ns_steps` quintic Newton-Schulz steps
X <- a X + (b A + c A^2) X with A = X X^T, (a, b, c) = (3.4445, -4.7750, 2.0315), on the
transpose when rows > columns; then scaled so its RMS matches AdamW's, 0.2
sqrt(max(fan_in, fan_out)) for `muon_rms=0.2` (Moonlight, "Muon is Scalable for LLM
Training": one learning rate and weight decay serve both groups), or sqrt(max(1,
fan_out / fan_in)) for `muon_rms=0`; decoupled weight decay and the learning rate after
it (optax.add_decayed_weights, scale_by_learning_rate), as optax's AdamW applies them.

Sharding. optax's `contrib.scale_by_muon` flattens all batch axes into one with a reshape
before it vmaps the iteration; on a stacked [layers, expert, D, F] tensor sharded over
`expert` that merge cannot keep the expert sharding, and XLA gathers every expert onto
every chip of the expert axis (measured on 8 CPU devices, fsdp 2 x expert 4: an
all-gather of the whole [4, 8, 128, 128] local stack, then every chip orthogonalises all
32 matrices). Here each batch axis gets its own vmap and nothing is reshaped across a
sharded axis, so an expert's matrix stays on the chips that hold it: the same case
compiles with no all-gather, only the all-reduce of each Newton-Schulz Gram matrix
A = X X^T [min(m, n)]^2 over the axis sharding the contracted side (fsdp) and of the
Frobenius norm (tests/test_muon.py checks the compiled collectives).
"""

import math

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
BATCH_AXES = ("layers", "expert")
ADAMW_NAMES = ("lm_head", "scale", "sinks")
ADAMW_AXES = ("vocab", "norm")


def _name(path) -> str:
    return str(getattr(path[-1], "key", path[-1]))


def matrix_axes(name: str, axes: tuple, shape: tuple) -> MuonDimensionNumbers | None:
    """The (reduction, output) axes of parameter `name` with logical `axes` and `shape`
    when Muon orthogonalises it, else None (AdamW)."""
    if axes is None or name in ADAMW_NAMES or name.endswith(("bias", "embedding")):
        return None
    if any(a in ADAMW_AXES for a in axes):
        return None
    matrix = [i for i, a in enumerate(axes) if a not in BATCH_AXES]
    if len(matrix) < 2:
        return None
    if axes[matrix[-1]] == "embed":
        reduction, output = tuple(matrix[:-1]), (matrix[-1],)
    else:
        reduction, output = (matrix[0],), tuple(matrix[1:])
    if min(math.prod(shape[i] for i in reduction), math.prod(shape[i] for i in output)) < 2:
        return None
    return MuonDimensionNumbers(reduction, output)


def dimension_numbers(param_axes) -> dict:
    """models/spec.py `param_axes` (leaves with .axes and .shape) -> a tree of
    MuonDimensionNumbers (Muon) or None (AdamW), same structure as the parameters."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: matrix_axes(_name(path), leaf.axes, leaf.shape),
        param_axes,
        is_leaf=lambda x: hasattr(x, "axes") and hasattr(x, "shape"),
    )


def labels(dims) -> dict:
    """'muon' / 'adamw' per parameter, from `dimension_numbers`."""
    return jax.tree.map(
        lambda d: "adamw" if d is None else "muon",
        dims,
        is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers),
    )


def newton_schulz(x_MN, steps: int):
    """The quintic Newton-Schulz iteration on one matrix [M, N] (its Frobenius norm first)."""
    a, b, c = NS_COEFFS
    transposed = x_MN.shape[0] > x_MN.shape[1]
    x = x_MN.T if transposed else x_MN  # A = X X^T is the smaller Gram matrix
    x = x / (jnp.linalg.norm(x) + NS_EPS)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


def orthogonalize(x, dims: MuonDimensionNumbers, steps: int):
    """Newton-Schulz on every matrix of `x`: its batch axes (those in neither of `dims`)
    vmapped one at a time, its reduction and output axes merged into the two sides."""
    red, out = tuple(dims.reduction_axis), tuple(dims.output_axis)
    batch = tuple(i for i in range(x.ndim) if i not in red + out)
    order = batch + red + out
    moved = x.transpose(order)
    lead = moved.shape[: len(batch)]
    fan_in, fan_out = _fan(x, dims)
    fn = lambda m: newton_schulz(m, steps)
    for _ in batch:
        fn = jax.vmap(fn)
    y = fn(moved.reshape(*lead, fan_in, fan_out)).reshape(moved.shape)
    return y.transpose(tuple(order.index(i) for i in range(x.ndim)))


def _fan(x, dims: MuonDimensionNumbers) -> tuple[int, int]:
    fan_in = math.prod(x.shape[i] for i in dims.reduction_axis)
    return fan_in, math.prod(x.shape[i] for i in dims.output_axis)


def _shape_factor(rms: float, fan_in: int, fan_out: int) -> float:
    if rms:
        return rms * math.sqrt(max(fan_in, fan_out))
    return math.sqrt(max(1.0, fan_out / fan_in))


def scale_by_orthogonalization(dims_tree, steps: int, rms: float):
    """Each update matrix orthogonalised (`orthogonalize`) and scaled by the shape factor
    (module docstring). `dims_tree`: MuonDimensionNumbers per leaf, optax.MaskedNode where
    optax.partition hides a leaf from this branch."""

    def scale(x, dims):
        y = orthogonalize(x.astype(jnp.float32), dims, steps)
        return (y * _shape_factor(rms, *_fan(x, dims))).astype(x.dtype)

    def update(updates, state, params=None):
        del params
        is_dims = lambda x: isinstance(x, (MuonDimensionNumbers, optax.MaskedNode))
        scaled = jax.tree.map(
            lambda d, x: x if isinstance(d, optax.MaskedNode) else scale(x, d),
            dims_tree,
            updates,
            is_leaf=is_dims,
        )
        return scaled, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def muon(opt_cfg, schedule, param_axes, rest: optax.GradientTransformation):
    """Muon for the matrices (the `optimizer` section's muon_* keys, its weight decay and
    `schedule`), `rest` (the optimizer's AdamW) for the other parameters."""
    if param_axes is None:
        raise ValueError("optimizer.name='muon' needs the model's parameter axes (param_axes)")
    dims = dimension_numbers(param_axes)
    # optax.partition hands the Muon branch a tree whose AdamW leaves are MaskedNode.
    masked_dims = jax.tree.map(
        lambda d: optax.MaskedNode() if d is None else d,
        dims,
        is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers),
    )
    matrices = optax.chain(
        optax.trace(decay=opt_cfg.muon_momentum, nesterov=opt_cfg.muon_nesterov),
        scale_by_orthogonalization(masked_dims, opt_cfg.muon_ns_steps, opt_cfg.muon_rms),
        optax.add_decayed_weights(opt_cfg.weight_decay),
        optax.scale_by_learning_rate(schedule),
    )
    return optax.partition({"muon": matrices, "adamw": rest}, labels(dims))
