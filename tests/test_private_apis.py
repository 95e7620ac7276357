"""Each private API behind jaxmoe/compat/private_apis.py, exercised for real on tiny inputs:
an upgrade of Orbax, JAX, tfds or lm-eval that moves one or changes what it does fails
here, naming the function, instead of inside a conversion or a multi-host run."""

import argparse
import socket
import subprocess
import sys
import textwrap

import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from etils import epath
from orbax.checkpoint import type_handlers

from jaxmoe.compat import private_apis


def _param_info(parent: epath.Path, name: str, ocdbt: bool) -> type_handlers.ParamInfo:
    return type_handlers.ParamInfo(
        name=name,
        parent_dir=parent,
        is_ocdbt_checkpoint=ocdbt,
        use_zarr3=False,
        ts_context=type_handlers.get_ts_context(use_ocdbt=ocdbt),
    )


@pytest.mark.parametrize("ocdbt", [True, False], ids=["ocdbt", "per_array"])
def test_read_spec_opens_what_orbax_saved(tmp_path, ocdbt):
    """The read spec opens an array Orbax's public API saved, and reads its values and a
    slice of them."""
    values = np.arange(24, dtype=np.float32).reshape(2, 3, 4) * 0.5
    root = epath.Path(tmp_path) / "item"
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt)
    with ocp.Checkpointer(handler) as checkpointer:
        checkpointer.save(root, args=ocp.args.PyTreeSave({"w": values}))
    info = _param_info(root, "w", ocdbt)
    spec = private_apis.orbax_array_read_spec(info)
    store = ts.open(ts.Spec(spec), open=True, context=info.ts_context).result()
    np.testing.assert_array_equal(store.read().result(), values)
    np.testing.assert_array_equal(store[1].read().result(), values[1])


def test_write_spec_has_the_asked_chunks_and_reads_back(tmp_path):
    """An array written through the write spec (per-array layout) has one storage chunk per
    `local_shape` and reads back, through the read spec, as written."""
    values = np.arange(12, dtype=np.int32).reshape(3, 4)
    parent = epath.Path(tmp_path)
    info = _param_info(parent, "w", ocdbt=False)
    spec = private_apis.orbax_array_write_spec(
        info, type_handlers.SaveArgs(), global_shape=(3, 4), local_shape=(1, 4), dtype=values.dtype
    )
    store = ts.open(ts.Spec(spec), create=True, open=True, context=info.ts_context).result()
    assert tuple(store.chunk_layout.write_chunk.shape) == (1, 4)
    for row in range(3):
        store[row].write(values[row]).result()
    read = ts.open(ts.Spec(private_apis.orbax_array_read_spec(info)), open=True).result()
    np.testing.assert_array_equal(read.read().result(), values)


def test_leafwise_save_is_an_orbax_checkpoint(tmp_path):
    """The write spec in its real setting (OCDBT, inside Orbax's save): what
    save_params_leafwise writes piece by piece, Orbax's public restore reads whole."""
    from jaxmoe.checkpoints.leafwise import LazyArray, save_params_leafwise
    from jaxmoe.config.defaults import base_config

    values = np.arange(2 * 3 * 2, dtype=np.float32).reshape(2, 3, 2) - 5.0
    lazy = LazyArray(values.shape, values.dtype, 1, lambda: (((i,), values[i]) for i in range(2)))
    save_params_leafwise(str(tmp_path / "ckpt"), {"w": lazy}, base_config())
    with ocp.PyTreeCheckpointer() as checkpointer:
        restored = checkpointer.restore(tmp_path / "ckpt" / "params")
    np.testing.assert_array_equal(np.asarray(restored["w"]), values)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def test_wait_at_barrier_without_and_with_a_coordination_client():
    """No client before jax.distributed.initialize: False at once; after it (a one-process
    run, in a fresh interpreter), the barrier is waited at and True returned."""
    script = textwrap.dedent(
        f"""
        import jax
        from jaxmoe.compat.private_apis import wait_at_barrier

        assert wait_at_barrier("before", 1000) is False
        jax.distributed.initialize("localhost:{_free_port()}", num_processes=1, process_id=0)
        assert wait_at_barrier("after", 10_000) is True
        jax.distributed.shutdown()
        print("ok")
        """
    )
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_tfds_progress_bar_shown_follows_the_setting():
    tfds = pytest.importorskip("tensorflow_datasets")
    before = private_apis.tfds_progress_bar_shown()
    try:
        tfds.display_progress_bar(False)
        assert private_apis.tfds_progress_bar_shown() is False
        tfds.display_progress_bar(True)
        assert private_apis.tfds_progress_bar_shown() is True
    finally:
        tfds.display_progress_bar(before)


def test_lm_eval_merge_dict_action_parses_model_args():
    pytest.importorskip("lm_eval")
    parser = argparse.ArgumentParser()
    action = private_apis.lm_eval_merge_dict_action()
    parser.add_argument("--model_args", nargs="+", action=action)
    args = parser.parse_args(["--model_args", "max_length=64,pretrained=x", "max_gen_toks=8"])
    assert args.model_args == {"max_length": 64, "pretrained": "x", "max_gen_toks": 8}
    as_json = parser.parse_args(["--model_args", '{"max_length": 32}'])
    assert as_json.model_args == {"max_length": 32}


def test_lm_eval_single_task_kinds_tell_a_task_from_a_group(tmp_path):
    pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    (tmp_path / "one.yaml").write_text(
        "task: one_task\ndataset_path: json\noutput_type: loglikelihood\n"
        "doc_to_text: x\ndoc_to_target: y\n"
    )
    (tmp_path / "group.yaml").write_text("group: a_group\ntask:\n  - one_task\n")
    index = TaskManager(include_path=str(tmp_path), include_defaults=False).task_index
    kinds = private_apis.lm_eval_single_task_kinds()
    assert index["one_task"].kind in kinds
    assert index["a_group"].kind not in kinds
