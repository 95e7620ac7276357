"""Direct preference optimisation (`train.objective=dpo`; Rafailov et al. 2023), with the
conventions of TRL's DPOTrainer (its default `sigmoid` loss):

    logits = (log pi(y_c|x) - log pi(y_r|x)) - (log ref(y_c|x) - log ref(y_r|x))
    loss   = -(1 - eps) log sigmoid(beta logits) - eps log sigmoid(-beta logits)

averaged over the pairs of the batch, where log pi(y|x) sums the log-probabilities of the
response's tokens and its EOS (the prompt is not scored), beta is `train.dpo_beta` and eps
`train.dpo_label_smoothing` (conservative DPO: the share of pairs taken as mislabelled).
Reported, as TRL does: rewards beta (log pi - log ref) of the chosen and the rejected
responses, their margin, and the share of pairs whose chosen reward is the larger
(`rewards_accuracy`); `logps_accuracy` is the share the policy itself prefers.

The reference is the frozen initial model: the `train.init_from` checkpoint, or under
train.lora the base with its adapters at zero (the same computation, no second copy of the
weights). Pairs come packed as documents (data.format=preference, data/batch_fields.py):
segments 2j + 1 and 2j + 2 of a row are the chosen and the rejected response of pair j.
"""

import jax
import jax.numpy as jnp
import optax

# Per-batch sums of the step (divided by the number of pairs for the logs).
SUM_KEYS = (
    "dpo_loss_sum",
    "rewards_chosen_sum",
    "rewards_rejected_sum",
    "rewards_margin_sum",
    "rewards_accuracy_sum",
    "logps_accuracy_sum",
)


def segment_sums(values_BL, segment_ids_BL):
    """f32 [B, L + 1]: the sum of `values` over each segment id 0..L of each row."""
    b, length = segment_ids_BL.shape
    ids = segment_ids_BL + (length + 1) * jnp.arange(b, dtype=segment_ids_BL.dtype)[:, None]
    sums = jax.ops.segment_sum(
        values_BL.reshape(-1).astype(jnp.float32), ids.reshape(-1), num_segments=b * (length + 1)
    )
    return sums.reshape(b, length + 1)


def _pairs(per_segment_BS, length: int):
    """(chosen [B, P], rejected [B, P]) of per-segment values, P = L // 2 slots per row."""
    pairs = length // 2
    return per_segment_BS[:, 1::2][:, :pairs], per_segment_BS[:, 2::2][:, :pairs]


def valid_pairs(batch):
    """bool [B, P]: the pair slots of each row that hold a pair (both sides scored)."""
    weights = batch["weights"]
    chosen, rejected = _pairs(segment_sums(weights, batch["segment_ids"]), weights.shape[1])
    return (chosen > 0) & (rejected > 0)


def pair_count(batch):
    """The number of pairs in a batch (at least 1, a divisor)."""
    return jnp.maximum(jnp.sum(valid_pairs(batch).astype(jnp.float32)), 1.0)


def response_logps(logits_BLV, batch):
    """(chosen, rejected) f32 [B, P]: each response's summed log-probability of its scored
    tokens (the response and its EOS)."""
    nll_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, batch["targets"])
    logp_BL = -nll_BL * batch["weights"]
    return _pairs(segment_sums(logp_BL, batch["segment_ids"]), logp_BL.shape[1])


def dpo_sums(policy, reference, valid_BP, beta: float, smoothing: float) -> dict:
    """The batch's sums of the DPO loss and its metrics over the valid pairs; `policy` and
    `reference` are (chosen, rejected) log-probabilities [B, P] each."""
    (pi_c, pi_r), (ref_c, ref_r) = policy, reference
    logits = (pi_c - pi_r) - (ref_c - ref_r)
    losses = (
        -jax.nn.log_sigmoid(beta * logits) * (1.0 - smoothing)
        - jax.nn.log_sigmoid(-beta * logits) * smoothing
    )
    chosen = jax.lax.stop_gradient(beta * (pi_c - ref_c))
    rejected = jax.lax.stop_gradient(beta * (pi_r - ref_r))
    valid = valid_BP.astype(jnp.float32)

    def total(x):
        return jnp.sum(x.astype(jnp.float32) * valid)

    return {
        "dpo_loss_sum": total(losses),
        "rewards_chosen_sum": total(chosen),
        "rewards_rejected_sum": total(rejected),
        "rewards_margin_sum": total(chosen - rejected),
        "rewards_accuracy_sum": total(chosen > rejected),
        "logps_accuracy_sum": total(jax.lax.stop_gradient(pi_c > pi_r)),
    }


def dpo_metrics(sums: dict, pairs) -> dict:
    """The logged means: loss, rewards_chosen, rewards_rejected, rewards_margin,
    rewards_accuracy, logps_accuracy."""
    return {
        key.removesuffix("_sum").replace("dpo_loss", "loss"): sums[key] / pairs for key in SUM_KEYS
    }


def dpo_eval_step(params, reference, batch, forward, beta: float, smoothing: float) -> dict:
    """Sums over an evaluation batch (`forward(params, batch) -> logits`), and its pairs;
    `reference_logps_accuracy`: the share of pairs the reference (the initial model)
    prefers the chosen response of, what `logps_accuracy` started from."""
    valid = valid_pairs(batch)
    ref_c, ref_r = response_logps(forward(reference, batch), batch)
    sums = dpo_sums(
        response_logps(forward(params, batch), batch), (ref_c, ref_r), valid, beta, smoothing
    )
    prefers = jnp.sum((ref_c > ref_r).astype(jnp.float32) * valid)
    return sums | {"pairs": jnp.sum(valid.astype(jnp.float32)), "reference_prefers": prefers}
