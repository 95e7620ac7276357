"""jaxmoe's side of `train_throughput`: a worker process that never imports torch.

    python -m benchmarks.throughput_jaxmoe --variant top2 [--set k=v ...] [--batches N]
(driven over stdin/stdout by train_throughput.py; see worker_protocol.py)
"""

import argparse
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from benchmarks.worker_protocol import serve
from jaxmoe.config.loading import load_config
from jaxmoe.models.flops import train_flops_per_step
from jaxmoe.models.spec import model_spec
from jaxmoe.parallel.host_memory import retain_freed_host_memory
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.parallel.platforms import skip_absent_tpu
from jaxmoe.training.optimizer import make_optimizer
from jaxmoe.training.state import init_state, state_shardings
from jaxmoe.training.steps import step_fns, train_step

ROOT = Path(__file__).resolve().parents[1]

CONFIG = ROOT / "configs" / "tiny_mixtral.py"
# The fine-grained variant: tiny_mixtral's sizes (vocab 8192, d_model 256, 4 layers, 8 / 2
# heads of 32, sequence 256, batch 8) with a tiny Qwen3-MoE's MoE and attention: 64 experts
# of FFN 128, top-8 renormalised (norm_topk_prob), per-head QK-norm. Its active FFN width
# (8 x 128) is the :dense variant's 1024; the peer is transformers' Qwen3MoeForCausalLM.
FINE_GRAINED = [
    "model.moe.num_experts=64",
    "model.moe.ffn_dim=128",
    "model.moe.gating=topk",
    "model.moe.top_k=8",
    "model.moe.renormalize=True",
    "model.qk_norm=head",
]


def variant_config(variant: str, overrides: list[str]):
    if variant == "fine_grained":
        return load_config(str(CONFIG), [*FINE_GRAINED, *overrides])
    return load_config(f"{CONFIG}:{variant}", overrides)


def peer_spec(config) -> dict:
    """What the peer needs to build the same model and optimizer, as plain JSON."""
    m, moe, t, o = config.model, config.model.moe, config.train, config.optimizer
    return {
        "vocab_size": m.vocab_size,
        "d_model": m.d_model,
        "num_layers": m.num_layers,
        "num_heads": m.num_heads,
        "num_kv_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "ffn_dim": m.ffn_dim,
        "norm_eps": m.norm_eps,
        "tie_embeddings": m.tie_embeddings,
        "rope_theta": m.rope_theta,
        "num_experts": moe.num_experts,
        "moe_ffn_dim": moe.ffn_dim,
        "top_k": moe.gate.top_k,
        "renormalize": moe.gate.renormalize,
        "qk_norm": m.qk_norm,
        "balance_loss_weight": moe.balance_loss_weight,
        "batch_size": t.batch_size,
        "seq_len": t.seq_len,
        "learning_rate": o.learning_rate,
        "b1": o.b1,
        "b2": o.b2,
        "eps": o.eps,
        "weight_decay": o.weight_decay,
        "grad_clip_norm": o.grad_clip_norm,
    }


class JaxRunner:
    """jaxmoe's train step for one config on one device; `step()` returns its seconds."""

    def __init__(self, config, num_batches: int, seed: int = 0):
        self.config = config
        mesh = make_mesh(config.mesh, devices=jax.devices()[:1])
        spec = model_spec(config.model, mesh)
        optimizer, schedule = make_optimizer(config.optimizer, config.train.steps, spec.param_axes)
        _, shardings = state_shardings(mesh, spec, optimizer)
        self.state = init_state(config.model, seed, optimizer, shardings, mesh)
        fns = step_fns(config.train, config.optimizer, config.model, spec, optimizer, schedule)
        replicated = NamedSharding(mesh, PartitionSpec())
        self.step_fn = jax.jit(
            functools.partial(train_step, fns=fns),
            in_shardings=(shardings, replicated),
            out_shardings=(shardings, None),
            donate_argnums=0,
        )
        self.mesh = mesh
        self.batches = _token_batches(config, num_batches, seed, replicated)
        self.next_batch = 0
        self.last_metrics = None

    def step(self) -> float:
        batch = self.batches[self.next_batch % len(self.batches)]
        self.next_batch += 1
        start = time.perf_counter()
        with jax.set_mesh(self.mesh):
            self.state, metrics = self.step_fn(self.state, batch)
        jax.block_until_ready(metrics["loss"])
        elapsed = time.perf_counter() - start
        self.last_metrics = metrics
        return elapsed

    def compiles(self) -> int:
        """Programs compiled for the step: 1 unless something retraced."""
        return self.step_fn._cache_size()

    def final(self) -> dict:
        fraction = None
        if self.config.model.moe.num_experts:
            fraction = float(self.last_metrics["top2_fraction"])
        loss = None if self.last_metrics is None else float(self.last_metrics["loss"])
        return {"compiles": self.compiles(), "top2_fraction": fraction, "loss": loss}


def _token_batches(config, count: int, seed: int, sharding) -> list[dict]:
    """`count` distinct random batches, made on the device before timing starts."""
    batch, length = config.train.batch_size, config.train.seq_len
    vocab = config.model.vocab_size

    @functools.partial(jax.jit, out_shardings=sharding)
    def make(key):
        tokens = jax.random.randint(key, (batch, length + 1), 0, vocab, jnp.int32)
        return {
            "inputs": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "weights": jnp.ones((batch, length), jnp.float32),
        }

    keys = jax.random.split(jax.random.key(seed + 1), count)
    return jax.block_until_ready([make(k) for k in keys])


def flops_per_step(config, top2_fraction: float | None) -> float:
    """Model FLOPs per step; adaptive counted at its measured top-2 share."""
    t = config.train
    if config.model.moe.num_experts == 0 or config.model.moe.gate.gating != "adaptive":
        return train_flops_per_step(config.model, t.batch_size, t.seq_len)
    model = config.model
    one = train_flops_per_step(
        model.replace(moe=model.moe.replace(gating="top1")), t.batch_size, t.seq_len
    )
    two = train_flops_per_step(
        model.replace(moe=model.moe.replace(gating="top2")), t.batch_size, t.seq_len
    )
    share = 1.0 if top2_fraction is None else top2_fraction
    return one + share * (two - one)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", required=True)
    parser.add_argument("--set", action="append", default=[], help="config override k=v")
    parser.add_argument("--batches", type=int, default=8, help="distinct batches to cycle")
    args = parser.parse_args(argv)
    skip_absent_tpu()  # libtpu's probe on a host without a TPU only prints noise
    retain_freed_host_memory()  # as `jaxmoe train` does on the CPU
    config = variant_config(args.variant, args.set)
    runner = JaxRunner(config, args.batches)
    t = config.train
    ready = {
        "system": "jaxmoe",
        "variant": args.variant,
        "peer_spec": peer_spec(config),
        "tokens_per_step": t.batch_size * t.seq_len,
        "flops_top1": flops_per_step(config, 0.0),
        "flops_top2": flops_per_step(config, 1.0),
        "device": str(jax.devices()[0]),
    }
    serve(runner, ready)
    return 0


if __name__ == "__main__":
    sys.exit(main())
