"""Keep libtpu and JAX's GPU plugins quiet on hosts without a TPU or GPU.

With the `tpu` extra installed, JAX's first backend initialisation loads libtpu to probe
for TPU chips. On a host without one, libtpu prints its own warnings and `E0000 ...
INVALID_ARGUMENT` lines to stderr (written before its logging is set up, so no log level
silences them), and every jaxmoe command would start with them. With the `gpu` extra, JAX's
CUDA plugin fails to start on a host without a GPU and prints a traceback. Where no TPU or
GPU is attached and the user chose no platform, jaxmoe asks JAX for the CPU backend only,
so neither is probed. `jaxmoe compile` still reaches both: it builds compile-only TPU and
GPU devices from topology descriptions, which do not go through backend discovery.
"""

import glob
import importlib.util
import os
from pathlib import Path

# PCI vendor id of Google's TPU chips (what JAX itself looks for under /sys/bus/pci).
_GOOGLE_PCI_VENDOR = "0x1ae0"


def tpu_attached() -> bool:
    """Whether this host has TPU chips: /dev/accel* (v2-v4) or a Google PCI device."""
    if glob.glob("/dev/accel*"):
        return True
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            if Path(vendor).read_text().strip() == _GOOGLE_PCI_VENDOR:
                return True
        except OSError:
            continue
    return False


def gpu_attached() -> bool:
    """Whether this host has a GPU a driver serves: /dev/nvidiaN (NVIDIA) or /dev/kfd (AMD)."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")


def gpu_plugin_installed() -> bool:
    """A JAX GPU plugin is installed: leave platform discovery to JAX then."""
    names = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm6_plugin", "jax_rocm7_plugin")
    return any(importlib.util.find_spec(name) is not None for name in names)


def skip_absent_tpu() -> bool:
    """Restrict JAX to the CPU backend when libtpu or a GPU plugin is installed but neither a
    TPU nor a GPU is attached, and neither JAX_PLATFORMS nor JAX_FORCE_TPU_INIT says
    otherwise. Must run before JAX initialises its backends (the first jax.devices() or
    computation). True if it did."""
    if os.environ.get("JAX_PLATFORMS") or "JAX_FORCE_TPU_INIT" in os.environ:
        return False
    libtpu, gpu_plugin = importlib.util.find_spec("libtpu") is not None, gpu_plugin_installed()
    if not (libtpu or gpu_plugin):
        return False
    if (libtpu and tpu_attached()) or (gpu_plugin and gpu_attached()):
        return False
    import jax

    jax.config.update("jax_platforms", "cpu")
    return True
