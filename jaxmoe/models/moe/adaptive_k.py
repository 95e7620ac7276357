"""`adaptive_k`: the adaptive gate (Li et al. 2023) generalised to top-k routers.

A token keeps its top-1 expert and also takes every expert of rank j = 2..max_k whose gap to
the top-1 expert is below `threshold`, the gap normalised as the adaptive gate's:

    gap_normalization "top2" (default): (p1 - pj) / (p1 + pj), the pair (p1, pj) renormalised
                                         to sum to one, exactly the adaptive gate's formula;
    gap_normalization "none":           p1 - pj on the raw router probabilities.

At max_k = 2 this is the adaptive gate, token for token. Because pj falls with j, the gap
rises with j, so the chosen slots are always a prefix of the ranking (the rule needs no scan).
For "top2" the rule is a logit margin: pj / p1 > (1 - T) / (1 + T), i.e.
logit_1 - logit_j < log((1 + T) / (1 - T)), whatever the number of experts. Why this rule and
not a chain of neighbour gaps or cumulative top-p: docs/adaptive_k.md.

Shapes are static: max_k slots per token, slot j the rank-(j+1) expert, masked slots weight 0.
This module holds the rule; gates.py's `adaptive_k_gate` turns it into a Routing, and
router.py applies it to the selection scores (bias and group limit included) of sigmoid,
biased and group-limited routers, as a plain difference there (docs/adaptive_k.md).
"""

import jax
import jax.numpy as jnp


def kept_ranks(chosen_TK: jax.Array, threshold: float, gap_normalization: str) -> jax.Array:
    """bool [T, K]: which of the descending probabilities chosen_TK [T, K] a token keeps."""
    p1_T1 = chosen_TK[:, :1]
    gap_TK = p1_T1 - chosen_TK
    if gap_normalization == "top2":
        # Written as the adaptive gate writes it, so max_k = 2 matches it bit for bit.
        gap_TK = gap_TK / (p1_T1 + chosen_TK)
    # Slot 0 is always kept: its gap is 0, which threshold 0 would otherwise reject.
    first_TK = jnp.arange(chosen_TK.shape[1]) == 0
    return first_TK | (gap_TK < threshold)
