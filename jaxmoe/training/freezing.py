"""Frozen parts of a model (`train.freeze`, `train.trainable`): parameter groups that keep
their values while the rest trains.

Groups, by where a parameter sits (its path in the parameter tree):
- `router`: an MoE layer's router (its weights, bias and selection bias);
- `experts`: an MoE layer's experts (their kernels and biases);
- `shared_experts`: an MoE layer's shared experts and their gate;
- `dense_ffn`: the FFN of a dense layer;
- `attention`: self- and cross-attention (q/k/v/out, their biases and norms, T5's
  relative-position tables, MLA's projections);
- `norms`: the block and final RMSNorm scales;
- `embeddings`: the input embedding (the output layer too when tied);
- `head`: the untied output layer.

`train.freeze=router,embeddings` freezes those groups; `train.trainable=experts` freezes all
but those. A frozen parameter's gradient is dropped where it is computed (so XLA does not
compute it), it gets no optimizer state and no update (weight decay included), and the
gradient norm that clipping and the logs see is that of the trained parameters.
"""

import jax
import jax.numpy as jnp
import optax

GROUPS = (
    "router",
    "experts",
    "shared_experts",
    "dense_ffn",
    "attention",
    "norms",
    "embeddings",
    "head",
)
_ATTENTION = ("attn", "self_attn", "cross_attn", "encoder_relpos", "decoder_relpos")
_ROUTER = ("router", "router_bias", "selection_bias")


def parse_groups(text: str, key: str) -> tuple[str, ...]:
    """The groups of a comma list (`train.freeze` / `train.trainable`); ValueError naming
    the key for an unknown one."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        raise ValueError(f"{key}={text!r}: unknown group {unknown[0]!r} ({' | '.join(GROUPS)})")
    return names


def group_of(path: tuple[str, ...], moe_ffns: set[tuple[str, ...]]) -> str:
    """The group of the parameter at `path`; `moe_ffns`: the paths of the MoE FFN modules."""
    parts = tuple(str(p) for p in path)
    for i, part in enumerate(parts):
        if parts[: i + 1] in moe_ffns:
            child = parts[i + 1]
            if child in ("shared", "shared_gate"):
                return "shared_experts"
            return "router" if child in _ROUTER else "experts"
        if part in _ATTENTION:
            return "attention"
    if parts[0] == "lm_head":
        return "head"
    if parts[-1] == "embedding":
        return "embeddings"
    if parts[-1] == "scale":
        return "norms"
    return "dense_ffn"


def frozen_tree(params, freeze: str, trainable: str):
    """A tree like `params` of bools (True: frozen), or None when nothing is frozen."""
    frozen = set(parse_groups(freeze, "train.freeze"))
    kept = parse_groups(trainable, "train.trainable")
    if kept:
        frozen |= set(GROUPS) - set(kept)
    if not frozen:
        return None
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    paths = [tuple(str(getattr(k, "key", k)) for k in path) for path, _ in leaves]
    moe_ffns = {p[: p.index("router")] for p in paths if "router" in p}
    flags = [group_of(p, moe_ffns) in frozen for p in paths]
    if all(flags):
        raise ValueError(
            f"train.freeze={freeze!r} / train.trainable={trainable!r} freeze every parameter"
        )
    return jax.tree_util.tree_unflatten(jax.tree.structure(params), flags)


def mask_gradients(grads, frozen):
    """`grads` with the frozen leaves replaced by zeros (constants: their backward pass is
    never computed)."""
    if frozen is None:
        return grads
    return jax.tree.map(lambda g, f: jnp.zeros_like(g) if f else g, grads, frozen)


def with_frozen(optimizer: optax.GradientTransformation, frozen) -> optax.GradientTransformation:
    """`optimizer` on the trained parameters only; frozen ones get zero updates and no state."""
    if frozen is None:
        return optimizer
    labels = jax.tree.map(lambda f: "frozen" if f else "trained", frozen)
    return optax.multi_transform({"trained": optimizer, "frozen": optax.set_to_zero()}, labels)
