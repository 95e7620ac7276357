"""Gates: pure functions from router probabilities to (expert indices, combine weights, mask).

Every gate maps probs_TE [T, E] (softmax of the router logits, f32) to a `Routing` of
indices_TK (int32), weights_TK (f32) and mask_TK (bool) with a static number K of slots per
token; slot 0 is the top-1 expert, later slots are lower ranked. Masked slots carry weight 0
and must be ignored by the dispatch.

- `top1` (Switch): K = 1. `top2` (GShard): K = 2. `topk`: K = top_k.
- `adaptive` (Li et al. 2023): K = 2; the second expert is used when gap < threshold
  (strict, as in the paper), where with `gap_normalization`
    "top2" (default): gap = (p1 - p2) / (p1 + p2), the top-2 probabilities renormalised to
      sum to one (the paper "normalizes the expert probability"; this is its most likely
      reading). The gap lies in [0, 1]: threshold 0 is top-1, threshold 1 is top-2 (for
      every token whose second probability is not exactly 0);
    "none": gap = p1 - p2 on the raw softmax probabilities.
  Any threshold >= 0 is accepted (above 1 the "top2" gap always passes). With sigmoid
  scores, a selection bias or group limits the adaptive gates run in router.py instead.
- `top_p` (Huang et al. 2024): the smallest set of experts, by descending probability,
  whose probabilities sum to at least top_p, capped at K = max_k experts (static shapes).
- `adaptive_k`: the adaptive gate for top-k routers, K = max_k (adaptive_k.py).

Combine weights, for every gate (the paper: "weighted by the router probabilities of the
chosen experts"; it leaves the two details below open):
- `renormalize` (default False): a token with two or more experts gets their raw router
  probabilities (False) or those probabilities divided by their sum (True, as in GShard
  and Mixtral).
- `single_weight` (default "prob"): a token with one expert gets its probability ("prob",
  as in Switch) or 1 ("one").

Losses (unweighted; the trainer multiplies by the config coefficients):
- `balance_loss`: E * sum_e f_e * P_e with P_e the mean router probability of expert e.
  For `adaptive`, f_e is the share of tokens whose top-1 expert is e (the paper's Eq. 4:
  second choices carry no balancing term). For the other gates, f_e is expert e's share of
  all chosen (unmasked) assignments; for top1 this is the Switch loss, for top2 / topk the
  GShard form counting every choice. Both equal 1 under perfect balance. Counts are taken
  before any capacity drop (they measure the router, not the dispatch). `fractions`
  overrides the choice: "top1" counts only each token's top-1 expert for any gate (what
  GShard's implementation does for its top-2 baseline), "chosen" every unmasked choice.
- `z_loss` (ST-MoE): mean over tokens of logsumexp(logits)^2.

Both losses take an optional `token_mask_T` (bool [T]): padding tokens (mask False) count
neither in f_e nor in P_e nor in the z-loss mean, so a padded batch has the losses of the
same batch without its padding (means over real tokens; an all-padding batch gives 0).
"""

from dataclasses import dataclass
from typing import Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp

from jaxmoe.fields import Options, check_choices, need, option
from jaxmoe.models.moe.adaptive_k import kept_ranks

Gating = Literal["top1", "top2", "topk", "adaptive", "top_p", "adaptive_k"]
GapNormalization = Literal["top2", "none"]
SingleWeight = Literal["prob", "one"]
GATES: tuple[str, ...] = get_args(Gating)
GAP_NORMALIZATIONS: tuple[str, ...] = get_args(GapNormalization)
SINGLE_WEIGHTS: tuple[str, ...] = get_args(SingleWeight)


class Routing(NamedTuple):
    """indices_TK int32, weights_TK f32 (0 where masked), mask_TK bool."""

    indices: jax.Array
    weights: jax.Array
    mask: jax.Array


