"""Which host a result was measured on: CPU model, vector extensions, cores, library versions.

Every result JSON carries this under "host" (results.write_json adds it), so a table can
say which machine its numbers belong to: the same code runs 2x apart between an AVX2 EPYC
and an AVX-512/AMX Xeon of the same core count. Standard library only, and no framework is
imported (versions come from package metadata): workers run under other interpreters and
must not pull in JAX or torch just to describe the host.
"""

import importlib.metadata
import os
import platform
from pathlib import Path

# The extensions that decide XLA:CPU's and PyTorch's kernels: AVX2, AVX-512 foundation, AMX.
VECTOR_FLAGS = ("avx2", "avx512f", "amx_tile")
LIBRARIES = ("jax", "jaxlib", "torch", "transformers")
CPUINFO = Path("/proc/cpuinfo")


def cpuinfo_fields(text: str) -> dict[str, str]:
    """The first processor's `key : value` lines of /proc/cpuinfo."""
    fields = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the blank line after the first processor
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_description(text: str | None = None) -> dict:
    """CPU model and which of VECTOR_FLAGS it has, from /proc/cpuinfo text (None: read it)."""
    if text is None:
        try:
            text = CPUINFO.read_text()
        except OSError:  # not Linux: the model from platform, extensions unknown
            return {"cpu_model": platform.processor() or None, "vector_extensions": None}
    fields = cpuinfo_fields(text)
    flags = set(fields.get("flags", "").split())
    return {
        "cpu_model": fields.get("model name") or platform.processor() or None,
        "vector_extensions": [flag for flag in VECTOR_FLAGS if flag in flags],
    }


def library_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def usable_cores() -> int | None:
    """Cores this process may run on (a container or taskset can allow fewer than exist)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity outside Linux
        return None


def host_info() -> dict:
    """The "host" record of a result JSON."""
    return {
        **cpu_description(),
        "cpu_count": os.cpu_count(),
        "affinity_cores": usable_cores(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "versions": {name: library_version(name) for name in LIBRARIES},
    }
