"""Test setup: 8 simulated CPU devices, so every sharding layout runs on one host, and a
persistent XLA compilation cache shared by every test run and by the `jaxmoe ...`
subprocesses the tests start.

Device runs: `pytest -m gpu` (or `-m tpu`, `-m "gpu or tpu"`) on a machine with that
accelerator lets jax see it (the CPU-only default is not set) and runs the tests marked for
it; elsewhere a marked test is skipped with the reason, unless it is marked
`gpu(also_on_cpu=True)`: a test that still checks something on the CPU (a Pallas kernel in
interpret mode, XLA's lowering of jax.nn.dot_product_attention) runs in every lane.
"""

import os
import re
import sys
from pathlib import Path

import pytest

DEVICE_MARKS = ("gpu", "tpu")
# `-m gpu`, `-m tpu`, `-m "gpu or tpu"`: a run for a device. Read from the command line,
# before jax starts, because jax must then be free to pick the accelerator.
DEVICE_RUN = re.compile(r"\s*(gpu|tpu)(\s+or\s+(gpu|tpu))?\s*")
# The device tests' own code, checked on a laptop: JAXMOE_DEVICE_TESTS_ON_CPU=1 runs the
# marked tests on the CPU too (they then compare the CPU with itself; for their authors).
ON_CPU = os.environ.get("JAXMOE_DEVICE_TESTS_ON_CPU") == "1"


def _device_run(args: list[str]) -> bool:
    for i, arg in enumerate(args):
        expr = args[i + 1] if arg == "-m" and i + 1 < len(args) else None
        expr = arg[2:] if arg.startswith("-m") and len(arg) > 2 else expr
        if expr is not None and DEVICE_RUN.fullmatch(expr):
            return True
    return False


# Must be set before jax initialises its backends. pytest-xdist's workers do not see the
# command line: they inherit JAXMOE_DEVICE_RUN from the process that read it.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if _device_run(sys.argv[1:]) or os.environ.get("JAXMOE_DEVICE_RUN") == "1":
    os.environ["JAXMOE_DEVICE_RUN"] = "1"
else:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# Most of the suite's time is XLA compiling the same tiny programs run after run: keep the
# executables on disk (in the work tree, git-ignored). Set through the environment, not
# only jax.config, so subprocesses (`python -m jaxmoe ...`) read and fill the same cache.
# Every compile is kept (the tiny programs compile in well under jax's 1 s default), and
# entries of any size. The cache key covers XLA_FLAGS, so runs with other device counts
# get their own entries.
COMPILE_CACHE = Path(__file__).resolve().parents[1] / ".jax_cache"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(COMPILE_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402  (after the environment above, which jax reads at import)

# jax may already have been imported (a plugin, an earlier conftest): set the options too.
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update(
    "jax_persistent_cache_min_compile_time_secs",
    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
)
jax.config.update(
    "jax_persistent_cache_min_entry_size_bytes",
    int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]),
)

# Session fixtures, imported here so every test module sees them.
from tests.fixtures_checkpoints import saved_dense, trained_dense  # noqa: E402, F401
from tests.fixtures_data import data_cache, embedded_data_cache  # noqa: E402, F401

# Each lane's wall time and slowest tests to a dated JSON (JAXMOE_TEST_TIMES, .ci/run).
from tests.lane_times import (  # noqa: E402, F401
    pytest_runtest_logreport,
    pytest_sessionfinish,
    pytest_sessionstart,
)


def pytest_configure(config):
    """LLVM at -O0 for XLA:CPU's kernels, except in the slow lane (`-m slow`).

    The fast tests' programs are tiny and run a few times each, so compiling them is most of
    their time: at -O0 XLA:CPU compiles ~35% faster (a scanned MoE grad on 8 devices: 9.4 ->
    6.1 s; model init's small programs 8.5 -> 3.9 s) and the losses come out the same (dots
    and reductions run in XLA's libraries, not in the generated code). The slow lane's
    tests train for longer and run processes whose collectives time out when starved, so
    they keep optimised kernels. Added unless the caller chose a level; subprocesses inherit
    it with the rest of XLA_FLAGS. Here, not at import: jax reads XLA_FLAGS when its first
    backend starts, after this hook.
    """
    markexpr = config.getoption("markexpr", "").strip()
    if DEVICE_RUN.fullmatch(markexpr):
        # Device tests compare with float64/f32 references at the CPU's tolerances: f32
        # matmuls in full precision, not TF32 (a GPU's default) or bf16 passes (a TPU's).
        # Their programs run on the device, so XLA:CPU's level is left as it is.
        jax.config.update("jax_default_matmul_precision", "highest")
        return
    if markexpr == "slow":
        return
    if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"


def pytest_runtest_setup(item):
    """A test marked `gpu` or `tpu` runs where jax's backend is that device; elsewhere it
    is skipped, saying why, unless it is marked also_on_cpu=True (or ON_CPU is set)."""
    marks = [m for m in map(item.get_closest_marker, DEVICE_MARKS) if m is not None]
    if not marks or ON_CPU or any(m.kwargs.get("also_on_cpu") for m in marks):
        return
    backend, wanted = jax.default_backend(), [m.name for m in marks]
    if backend not in wanted:
        devices = " or ".join(name.upper() for name in wanted)
        pytest.skip(f"needs a {devices} (jax's backend here is {backend}): pytest -m {wanted[0]}")
