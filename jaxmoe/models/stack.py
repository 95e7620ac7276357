"""A stack of residual blocks, Python-unrolled or scanned, and the remat policies.

Unrolled (`model.scan_layers=False`): an `nnx.List` of blocks, parameters at
`<stack>/<i>/...`. Compile time and program size grow with depth.

Scanned (`model.scan_layers=True`): a `ScannedStack`. Block i = p * k + j (period p, position
j in a period of k = `model.moe.every` blocks, so dense and MoE layers keep alternating)
keeps its parameters in row p of `<stack>/period/<j>/...`, whose leading axis has the logical
name `layers` (never sharded). The k blocks of one period are one `jax.lax.scan` body, so
the program holds one period whatever the depth. Layers left over when k does not divide the
depth (all dense, see ffn.is_moe_layer) are unrolled after the scan at
`<stack>/tail/<t>/...`.

Both run the same block code and create parameters in the same order from the same RNG
streams, so one seed gives the same model in either layout (`stack_layers` maps one onto
the other).
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

LAYERS_AXIS = "layers"
PERIOD, TAIL = "period", "tail"

# model.remat -> jax.checkpoint policy (None: save only the block inputs).
REMAT_POLICIES = {
    "none": None,
    "full": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,  # keep matmul outputs
    # Keep the unbatched matmul outputs in host memory (TPU/GPU: "pinned_host").
    "offload_dots": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}
# Values of model.remat written before it took a policy name.
LEGACY_REMAT = {True: "full", False: "none", "true": "full", "false": "none"}


def remat_name(value) -> str:
    """model.remat as a policy name: bools and "true"/"false" of older configs included."""
    if isinstance(value, str):
        value = value.lower()
    return LEGACY_REMAT.get(value, value)


def period_of(cfg) -> int:
    """Blocks per scan body: the MoE interleave `moe.every` (1 for dense models)."""
    return int(cfg.moe.every) if cfg.moe.num_experts > 0 else 1


def check_scannable(cfg, num_layers: int | None = None) -> None:
    """ValueError (one line) when `model.scan_layers` meets an MoE placement that is not the
    `moe.every` pattern (first_dense_layers / dense_layers): one scan body holds one period,
    so every period must have the same layer kinds. Such models run unrolled."""
    if not cfg.scan_layers or cfg.moe.num_experts <= 0:
        return
    from jaxmoe.models.ffn import is_moe_layer  # ffn imports the MoE options

    every = int(cfg.moe.every)
    irregular = [
        i
        for i in range(int(num_layers or cfg.num_layers))
        if is_moe_layer(cfg, i) != ((i + 1) % every == 0)
    ]
    if irregular:
        raise ValueError(
            f"model.scan_layers=True needs every layer kind to repeat with model.moe.every="
            f"{every}, but first_dense_layers / dense_layers make layer {irregular[0]} dense; "
            "set model.scan_layers=False"
        )


class ScannedStack(nnx.Module):
    """`num_layers` blocks made by `make_block(i, rngs)`, stacked by period for a scan."""

    def __init__(self, make_block: Callable, num_layers: int, period: int, *, rngs: nnx.Rngs):
        blocks = [make_block(i, rngs) for i in range(num_layers)]
        self.num_periods = num_layers // period
        self.period = nnx.List(
            [
                _stacked(blocks[j], [blocks[p * period + j] for p in range(self.num_periods)])
                for j in range(period if self.num_periods else 0)  # fewer layers than k
            ]
        )
        self.tail = nnx.List(blocks[self.num_periods * period :])


def _stacked(template: nnx.Module, members: list[nnx.Module]) -> nnx.Module:
    """`template` holding the stacked state of `members`, Params tagged with `layers`."""
    states = [nnx.state(member) for member in members]
    nnx.update(template, jax.tree.map(lambda *xs: jnp.stack(xs), *states))
    for _, node in nnx.iter_graph(template):
        if isinstance(node, nnx.Param):
            axes = node.get_metadata().get("axes")
            node.set_metadata("axes", (LAYERS_AXIS, *axes) if axes is not None else None)
    return template


def build_stack(cfg, make_block: Callable, num_layers: int, rngs: nnx.Rngs):
    """An nnx.List of blocks, or a ScannedStack when `cfg.scan_layers`."""
    if cfg.scan_layers:
        check_scannable(cfg, num_layers)
        return ScannedStack(make_block, num_layers, period_of(cfg), rngs=rngs)
    return nnx.List([make_block(i, rngs) for i in range(num_layers)])


def run_stack(stack, x, apply: Callable, remat, name: Callable[[int], object], states=None):
    """Run every block of `stack` on x in layer order.

    apply(block, x, state, row) -> (x, aux dict (empty for a dense FFN), new state).
    states: None (training, eval) or one pytree per stack module (`stack_modules` order),
    e.g. KV caches. A scanned period block's state has a leading [P] layer axis and is
    carried through the scan: `row` (the scan step) tells the block which row is its own,
    to read and write in place; row is None for unrolled and tail blocks.
    remat: the model.remat value; name(i): the aux key of layer i.
    Returns (x, {name(i): aux of layer i} in layer order, new states or None).
    """
    policy_name = remat_name(remat)
    if isinstance(stack, ScannedStack):
        return _run_scanned(stack, x, apply, policy_name, name, states)
    return _run_blocks(list(stack), 0, x, apply, policy_name, name, states)


def _checkpointed(fn, policy_name: str, *, in_scan: bool):
    """fn under jax.checkpoint. Outside a scan, `prevent_cse` keeps XLA from merging the
    backward pass's recomputation of a block with its forward pass (the two are the same
    ops): merged, forward values can stay live until the backward, which remat is there
    to avoid. A scan body needs no such barrier: JAX documents prevent_cse=False as safe
    there, as the loop keeps the two apart."""
    if policy_name == "none":
        return fn
    policy = REMAT_POLICIES[policy_name]
    return jax.checkpoint(fn, policy=policy, prevent_cse=not in_scan)


def _run_blocks(blocks, first_index: int, x, apply, policy_name, name, states):
    aux, new_states = {}, []
    for offset, block in enumerate(blocks):
        state = None if states is None else states[offset]
        x, layer_aux, state = _apply_pure(block, x, state, apply, policy_name)
        new_states.append(state)
        if layer_aux:
            aux[name(first_index + offset)] = layer_aux
    return x, aux, None if states is None else new_states


def _apply_pure(block, x, state, apply, policy_name):
    """apply(block, x, state, None), rematted as a pure function of the block's state.

    The block's non-parameter state (RNG counters of router jitter) is written back.
    """
    if policy_name == "none":
        return apply(block, x, state, None)
    graphdef, params, rest = nnx.split(block, nnx.Param, ...)

    def fn(x, state, params, rest):
        live = nnx.merge(graphdef, params, rest)
        x, layer_aux, state = apply(live, x, state, None)
        return x, layer_aux, state, nnx.split(live, nnx.Param, ...)[2]

    rematted = _checkpointed(fn, policy_name, in_scan=False)
    x, layer_aux, state, new_rest = rematted(x, state, params, rest)
    nnx.update(block, new_rest)
    return x, layer_aux, state


def _run_scanned(stack: ScannedStack, x, apply, policy_name, name, states):
    k = len(stack.period)
    tail_states = None if states is None else states[k:]
    if not stack.num_periods:
        return _run_blocks(list(stack.tail), 0, x, apply, policy_name, name, tail_states)
    graphdef, params, rest = nnx.split(stack.period, nnx.Param, ...)

    def body(carry, slices):
        x, period_states = carry
        row, params_p, rest_p = slices
        period = nnx.merge(graphdef, params_p, rest_p)
        auxes, new_states = [], []
        for j, block in enumerate(period):
            state = None if period_states is None else period_states[j]
            x, layer_aux, state = apply(block, x, state, row)
            auxes.append(layer_aux)
            new_states.append(state)
        new_states = None if period_states is None else new_states
        return (x, new_states), (auxes, nnx.split(period, nnx.Param, ...)[2])

    rows = jnp.arange(stack.num_periods, dtype=jnp.int32)
    period_states = None if states is None else states[:k]
    (x, period_states), (auxes, new_rest) = jax.lax.scan(
        _checkpointed(body, policy_name, in_scan=True), (x, period_states), (rows, params, rest)
    )
    nnx.update(stack.period, new_rest)
    aux = {}
    # Per-layer outputs come out stacked [num_periods, ...]; layer p * k + j is row p of j.
    for p in range(stack.num_periods):
        for j, stacked in enumerate(auxes):
            if stacked:
                aux[name(p * k + j)] = jax.tree.map(lambda a, p=p: a[p], stacked)
    first_tail = stack.num_periods * k
    x, tail_aux, tail_states = _run_blocks(
        list(stack.tail), first_tail, x, apply, policy_name, name, tail_states
    )
    new_states = None if states is None else [*period_states, *tail_states]
    return x, aux | tail_aux, new_states


def stack_modules(stack) -> list[nnx.Module]:
    """The block modules a stack holds (a scanned stack: its period blocks, then its tail),
    for changing blocks in place."""
    if isinstance(stack, ScannedStack):
        return [*stack.period, *stack.tail]
    return list(stack)


def map_stack(stack, fn: Callable) -> list:
    """[fn(block) per stack module]; for a scanned stack's period blocks fn runs under one
    scan over the periods and its results come out stacked [P, ...] (layer axis first)."""
    if not isinstance(stack, ScannedStack):
        return [fn(block) for block in stack]
    out = []
    if stack.num_periods:
        graphdef, state = nnx.split(stack.period)

        def body(_, state_p):
            return None, [fn(block) for block in nnx.merge(graphdef, state_p)]

        out = list(jax.lax.scan(body, None, state)[1])
    return out + [fn(block) for block in stack.tail]


def stack_sizes(cfg) -> dict[str, int]:
    """{params key of a layer stack: its number of layers} for a model config."""
    if cfg.arch == "encoder_decoder":
        return {
            "encoder_layers": cfg.num_encoder_layers or cfg.num_layers,
            "decoder_layers": cfg.num_layers,
        }
    return {"layers": cfg.num_layers}


def is_stacked(params, cfg) -> bool:
    """Whether a params tree holds its layers in the scanned layout."""
    return any(_stacked_tree(params.get(name, {})) for name in stack_sizes(cfg))


def _stacked_tree(layers: dict) -> bool:
    return PERIOD in layers or TAIL in layers


def _stack(*leaves):
    """Stack one leaf of every period; abstract leaves (ShapeDtypeStruct) stay abstract."""
    first = leaves[0]
    if isinstance(first, jax.ShapeDtypeStruct):
        sharding = first.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
        return jax.ShapeDtypeStruct((len(leaves), *first.shape), first.dtype, sharding=sharding)
    xp = np if all(isinstance(leaf, np.ndarray) for leaf in leaves) else jnp
    return xp.stack(leaves)


def _take(leaf, p: int):
    """Row p of a stacked leaf; abstract leaves stay abstract."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        sharding = leaf.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
        return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=sharding)
    return leaf[p]


