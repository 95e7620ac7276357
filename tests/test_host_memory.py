"""jaxmoe's host allocator settings on the CPU (jaxmoe/parallel/host_memory.py), checked with
the kernel's own count of page faults (getrusage) in fresh processes."""

import json
import os
import subprocess
import sys

import pytest

from jaxmoe.parallel import host_memory

# Mallocs, touches and frees 64 MiB ten times, as XLA:CPU does with a step's temporaries
# (numpy would ask for huge pages, which XLA does not), and prints the minor page faults
# of the last eight rounds.
PROBE = """
import ctypes, ctypes.util, json, resource, sys
from jaxmoe.parallel.host_memory import retain_freed_host_memory
applied = retain_freed_host_memory() if sys.argv[1] == "retain" else None
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
for i in range(10):
    if i == 2:
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(64 * 2**20)
    ctypes.memset(block, 1, 64 * 2**20)
    libc.free(block)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start
print(json.dumps({"applied": applied, "faults_per_round": faults / 8}))
"""


def _probe(mode: str, **env) -> dict:
    environ = {**os.environ, "JAX_PLATFORMS": "cpu", **env}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env=environ, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_retained_memory_is_not_faulted_in_again():
    default = _probe("default")
    retained = _probe("retain")
    assert retained["applied"] is True
    pages = 64 * 2**20 / os.sysconf("SC_PAGE_SIZE")
    if default["faults_per_round"] > pages / 2:  # no transparent huge pages on this host
        # glibc's default returns the block to the kernel: every round faults it in again.
        assert retained["faults_per_round"] < pages / 20, (default, retained)
    else:
        assert retained["faults_per_round"] <= default["faults_per_round"], (default, retained)


def test_opt_out_and_accelerators_leave_glibc_alone(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv(host_memory.OPT_OUT, "default")
    assert host_memory.retain_freed_host_memory() is False
    monkeypatch.delenv(host_memory.OPT_OUT)
    for platforms, expected in (("tpu", False), ("cuda,cpu", False), ("cpu", True)):
        monkeypatch.setenv("JAX_PLATFORMS", platforms)
        assert host_memory.computes_on_cpu() is expected, platforms
