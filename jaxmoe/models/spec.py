"""A model's static side: its graph, abstract parameters, their shardings and logical axes.

The one abstract-parameter builder (`model_spec`): training, evaluation, decoding, analysis
and every checkpoint converter build parameter shapes through it, from `nnx.eval_shape`, so
nothing full-size is allocated.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxmoe.models import build_model
from jaxmoe.models.stack import split_params
from jaxmoe.parallel.sharding import DEFAULT_RULES, param_specs


def str_keys(tree):
    """Nested dict with string keys (nnx.List gives int keys; checkpoints want strings)."""
    if isinstance(tree, dict):
        return {str(key): str_keys(value) for key, value in tree.items()}
    return tree


def model_params(model) -> tuple[nnx.GraphDef, dict]:
    """(graphdef, params as a nested str-keyed dict of arrays) of an nnx model."""
    graphdef, state, _ = split_params(model)
    return graphdef, str_keys(nnx.to_pure_dict(state))


@dataclass
class ModelSpec:
    """The static side of a model: its graph, abstract params and their shardings."""

    graphdef: nnx.GraphDef
    abstract_params: dict  # ShapeDtypeStruct leaves
    param_specs: dict  # PartitionSpec leaves
    param_axes: dict  # (logical axis names, shape) leaves
    rest: dict  # abstract non-parameter state: the MoE jitter RNG streams, or empty


def model_rngs(key) -> nnx.Rngs:
    """Parameter init plus named streams for router jitter and dropout. The names matter:
    `merge_model` reseeds the streams by name (a stream forked from `default` is skipped)."""
    return nnx.Rngs(
        params=key,
        jitter=jax.random.fold_in(key, 1),
        dropout=jax.random.fold_in(key, 2),
        lora=jax.random.fold_in(key, 3),  # adapters' init: the base's draws stay the same
    )


def _abstract_model(model_cfg, lora=None):
    return nnx.eval_shape(
        lambda: build_model(model_cfg, rngs=model_rngs(jax.random.key(0)), lora=lora)
    )


def abstract_params(model_cfg, lora=None) -> dict:
    """The model's parameters as a str-keyed nested dict of ShapeDtypeStruct (nothing
    allocated). Converters pass `unrolled_config(cfg)` to get per-layer paths; `lora`
    (models/lora.py LoraOptions): with the adapters."""
    _, state, _ = split_params(_abstract_model(model_cfg, lora))
    return str_keys(nnx.to_pure_dict(state))


def model_spec(model_cfg, mesh: Mesh, rules=DEFAULT_RULES, lora=None) -> ModelSpec:
    """Abstract parameters with their shardings on `mesh` and logical axes; `lora`
    (train.lora, models/lora.py): the model with its adapters."""
    abstract = _abstract_model(model_cfg, lora)
    graphdef, state, rest = split_params(abstract)
    specs = str_keys(nnx.to_pure_dict(param_specs(state, mesh, rules)))
    shapes = str_keys(nnx.to_pure_dict(state))
    axes = str_keys(
        nnx.to_pure_dict(
            jax.tree.map(
                lambda v: _AxesLeaf(v.get_metadata().get("axes"), v.get_value().shape),
                state,
                is_leaf=lambda x: isinstance(x, nnx.Variable),
            )
        )
    )
    return ModelSpec(graphdef, shapes, specs, axes, str_keys(nnx.to_pure_dict(rest)))


@dataclass(frozen=True)
class _AxesLeaf:
    """A parameter's logical axis names and shape, kept as one pytree leaf."""

    axes: tuple | None
    shape: tuple


def _materialize(leaf):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):  # stacked in a scanned stack
        return jax.random.split(jax.random.key(0), leaf.shape) if leaf.shape else jax.random.key(0)
    return jnp.zeros(leaf.shape, leaf.dtype)


def merge_model(graphdef, params, rest=None, rng=None):
    """The nnx model from its parameters. Models with RNG streams (router jitter, dropout)
    get them re-created inside the trace and, when `rng` is given, seeded from it: the train
    step derives that key from the step number, so the noise differs every step and a
    resumed run draws the same noise as an uninterrupted one."""
    if rest is None or not jax.tree.leaves(rest):
        return nnx.merge(graphdef, params)
    model = nnx.merge(graphdef, params, jax.tree.map(_materialize, rest))
    if rng is not None:
        # A scanned stack holds one key per period: "match_shape" splits the keys for them.
        nnx.reseed(model, jitter=rng, dropout=jax.random.fold_in(rng, 1), policy="match_shape")
    return model
