"""MaxText's train_compile for an NVIDIA GPU cluster on a host without a GPU, on the same
compile-only devices `jaxmoe compile` uses. Run in MaxText's own venv (Python 3.12 with
`maxtext[tpu]==0.2.5` and `jax[cuda13]`; the tpu extra only brings MaxText's Python
dependencies), with this checkout on PYTHONPATH; benchmarks/pod_compile_peer.py starts it:

    python -m benchmarks.maxtext_gpu_compile h100-32 model_name=mixtral-8x7b ...

MaxText's GPU path (`compile_topology=a3`) takes its devices from `jax.devices()`, so it
needs the GPUs themselves. Here its topology mesh is built instead from jaxmoe's
compile-only devices for the named cluster (jaxmoe/aot/gpu_topologies.py: the GPU
description and layout `jaxmoe compile` compiles for), laid out by MaxText's own
`create_device_mesh`; the rest of `train_compile.main` runs as released. As for `jaxmoe
compile`, jax's cuDNN attention checks answer for the target GPU while MaxText traces
(a host without a GPU would otherwise refuse head widths over 128, such as MLA's 192).
MaxText sizes its global batch by one 8-GPU a3 slice, so `per_device_batch_size` must be
the sequences per GPU times the number of nodes.
"""

import os
import sys

# Before JAX starts: no GPU to probe here, and the CUDA plugin's check of its libraries
# against a driver's would fail without one.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def main(argv: list[str]) -> None:
    import jax
    import maxtext
    from jax.sharding import AxisType, Mesh
    from maxtext.common.common_types import ShardMode
    from maxtext.trainers.pre_train import train_compile
    from maxtext.utils import maxtext_utils

    from jaxmoe.aot.gpu_topologies import gpu_topology_devices, parse_gpu_topology
    from jaxmoe.compat.private_apis import cudnn_attention_for

    name, *settings = argv
    topology = parse_gpu_topology(name)
    devices = gpu_topology_devices(topology)

    def topology_mesh(config):  # MaxText's get_topology_mesh, these devices in its place
        jax.config.update(
            "jax_remove_size_one_mesh_axis_from_type", config.remove_size_one_mesh_axis_from_type
        )
        grid = maxtext_utils.create_device_mesh(config, devices)
        kind = AxisType.Explicit if config.shard_mode == ShardMode.EXPLICIT else AxisType.Auto
        return Mesh(grid, config.mesh_axes, axis_types=(kind,) * len(config.mesh_axes))

    train_compile.get_topology_mesh = topology_mesh
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    fixed = ["compile_topology=a3", "compile_topology_num_slices=1", "hardware=gpu"]
    fixed += ["run_name=aot", "dataset_type=synthetic"]
    with cudnn_attention_for(topology.gpu.compute_capability):
        train_compile.main(["train_compile", base, *fixed, *settings])


if __name__ == "__main__":
    main(sys.argv[1:])