@dataclass(frozen=True)
class GateOptions(Options):
    """model.moe's gate keys (a flat section: `model.moe.threshold`, ...): which experts a
    token takes and their combine weights. Frozen and hashable: jitted code closes over it."""

    gating: Gating = option("adaptive", "router policy")
    threshold: float = option(
        0.1,
        "adaptive / adaptive_k: the next expert while its gap to the top-1 < threshold (>= 0; "
        "sigmoid or biased routers: on the selection scores, docs/adaptive_k.md)",
    )
    top_k: int = option(2, "topk: experts per token")
    top_p: float = option(0.4, "top_p: smallest expert set whose probabilities pass p")
    max_k: int = option(2, "top_p / adaptive_k: at most this many experts per token")
    gap_normalization: GapNormalization = option(
        "top2", "adaptive gap on: top2 (p1,p2 renormalised) | none (raw)"
    )
    renormalize: bool = option(
        False, "chosen weights / their sum (HF norm_topk_prob; sigmoid: / (sum + 1e-20))"
    )
    single_weight: SingleWeight = option("prob", "weight of a one-expert token")

    def __post_init__(self) -> None:
        check_choices(self, "model.moe.")
        need(self.top_k >= 1, f"model.moe.top_k={self.top_k} must be >= 1")
        need(self.max_k >= 1, f"model.moe.max_k={self.max_k} must be >= 1")
        need(0.0 < self.top_p <= 1.0, f"model.moe.top_p={self.top_p} not in (0, 1]")
        # Above 1 a pair-renormalised gap (in [0, 1)) always passes; a raw gap of biased
        # sigmoid scores (router.py) can exceed 1, so any T >= 0 is allowed.
        need(self.threshold >= 0.0, f"model.moe.threshold={self.threshold} must be >= 0")


def num_slots(cfg: GateOptions) -> int:
    """K, the static number of expert slots per token."""
    if cfg.gating in ("top_p", "adaptive_k"):
        return cfg.max_k
    return {"top1": 1, "top2": 2, "topk": cfg.top_k, "adaptive": 2}[cfg.gating]


