"""Hugging Face's side of `decode_peer`: greedy `generate` per case, never importing JAX.

With a dynamic and a static KV cache, the faster one reported; one JSON line per case
(worker_protocol.emit).

    python -m benchmarks.decode_hf --spec JSON --cases JSON --prompt_len 1024 --new_tokens 32
"""

import argparse
import json
import sys
import time

from benchmarks.worker_protocol import emit, imported_frameworks


def build(spec: dict, kv_heads: int, gating: str, attention: str = ""):
    import transformers

    common = dict(
        vocab_size=spec["vocab"],
        hidden_size=spec["d_model"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=kv_heads,
        head_dim=spec["head_dim"],
        intermediate_size=spec["ffn"],
        max_position_embeddings=spec["max_len"],
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": spec["rope_theta"]},
    )
    if attention == "mla":  # DeepSeek-V3 with every FFN dense: the attention compared
        del common["head_dim"]
        config = transformers.DeepseekV3Config(
            **common, **{k: v or None for k, v in spec["mla"].items()},
            first_k_dense_replace=spec["layers"], n_routed_experts=1, num_experts_per_tok=1,
            n_group=1, topk_group=1,
        )  # fmt: skip
        return transformers.DeepseekV3ForCausalLM(config).eval()
    if gating:  # Mixtral routes every token to a fixed top-k
        config = transformers.MixtralConfig(
            num_local_experts=spec["experts"], num_experts_per_tok=2 if gating == "top2" else 1,
            **common,
        )  # fmt: skip
        return transformers.MixtralForCausalLM(config).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True)
    parser.add_argument("--cases", required=True)
    parser.add_argument("--prompt_len", type=int, default=1024)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    spec = json.loads(args.spec)
    for case in json.loads(args.cases):
        model = build(spec, case["kv_heads"], case.get("gating", ""), case.get("attention", ""))
        prompts = torch.randint(3, spec["vocab"], (case["batch"], args.prompt_len))

        def seconds(new_tokens, cache, model=model, prompts=prompts):
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(
                    prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                    max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None,
                    pad_token_id=0, cache_implementation=cache,
                )  # fmt: skip
            return time.perf_counter() - start

        best = None
        for cache in ("dynamic", "static"):
            for n in (1, args.new_tokens):
                seconds(n, cache)  # warm up
            t_1 = min(seconds(1, cache) for _ in range(2))
            t_n = min(seconds(args.new_tokens, cache) for _ in range(2))
            per_token = (t_n - t_1) / (args.new_tokens - 1)
            if best is None or per_token < best[0]:
                best = (per_token, t_1, cache)
        emit({**case, "ms_per_token": 1e3 * best[0], "prefill_s": best[1],
              "cache": best[2], "imported": imported_frameworks()})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
