"""Environment variables jaxmoe and JAX read are checked where they are read: a bad value
is one line naming the variable, not an `int()` error, XLA's abort with its 93-line flag
list, a backend's traceback, or an OSError traceback at the first batch."""

import pytest

from jaxmoe.cli import main
from jaxmoe.data.multihost import TracedBatches
from jaxmoe.errors import ConfigError
from jaxmoe.parallel.distributed import cluster_detected, initialize
from jaxmoe.parallel.platforms import gpu_plugin_installed, tpu_attached

EVAL = ["eval", "--checkpoint", "/nowhere", "--data", "embedded"]  # never opened


def one_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    return err[0]


def test_xla_device_count_that_is_not_a_number(capsys, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=abc")
    assert one_line(capsys, EVAL) == (
        "jaxmoe eval: error: XLA_FLAGS: '--xla_force_host_platform_device_count=abc': the "
        "simulated CPU device count must be a positive integer (e.g. "
        "--xla_force_host_platform_device_count=8)"
    )


@pytest.mark.skipif(gpu_plugin_installed(), reason="a JAX GPU plugin is installed here")
def test_jax_platforms_naming_a_gpu_without_its_plugin(capsys, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert one_line(capsys, EVAL) == (
        "jaxmoe eval: error: JAX_PLATFORMS='cuda': cuda: no JAX GPU plugin is installed (e.g. "
        "pip install 'jax[cuda12]'); unset JAX_PLATFORMS to use what this host has, or set it "
        "to cpu"
    )


@pytest.mark.skipif(tpu_attached(), reason="this host has a TPU")
def test_jax_platforms_naming_a_tpu_on_a_host_without_one(capsys, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    assert one_line(capsys, EVAL) == (
        "jaxmoe eval: error: JAX_PLATFORMS='tpu': tpu: no TPU is attached to this host; unset "
        "JAX_PLATFORMS to use what this host has, or set it to cpu"
    )


@pytest.mark.parametrize(
    "env, line",
    [
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "many"},
         "environment variable SLURM_NTASKS='many' is not a whole number"),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "JAXMOE_INIT_TIMEOUT": "soon"},
         "environment variable JAXMOE_INIT_TIMEOUT='soon' is not a whole number"),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "JAXMOE_INIT_TIMEOUT": "0"},
         "environment variable JAXMOE_INIT_TIMEOUT=0 must be >= 1"),
    ],
)  # fmt: skip
def test_cluster_variables_are_named(monkeypatch, env, line):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as refused:
        initialize()
    assert str(refused.value) == line


def test_one_slurm_task_is_no_cluster(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert not cluster_detected()


def test_data_trace_folder_that_cannot_be_written(tmp_path):
    (tmp_path / "file").write_text("x")
    folder = tmp_path / "file" / "trace"
    with pytest.raises(ConfigError) as refused:
        TracedBatches(iter([]), str(folder), 0)
    assert str(refused.value) == (
        f"JAXMOE_DATA_TRACE={str(folder)!r}: cannot write {folder}/rows_0.jsonl (Not a "
        f"directory); unset it or name a writable folder"
    )
