"""The tiny chat model the fine-tuning tests build, and its data: a random transformers
Qwen3-MoE (every weight perturbed, the output layer scaled so its NLL is far from log V)
saved with a byte-level BPE tokenizer and a ChatML chat template, plus chat jsonl files of
a task a tiny model learns in a few steps (name colours back in reverse order).

    python -m tests.tiny_chat_model tiny      # tiny/qwen3_moe_chat/, tiny/chat_train.jsonl,
                                              # tiny/chat_held_out.jsonl (docs/fine_tuning.md)
"""

import json
import sys
from pathlib import Path

import numpy as np

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
COLORS = ["red", "green", "blue", "black", "white", "pink", "gray", "brown"]


def conversation(rng) -> dict:
    words = list(rng.choice(COLORS, rng.integers(2, 5)))
    return {
        "messages": [
            {"role": "user", "content": "reverse: " + " ".join(words)},
            {"role": "assistant", "content": " ".join(reversed(words))},
        ]
    }


def write_chats(path: Path, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    path.write_text("".join(json.dumps(conversation(rng)) + "\n" for _ in range(n)))


def preference(rng) -> dict:
    """A pair of the reversal task (DPO): the reversed words chosen, them as given rejected."""
    words = list(rng.choice(COLORS, rng.integers(2, 5), replace=False))
    return {
        "prompt": "reverse: " + " ".join(words) + "\n",
        "chosen": " ".join(reversed(words)),
        "rejected": " ".join(words),
    }


def write_preferences(path: Path, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    path.write_text("".join(json.dumps(preference(rng)) + "\n" for _ in range(n)))


def build_checkpoint(folder: Path, seed: int = 44) -> Path:
    """The Hugging Face checkpoint (config.json, model.safetensors, tokenizer files)."""
    import tokenizers
    import torch
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=alphabet
    )
    tok.train_from_iterator([" ".join(COLORS) + " reverse: user assistant"] * 8, trainer)
    tok.save(str(folder / "tokenizer.json"))
    special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML, **special}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    model_config = Qwen3MoeConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        eos_token_id=tok.token_to_id("<|im_end|>"), pad_token_id=tok.token_to_id("<|endoftext|>"),
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(model_config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # unit scale: N(0, 1/fan_in), norm scales 1 + N(0, 0.2)
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if p.ndim == 1 else noise * p.shape[-1] ** -0.5)
        model.lm_head.weight.mul_(4.0)  # peaked predictions: far from log V
    model.eval().save_pretrained(folder)
    return folder


def build(root: Path) -> None:
    """Everything docs/fine_tuning.md's commands read, under `root`."""
    build_checkpoint(root / "qwen3_moe_chat")
    write_chats(root / "chat_train.jsonl", 160, seed=0)
    write_chats(root / "chat_held_out.jsonl", 6, seed=1)


if __name__ == "__main__":
    build(Path(sys.argv[1] if len(sys.argv) > 1 else "tiny"))
