"""`convert t5x --keep_optimizer`: T5X's Adafactor state as jaxmoe's `t5x_adafactor` state.

T5X keeps, per parameter, `v_row`/`v_col` (factored second moments) or `v` (unfactored),
`m` (momentum, a (1,) placeholder without it) and one global `step`. `t5x_adafactor` runs on
the same 2-D views T5X stores (attention `[D, H*dh]`), so each array maps to the same shape;
its moment count becomes T5X's step, so the next update decays the moments exactly as T5X's
would. The learning-rate schedule's count starts at 0: the schedule is offset by
`optimizer.start_step` (set to the step by the uptraining config).
"""

import jax
import numpy as np
import optax

from jaxmoe.checkpoints.finite import check_finite
from jaxmoe.checkpoints.manager import CheckpointError
from jaxmoe.checkpoints.trees import unflatten
from jaxmoe.conversions.t5x.reader import T5xCheckpoint


def adafactor_state(checkpoint: T5xCheckpoint, config, plan, src) -> object:
    """The `t5x_adafactor` optimizer state (numpy leaves) of `config` filled from the T5X
    checkpoint; `plan` is the conversion plan [(jaxmoe path, T5X name, jaxmoe shape)]."""
    from jaxmoe.training.optimizer import make_optimizer

    o = config.optimizer
    if o.name != "t5x_adafactor" or o.momentum:
        raise CheckpointError(
            f"--keep_optimizer keeps T5X's Adafactor state, which needs optimizer.name="
            f"t5x_adafactor without momentum (got name={o.name!r}, momentum={o.momentum})"
        )
    step = checkpoint.step
    if step is None:
        raise CheckpointError(f"{src}: --keep_optimizer: the checkpoint stores no optimizer step")
    optimizer, _ = make_optimizer(o, config.train.steps)
    shapes = {path: jax.ShapeDtypeStruct(shape, np.float32) for path, _, shape in plan}
    abstract = jax.eval_shape(optimizer.init, unflatten(shapes))
    names = {path: name for path, name, _ in plan}
    table = checkpoint.optimizer_state

    def read(name: str, want: tuple[int, ...]) -> np.ndarray:
        if name not in table:
            raise CheckpointError(f"{src}: --keep_optimizer: missing optimizer state {name}")
        value = table.read(name)
        if tuple(value.shape) != tuple(want):
            raise CheckpointError(
                f"{src}: optimizer state {name} has shape {list(value.shape)} but "
                f"t5x_adafactor keeps {list(want)} (factored with other rules?)"
            )
        return check_finite(value, f"{src}: optimizer state {name}").astype(np.float32)

    def fill(keypath, node):
        if not isinstance(node, optax.FactoredState):
            return np.zeros(node.shape, node.dtype)  # schedule counts and empty states
        path = tuple(k.key for k in keypath if isinstance(k, jax.tree_util.DictKey))
        prefix = f"param_states/{names[path]}"
        momentum = table.shape(f"{prefix}/m") if f"{prefix}/m" in table else (1,)
        if tuple(momentum) != (1,):
            raise CheckpointError(
                f"{src}: {prefix}/m {list(momentum)} is a momentum T5X trained with; "
                "--keep_optimizer keeps momentum-free Adafactor states only"
            )
        return optax.FactoredState(
            count=np.asarray(step, node.count.dtype),
            v_row=read(f"{prefix}/v_row", node.v_row.shape),
            v_col=read(f"{prefix}/v_col", node.v_col.shape),
            v=read(f"{prefix}/v", node.v.shape),
        )

    return jax.tree_util.tree_map_with_path(
        fill, abstract, is_leaf=lambda node: isinstance(node, optax.FactoredState)
    )
