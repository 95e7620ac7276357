"""MaxText's side of `train_throughput`: a worker that never imports jaxmoe or torch.

Runs under MaxText's own interpreter (its venv has its own JAX), on one CPU device, from
the repository root (`-m` finds this package there; the package imports no JAX):
    JAX_PLATFORMS=cpu ~/.cache/maxtext_venv/bin/python -m benchmarks.throughput_maxtext \
        --peer top2 --spec JSON [--batches N] [--moe ragged|dense]
(driven over stdin/stdout by train_throughput.py; see worker_protocol.py)

The model is MaxText's own: its `mixtral` decoder block (8 SwiGLU experts, softmax over the
top-k router logits, i.e. Mixtral's renormalised top-2; weight 1 at top-1) or `llama2` for
:dense, built from base.yml with key=value overrides (`maxtext_overrides`). The step is its
real pre-training step (maxtext.trainers.pre_train.train.train_step, jitted by
train_utils.jit_train_and_eval_step with the state's shardings and donation, as its
train_loop does), driven one step per `step()` on synthetic batches made before timing.
"""

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.worker_protocol import serve

# MaxText's dropless MoE paths that run on a CPU: `ragged` is its sparse_matmul path with
# jax.lax.ragged_dot (megablox and tokamax are Pallas kernels for TPU); `dense` is its
# dense_matmul path, which with capacity_factor -1 drops nothing.
MOE_IMPLS = {
    "ragged": {"sparse_matmul": True, "megablox": False, "use_tokamax_gmm": False},
    "dense": {"sparse_matmul": False, "megablox": False, "use_tokamax_gmm": False},
}


def maxtext_overrides(spec: dict, peer: str, moe: str = "ragged") -> dict:
    """base.yml keys for the model and optimizer described by `spec` (throughput_jaxmoe.py)."""
    out = {
        "run_name": "jaxmoe_peer",
        "hardware": "cpu",
        "dataset_type": "synthetic",
        "enable_checkpointing": False,
        "enable_tensorboard": False,
        "skip_jax_distributed_system": True,
        "attention": "dot_product",  # flash kernels are for TPU/GPU
        "decoder_block": "llama2" if peer == "dense" else "mixtral",
        "vocab_size": spec["vocab_size"],
        "base_emb_dim": spec["d_model"],
        "base_num_decoder_layers": spec["num_layers"],
        "base_num_query_heads": spec["num_heads"],
        "base_num_kv_heads": spec["num_kv_heads"],
        "head_dim": spec["head_dim"],
        # base.yml's mlp_activations ["silu", "linear"] is SwiGLU already.
        "normalization_layer_epsilon": spec["norm_eps"],
        "rope_max_timescale": int(spec["rope_theta"]),
        "logits_via_embedding": spec["tie_embeddings"],
        "max_target_length": spec["seq_len"],
        "per_device_batch_size": spec["batch_size"],  # one device
        "dtype": "float32",
        "weight_dtype": "float32",
        "enable_dropout": False,
        # jaxmoe runs unrolled (model.scan_layers False) without remat; MaxText has no
        # "no remat" policy: minimal_with_context saves every projection and attention's
        # context, so only elementwise work is recomputed.
        "scan_layers": False,
        "remat_policy": "minimal_with_context",
        "opt_type": "adamw",
        "learning_rate": spec["learning_rate"],
        "adam_b1": spec["b1"],
        "adam_b2": spec["b2"],
        "adam_eps": spec["eps"],
        "adam_weight_decay": spec["weight_decay"],
        "gradient_clipping_threshold": spec["grad_clip_norm"],
        "steps": 1_000_000,  # the schedule's length only; the step count is the parent's
    }
    if peer == "dense":
        out["base_mlp_dim"] = spec["ffn_dim"]
    else:
        out |= {
            "num_experts": spec["num_experts"],
            "num_experts_per_tok": 1 if peer == "top1" else 2,
            "base_mlp_dim": spec["moe_ffn_dim"],
            "base_moe_mlp_dim": spec["moe_ffn_dim"],
            "capacity_factor": -1.0,  # dropless, as Mixtral
            "load_balance_loss_weight": spec["balance_loss_weight"],
            **MOE_IMPLS[moe],
        }
    return out


