"""The launch scripts: the TPU dry run prints the right sequence; local.sh reports failures."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pod_dry_run(*flags: str, job=("--config.mesh.fsdp=64",)) -> list[str]:
    """The `+ command` lines of a tpu_pod.sh dry run of a train job on slice `moe`."""
    result = subprocess.run(
        ["bash", "launch/tpu_pod.sh", "--name", "moe", "--zone", "us-east5-a",
         "--accelerator", "v5p-128", *flags, "--dry_run", "--", "train", "--config",
         "configs/default.py", "--workdir", "gs://bucket/run", *job],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if line.startswith("+ ")]


def test_tpu_pod_dry_run_prints_the_command_sequence():
    lines = pod_dry_run()
    assert lines[0].startswith("+ jaxmoe compile --config configs/default.py --topology v5p-128")
    assert "--config.mesh.fsdp=64" in lines[0]
    assert "tpu-vm create moe --zone us-east5-a --accelerator-type v5p-128" in lines[1]
    assert "--version v2-alpha-tpuv5" in lines[1]
    assert "pip wheel" in lines[2]
    assert "tpu-vm scp" in lines[3] and "--worker=all" in lines[3]
    assert "tpu-vm ssh moe --worker=all" in lines[4] and "tpu" in lines[4]
    assert "tpu-vm ssh moe --worker=all" in lines[5]
    assert (
        "jaxmoe\\ train\\ --config\\ configs/default.py\\ --workdir\\ gs://bucket/run" in lines[5]
    )


def test_local_launcher_returns_first_failure():
    result = subprocess.run(
        [
            "bash",
            "launch/local.sh",
            "2",
            "--",
            "train",
            "--workdir",
            "/tmp/x",
            "--config.train.stepz=3",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "unknown config key 'train.stepz'" in result.stdout


def test_tpu_pod_multislice_dry_run_uses_a_queued_resource():
    lines = pod_dry_run("--num_slices", "2", job=())
    assert "--topology v5p-128 --num_slices 2" in lines[0]  # the same preflight, both slices
    assert "queued-resources create moe" in lines[1] and "--node-count 2" in lines[1]
    assert "--node-prefix moe" in lines[1] and "--accelerator-type v5p-128" in lines[1]
    runs = [line for line in lines if "jaxmoe\\ train" in line]
    assert [line.split()[6] for line in runs] == ["moe-0", "moe-1"]  # every slice runs it


def test_gpu_launcher_installs_a_cuda_jax():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    gpu = extras["optional-dependencies"]["gpu"]
    assert any(req.startswith("jax[cuda") for req in gpu), gpu
    script = (ROOT / "launch" / "gpu_slurm.sbatch").read_text()
    assert 'pip" install -q -e "$here[gpu]"' in script
    assert "platform == 'gpu'" in script or "p == 'gpu'" in script
