"""T5X's Adafactor (the optimizer of T5.1.1 and of the GQA paper's uptraining) from optax parts.

T5X applies Adafactor to 2-D kernels: attention `[D, H*dh]` and `[H*dh, D]`, FFN `[D, F]`,
embeddings `[V, D]`. jaxmoe keeps heads as their own axis (`[D, H, dh]`, `[H, dh, D]`), where
optax's Adafactor would see a 3-D array and factor the wrong pair of axes. So every update
runs on each parameter's *matrix view*: the attention kernels' head axes merged, any axes in
front of the matrix (experts, scanned layers) treated as a batch of independent matrices, as
T5X's `FactorDim.BATCH` does. Per matrix, in T5X's order:

  v         <- decay_t v + (1 - decay_t) (g^2 + epsilon1)   (factored into row and column
               means: see "Which matrices are factored" below)
  y         =  g / sqrt(v),   decay_t = 1 - (t + 1)^-decay_rate
  y         /= max(1, RMS(y) / clipping_threshold)
  update    =  -learning_rate(t) * max(RMS(param), epsilon2) * y   [momentum: EMA of this]

Which matrices are factored follows T5X with its logical factor rules (the T5.1.1 and MoE gin
configs set `logical_factor_rules`): a plain 2-D matrix falls back to T5X's heuristic (both
axes >= min_dim_size_to_factor), but a batched one (a scanned `layers` axis, an `expert`
axis: FactorDim.BATCH) has an explicit rule, which T5X applies whatever the sizes, so every
matrix of a batch is factored. Which of the two axes is called the row does not change the
update (the factored estimate v_row v_col / mean(v_row) is symmetric), only which state
array is named v_row.

t counts this optimizer state's steps from 0, so a fresh state (uptraining without the
source's optimizer state) restarts the second-moment decay as T5X does with
`step_offset = start step`; the learning rate follows its own, possibly offset, schedule.
"""

import math

import jax
import optax

ATTENTION_IN = ("query", "key", "value")  # [..., D, H, dh] -> [..., D, H*dh]
ATTENTION_OUT = ("out",)  # [..., H, dh, D] -> [..., H*dh, D]


def matrix_view(path: tuple[str, ...], shape: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """(shape of the parameter's T5X-style view, number of leading batch axes in it).

    Named by the parameter's last path key, so a leading `layers` or `expert` axis only adds
    batch axes: a norm `scale` is a vector, every other parameter a matrix over its last two
    axes (a 1-D parameter is a vector).
    """
    name = path[-1] if path else ""
    if name in ATTENTION_IN and len(shape) >= 3:
        view = (*shape[:-2], shape[-2] * shape[-1])
    elif name in ATTENTION_OUT and len(shape) >= 3:
        view = (*shape[:-3], shape[-3] * shape[-2], shape[-1])
    else:
        view = tuple(shape)
    matrix_ndim = 1 if name == "scale" else min(len(view), 2)
    return view, len(view) - matrix_ndim


def per_matrix(
    inner: optax.GradientTransformation,
    view_fn=matrix_view,
    batched_inner: optax.GradientTransformation | None = None,
):
    """`inner` applied to every parameter's matrix view on its own (vmapped over batch axes;
    `batched_inner`, when given, instead of `inner` for the views with batch axes).

    The state mirrors the parameter tree with one `inner` state per parameter, so blockwise
    statistics (RMS clipping, parameter scale, factored moments) never mix matrices.
    """

    def layout(path, leaf):
        keys = tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        view, batch = view_fn(keys, tuple(leaf.shape))
        # Batch axes are folded into one so a single vmap covers any number of them.
        batched = (math.prod(view[:batch]), *view[batch:]) if batch else view
        return batched, bool(batch)

    def layouts(params):
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        return [layout(path, leaf) for path, leaf in flat], treedef

    def transform(batched: bool) -> optax.GradientTransformation:
        return batched_inner if batched and batched_inner is not None else inner

    def vmapped(fn, batched: bool):
        return jax.vmap(fn) if batched else fn

    def init(params):
        specs, treedef = layouts(params)
        states = [
            vmapped(transform(batched).init, batched)(leaf.reshape(shape))
            for leaf, (shape, batched) in zip(treedef.flatten_up_to(params), specs, strict=True)
        ]
        return treedef.unflatten(states)

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("per_matrix: the update needs the parameters (parameter scale)")
        specs, treedef = layouts(params)
        outs, new_states = [], []
        for grad, leaf_state, param, (shape, batched) in zip(
            treedef.flatten_up_to(updates),
            treedef.flatten_up_to(state),
            treedef.flatten_up_to(params),
            specs,
            strict=True,
        ):
            out, new_state = vmapped(transform(batched).update, batched)(
                grad.reshape(shape), leaf_state, param.reshape(shape)
            )
            outs.append(out.reshape(grad.shape))
            new_states.append(new_state)
        return treedef.unflatten(outs), treedef.unflatten(new_states)

    return optax.GradientTransformation(init, update)


def t5x_adafactor(
    learning_rate: optax.ScalarOrSchedule,
    *,
    decay_rate: float = 0.8,
    clipping_threshold: float | None = 1.0,
    momentum: float | None = None,
    epsilon1: float = 1e-30,
    epsilon2: float = 1e-3,
    min_dim_size_to_factor: int = 128,
    multiply_by_parameter_scale: bool = True,
    view_fn=matrix_view,
) -> optax.GradientTransformation:
    """T5X's Adafactor with T5X's defaults (no momentum, no weight decay)."""

    def one_matrix(min_dim: int) -> optax.GradientTransformation:
        chain = [
            optax.scale_by_factored_rms(
                factored=True,
                decay_rate=decay_rate,
                min_dim_size_to_factor=min_dim,
                epsilon=epsilon1,
            )
        ]
        if clipping_threshold:
            chain.append(optax.clip_by_block_rms(clipping_threshold))
        chain.append(optax.scale_by_learning_rate(learning_rate, flip_sign=False))
        if multiply_by_parameter_scale:
            chain.append(optax.scale_by_param_block_rms(epsilon2))
        if momentum:
            chain.append(optax.ema(momentum, debias=False))
        chain.append(optax.scale(-1.0))
        return optax.chain(*chain)

    # Batched matrices (scanned layers, experts) are factored whatever their sizes: T5X's
    # explicit BATCH/ROW/COLUMN rule for them skips the min_dim_size_to_factor heuristic.
    return per_matrix(one_matrix(min_dim_size_to_factor), view_fn, batched_inner=one_matrix(1))
