"""Which platform a traced computation is for, where kernels are chosen per platform."""

import jax


def mesh_platform() -> str:
    """ "cpu" | "gpu" | "tpu": the platform of the mesh set by `jax.set_mesh` (also inside
    `jax.jit`), else the default backend. A CPU step traced in a process whose default
    backend is a GPU (the one-shot GPU run's CPU side) thus gets the CPU's kernels, and an
    ahead-of-time TPU compile the TPU's."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    platform = getattr(device, "platform", None) or jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm") else platform