class MaxTextRunner:
    """MaxText's train step for one model on one CPU device; `step()` returns its seconds."""

    def __init__(self, spec: dict, peer: str, num_batches: int, moe: str = "ragged"):
        import jax
        from flax import nnx
        from flax.core.spmd import logical_axis_rules
        from maxtext.configs import pyconfig
        from maxtext.trainers.pre_train import train
        from maxtext.utils import maxtext_utils, sharding, train_utils

        if jax.device_count() != 1:
            raise RuntimeError(f"MaxText worker: expected one device, got {jax.devices()}")
        base = Path(pyconfig.__file__).resolve().parent / "base.yml"
        overrides = maxtext_overrides(spec, peer, moe)
        overrides["base_output_directory"] = os.environ.get("TMPDIR", "/tmp") + "/maxtext_peer"
        config = pyconfig.initialize(["", str(base), *(f"{k}={v}" for k, v in overrides.items())])
        # As train_loop does: set up the state, split it, jit the step with its shardings.
        setup = train_utils.setup_train_loop(config, None)
        state_mesh_shardings, mesh, state = setup[2], setup[4], setup[-1]
        graphdef, state = nnx.split(state)
        params_shardings, state_mesh_shardings = sharding.maybe_update_params_sharding_with_opt(
            config, state_mesh_shardings
        )
        self.step_fn, _ = train_utils.jit_train_and_eval_step(
            config,
            graphdef,
            mesh,
            state,
            state_mesh_shardings,
            train.train_step,
            params_shardings=params_shardings,
        )
        with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
            data_sharding = sharding.get_input_data_sharding(config, mesh)
            shaped = maxtext_utils.get_shaped_batch(config, batch_sharding=data_sharding)
            self.batches = jax.block_until_ready(
                [train.make_synthetic_batch(config, shaped, seed=i) for i in range(num_batches)]
            )
        self.num_params = sum(
            leaf.size
            for leaf in jax.tree.leaves(nnx.state(nnx.merge(graphdef, state).model, nnx.Param))
        )
        self.tokens_per_step = int(self.batches[0]["inputs"].size)
        self.state = state
        self.next_batch = 0
        self.last_loss = None
        self.jax = jax

    def step(self) -> float:
        batch = self.batches[self.next_batch % len(self.batches)]
        self.next_batch += 1
        start = time.perf_counter()
        self.state, metrics = self.step_fn(self.state, batch)
        self.jax.block_until_ready(metrics)
        elapsed = time.perf_counter() - start
        self.last_loss = float(metrics["scalar"]["learning/loss"])
        return elapsed

    def final(self) -> dict:
        return {"compiles": self.step_fn._cache_size(), "loss": self.last_loss}


class _QuietSteps:
    """The runner with MaxText's prints kept off stdout, which carries the protocol."""

    def __init__(self, runner):
        self.runner = runner

    def step(self) -> float:
        with contextlib.redirect_stdout(sys.stderr):
            return self.runner.step()

    def final(self) -> dict:
        return self.runner.final()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", required=True, choices=("top1", "top2", "dense"))
    parser.add_argument("--spec", required=True, help="the model and optimizer, as JSON")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--moe", choices=sorted(MOE_IMPLS), default="ragged")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    with contextlib.redirect_stdout(sys.stderr):
        runner = MaxTextRunner(json.loads(args.spec), args.peer, args.batches, args.moe)
    import jax
    import maxtext

    ready = {
        "system": "maxtext",
        "variant": args.peer,
        "num_params": runner.num_params,
        "tokens_per_step": runner.tokens_per_step,
        "moe": "-" if args.peer == "dense" else args.moe,
        "versions": {"maxtext": getattr(maxtext, "__version__", "?"), "jax": jax.__version__},
        "device": str(jax.devices()[0]),
    }
    serve(_QuietSteps(runner), ready)
    return 0


if __name__ == "__main__":
    sys.exit(main())
