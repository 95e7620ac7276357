"""The README's own commands, as a new user types them: a copy of the repository in a
directory whose name has a space, relative paths, a fresh HOME (so `~/.cache` starts empty),
shortened only by appended `--config.train.*` overrides."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SHORTER = [
    "--config.train.steps=4",
    "--config.train.checkpoint_every=2",
    "--config.train.eval_batches=2",
    "--no_progress",
]


def readme_command(prefix: str) -> list[str]:
    """The first README line running `prefix`, from `jaxmoe` on, as argv."""
    for line in README.splitlines():
        if prefix in line:
            command = line[line.index(prefix) :].split("&&")[0]
            return shlex.split(command)
    raise AssertionError(f"the README has no line with {prefix!r}")


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """The tracked files of the repository, copied as a fresh clone would lay them out."""
    root = tmp_path_factory.mktemp("fresh") / "my clone"
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, files):
        source = ROOT / name.decode()
        if source.is_file():
            target = root / name.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
    (root / "home").mkdir()
    return root


def run(clone: Path, argv: list[str]) -> subprocess.CompletedProcess:
    assert argv[0] == "jaxmoe"
    env = {
        **os.environ,
        "HOME": str(clone / "home"),
        "PYTHONPATH": str(clone),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
    }
    return subprocess.run(
        [sys.executable, "-m", "jaxmoe", *argv[1:]],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_readme_first_command_then_eval_and_decode(clone):
    train = readme_command("jaxmoe train --config configs/default.py --workdir runs/default")
    assert "runs/default" in train  # relative, as users type it
    result = run(clone, train + SHORTER)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: step 4, eval loss" in result.stdout
    checkpoints = clone / "runs" / "default" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["2", "4"]
    assert (clone / "home" / ".cache" / "jaxmoe").is_dir()  # `~` as the default cache
    assert not (clone / "runs" / "default" / ".lock").exists()  # released at the end

    evaluate = run(clone, readme_command("jaxmoe eval --checkpoint runs/default --data embedded"))
    assert evaluate.returncode == 0, evaluate.stderr[-3000:]
    assert '"loss"' in evaluate.stdout.splitlines()[-1]

    decode = run(
        clone,
        [
            "jaxmoe",
            "decode",
            "--checkpoint",
            "runs/default",
            "--prompt",
            "The",
            "--max_new_tokens",
            "4",
        ],
    )
    assert decode.returncode == 0, decode.stderr[-3000:]
    assert '"new_tokens": 4' in decode.stdout


def test_relative_paths_with_spaces_for_converters_and_init_from(clone):
    if not (clone / "runs" / "default" / "checkpoints" / "4").exists():
        pytest.skip("needs the README run of the test above")
    gqa = run(
        clone, ["jaxmoe", "convert", "gqa", "runs/default", "runs/gqa one", "--num_kv_heads=1"]
    )
    assert gqa.returncode == 0, gqa.stderr[-3000:]
    assert (clone / "runs" / "gqa one" / "params").is_dir()
    (clone / "ex.jsonl").write_text('{"text": "The quick brown fox."}\n')
    evaluate = run(
        clone, ["jaxmoe", "eval", "--checkpoint", "runs/gqa one", "--data", "jsonl:ex.jsonl"]
    )
    assert evaluate.returncode == 0, evaluate.stderr[-3000:]
    # `~` inside a config value, and train.init_from relative to the current directory.
    tilde = run(
        clone,
        [
            "jaxmoe",
            "train",
            "--workdir",
            "~/uptrain run",
            "--config.model.num_kv_heads=1",
            "--config.train.init_from=runs/gqa one",
            "--config.train.steps=1",
            "--config.train.eval_batches=1",
            "--no_progress",
        ],
    )
    assert tilde.returncode == 0, tilde.stderr[-3000:]
    assert (clone / "home" / "uptrain run" / "checkpoints" / "1").is_dir()
