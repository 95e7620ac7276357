"""Frozen parts of a model (`train.freeze`, `train.trainable`): parameter groups that keep
their values while the rest trains. The groups (router, experts, shared_experts, dense_ffn,
attention, norms, embeddings, head) are models/param_groups.py's.

`train.freeze=router,embeddings` freezes those groups; `train.trainable=experts` freezes all
but those. A frozen parameter's gradient is dropped where it is computed (so XLA does not
compute it), it gets no optimizer state and no update (weight decay included), and the
gradient norm that clipping and the logs see is that of the trained parameters.
"""

import jax
import jax.numpy as jnp
import optax

from jaxmoe.models.param_groups import GROUPS, group_of, moe_ffn_paths, parse_groups

__all__ = ["GROUPS", "frozen_tree", "group_of", "mask_gradients", "parse_groups", "with_frozen"]


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
    moe_ffns = moe_ffn_paths(paths)
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
