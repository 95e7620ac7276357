"""A stack of residual blocks, Python-unrolled or scanned, and the remat policies.

Unrolled (`model.scan_layers=False`): an `nnx.List` of blocks, parameters at
`<stack>/<i>/...`. Compile time and program size grow with depth.

Scanned (`model.scan_layers=True`): a `ScannedStack`. A dense prefix that breaks the
`moe.every` pattern (DeepSeek's first_k_dense_replace = `moe.first_dense_layers`, or
`moe.dense_layers` ids that form a prefix) is the head: its h layers (a multiple of k, see
`head_of`) are unrolled first, at `<stack>/head/<i>/...`. Block i = h + p * k + j (period p,
position j in a period of k = `model.moe.every` blocks, so dense and MoE layers keep
alternating) keeps its parameters in row p of `<stack>/period/<j>/...`, whose leading axis
has the logical name `layers` (never sharded). The k blocks of one period are one
`jax.lax.scan` body, so the program holds one period whatever the depth. Layers left over
when k does not divide the rest (all dense, see ffn.is_moe_layer) are unrolled after the
scan at `<stack>/tail/<t>/...`. Any other irregular placement is refused.

Both run the same block code and create parameters in the same order from the same RNG
streams, so one seed gives the same model in either layout (`stack_layers` maps one onto
the other).
"""

from collections.abc import Callable
from typing import NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

LAYERS_AXIS = "layers"
HEAD, PERIOD, TAIL = "head", "period", "tail"

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
    return cfg.moe.every if cfg.moe.num_experts > 0 else 1


def _irregular_layers(cfg, num_layers: int | None) -> list[int]:
    """Layers the `moe.every` pattern makes MoE but first_dense_layers / dense_layers dense."""
    from jaxmoe.models.layer_kinds import is_moe_layer

    every = cfg.moe.every
    return [
        i
        for i in range(int(num_layers or cfg.num_layers))
        if is_moe_layer(cfg, i) != ((i + 1) % every == 0)
    ]


