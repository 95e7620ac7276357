"""Training throughput of the tiny Mixtral (configs/tiny_mixtral.py), optionally against HF.

Each variant runs jaxmoe's real train step (jaxmoe.steps.train_step, jitted with the state's
shardings and donation as in jaxmoe/train.py) on one device (the default CPU device), on a
fresh random token batch each step (generated on device beforehand, so the data path costs
nothing). After a warm-up, steps are timed one by one (a sync after each) in blocks;
with `--peer hf` the blocks of jaxmoe and of Hugging Face transformers (MixtralForCausalLM,
LlamaForCausalLM for :dense, torch AdamW, same sizes, batch and threads) alternate, so a
drifting load on a shared machine hits both sides alike. Reported: median step time,
tokens/s, model FLOPs per token (jaxmoe/flops.py; adaptive at its measured top-2 share) and
implied FLOP/s (and MFU with --peak_flops).

    python benchmarks/train_throughput.py                     # jaxmoe, all variants
    python benchmarks/train_throughput.py --peer hf           # side by side, with ratios
    python benchmarks/train_throughput.py --peer hf --json    # one JSON object
    python benchmarks/train_throughput.py --variants top2 --steps 5 --warmup 2 --blocks 1
    python benchmarks/train_throughput.py --set model.dtype=bfloat16 --peak_flops 989e12
"""

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a fresh clone without installing

from jaxmoe.config import apply_overrides, load_config, validate  # noqa: E402
from jaxmoe.flops import train_flops_per_step  # noqa: E402
from jaxmoe.optim import make_optimizer  # noqa: E402
from jaxmoe.parallel.sharding import make_mesh  # noqa: E402
from jaxmoe.steps import step_fns, train_step  # noqa: E402
from jaxmoe.train_state import init_state, model_spec, state_shardings  # noqa: E402

CONFIG = ROOT / "configs" / "tiny_mixtral.py"
VARIANTS = ("top2", "top1", "adaptive", "dense")
PEER_OF = {"top2": "top2", "top1": "top1", "adaptive": "top1", "dense": "dense"}
# Variants measured in one interleaved group: each group shares its peer run.
GROUPS = (("top2",), ("top1", "adaptive"), ("dense",))


def variant_config(variant: str, overrides: list[str]):
    config = load_config(f"{CONFIG}:{variant}")
    apply_overrides(config, overrides)
    validate(config)
    return config


class JaxRunner:
    """jaxmoe's train step for one config on one device; `step()` returns its seconds."""

    def __init__(self, config, num_batches: int, seed: int = 0):
        self.config = config
        mesh = make_mesh(config.mesh, devices=jax.devices()[:1])
        spec = model_spec(config.model, mesh)
        optimizer, schedule = make_optimizer(config.optimizer, config.train.steps)
        _, shardings = state_shardings(mesh, spec, optimizer)
        self.state = init_state(config.model, seed, optimizer, shardings, mesh)
        fns = step_fns(config, spec, optimizer, schedule)
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


class HFRunner:
    """Hugging Face transformers' Mixtral (or Llama for :dense) with torch AdamW."""

    def __init__(self, config, peer: str, num_batches: int, threads: int, seed: int = 0):
        import torch
        import transformers

        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        m, moe, t = config.model, config.model.moe, config.train
        common = dict(
            vocab_size=m.vocab_size,
            hidden_size=m.d_model,
            num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_heads,
            num_key_value_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            max_position_embeddings=t.seq_len,
            rms_norm_eps=m.norm_eps,
            tie_word_embeddings=m.tie_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
            use_cache=False,
        )
        if peer == "dense":
            hf_config = transformers.LlamaConfig(intermediate_size=m.ffn_dim, **common)
            self.model = transformers.LlamaForCausalLM(hf_config)
        else:
            hf_config = transformers.MixtralConfig(
                intermediate_size=moe.ffn_dim,
                num_local_experts=moe.num_experts,
                num_experts_per_tok=1 if peer == "top1" else 2,
                output_router_logits=moe.balance_loss_weight > 0,
                router_aux_loss_coef=moe.balance_loss_weight,
                **common,
            )
            self.model = transformers.MixtralForCausalLM(hf_config)
        self.model.train()
        o = config.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=o.learning_rate,
            betas=(o.b1, o.b2),
            eps=o.eps,
            weight_decay=o.weight_decay,
        )
        self.clip = o.grad_clip_norm
        generator = torch.Generator().manual_seed(seed + 1)
        self.batches = [
            torch.randint(0, m.vocab_size, (t.batch_size, t.seq_len), generator=generator)
            for _ in range(num_batches)
        ]
        self.next_batch = 0
        self.torch = torch

    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def step(self) -> float:
        tokens = self.batches[self.next_batch % len(self.batches)]
        self.next_batch += 1
        start = time.perf_counter()
        loss = self.model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        if self.clip:  # jaxmoe clips the global gradient norm too (optimizer.grad_clip_norm)
            self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start