def combine_weights(chosen_TK, mask_TK, cfg: GateOptions):
    """Weights of the chosen experts from their probabilities chosen_TK (see module doc)."""
    chosen_TK = jnp.where(mask_TK, chosen_TK, 0.0)
    # Softmax probabilities can underflow to 0; keep the division finite.
    total_T1 = jnp.maximum(jnp.sum(chosen_TK, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    multi_TK = chosen_TK / total_T1 if cfg.renormalize else chosen_TK
    single_TK = chosen_TK if cfg.single_weight == "prob" else mask_TK.astype(chosen_TK.dtype)
    is_single_T1 = jnp.sum(mask_TK, axis=-1, keepdims=True) == 1
    return jnp.where(is_single_T1, single_TK, multi_TK)


def _first_k(probs_TE, k: int):
    k = min(k, probs_TE.shape[-1])
    chosen_TK, indices_TK = jax.lax.top_k(probs_TE, k)  # ties: lower index first
    return chosen_TK, indices_TK.astype(jnp.int32)


def topk_gate(probs_TE, cfg: GateOptions, k: int) -> Routing:
    """The k most probable experts for every token (top1: k = 1, top2: k = 2)."""
    chosen_TK, indices_TK = _first_k(probs_TE, k)
    mask_TK = jnp.ones(indices_TK.shape, bool)
    return Routing(indices_TK, combine_weights(chosen_TK, mask_TK, cfg), mask_TK)


def adaptive_gate(probs_TE, cfg: GateOptions) -> Routing:
    """Top-2 where the (normalised) gap p1 - p2 is below the threshold, else top-1."""
    chosen_T2, indices_T2 = _first_k(probs_TE, 2)
    p1_T, p2_T = chosen_T2[:, 0], chosen_T2[:, 1]
    gap_T = p1_T - p2_T
    if cfg.gap_normalization == "top2":
        gap_T = gap_T / (p1_T + p2_T)
    mask_T2 = jnp.stack([jnp.ones_like(p1_T, bool), gap_T < cfg.threshold], axis=1)
    return Routing(indices_T2, combine_weights(chosen_T2, mask_T2, cfg), mask_T2)


def top_p_gate(probs_TE, cfg: GateOptions) -> Routing:
    """The smallest descending set of experts whose probabilities reach top_p (<= max_k)."""
    chosen_TK, indices_TK = _first_k(probs_TE, cfg.max_k)
    # An expert joins while the experts ranked above it sum to less than p (the first always).
    before_TK = jnp.cumsum(chosen_TK, axis=-1) - chosen_TK
    mask_TK = before_TK < cfg.top_p
    return Routing(indices_TK, combine_weights(chosen_TK, mask_TK, cfg), mask_TK)


def adaptive_k_gate(probs_TE, cfg: GateOptions) -> Routing:
    """The top-1 expert plus every expert up to rank max_k within the gap threshold of it
    (the rule: adaptive_k.py)."""
    chosen_TK, indices_TK = _first_k(probs_TE, cfg.max_k)
    mask_TK = kept_ranks(chosen_TK, cfg.threshold, cfg.gap_normalization)
    return Routing(indices_TK, combine_weights(chosen_TK, mask_TK, cfg), mask_TK)


def route(probs_TE: jax.Array, cfg: GateOptions) -> Routing:
    """Applies the gate named by cfg.gating to probs_TE [T, E]."""
    if cfg.gating == "adaptive":
        return adaptive_gate(probs_TE, cfg)
    if cfg.gating == "top_p":
        return top_p_gate(probs_TE, cfg)
    if cfg.gating == "adaptive_k":
        return adaptive_k_gate(probs_TE, cfg)
    return topk_gate(probs_TE, cfg, num_slots(cfg))


BALANCE_FRACTIONS = ("auto", "top1", "chosen")


def _token_weights(num_tokens: int, token_mask_T) -> jax.Array:
    """f32 [T]: 1 for real tokens, 0 for padding (all 1 without a mask)."""
    if token_mask_T is None:
        return jnp.ones((num_tokens,), jnp.float32)
    return token_mask_T.reshape(num_tokens).astype(jnp.float32)


def balance_loss(
    probs_TE: jax.Array,
    routing: Routing,
    gating: str,
    fractions: str = "auto",
    token_mask_T: jax.Array | None = None,
) -> jax.Array:
    """E * sum_e f_e * P_e over the real tokens (see the module docstring); a f32 scalar."""
    if fractions not in BALANCE_FRACTIONS:
        raise ValueError(f"balance fractions {fractions!r} not one of {BALANCE_FRACTIONS}")
    num_tokens, num_experts = probs_TE.shape
    real_T = _token_weights(num_tokens, token_mask_T)
    num_real = jnp.maximum(jnp.sum(real_T), 1.0)
    mean_prob_E = jnp.sum(probs_TE * real_T[:, None], axis=0) / num_real
    top1_only = fractions == "top1" or (fractions == "auto" and gating == "adaptive")
    if top1_only:
        top1_TE = jax.nn.one_hot(routing.indices[:, 0], num_experts, dtype=jnp.float32)
        fraction_E = jnp.sum(top1_TE * real_T[:, None], axis=0) / num_real
    else:
        chosen_TKE = jax.nn.one_hot(routing.indices, num_experts, dtype=jnp.float32)
        chosen_TK = routing.mask * real_T[:, None]
        counts_E = jnp.sum(chosen_TKE * chosen_TK[..., None], axis=(0, 1))
        fraction_E = counts_E / jnp.maximum(jnp.sum(counts_E), 1.0)
    # The fractions come from hard choices: no gradient flows through them (as in Switch).
    return num_experts * jnp.sum(jax.lax.stop_gradient(fraction_E) * mean_prob_E)


def z_loss(logits_TE: jax.Array, token_mask_T: jax.Array | None = None) -> jax.Array:
    """Router z-loss: mean over real tokens of logsumexp(logits_t)^2 (a f32 scalar)."""
    real_T = _token_weights(logits_TE.shape[0], token_mask_T)
    z_T = jnp.square(jax.nn.logsumexp(logits_TE.astype(jnp.float32), axis=-1))
    return jnp.sum(z_T * real_T) / jnp.maximum(jnp.sum(real_T), 1.0)
