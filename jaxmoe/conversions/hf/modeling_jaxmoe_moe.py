"""Mixtral with jaxmoe's gates, for transformers (5.x): the modeling file that `jaxmoe export
hf` ships next to an MoE whose routing stock Mixtral cannot express (adaptive, top-p, or
top-k without renormalised weights), loaded with `trust_remote_code=True`.

Standalone on purpose: it is copied into the exported folder as `modeling_jaxmoe_moe.py` and
imports only torch and transformers. Everything but the router is transformers' Mixtral;
the router applies the rule of jaxmoe's `models/gates.py` with the options in
`config.jaxmoe_gate` (see docs/hf_interop.md):

- probabilities: softmax of the router logits, computed in float32;
- top1 / top2 / topk: the K most probable experts;
- adaptive: the top-2 experts, the second kept only where the gap p1 - p2 (divided by
  p1 + p2 when gap_normalization is "top2") is strictly below `threshold`;
- top_p: by descending probability, an expert joins while the experts ranked above it sum
  to less than `top_p`, at most `max_k` experts;
- weights: a token with one expert gets its probability (single_weight "prob") or 1
  ("one"); a token with more gets the raw probabilities, or with `renormalize` those divided
  by their sum.

An unused slot routes to the token's first expert with weight 0, so transformers' expert
kernels (which expect a fixed number of slots) add nothing for it.
"""

import torch
import torch.nn.functional as F
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

MODEL_TYPE = "jaxmoe_moe"


class JaxmoeMoeConfig(MixtralConfig):
    """MixtralConfig under its own model_type: without trust_remote_code transformers refuses
    the folder instead of silently running stock top-k routing on it."""

    model_type = MODEL_TYPE


def _register_weight_names() -> None:
    """The checkpoint holds Mixtral's per-expert tensor names; transformers 5.x fuses them
    on load by model_type, so the Mixtral rules are registered for this model_type too."""
    from transformers import conversion_mapping as cm

    mixtral = cm.get_checkpoint_conversion_mapping("mixtral")
    if mixtral is not None:
        cm.register_checkpoint_conversion_mapping(MODEL_TYPE, mixtral, overwrite=True)


_register_weight_names()


def slots(gate: dict) -> int:
    """The static number of expert slots per token."""
    return {"top1": 1, "top2": 2, "topk": gate["top_k"], "adaptive": 2, "top_p": gate["max_k"]}[
        gate["gating"]
    ]


def route(probs: torch.Tensor, gate: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """probs [T, E] float32 -> (indices [T, K], weights [T, K], mask [T, K])."""
    k = min(slots(gate), probs.shape[-1])
    chosen, indices = torch.topk(probs, k, dim=-1)
    if gate["gating"] == "adaptive":
        gap = chosen[:, 0] - chosen[:, 1]
        if gate["gap_normalization"] == "top2":
            gap = gap / (chosen[:, 0] + chosen[:, 1])
        mask = torch.stack([torch.ones_like(gap, dtype=torch.bool), gap < gate["threshold"]], 1)
    elif gate["gating"] == "top_p":
        mask = (torch.cumsum(chosen, dim=-1) - chosen) < gate["top_p"]
    else:
        mask = torch.ones_like(chosen, dtype=torch.bool)
    chosen = torch.where(mask, chosen, torch.zeros_like(chosen))
    tiny = torch.finfo(torch.float32).tiny
    total = torch.clamp(chosen.sum(dim=-1, keepdim=True), min=tiny)
    multi = chosen / total if gate["renormalize"] else chosen
    single = chosen if gate["single_weight"] == "prob" else mask.to(chosen.dtype)
    is_single = mask.sum(dim=-1, keepdim=True) == 1
    weights = torch.where(is_single, single, multi)
    return indices, weights, mask


class JaxmoeRouter(MixtralTopKRouter):
    """Mixtral's router with jaxmoe's gate; returns (logits, weights, indices) like it."""

    def __init__(self, config):
        super().__init__(config)
        self.gate = dict(config.jaxmoe_gate)

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hidden_states.float(), self.weight.float())  # jaxmoe: f32 router
        probs = torch.softmax(logits, dim=-1)
        indices, weights, mask = route(probs, self.gate)
        indices = torch.where(mask, indices, indices[:, :1])  # unused slot: weight 0
        return logits, weights, indices


class JaxmoeMoeForCausalLM(MixtralForCausalLM):
    """MixtralForCausalLM whose every MoE block routes with JaxmoeRouter."""

    config_class = JaxmoeMoeConfig

    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            router = JaxmoeRouter(config)
            router.weight = layer.mlp.gate.weight  # same parameter: loading fills it
            layer.mlp.gate = router
