"""Held-out evaluation during training, and the host batches made global arrays."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.training.steps import eval_metrics, eval_step


def to_global(batch: dict, shardings: dict) -> dict:
    """Assemble this process's rows into global arrays sharded over the batch axes."""
    return {
        key: jax.make_array_from_process_local_data(shardings[key], np.asarray(value))
        for key, value in batch.items()
        if key in shardings
    }


class Evaluator:
    """Jitted evaluation over a fixed list of batches; one device->host fetch at the end."""

    def __init__(
        self,
        spec,
        mesh,
        batches: list[dict],
        param_shardings,
        batch_shardings,
        step=None,
        summarize=eval_metrics,
    ):
        """`step(params, batch) -> sums` (default steps.eval_step) and `summarize(totals)
        -> metrics` (default steps.eval_metrics): DPO's are dpo.py's."""
        self.mesh, self.batches, self.batch_shardings = mesh, batches, batch_shardings
        self.summarize = summarize
        self.fn = jax.jit(
            step or functools.partial(eval_step, graphdef=spec.graphdef, rest=spec.rest),
            in_shardings=(param_shardings, batch_shardings),
        )

    def __call__(self, params, batches: list[dict] | None = None) -> dict:
        """Metrics over `batches` (default: the evaluator's own)."""
        totals = None
        with jax.set_mesh(self.mesh):
            for batch in self.batches if batches is None else batches:
                sums = self.fn(params, to_global(batch, self.batch_shardings))
                sums = {k: v for k, v in sums.items() if not k.endswith("per_example")}
                totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
        return self.summarize(jax.device_get(totals))
