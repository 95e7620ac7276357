"""The one way to open a trained checkpoint for use: its config, and its parameters read
straight into their shards on a mesh (evaluation, decoding, lm-eval, routing analysis and
checkpoint surgery all come through here)."""

import jax
from jax.sharding import NamedSharding

from jaxmoe.checkpoints.manager import read_config, restore_params


def checkpoint_config(checkpoint: str, overrides=()):
    """The config stored with `checkpoint`, `--config.KEY=VALUE` overrides applied."""
    from jaxmoe.config.loading import apply_overrides
    from jaxmoe.config.validation import validate

    # A tokenizer given here is not looked up in the checkpoint (nor refused there).
    named = any(o.removeprefix("--").removeprefix("config.").startswith("data.tokenizer=")
                for o in overrides)  # fmt: skip
    config = read_config(checkpoint, tokenizer=not named)
    apply_overrides(config, overrides)
    validate(config)
    return config


def restore_on_mesh(checkpoint: str, spec, mesh, model_cfg=None):
    """The parameters of `checkpoint`, read straight into their shards on `mesh` as `spec`
    (models/spec.py) lays them out; either layer layout when `model_cfg` is given (see
    models/stack.py)."""
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
        spec.abstract_params,
        spec.param_specs,
    )
    return restore_params(checkpoint, abstract, model_cfg)
