"""The one way to open a trained checkpoint for use: its config, its own tokenizer, and
its parameters read straight into their shards on a mesh (evaluation, decoding, lm-eval,
routing analysis and checkpoint surgery all come through here).

A checkpoint is data, never instructions: what its stored config says about where to read
or write (`data.source`, `data.mixture`, `data.cache_dir`, `data.data_dir`,
`train.init_from`) is dropped, and its tokenizer is the copy inside it
(tokenizer_item.py); only the command line names other places.
"""

import jax
from jax.sharding import NamedSharding

from jaxmoe.checkpoints.manager import read_config, resolve_checkpoint, restore_params
from jaxmoe.checkpoints.tokenizer_item import check_tokenizer_fits
from jaxmoe.errors import ConfigError

# Stored keys that name places to read or write: the sender's, not the reader's.
_STORED_PLACES = ("data.source", "data.mixture", "data.cache_dir", "data.data_dir",
                  "train.init_from")  # fmt: skip


def _named(overrides, key: str) -> bool:
    """True when `--config.KEY=...` is among `overrides`."""
    return any(o.removeprefix("--").removeprefix("config.").startswith(key + "=")
               for o in overrides)  # fmt: skip


def checkpoint_config(checkpoint: str, overrides=()):
    """The config stored with `checkpoint`, its places reset to the defaults, then the
    `--config.KEY=VALUE` overrides applied."""
    from jaxmoe.config.defaults import base_config
    from jaxmoe.config.loading import apply_overrides
    from jaxmoe.config.validation import validate

    # A tokenizer given here is not looked up in the checkpoint (nor refused there).
    config = read_config(checkpoint, tokenizer=not _named(overrides, "data.tokenizer"))
    defaults = base_config()
    for key in _STORED_PLACES:
        section, leaf = key.split(".")
        config[section][leaf] = defaults[section][leaf]
    apply_overrides(config, overrides)
    validate(config)
    return config


def checkpoint_tokenizer(checkpoint: str, config, overrides=(), required: bool = True):
    """The tokenizer to use with `checkpoint`: the one named by `--config.data.tokenizer`,
    else the checkpoint's own copy, else the one a `--config` file names.
    Without either: a ConfigError saying how to name one, or None when not `required`
    (token-id data needs none). A tokenizer with more ids than the model's embedding
    table is refused: those ids would silently index past it."""
    from jaxmoe.data.tokenizer import open_tokenizer

    if _named(overrides, "data.tokenizer"):
        path, where = config.data.tokenizer, "--config.data.tokenizer"
    else:
        path = read_config(checkpoint).data.tokenizer or config.data.tokenizer
        where = "the checkpoint's own tokenizer"
    if not path:
        if not required:
            return None
        raise ConfigError(
            f"checkpoint {str(resolve_checkpoint(checkpoint))!r} holds no tokenizer (saved "
            f"before checkpoints carried one, or converted without tokenizer files): name "
            f"one with --config.data.tokenizer=FILE (a .model, a tokenizer.json or its folder)"
        )
    tokenizer = open_tokenizer(path, eos_token=config.data.eos_token)
    check_tokenizer_fits(tokenizer, config.model.vocab_size, where)
    return tokenizer


def checkpoint_step(checkpoint: str) -> dict:
    """{"checkpoint": the step directory used, "step": its number or None}: printed with
    every result, so a number always says which parameters it is for."""
    step_dir = resolve_checkpoint(checkpoint)
    name = step_dir.name
    return {"checkpoint": str(step_dir), "step": int(name) if name.isdigit() else None}


def restore_on_mesh(checkpoint: str, spec, mesh, layouts=()):
    """The parameters of `checkpoint`, read straight into their shards on `mesh` as `spec`
    (models/spec.py) lays them out; stored in any of `layouts` (restore_params; e.g.
    models.stack.layer_layouts: either layer layout)."""
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
        spec.abstract_params,
        spec.param_specs,
    )
    return restore_params(checkpoint, abstract, layouts)
