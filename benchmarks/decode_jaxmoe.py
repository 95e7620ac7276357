"""jaxmoe's side of `decode_peer`: greedy KV-cache decoding per case, never importing torch.

Prints one JSON line per case (worker_protocol.emit).

    python -m benchmarks.decode_jaxmoe --spec JSON --cases JSON --prompt_len 1024 --new_tokens 32
"""

import argparse
import json
import sys
import time

import jax
import numpy as np
from flax import nnx

from benchmarks.worker_protocol import emit, imported_frameworks
from jaxmoe.config import typed
from jaxmoe.config.defaults import base_config
from jaxmoe.inference.decode import Generator, Sampling
from jaxmoe.models import build_model
from jaxmoe.models.spec import model_params
from jaxmoe.parallel.host_memory import retain_freed_host_memory
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.parallel.options import MeshOptions
from jaxmoe.parallel.platforms import skip_absent_tpu


def model_config(spec: dict, kv_heads: int, gating: str, attention: str = ""):
    cfg = base_config().model
    if attention == "mla":  # latent attention, decoded through the latent cache
        cfg.attention = "mla"
        for key, value in spec["mla"].items():
            setattr(cfg, key, value)
    cfg.vocab_size, cfg.d_model, cfg.num_layers = spec["vocab"], spec["d_model"], spec["layers"]
    cfg.num_heads, cfg.num_kv_heads, cfg.head_dim = spec["heads"], kv_heads, spec["head_dim"]
    cfg.ffn_dim, cfg.rope_theta = spec["ffn"], spec["rope_theta"]
    cfg.max_len = spec["max_len"]
    cfg.moe.num_experts = spec.get("experts", 0) if gating else 0
    if gating:
        cfg.moe.gating, cfg.moe.ffn_dim = gating, spec["ffn"]
        cfg.moe.threshold = spec.get("threshold", 0.1)
    return typed({"model": cfg}).model


def seconds(generator, prompts, new_tokens: int) -> float:
    start = time.perf_counter()
    generator.generate(prompts, new_tokens, Sampling())
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True)
    parser.add_argument("--cases", required=True, help="JSON list of {kv_heads, batch, gating}")
    parser.add_argument("--prompt_len", type=int, default=1024)
    parser.add_argument("--new_tokens", type=int, default=32)
    args = parser.parse_args(argv)
    skip_absent_tpu()
    retain_freed_host_memory()  # as `jaxmoe decode` does on the CPU
    spec = json.loads(args.spec)
    devices = jax.devices()[:1]
    mesh = make_mesh(MeshOptions(data=1, fsdp=1, tensor=1, expert=1), devices)
    rng = np.random.default_rng(0)
    for case in json.loads(args.cases):
        cfg = model_config(
            spec, case["kv_heads"], case.get("gating", ""), case.get("attention", "")
        )
        _, params = model_params(build_model(cfg, rngs=nnx.Rngs(0)))
        generator = Generator(cfg, params, mesh, eos_id=-1)  # never stops early
        prompts = rng.integers(3, spec["vocab"], (case["batch"], args.prompt_len)).tolist()
        for n in (1, args.new_tokens):  # compile both programs first
            generator.generate(prompts, n, Sampling())
        t_1 = min(seconds(generator, prompts, 1) for _ in range(2))
        t_n = min(seconds(generator, prompts, args.new_tokens) for _ in range(2))
        per_token = (t_n - t_1) / (args.new_tokens - 1)
        emit({**case, "ms_per_token": 1e3 * per_token, "prefill_s": t_1,
              "imported": imported_frameworks()})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
