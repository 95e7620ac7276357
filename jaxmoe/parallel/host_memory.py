"""Keep freed host memory in the process when XLA computes on the CPU.

XLA:CPU allocates each step's temporaries with malloc and frees them when the step ends.
glibc hands blocks over 32 MiB (and every block of a worker thread's arena) back to the
kernel on free, so the next step touches fresh pages again: on the 2-core benchmark host a
top-2 step of configs/tiny_mixtral.py took 91,000 page faults and 140 ms of kernel time for
about 620 ms of compute. Four mallopt settings keep those pages: one arena for all threads,
no mmap'd blocks, no trimming of the heap's top, and 64 MiB of slack when it grows. Then a
step takes about 15,000 faults and 23 ms of kernel time
(docs/results/2026-12-01_train_throughput.md).

The cost is that memory freed once stays with the process, so its resident size is its
peak. That is what a compute loop wants, and not what a converter streaming a checkpoint
tensor by tensor wants, so only computing commands call this, and only on the CPU.
"""

import ctypes
import ctypes.util
import importlib.util
import logging
import os
import sys

from jaxmoe.parallel.platforms import gpu_plugin_installed

log = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

_SETTINGS = (
    (_M_ARENA_MAX, 1),  # worker threads' arenas are mmap'd heaps that shrink on free
    (_M_MMAP_MAX, 0),  # large blocks come from the heap, so freeing them keeps the pages
    (_M_TRIM_THRESHOLD, 2**31 - 1),  # never give the heap's top back (mallopt takes an int)
    (_M_TOP_PAD, 64 * 2**20),  # grow the heap in 64 MiB steps
)

OPT_OUT = "JAXMOE_HOST_MALLOC"  # set to "default" to leave glibc's settings alone


def computes_on_cpu() -> bool:
    """Whether JAX will run on the CPU here, judged before any backend starts (the settings
    only reach threads that have not allocated yet)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    if "jax" in sys.modules:
        import jax

        # skip_absent_tpu may have chosen the CPU (jax's flags are untyped attributes)
        chosen = jax.config.jax_platforms  # type: ignore[attr-defined]
        if chosen:
            return chosen.split(",")[0].strip() == "cpu"
    return importlib.util.find_spec("libtpu") is None and not gpu_plugin_installed()


def retain_freed_host_memory() -> bool:
    """Apply the settings above when JAX computes on the CPU under glibc; True if applied."""
    if os.environ.get(OPT_OUT) == "default" or not sys.platform.startswith("linux"):
        return False
    if not computes_on_cpu():
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # musl and other C libraries: no mallopt
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    applied = all(mallopt(param, value) == 1 for param, value in _SETTINGS)
    if not applied:
        log.debug("mallopt refused some of %s", _SETTINGS)
    return applied
