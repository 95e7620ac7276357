"""Building the train state directly sharded on a mesh, and its shardings.

Shapes come from `nnx.eval_shape` (nothing allocated); the state is then created by a jitted
init whose out_shardings place every array where the rules table says, so no full copy of
the model ever sits on one device.
"""

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec

from jaxmoe.models import build_model
from jaxmoe.models.spec import ModelSpec, model_params, model_rngs
from jaxmoe.parallel.sharding import named


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