def unrolled_config(model_cfg):
    """A copy of the model config with `scan_layers` off: per-layer parameter paths."""
    cfg = model_cfg.copy_and_resolve_references()
    cfg.scan_layers = False
    return cfg


def stack_layers(params: dict, cfg) -> dict:
    """A params tree with per-layer entries `<stack>/<i>/...` in the scanned layout of `cfg`.

    Host (numpy) leaves stay on the host. A tree already stacked is returned as it is.
    Converters build per-layer trees and call this at the end when `cfg.scan_layers`.
    """
    k = period_of(cfg)
    out = dict(params)
    for name, num_layers in stack_sizes(cfg).items():
        layers = params[name]
        if _stacked_tree(layers):
            continue
        periods = num_layers // k
        stacked = {}
        if periods:
            stacked[PERIOD] = {
                str(j): jax.tree.map(_stack, *[layers[str(p * k + j)] for p in range(periods)])
                for j in range(k)
            }
        if num_layers > periods * k:
            tail = range(periods * k, num_layers)
            stacked[TAIL] = {str(t): layers[str(i)] for t, i in enumerate(tail)}
        out[name] = stacked
    return out


def unstack_layers(params: dict, cfg) -> dict:
    """The inverse of `stack_layers`: per-layer entries `<stack>/<i>/...`."""
    k = period_of(cfg)
    out = dict(params)
    for name, num_layers in stack_sizes(cfg).items():
        stacked = params[name]
        if not _stacked_tree(stacked):
            continue
        periods = num_layers // k
        layers = {}
        for i in range(periods * k):
            p, j = divmod(i, k)
            layers[str(i)] = jax.tree.map(lambda a, p=p: _take(a, p), stacked[PERIOD][str(j)])
        for t, subtree in stacked.get(TAIL, {}).items():
            layers[str(periods * k + int(t))] = subtree
        out[name] = layers
    return out


