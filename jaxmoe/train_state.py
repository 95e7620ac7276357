"""Building the train state directly sharded on a mesh, and its shardings.

Shapes come from `nnx.eval_shape` (nothing allocated); the state is then created by a jitted
init whose out_shardings place every array where the rules table says, so no full copy of
the model ever sits on one device.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxmoe.models import build_model
from jaxmoe.parallel.sharding import DEFAULT_RULES, named, param_specs


def str_keys(tree):
    """Nested dict with string keys (nnx.List gives int keys; checkpoints want strings)."""
    if isinstance(tree, dict):
        return {str(key): str_keys(value) for key, value in tree.items()}
    return tree


def model_params(model) -> tuple[nnx.GraphDef, dict]:
    """(graphdef, params as a nested str-keyed dict of arrays) of an nnx model."""
    graphdef, state, _ = nnx.split(model, nnx.Param, ...)
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
        params=key, jitter=jax.random.fold_in(key, 1), dropout=jax.random.fold_in(key, 2)
    )


def model_spec(model_cfg, mesh: Mesh, rules=DEFAULT_RULES) -> ModelSpec:
    abstract = nnx.eval_shape(lambda: build_model(model_cfg, rngs=model_rngs(jax.random.key(0))))
    graphdef, state, rest = nnx.split(abstract, nnx.Param, ...)
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


def _path_keys(path) -> tuple[str, ...]:
    return tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def opt_state_specs(abstract_opt_state, spec: ModelSpec):
    """Optimizer leaves that mirror a parameter get its spec; the rest are replicated."""
    flat_specs = dict(
        (_path_keys(path), leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(
            spec.param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )[0]
    )
    flat_shapes = {
        _path_keys(path): leaf.shape
        for path, leaf in jax.tree_util.tree_flatten_with_path(spec.abstract_params)[0]
    }

    def choose(path, leaf):
        keys = _path_keys(path)
        for start in range(len(keys)):
            suffix = keys[start:]
            if suffix in flat_specs and flat_shapes[suffix] == leaf.shape:
                return flat_specs[suffix]
        return PartitionSpec()

    return jax.tree_util.tree_map_with_path(choose, abstract_opt_state)


def state_shardings(mesh: Mesh, spec: ModelSpec, optimizer: optax.GradientTransformation):
    """(abstract state, NamedSharding tree) for {"step", "params", "opt_state"}."""
    abstract_opt = jax.eval_shape(optimizer.init, spec.abstract_params)
    abstract = {
        "step": jax.ShapeDtypeStruct((), jnp.int32),
        "params": spec.abstract_params,
        "opt_state": abstract_opt,
    }
    specs = {
        "step": PartitionSpec(),
        "params": spec.param_specs,
        "opt_state": opt_state_specs(abstract_opt, spec),
    }
    shardings = named(mesh, specs)
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    return abstract, shardings


def init_state(model_cfg, seed: int, optimizer, shardings, mesh: Mesh):
    """The initial train state, created already sharded."""

    def init(key):
        _, params = model_params(build_model(model_cfg, rngs=model_rngs(key)))
        return {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": optimizer.init(params),
        }

    with jax.set_mesh(mesh):
        return jax.jit(init, out_shardings=shardings)(jax.random.key(seed))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
