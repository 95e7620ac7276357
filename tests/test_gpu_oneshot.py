"""`benchmarks/gpu/run.sh --dry-run` end to end on the CPU (issue 29, item 3), against an
environment holding only the GPU image's package set plus a wheel folder.

Built without network: the image's set is this venv's closure of IMAGE (their installed
requirements, walked with their extras); every other module outside the standard library is
blocked (tests/import_blocker, JAXMOE_ALLOW_ONLY) unless it comes from run.sh's private
--target folder. The wheel folder holds a wheel of this checkout (`pip wheel --no-deps`)
and, for each package jaxmoe needs that the image lacks, a wheel repacked from its installed
files (pure Python only). So the run proves that the folder alone completes the image.
"""

import base64
import hashlib
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
BLOCKER = ROOT / "tests" / "import_blocker"
IMAGE = (
    *("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "tensorstore", "sentencepiece"),
    *("tokenizers", "torch", "transformers", "pip"),
)
# What the image lacks and the run imports (benchmarks/gpu/fetch_wheels.py fetches the same
# from PyPI for the real target).
LACKING = ("ml-collections", "importlib-resources")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots) -> set[str]:
    """Installed distributions reachable from `roots` through their requirements."""
    seen, todo = {}, [(canonical(r), frozenset()) for r in roots]
    while todo:
        name, extras = todo.pop()
        if extras <= seen.get(name, frozenset()) and name in seen:
            continue
        seen[name] = seen.get(name, frozenset()) | extras
        try:
            requires = md.distribution(name).requires or []
        except md.PackageNotFoundError:
            continue  # an optional platform dependency not installed here
        for line in requires:
            req = Requirement(line)
            envs = [{"extra": e} for e in ("", *seen[name])]
            if req.marker is None or any(Marker(str(req.marker)).evaluate(e) for e in envs):
                todo.append((canonical(req.name), frozenset(req.extras)))
    return set(seen)


def top_level_modules(name: str) -> set[str]:
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        return set()
    listed = (dist.read_text("top_level.txt") or "").split()
    if listed:
        return set(listed)
    found = set()
    for file in dist.files or []:
        first = file.parts[0]
        if first.endswith(".dist-info") or first in ("..", "__pycache__"):
            continue
        found.add(first.split(".")[0])
    return found


def repack_installed(name: str, folder: Path) -> Path:
    """A wheel of an installed pure-Python distribution, from its own installed files."""
    dist = md.distribution(name)
    files = [
        f
        for f in dist.files
        if "__pycache__" not in f.parts
        and f.suffix != ".pyc"
        and f.name not in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json")
        and f.parts[0] != ".."
    ]
    assert not [f for f in files if f.suffix in (".so", ".pyd")], f"{name} is not pure Python"
    info = next(f.parts[0] for f in files if f.parts[0].endswith(".dist-info"))
    stem = info.removesuffix(".dist-info")
    wheel = folder / f"{stem}-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for f in files:
            data = Path(dist.locate_file(f)).read_bytes()
            archive.writestr(str(f), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{f},sha256={digest.decode()},{len(data)}")
        record.append(f"{info}/RECORD,,")
        archive.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return wheel


@pytest.fixture(scope="module")
def wheel_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("wheels")
    build = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps"),
            *("--no-build-isolation", "--no-index", "-w", str(folder), str(ROOT)),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if build.returncode:
        pytest.skip(f"no jaxmoe wheel without network: {build.stderr.strip().splitlines()[-1]}")
    image = closure(IMAGE)
    for name in sorted(closure(LACKING) - image):
        repack_installed(name, folder)
    (folder / "manifest.json").write_text(json.dumps({"built_by": "tests/test_gpu_oneshot"}))
    return folder


def image_env(site: Path, report: Path) -> dict:
    allowed = set()
    for name in closure(IMAGE):
        allowed |= top_level_modules(name)
    env = dict(os.environ, PYTHONPATH=str(BLOCKER), JAXMOE_ALLOW_ONLY=",".join(sorted(allowed)))
    env |= {"JAXMOE_ALLOW_UNDER": str(site), "JAXMOE_IMPORTS_REPORT": str(report)}
    env.pop("JAXMOE_BLOCK", None)
    return env


def test_closure_walks_extras():
    # orbax-checkpoint asks for etils[epath,epy]: their requirements are in the image too.
    assert {"etils", "fsspec", "zipp"} <= closure(["orbax-checkpoint"])
    assert "ml-collections" not in closure(IMAGE)


@pytest.mark.slow
def test_run_sh_dry_run_in_the_image_set(wheel_folder, tmp_path):
    site, report = tmp_path / "site", tmp_path / "imports"
    report.mkdir()
    out = tmp_path / "oneshot.json"
    command = ["bash", str(ROOT / "benchmarks" / "gpu" / "run.sh"), "--dry-run"]
    command += ["--wheels", str(wheel_folder), "--site", str(site), "--out", str(out)]
    env = image_env(site, report) | {"PYTHON": sys.executable}
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-4000:])
    result = json.loads(out.read_text())
    assert Path(result["jaxmoe_from"]).resolve().is_relative_to(site.resolve())
    assert len(result["equality"]["losses"]["cpu"]) == 5
    assert all(2.0 < loss < 10.0 for loss in result["equality"]["losses"]["cpu"])
    for name, row in result["models"].items():
        assert 2.0e9 < row["parameters"] < 3.0e9, (name, row["parameters"])
    assert "| dense |" in run.stdout and "CPU side of the equality check" in run.stdout
    # The attention check ran jax.nn.dot_product_attention (XLA's lowering on the CPU; the
    # GPU run's is cuDNN's) against jaxmoe's XLA path.
    attention = result["attention"]
    assert attention["kernel"] == "dot_product_attention" and attention["passed"], attention
    assert "attention dot_product_attention (xla)" in run.stdout
    # The preflight of the tiny model needs JAX's CUDA plugin, which the image set here lacks.
    assert result["aot_prediction_tiny"] == {"skipped": "JAX's CUDA plugin is not installed"}
    # The blocker saw the run: no data or metrics package was imported from anywhere.
    (imported,) = [
        set(p.read_text().split())
        for p in report.glob("modules-*.txt")
        if "jaxmoe" in p.read_text().split()
    ]
    assert {"jax", "torch", "transformers", "ml_collections"} <= imported
    assert not imported & {"grain", "tensorflow_datasets", "array_record", "tensorboardX"}