def stacked_location(path: tuple[str, ...], cfg) -> tuple[tuple[str, ...], int | None]:
    """Where per-layer parameter `path` (`<stack>/<i>/...`) lives in the scanned layout of
    `cfg`: (stacked path, row) for a layer in a period, (tail path, None) for a tail layer,
    and (`path`, None) for anything outside a layer stack. The inverse of `stack_layers`
    for one leaf, for converters that read or write one layer at a time."""
    sizes = stack_sizes(cfg)
    if len(path) < 2 or path[0] not in sizes:
        return path, None
    k = period_of(cfg)
    periods = sizes[path[0]] // k
    layer, rest = int(path[1]), path[2:]
    if layer < periods * k:
        p, j = divmod(layer, k)
        return (path[0], PERIOD, str(j), *rest), p
    return (path[0], TAIL, str(layer - periods * k), *rest), None


def layer_layouts(cfg) -> tuple[Callable[[dict], dict], Callable[[dict], dict]]:
    """The two arrangements a params tree of model `cfg` may be stored in, per-layer and
    scanned, each as a function putting a tree (abstract or not) in either into it: what
    `checkpoints.manager.restore_params(..., layouts)` takes to read a checkpoint saved in
    the layout other than the one asked for."""
    return (lambda params: unstack_layers(params, cfg), lambda params: stack_layers(params, cfg))
