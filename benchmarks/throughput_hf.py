"""Hugging Face's side of `train_throughput`: a worker process that never imports JAX.

    python -m benchmarks.throughput_hf --peer top2 --spec JSON [--threads N] [--batches N]
(driven over stdin/stdout by train_throughput.py; see worker_protocol.py)
"""

import argparse
import json
import sys
import time

from benchmarks.worker_protocol import serve


class HFRunner:
    """Hugging Face transformers' Mixtral (Llama for :dense, Qwen3-MoE for :fine_grained)
    with torch AdamW."""

    def __init__(self, spec: dict, peer: str, num_batches: int, threads: int, seed: int = 0):
        import torch
        import transformers

        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        common = dict(
            vocab_size=spec["vocab_size"],
            hidden_size=spec["d_model"],
            num_hidden_layers=spec["num_layers"],
            num_attention_heads=spec["num_heads"],
            num_key_value_heads=spec["num_kv_heads"],
            head_dim=spec["head_dim"],
            max_position_embeddings=spec["seq_len"],
            rms_norm_eps=spec["norm_eps"],
            tie_word_embeddings=spec["tie_embeddings"],
            rope_parameters={"rope_type": "default", "rope_theta": spec["rope_theta"]},
            use_cache=False,
        )
        if peer == "dense":
            hf_config = transformers.LlamaConfig(intermediate_size=spec["ffn_dim"], **common)
            self.model = transformers.LlamaForCausalLM(hf_config)
        elif peer == "fine_grained":
            if spec["qk_norm"] != "head":  # Qwen3-MoE always norms each q/k head
                raise ValueError(f"fine_grained peer needs qk_norm=head, got {spec['qk_norm']}")
            hf_config = transformers.Qwen3MoeConfig(
                intermediate_size=spec["ffn_dim"],  # dense layers only: there are none
                moe_intermediate_size=spec["moe_ffn_dim"],
                num_experts=spec["num_experts"],
                num_experts_per_tok=spec["top_k"],
                norm_topk_prob=spec["renormalize"],
                decoder_sparse_step=1,
                mlp_only_layers=[],
                output_router_logits=spec["balance_loss_weight"] > 0,
                router_aux_loss_coef=spec["balance_loss_weight"],
                **common,
            )
            self.model = transformers.Qwen3MoeForCausalLM(hf_config)
        else:
            hf_config = transformers.MixtralConfig(
                intermediate_size=spec["moe_ffn_dim"],
                num_local_experts=spec["num_experts"],
                num_experts_per_tok=1 if peer == "top1" else 2,
                output_router_logits=spec["balance_loss_weight"] > 0,
                router_aux_loss_coef=spec["balance_loss_weight"],
                **common,
            )
            self.model = transformers.MixtralForCausalLM(hf_config)
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=spec["learning_rate"],
            betas=(spec["b1"], spec["b2"]),
            eps=spec["eps"],
            weight_decay=spec["weight_decay"],
        )
        self.clip = spec["grad_clip_norm"]
        generator = torch.Generator().manual_seed(seed + 1)
        shape = (spec["batch_size"], spec["seq_len"])
        self.batches = [
            torch.randint(0, spec["vocab_size"], shape, generator=generator)
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

    def final(self) -> dict:
        return {"num_params": self.num_params()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", required=True, choices=("top1", "top2", "dense", "fine_grained"))
    parser.add_argument("--spec", required=True, help="the model and optimizer, as JSON")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--batches", type=int, default=8)
    args = parser.parse_args(argv)
    runner = HFRunner(json.loads(args.spec), args.peer, args.batches, args.threads)
    serve(runner, {"system": "hf", "variant": args.peer, "num_params": runner.num_params()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