def head_of(cfg, num_layers: int | None = None) -> int:
    """Leading layers a scanned stack unrolls before its periods: 0 when every layer follows
    the `moe.every` pattern, else the smallest multiple of k = `moe.every` past the last
    layer that breaks it, so the periods keep the pattern's phase. `check_scannable`
    refuses heads that are not all dense (DeepSeek's first_k_dense_replace = 1 gives h = 1)."""
    if cfg.moe.num_experts <= 0:
        return 0
    every = cfg.moe.every
    irregular = _irregular_layers(cfg, num_layers)
    return (irregular[-1] // every + 1) * every if irregular else 0


def check_scannable(cfg, num_layers: int | None = None) -> None:
    """ValueError (one line) when `model.scan_layers` meets an MoE placement that is neither
    the `moe.every` pattern nor that pattern behind a dense prefix (`head_of`): one scan
    body holds one period, so every period must have the same layer kinds. Such models run
    unrolled."""
    if not cfg.scan_layers or cfg.moe.num_experts <= 0:
        return
    from jaxmoe.models.layer_kinds import is_moe_layer

    if any(is_moe_layer(cfg, i) for i in range(head_of(cfg, num_layers))):
        raise ValueError(
            f"model.scan_layers=True needs every layer kind to repeat with model.moe.every="
            f"{cfg.moe.every} behind a dense prefix, but first_dense_layers / dense_layers "
            f"make layer {_irregular_layers(cfg, num_layers)[0]} dense; "
            "set model.scan_layers=False"
        )


class ScannedStack(nnx.Module):
    """`num_layers` blocks made by `make_block(i, rngs)`: the first `head` unrolled, the
    next ones stacked by period for a scan, the leftover tail unrolled."""

    def __init__(
        self, make_block: Callable, num_layers: int, period: int, head: int, *, rngs: nnx.Rngs
    ):
        blocks = [make_block(i, rngs) for i in range(num_layers)]  # one RNG order, any layout
        self.head = nnx.List(blocks[:head])
        scanned = blocks[head:]
        self.num_periods = len(scanned) // period
        self.period = nnx.List(
            [
                _stacked(scanned[j], [scanned[p * period + j] for p in range(self.num_periods)])
                for j in range(period if self.num_periods else 0)  # fewer layers than k
            ]
        )
        self.tail = nnx.List(scanned[self.num_periods * period :])


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
        head = head_of(cfg, num_layers)
        return ScannedStack(make_block, num_layers, period_of(cfg), head, rngs=rngs)
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


def run_block(block, x, apply: Callable, remat):
    """One block outside a stack (apply(block, x, None, None) -> (x, aux, state)), rematted
    like the stack's blocks under `remat`; x may be a tuple of arrays."""
    return _apply_pure(block, x, None, apply, remat_name(remat))


def split_params(module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graph, parameters, the rest of the state: RNG counters...) of an nnx module."""
    # Two filters, three parts (nnx.split is typed for any number).
    return cast(tuple[nnx.GraphDef, nnx.State, nnx.State], nnx.split(module, nnx.Param, ...))


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
    graphdef, params, rest = split_params(block)

    def fn(x, state, params, rest):
        live = nnx.merge(graphdef, params, rest)
        x, layer_aux, state = apply(live, x, state, None)
        return x, layer_aux, state, split_params(live)[2]

    rematted = _checkpointed(fn, policy_name, in_scan=False)
    x, layer_aux, state, new_rest = rematted(x, state, params, rest)
    nnx.update(block, new_rest)
    return x, layer_aux, state


def _run_scanned(stack: ScannedStack, x, apply, policy_name, name, states):
    h, k = len(stack.head), len(stack.period)
    head_states = None if states is None else states[:h]
    period_states = None if states is None else states[h : h + k]
    tail_states = None if states is None else states[h + k :]
    x, aux, head_states = _run_blocks(list(stack.head), 0, x, apply, policy_name, name, head_states)
    if stack.num_periods:
        x, period_aux, period_states = _scan_periods(
            stack, x, apply, policy_name, name, period_states
        )
        aux |= period_aux
    first_tail = h + stack.num_periods * k
    x, tail_aux, tail_states = _run_blocks(
        list(stack.tail), first_tail, x, apply, policy_name, name, tail_states
    )
    if states is None:
        return x, aux | tail_aux, None
    # Each part is a list when `states` is one.
    return x, aux | tail_aux, [*(head_states or []), *(period_states or []), *(tail_states or [])]


def _scan_periods(stack: ScannedStack, x, apply, policy_name, name, period_states):
    """The period blocks under one jax.lax.scan over the P periods."""
    h, k = len(stack.head), len(stack.period)
    graphdef, params, rest = split_params(stack.period)

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
        return (x, new_states), (auxes, split_params(period)[2])

    rows = jnp.arange(stack.num_periods, dtype=jnp.int32)
    (x, period_states), (auxes, new_rest) = jax.lax.scan(
        _checkpointed(body, policy_name, in_scan=True), (x, period_states), (rows, params, rest)
    )
    nnx.update(stack.period, new_rest)
    aux = {}
    # Per-layer outputs come out stacked [num_periods, ...]; layer h + p * k + j is row p of j.
    for p in range(stack.num_periods):
        for j, stacked in enumerate(auxes):
            if stacked:
                aux[name(h + p * k + j)] = jax.tree.map(lambda a, p=p: a[p], stacked)
    return x, aux, period_states


def stack_modules(stack) -> list[nnx.Module]:
    """The block modules a stack holds (a scanned stack: its head, its period blocks, then
    its tail), for changing blocks in place."""
    if isinstance(stack, ScannedStack):
        return [*stack.head, *stack.period, *stack.tail]
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
    return [fn(block) for block in stack.head] + out + [fn(block) for block in stack.tail]


class StackLayout(NamedTuple):
    """Where the layers of one scanned stack go: `head` unrolled layers, `periods` periods
    of `period` scanned layers (layer head + p * period + j is row p of module j), and
    `tail` unrolled layers after them."""

    head: int
    period: int
    periods: int
    tail: int

    def module_counts(self) -> list[int | None]:
        """Per stack module (stack_modules order): its rows P when scanned, None when one
        layer."""
        scanned = [self.periods] * (self.period if self.periods else 0)
        return [None] * self.head + scanned + [None] * self.tail

    def module_layers(self) -> list[int]:
        """Per stack module: the layer it is (a scanned module: the layer of its row 0)."""
        scanned = range(self.head, self.head + (self.period if self.periods else 0))
        first_tail = self.head + self.periods * self.period
        return [*range(self.head), *scanned, *range(first_tail, first_tail + self.tail)]

    def location(self, layer: int) -> tuple[str, int, int | None]:
        """(HEAD / PERIOD / TAIL, module index in that part, row or None) of a layer."""
        if layer < self.head:
            return HEAD, layer, None
        p, j = divmod(layer - self.head, self.period)
        if p < self.periods:
            return PERIOD, j, p
        return TAIL, layer - self.head - self.periods * self.period, None


def stack_layout(cfg, num_layers: int | None = None) -> StackLayout:
    """The StackLayout of a scanned stack of `num_layers` (default cfg.num_layers)."""
    num_layers = int(num_layers or cfg.num_layers)
    head, k = head_of(cfg, num_layers), period_of(cfg)
    periods = (num_layers - head) // k
    return StackLayout(head, k, periods, num_layers - head - periods * k)


def stack_sizes(cfg) -> dict[str, int]:
    """{params key of a layer stack: its number of layers} for a model config."""
    if cfg.arch == "encoder_decoder":
        return {
            "encoder_layers": cfg.num_encoder_layers or cfg.num_layers,
            "decoder_layers": cfg.num_layers,
        }
    return {"layers": cfg.num_layers}


def _stacked_tree(layers: dict) -> bool:
    return HEAD in layers or PERIOD in layers or TAIL in layers


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
    """The model config with `scan_layers` off: per-layer parameter paths."""
    return model_cfg.replace(scan_layers=False)


def stack_layers(params: dict, cfg) -> dict:
    """A params tree with per-layer entries `<stack>/<i>/...` in the scanned layout of `cfg`.

    Host (numpy) leaves stay on the host. A tree already stacked is returned as it is.
    Converters build per-layer trees and call this at the end when `cfg.scan_layers`.
    """
    out = dict(params)
    for name, num_layers in stack_sizes(cfg).items():
        layers = params[name]
        if _stacked_tree(layers):
            continue
        layout = stack_layout(cfg, num_layers)
        h, k, periods = layout.head, layout.period, layout.periods
        stacked = {}
        if h:
            stacked[HEAD] = {str(i): layers[str(i)] for i in range(h)}
        if periods:
            stacked[PERIOD] = {
                str(j): jax.tree.map(_stack, *[layers[str(h + p * k + j)] for p in range(periods)])
                for j in range(k)
            }
        if layout.tail:
            first_tail = h + periods * k
            stacked[TAIL] = {str(t): layers[str(first_tail + t)] for t in range(layout.tail)}
        out[name] = stacked
    return out


def unstack_layers(params: dict, cfg) -> dict:
    """The inverse of `stack_layers`: per-layer entries `<stack>/<i>/...`."""
    out = dict(params)
    for name, num_layers in stack_sizes(cfg).items():
        stacked = params[name]
        if not _stacked_tree(stacked):
            continue
        layout, layers = stack_layout(cfg, num_layers), {}
        for i in range(num_layers):
            part, index, row = layout.location(i)
            subtree = stacked[part][str(index)]
            if row is not None:
                subtree = jax.tree.map(lambda a, p=row: _take(a, p), subtree)
            layers[str(i)] = subtree
        out[name] = layers
    return out


def stacked_location(path: tuple[str, ...], cfg) -> tuple[tuple[str, ...], int | None]:
    """Where per-layer parameter `path` (`<stack>/<i>/...`) lives in the scanned layout of
    `cfg`: (stacked path, row) for a layer in a period, (head or tail path, None) for an
    unrolled layer, and (`path`, None) for anything outside a layer stack. The inverse of
    `stack_layers` for one leaf, for converters that read or write one layer at a time."""
    sizes = stack_sizes(cfg)
    if len(path) < 2 or path[0] not in sizes:
        return path, None
    part, index, row = stack_layout(cfg, sizes[path[0]]).location(int(path[1]))
    return (path[0], part, str(index), *path[2:]), row


def layer_layouts(cfg) -> tuple[Callable[[dict], dict], Callable[[dict], dict]]:
    """The two arrangements a params tree of model `cfg` may be stored in, per-layer and
    scanned, each as a function putting a tree (abstract or not) in either into it: what
    `checkpoints.manager.restore_params(..., layouts)` takes to read a checkpoint saved in
    the layout other than the one asked for."""
    return (lambda params: unstack_layers(params, cfg), lambda params: stack_layers(params, cfg))
