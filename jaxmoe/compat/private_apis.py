"""Every private API of another library jaxmoe uses, behind a small named function.

Each one is used because no public API does the job (said at each function); each is
exercised for real by tests/test_private_apis.py, so an upgrade that moves or changes one
fails there, naming it, instead of deep inside a conversion or a multi-host run.
Each library is imported only when its function is called (Orbax and tfds are slow to
import; tfds and lm-eval are optional).
"""

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # importing Orbax is slow: only the functions that need it do
    from orbax.checkpoint.type_handlers import ParamInfo, SaveArgs


def orbax_array_write_spec(
    info: "ParamInfo",
    arg: "SaveArgs",
    *,
    global_shape: tuple[int, ...],
    local_shape: tuple[int, ...],
    dtype: np.dtype,
) -> dict[str, Any]:
    """The TensorStore spec (JSON) Orbax itself writes array `info` with, its storage
    chunks `local_shape`: a type handler writing an array piece by piece then produces an
    ordinary Orbax checkpoint. Orbax's public handlers only write whole arrays."""
    from orbax.checkpoint._src.serialization import ocdbt_utils, tensorstore_utils

    use_ocdbt = bool(info.is_ocdbt_checkpoint)
    spec = tensorstore_utils.build_array_write_spec(
        info=info,
        arg=arg,
        global_shape=tuple(global_shape),
        local_shape=tuple(local_shape),
        dtype=dtype,
        use_ocdbt=use_ocdbt,
        process_index=ocdbt_utils.get_process_index_for_subdir(use_ocdbt=use_ocdbt),
    )
    return spec.json


def orbax_array_read_spec(info: "ParamInfo") -> dict[str, Any]:
    """The TensorStore spec (JSON) Orbax reads array `info` of a saved item with (OCDBT or
    per-array directories, zarr v2 or v3): opened directly, one slice can be read without
    restoring the whole array, which Orbax's public restore always does."""
    from orbax.checkpoint._src.serialization import tensorstore_utils

    use_ocdbt = bool(info.is_ocdbt_checkpoint)
    return tensorstore_utils.build_array_read_spec(info, use_ocdbt=use_ocdbt).json


def wait_at_barrier(name: str, timeout_ms: int) -> bool:
    """Wait at the coordination service's barrier `name`; False (at once) when this
    process has no coordination client (jax.distributed not initialized). JAX's public
    `multihost_utils.sync_global_devices` has no timeout: a dead host would hang the rest."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        return False
    client.wait_at_barrier(name, int(timeout_ms))
    return True


def tfds_progress_bar_shown() -> bool:
    """Whether tfds shows its progress bars now (`tfds.display_progress_bar` sets it and
    has no getter): restored after a build that silences them."""
    import tensorflow_datasets as tfds

    return bool(getattr(tfds.core.utils.tqdm_utils, "_active", True))


def lm_eval_merge_dict_action() -> type:
    """lm-eval's argparse action for `--model_args` (key=value lists or JSON): parsing the
    flag exactly as lm-eval will, before lm-eval loads its tasks."""
    from lm_eval._cli.utils import MergeDictAction

    return MergeDictAction


def lm_eval_single_task_kinds() -> tuple:
    """The kinds of lm-eval task-index entries that are one task (a YAML task or a Python
    task class), not a group or a tag: whether `--tasks` names only such tasks decides if
    lm-eval's built-in index may be skipped. TaskManager's public API lists names, not kinds."""
    from lm_eval.tasks._index import Kind

    return (Kind.TASK, Kind.PY_TASK)
