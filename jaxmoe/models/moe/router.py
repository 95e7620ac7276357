"""Today's top-k routers (DeepSeek-V3, Qwen-MoE): sigmoid scores, a selection bias, group
limits, a routed scaling factor, and DeepSeek-V3's sequence-wise balance loss.

The classic path (softmax scores, no bias, one group) goes through gates.route unchanged;
`RouterOptions.plain` says when. Otherwise the choice and the weights come apart:
- scores_TE = softmax(logits) or sigmoid(logits) (`router_scoring`);
- choice_TE = scores + selection_bias [E] (when `selection_bias`), restricted to each
  token's `topk_group` best of `n_group` equal expert groups, a group scored by the sum of
  its two best biased scores (DeepSeek-V3 `noaux_tc`; experts outside get -inf);
- the top-k of choice_TE are the experts; their weights are their UNBIASED scores,
  renormalised when `renormalize` (softmax: as gates.combine_weights; sigmoid: / (sum +
  1e-20) as DeepSeek-V3), then times `routed_scaling_factor`.

The adaptive gates (`adaptive`, `adaptive_k`) work here too: the candidates are the top
`num_slots` of choice_TE, and a token keeps rank j while its gap to the top-1 on choice_TE
(the scores it is chosen by) is below the threshold (`adaptive_gap_normalization` says how
that gap is measured; why: docs/adaptive_k.md "Sigmoid and biased routers"). Masked slots
weigh 0 and the renormalisation sums over the kept slots only.
"""

from dataclasses import dataclass
from typing import Literal, get_args

import jax
import jax.numpy as jnp

from jaxmoe.fields import Options, check_choices, need, option
from jaxmoe.models.moe import gates
from jaxmoe.models.moe.adaptive_k import kept_ranks

Scoring = Literal["softmax", "sigmoid"]
SCORINGS: tuple[str, ...] = get_args(Scoring)

# The gates a selection bias / group limit works with: top-k choice, optionally adaptive.
ADAPTIVE_GATES = ("adaptive", "adaptive_k")
TOPK_GATES = ("top1", "top2", "topk", *ADAPTIVE_GATES)


@dataclass(frozen=True)
class RouterOptions(Options):
    """model.moe's router keys (a flat section: `model.moe.router_scoring`, ...): how expert
    scores are made and chosen from. Frozen and hashable: jitted code closes over it."""

    router_scoring: Scoring = option(
        "softmax", "expert scores: softmax | sigmoid (DeepSeek-V3: independent per expert)"
    )
    routed_scaling_factor: float = option(
        1.0, "routed experts' combine weights times this, after renormalize (DeepSeek)"
    )
    selection_bias: bool = option(
        False, "a per-expert bias [E] on the scores for choosing only, not trained (DeepSeek-V3)"
    )
    n_group: int = option(1, "group-limited routing: experts in n_group equal groups")
    topk_group: int = option(1, "group-limited routing: groups a token may use")

    def __post_init__(self) -> None:
        check_choices(self, "model.moe.")
        need(
            self.routed_scaling_factor > 0,
            f"model.moe.routed_scaling_factor={self.routed_scaling_factor} must be > 0",
        )
        need(self.n_group >= 1, f"model.moe.n_group={self.n_group} must be >= 1")
        need(
            1 <= self.topk_group <= self.n_group,
            f"model.moe.topk_group={self.topk_group} must be in [1, n_group={self.n_group}]",
        )

    @property
    def plain(self) -> bool:
        """Choice and weights from the same softmax probabilities (the classic gates)."""
        return self.router_scoring == "softmax" and not self.selection_bias and self.n_group == 1


def router_scores(logits_TE: jax.Array, scoring: str) -> jax.Array:
    """f32 [T, E]: softmax over experts, or an independent sigmoid per expert."""
    logits_TE = logits_TE.astype(jnp.float32)
    if scoring == "sigmoid":
        return jax.nn.sigmoid(logits_TE)
    return jax.nn.softmax(logits_TE, axis=-1)


def normalised_scores(scores_TE: jax.Array, scoring: str) -> jax.Array:
    """Scores that sum to one per token (what balance losses average): sigmoid scores divided
    by their sum, softmax probabilities as they are."""
    if scoring == "sigmoid":
        return scores_TE / jnp.sum(scores_TE, axis=-1, keepdims=True)
    return scores_TE


