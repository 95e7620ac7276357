"""Every private API of another library jaxmoe uses, behind a small named function.

Each one is used because no public API does the job (said at each function); each is
exercised for real by tests/test_private_apis.py, so an upgrade that moves or changes one
fails there, naming it, instead of deep inside a conversion or a multi-host run.
Each library is imported only when its function is called (Orbax and tfds are slow to
import; tfds and lm-eval are optional).
"""

import contextlib
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


def cuda_library_versions() -> dict[str, tuple[int, ...]] | None:
    """The CUDA runtime ((major, minor)) and cuDNN ((major, minor, patch)) versions JAX's
    installed CUDA plugin loads, without a GPU or a driver; None without the plugin. A
    compile-only GPU description must name them (aot/gpu_topologies.py): the compiler
    builds cuDNN's fused kernels with that library. JAX asks the same module
    (jax._src.lib.cuda_versions) before it runs cuDNN attention; no public API reports it."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return None
    if cuda_versions is None:
        return None
    runtime, cudnn = cuda_versions.cuda_runtime_get_version(), cuda_versions.cudnn_get_version()
    return {
        "cuda_runtime": (runtime // 1000, runtime % 1000 // 10),
        "cudnn": (cudnn // 10000, cudnn % 10000 // 100, cudnn % 100),
    }


@contextlib.contextmanager
def cudnn_attention_for(compute_capability: tuple[int, int]):
    """Inside, jax's cuDNN attention wrapper judges what cuDNN takes (head widths up to 256
    from Hopper on, MLA's widths, packed sequences) as on a GPU of `compute_capability`.

    It asks the local GPU (jax._src.cudnn.fused_attention_stablehlo's capability checks),
    so on a host without one (`jaxmoe compile` for a GPU cluster) it answers "not Hopper"
    and refuses head widths over 128 that the target GPU takes. No public API says which GPU
    a trace is for. Only for tracing: the checks are restored on exit.
    """
    from jax._src.cudnn import fused_attention_stablehlo as fused

    def parse(capability: str) -> tuple[int, ...]:
        return tuple(int(part) for part in capability.split("."))

    saved = fused.check_compute_capability, fused.is_cuda_compute_capability_equal
    fused.check_compute_capability = lambda capability: compute_capability >= parse(capability)
    fused.is_cuda_compute_capability_equal = lambda capability: (
        compute_capability == parse(capability)
    )
    try:
        yield
    finally:
        fused.check_compute_capability, fused.is_cuda_compute_capability_equal = saved
