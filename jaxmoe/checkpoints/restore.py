"""Reading a trained checkpoint's parameters for use: straight into their shards on a mesh
(evaluation, decoding, lm-eval, routing analysis and checkpoint surgery all come through
here; the config and tokenizer a checkpoint is opened with: inference/trained_model.py).
"""

import jax
from jax.sharding import NamedSharding

from jaxmoe.checkpoints.manager import resolve_checkpoint, restore_params


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