def measure(runners: dict, warmup: int, steps: int, blocks: int) -> dict[str, list[float]]:
    """Step times per runner: warm-up, then `blocks` rounds of steps/blocks each, alternating."""
    for runner in runners.values():
        for _ in range(warmup):
            runner.step()
    times = {name: [] for name in runners}
    per_block = max(steps // blocks, 1)
    for _ in range(blocks):
        for name, runner in runners.items():
            times[name] += [runner.step() for _ in range(per_block)]
    return times


def flops_per_step(config, top2_fraction: float | None) -> float:
    """Model FLOPs per step; adaptive counted at its measured top-2 share."""
    t = config.train
    if config.model.moe.num_experts == 0 or config.model.moe.gating != "adaptive":
        return train_flops_per_step(config.model, t.batch_size, t.seq_len)
    model = config.model.copy_and_resolve_references()
    model.moe.gating = "top1"
    one = train_flops_per_step(model, t.batch_size, t.seq_len)
    model.moe.gating = "top2"
    two = train_flops_per_step(model, t.batch_size, t.seq_len)
    share = 1.0 if top2_fraction is None else top2_fraction
    return one + share * (two - one)


def row(variant, system, times, config, top2_fraction, peak_flops) -> dict:
    t = config.train
    tokens = t.batch_size * t.seq_len
    median = statistics.median(times)
    flops = flops_per_step(config, top2_fraction)
    out = {
        "variant": variant,
        "system": system,
        "tokens_per_s": tokens / median,
        "step_time_s": median,
        "steps": len(times),
        "flops_per_token": flops / tokens,
        "flops_per_s": flops / median,
    }
    if top2_fraction is not None:
        out["top2_fraction"] = top2_fraction
    if peak_flops:
        out["mfu"] = flops / median / peak_flops
    return out


def run(args) -> dict:
    load_before = os.getloadavg()
    rows = []
    for group in GROUPS:
        variants = [v for v in group if v in args.variants]
        if not variants:
            continue
        configs = {v: variant_config(v, args.set) for v in variants}
        num_batches = args.warmup + args.steps
        runners = {("jaxmoe", v): JaxRunner(configs[v], num_batches) for v in variants}
        peer = PEER_OF[variants[0]]
        if args.peer == "hf":
            runners[("hf", peer)] = HFRunner(configs[variants[0]], peer, num_batches, args.threads)
        times = measure(runners, args.warmup, args.steps, args.blocks)
        for (system, v), runner in runners.items():
            fraction = None
            if system == "jaxmoe":
                if runner.compiles() != 1:
                    raise RuntimeError(f"{v}: the train step compiled {runner.compiles()} times")
                if configs[v].model.moe.num_experts:
                    fraction = float(runner.last_metrics["top2_fraction"])
            config = configs[v] if system == "jaxmoe" else configs[variants[0]]
            rows.append(row(v, system, times[(system, v)], config, fraction, args.peak_flops))
    load_after = os.getloadavg()
    return {
        "rows": rows,
        "ratios": ratios(rows),
        "load_average": {"before": list(load_before), "after": list(load_after)},
        "jax_devices": str(jax.devices()[0]),
        "threads": args.threads,
    }


def ratios(rows: list[dict]) -> dict:
    """jaxmoe tokens/s over the peer's, per variant (adaptive against the peer's top-1)."""
    speed = {(r["system"], r["variant"]): r["tokens_per_s"] for r in rows}
    out = {}
    for variant in VARIANTS:
        mine, peer = ("jaxmoe", variant), ("hf", PEER_OF[variant])
        if mine in speed and peer in speed:
            out[f"jaxmoe_{variant}/hf_{PEER_OF[variant]}"] = speed[mine] / speed[peer]
    return out


def print_table(result: dict) -> None:
    print(f"{'variant':9} {'system':7} {'tok/s':>8} {'ms/step':>8} {'GFLOP/tok':>9} {'GFLOP/s':>8}")
    for r in result["rows"]:
        extra = f"  top2_fraction {r['top2_fraction']:.2f}" if "top2_fraction" in r else ""
        extra += f"  MFU {r['mfu']:.1%}" if "mfu" in r else ""
        print(
            f"{r['variant']:9} {r['system']:7} {r['tokens_per_s']:8.0f} "
            f"{r['step_time_s'] * 1e3:8.1f} {r['flops_per_token'] / 1e9:9.3f} "
            f"{r['flops_per_s'] / 1e9:8.1f}{extra}"
        )
    for name, value in result["ratios"].items():
        print(f"{name}: {value:.2f}x")
    load = result["load_average"]
    print(f"load average (1/5/15 min): before {load['before']}, after {load['after']}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--peer", choices=("none", "hf"), default="none")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (compile + warm)")
    parser.add_argument("--blocks", type=int, default=8, help="alternations of the systems")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    parser.add_argument("--set", action="append", default=[], help="config override k=v")
    parser.add_argument("--peak_flops", type=float, default=0.0, help="chip peak, for MFU")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