def test_measured_peak_against_the_preflight():
    """The GPU's peak counter never resets: a model's measured peak is its own only where
    the counter rose during its steps."""
    from benchmarks.gpu.oneshot import memory_check, preflight_lines

    predicted = {"topology": "h200-1", "peak_hbm_bytes": 40 * 2**30}
    own = memory_check(predicted, {"peak_bytes_in_use": 2**30}, {"peak_bytes_in_use": 44 * 2**30})
    assert own == {"measured_peak_bytes": 44 * 2**30, "peak_set_here": True,
                   "measured_over_predicted": 1.1}  # fmt: skip
    earlier = memory_check(predicted, {"peak_bytes_in_use": 50}, {"peak_bytes_in_use": 50})
    assert earlier["peak_set_here"] is False
    rows = {"dense": {"jaxmoe": {"aot_prediction": predicted, "memory": own}}}
    (line,) = preflight_lines({"models": rows})
    assert line == "preflight dense (h200-1): predicted 40.00 GiB, measured 44.00 GiB"


@pytest.mark.slow
def test_device_tests_import_in_the_image_set(wheel_folder, tmp_path):
    """The lent GPU's second command (docs/testing.md): after run.sh filled --site, `pytest -m
    gpu` on the device tests, from a checkout, imports nothing the image and the folder lack.
    JAXMOE_DEVICE_TESTS_ON_CPU=1 runs them on this CPU (they compare the CPU with itself here:
    what this checks is the imports and the selection)."""
    site, report = tmp_path / "site", tmp_path / "imports"
    report.mkdir()
    command = ["bash", str(ROOT / "benchmarks" / "gpu" / "run.sh"), "--dry-run"]
    command += ["--wheels", str(wheel_folder), "--site", str(site), "--out", str(tmp_path / "o")]
    env = image_env(site, report) | {"PYTHON": sys.executable}
    assert subprocess.run(command, cwd=tmp_path, env=env, capture_output=True).returncode == 0
    allowed = set(env["JAXMOE_ALLOW_ONLY"].split(","))
    for name in closure(["pytest"]):  # the image holds pytest (not in IMAGE's closure here)
        allowed |= top_level_modules(name)
    env |= {"JAXMOE_ALLOW_ONLY": ",".join(sorted(allowed)), "JAXMOE_DEVICE_TESTS_ON_CPU": "1"}
    env |= {"PYTHONPATH": f"{site}:{BLOCKER}", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    env |= {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache")}
    # The checkout's packages (the device gets the working tree), not its .venv.
    env["JAXMOE_ALLOW_UNDER"] += "".join(f":{ROOT / d}" for d in ("tests", "jaxmoe", "benchmarks"))
    env |= {"JAXMOE_TEST_TIMES": str(tmp_path / "times"), "JAXMOE_TEST_LANE": "gpu"}
    tests = ["tests/test_on_device.py", "tests/test_moe.py", "tests/test_tpu_kernels.py"]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *tests],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    # Two device tests and test_moe's layer cases; no TPU-only test.
    assert re.search(r"\b9 passed, \d+ deselected", run.stdout), run.stdout[-1000:]
    (times,) = (tmp_path / "times").glob("*-tests-gpu.json")  # the device lane's own times
    assert json.loads(times.read_text())["outcomes"] == {"passed": 9}
