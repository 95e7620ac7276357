"""Environment variables that jaxmoe and JAX read at start-up, checked before JAX starts.

A bad value is one line naming the variable, instead of a bare `int()` error, XLA's abort
with its whole flag list (a bad `XLA_FLAGS` device count), or a backend's traceback (a
`JAX_PLATFORMS` this host cannot serve).
"""

import os
import re

from jaxmoe.errors import ConfigError
from jaxmoe.parallel.platforms import gpu_plugin_installed, tpu_attached

_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count(?:=(\S*))?")
_GPU_PLATFORMS = {"cuda", "gpu", "rocm"}


def env_int(name: str, default: int, minimum: int = 1) -> int:
    """Integer environment variable `name` (`default` when unset or empty); ConfigError
    naming it when it is not a whole number >= `minimum`."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"environment variable {name}={text!r} is not a whole number") from None
    if value < minimum:
        raise ConfigError(f"environment variable {name}={value} must be >= {minimum}")
    return value


def check_xla_flags() -> None:
    """XLA_FLAGS' simulated CPU device count must be a positive integer: XLA aborts the
    process on anything else, printing every flag it knows."""
    for match in _DEVICE_COUNT.finditer(os.environ.get("XLA_FLAGS", "")):
        value = match.group(1)
        if value is None or not value.isdigit() or int(value) < 1:
            raise ConfigError(
                f"XLA_FLAGS: {match.group(0)!r}: the simulated CPU device count must be a "
                f"positive integer (e.g. --xla_force_host_platform_device_count=8)"
            )


def check_platforms() -> None:
    """Each platform JAX_PLATFORMS names must be one this host can start: a TPU needs
    libtpu and attached chips, a GPU a JAX GPU plugin. Names JAX does not know are left to
    JAX, which refuses them in one line."""
    requested = [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    for platform in requested:
        problem = None
        if platform == "tpu" and not tpu_attached():
            problem = "no TPU is attached to this host"
        elif platform in _GPU_PLATFORMS and not gpu_plugin_installed():
            problem = "no JAX GPU plugin is installed (e.g. pip install 'jax[cuda12]')"
        if problem:
            raise ConfigError(
                f"JAX_PLATFORMS={os.environ['JAX_PLATFORMS']!r}: {platform}: {problem}; "
                f"unset JAX_PLATFORMS to use what this host has, or set it to cpu"
            )


def check_environment(platforms: bool = True) -> None:
    """The checks above: the CLI calls them before any backend starts (`env_int` values are
    checked where they are read)."""
    check_xla_flags()
    if platforms:
        check_platforms()
