"""A tiny Qwen3-MoE pretrained in PyTorch (transformers) on jaxmoe's own training batches.

The model is transformers' `Qwen3MoeForCausalLM` (top-k of many experts, norm_topk_prob,
per-head QK-norm), trained with its own top-k routing so the router is learned, not random.
Its batches are jaxmoe's (`TrainBatches` of the run's config: same tokenizer, packing and
order), and the optimizer mirrors jaxmoe's AdamW recipe (jaxmoe/training/optimizer.py:
linear warmup from 0, cosine to min_lr_ratio x peak, decoupled weight decay on matrices
only, global-norm clipping), so `jaxmoe convert hf` of the result is "the same model, now in
jaxmoe" and uptraining it continues the same recipe. Used by experiments/adaptive_k_uptrain.py
and its test; imports torch only when called.
"""

import math
import shutil
from pathlib import Path

import numpy as np


def qwen3_moe_config(vocab_size: int, size: dict):
    """A Qwen3MoeConfig of `size` (layers, d_model, heads, experts, k, expert width)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=size["d_model"],
        intermediate_size=4 * size["d_model"],  # dense MLP width; unused, every layer is MoE
        num_hidden_layers=size["num_layers"],
        num_attention_heads=size["num_heads"],
        num_key_value_heads=size["num_kv_heads"],
        head_dim=size["head_dim"],
        num_experts=size["num_experts"],
        num_experts_per_tok=size["top_k"],
        moe_intermediate_size=size["expert_dim"],
        norm_topk_prob=True,
        router_aux_loss_coef=size["aux_loss_coef"],
        max_position_embeddings=size["seq_len"],
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )


def build_model(config, seed: int):
    """A freshly initialised model (transformers' own init), float32, in train mode."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config).float().train()


def lr_factor(step: int, warmup: int, total: int, min_lr_ratio: float) -> float:
    """jaxmoe's cosine schedule as a fraction of the peak at optimizer step `step` (0-based):
    optax's linear warmup from 0, then cosine from 1 to min_lr_ratio over total - warmup."""
    if warmup and step < warmup:
        return step / warmup
    progress = min(step - warmup, max(total - warmup, 1)) / max(total - warmup, 1)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model, opt: dict):
    """AdamW as optax.adamw with jaxmoe's decay mask: only parameters of rank >= 2 decay."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": opt["weight_decay"]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    betas = (opt["b1"], opt["b2"])
    return torch.optim.AdamW(groups, lr=opt["learning_rate"], betas=betas, eps=opt["eps"])


def batch_loss(model, batch: dict, with_aux: bool):
    """(weighted mean next-token NLL, total loss) of one jaxmoe batch; the total adds the
    model's router load-balancing loss times its router_aux_loss_coef, as transformers does."""
    import torch

    inputs = torch.as_tensor(np.asarray(batch["inputs"]), dtype=torch.long)
    targets = torch.as_tensor(np.asarray(batch["targets"]), dtype=torch.long)
    weights = torch.as_tensor(np.asarray(batch["weights"]), dtype=torch.float32)
    out = model(input_ids=inputs, output_router_logits=with_aux)
    nll = torch.nn.functional.cross_entropy(
        out.logits.float().flatten(0, 1), targets.flatten(), reduction="none"
    ).view_as(weights)
    mean_nll = (nll * weights).sum() / weights.sum().clamp(min=1.0)
    total = mean_nll + model.config.router_aux_loss_coef * out.aux_loss if with_aux else mean_nll
    return mean_nll, total


def pretrain(model, batches, steps: int, opt: dict, log_every: int = 50) -> list[float]:
    """`steps` AdamW steps over the iterator `batches`; returns the NLL of every step."""
    import torch

    optimizer = make_optimizer(model, opt)
    warmup = opt["warmup_steps"]
    model.train()
    losses = []
    for step in range(steps):
        factor = lr_factor(step, warmup, steps, opt["min_lr_ratio"])
        for group in optimizer.param_groups:
            group["lr"] = opt["learning_rate"] * factor
        nll, total = batch_loss(model, next(batches), with_aux=True)
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        if opt["grad_clip_norm"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opt["grad_clip_norm"])
        optimizer.step()
        losses.append(nll.item())
        if log_every and (step + 1) % log_every == 0:
            print(f"pretrain step {step + 1}/{steps}: nll {np.mean(losses[-log_every:]):.4f}")
    return losses


def eval_loss(model, batches: list[dict]) -> float:
    """Mean next-token NLL over every weighted target of `batches` (jaxmoe's eval batches:
    padding has weight 0), with the model's own top-k routing."""
    import torch

    model.eval()
    nll_sum = weight_sum = 0.0
    with torch.no_grad():
        for batch in batches:
            mean_nll, _ = batch_loss(model, batch, with_aux=False)
            weight = float(np.asarray(batch["weights"]).sum())
            nll_sum += float(mean_nll) * weight
            weight_sum += weight
    return nll_sum / max(weight_sum, 1.0)


def save_with_tokenizer(model, folder: Path, tokenizer_path: str) -> None:
    """save_pretrained, plus jaxmoe's SentencePiece model as tokenizer.model: `convert hf`
    copies it into the checkpoint and points data.tokenizer at it, so the converted model
    reads the corpus with the very tokenizer (and token cache) it was pretrained on."""
    model.save_pretrained(folder)
    shutil.copyfile(tokenizer_path, folder / "tokenizer.model")