def choice_scores(scores_TE, bias_E, n_group: int, topk_group: int) -> jax.Array:
    """The scores experts are chosen by: biased, -inf outside the token's best groups."""
    choice_TE = scores_TE if bias_E is None else scores_TE + bias_E
    if n_group == 1:
        return choice_TE
    tokens, experts = choice_TE.shape
    grouped_TGS = choice_TE.reshape(tokens, n_group, experts // n_group)
    group_score_TG = jnp.sum(jax.lax.top_k(grouped_TGS, 2)[0], axis=-1)
    _, best_groups_TK = jax.lax.top_k(group_score_TG, topk_group)
    keep_TG = jnp.any(jax.nn.one_hot(best_groups_TK, n_group, dtype=bool), axis=1)
    keep_TGS = jnp.broadcast_to(keep_TG[..., None], grouped_TGS.shape)
    return jnp.where(keep_TGS, grouped_TGS, -jnp.inf).reshape(tokens, experts)


def adaptive_gap_normalization(router: RouterOptions, gate: gates.GateOptions) -> str:
    """How the adaptive gap is measured on the choice scores: as `gap_normalization` says
    for softmax scores without a selection bias; as a plain difference ("none") otherwise.
    A biased score can be <= 0 (the pair renormalisation then has no meaning) and the
    ranking ignores a common shift of all biases, which a difference ignores and a ratio
    does not; sigmoid scores lie in (0, 1) whatever the number of experts, so their
    difference keeps one scale (the reason "top2" exists for softmax does not apply)."""
    if router.router_scoring == "softmax" and not router.selection_bias:
        return gate.gap_normalization
    return "none"


def route(scores_TE, bias_E, router: RouterOptions, gate: gates.GateOptions) -> gates.Routing:
    """Top-k routing of the module docstring; `gate` gives k, `renormalize` and, for the
    adaptive gates, the threshold of the gap rule."""
    if router.plain:
        routing = gates.route(scores_TE, gate)
    else:
        choice_TE = choice_scores(scores_TE, bias_E, router.n_group, router.topk_group)
        ranked_TK, indices_TK = jax.lax.top_k(choice_TE, gates.num_slots(gate))
        indices_TK = indices_TK.astype(jnp.int32)
        chosen_TK = jnp.take_along_axis(scores_TE, indices_TK, axis=-1)
        mask_TK = jnp.ones(indices_TK.shape, bool)
        if gate.gating in ADAPTIVE_GATES:
            normalization = adaptive_gap_normalization(router, gate)
            mask_TK = kept_ranks(ranked_TK, gate.threshold, normalization)
        weights_TK = _chosen_weights(chosen_TK, mask_TK, router, gate)
        routing = gates.Routing(indices_TK, weights_TK, mask_TK)
    return _scaled(routing, router)


def _chosen_weights(chosen_TK, mask_TK, router: RouterOptions, gate: gates.GateOptions):
    """Combine weights of the chosen experts from their (unbiased) scores chosen_TK."""
    if router.router_scoring == "sigmoid":
        weights_TK = jnp.where(mask_TK, chosen_TK, 0.0)
        if gate.renormalize:
            total_T1 = jnp.sum(weights_TK, axis=-1, keepdims=True)
            weights_TK = weights_TK / (total_T1 + 1e-20)
        return weights_TK
    return gates.combine_weights(chosen_TK, mask_TK, gate)


def _scaled(routing: gates.Routing, router: RouterOptions) -> gates.Routing:
    if router.routed_scaling_factor != 1.0:
        routing = routing._replace(weights=routing.weights * router.routed_scaling_factor)
    return routing


def replay(scores_TE, experts_TK, router: RouterOptions, gate: gates.GateOptions) -> gates.Routing:
    """Router replay: the experts of a record (experts_TK int [T, K], -1 in unused slots:
    a variable count per token), weighted as `route` weighs its own choices, from the live
    scores (so the router keeps its gradient). Replaying the experts `route` chose gives
    `route`'s weights and mask value for value (an unused slot's index, which nothing
    reads, is 0 here)."""
    mask_TK = experts_TK >= 0
    indices_TK = jnp.where(mask_TK, experts_TK, 0).astype(jnp.int32)
    chosen_TK = jnp.take_along_axis(scores_TE, indices_TK, axis=-1)
    weights_TK = _chosen_weights(chosen_TK, mask_TK, router, gate)
    return _scaled(gates.Routing(indices_TK, weights_TK, mask_TK), router)


def expert_load(routing: gates.Routing, num_experts: int, token_mask_T) -> jax.Array:
    """f32 [E]: token-slots routed to each expert over the real tokens (before any drop).
    Under a mesh the sum over tokens is the cross-device reduction of the global batch."""
    chosen_TK = routing.mask & token_mask_T[:, None]
    onehot_TKE = jax.nn.one_hot(routing.indices, num_experts, dtype=jnp.float32)
    return jnp.sum(onehot_TKE * chosen_TK[..., None].astype(jnp.float32), axis=(0, 1))


def sequence_balance_loss(norm_scores_BLE, routing_BLK, mask_BLK, token_mask_BL) -> jax.Array:
    """DeepSeek-V3's sequence-wise balance loss, the mean over sequences of
    E / K * sum_e f_e P_e, f_e = (slots of the sequence routed to e) / (real tokens),
    P_e = mean over its real tokens of the normalised scores (1 under perfect balance).
    K is the number of slots per token. f32 scalar; a sequence without real tokens gives 0."""
    num_experts = norm_scores_BLE.shape[-1]
    slots = routing_BLK.shape[-1]
    real_BL = token_mask_BL.astype(jnp.float32)
    tokens_B = jnp.maximum(jnp.sum(real_BL, axis=1), 1.0)
    chosen_BLK = mask_BLK.astype(jnp.float32) * real_BL[..., None]
    onehot_BLKE = jax.nn.one_hot(routing_BLK, num_experts, dtype=jnp.float32)
    counts_BE = jnp.sum(onehot_BLKE * chosen_BLK[..., None], axis=(1, 2))
    f_BE = jax.lax.stop_gradient(counts_BE / tokens_B[:, None])  # hard choices: no gradient
    p_BE = jnp.sum(norm_scores_BLE * real_BL[..., None], axis=1) / tokens_B[:, None]
    per_seq_B = num_experts / slots * jnp.sum(f_BE * p_BE, axis=-1)
    has_tokens_B = jnp.sum(real_BL, axis=1) > 0
    return jnp.sum(per_seq_B * has_tokens_B) / jnp.maximum(jnp.sum(has_tokens_B), 1.0)
