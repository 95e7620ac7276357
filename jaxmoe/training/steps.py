"""The pure train and eval steps: `(state, batch) -> (state, metrics)`.

`state` is a dict {"step", "params", "opt_state"} of arrays; `params` is the model's
parameters as a nested dict with string keys (what Orbax saves and converters write).
The model is rebuilt from (graphdef, params) inside the traced function, which costs
nothing at run time.
"""

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxmoe.checkpoints.trees import join
from jaxmoe.models.layer_kinds import is_moe_layer
from jaxmoe.models.layers import head_logits
from jaxmoe.models.moe import balancing
from jaxmoe.models.mtp import ahead_in_document, mtp_key, shifted
from jaxmoe.models.options import ModelOptions
from jaxmoe.models.spec import merge_model
from jaxmoe.models.stack import head_of, period_of
from jaxmoe.models.transformer import MAX_LOGIT
from jaxmoe.training import dpo
from jaxmoe.training.chunked_loss import chunked_output_losses
from jaxmoe.training.freezing import mask_gradients
from jaxmoe.training.options import OptimizerOptions, TrainOptions
from jaxmoe.training.qk_clip import attention_sites, qk_clip, site_keys

SCALAR_MOE_KEYS = (
    "top2_fraction",
    "expert_load_cv",
    "dropped_fraction",
    "exchange_overflow",
    "kept_fraction",
)
# Micro-batch values that add up to the step's (the rest are averaged).
SUMMED_KEYS = (
    "nll_sum",
    "weighted_balance_loss",
    "weighted_router_z_loss",
    "weighted_sequence_balance_loss",
    "logits_z_loss",
    "expert_load_ME",
    "mtp_nll_sum_D",
    *dpo.SUM_KEYS,
)


@dataclass(frozen=True)
class StepFns:
    """What the pure steps need besides (state, batch); static under jit."""

    graphdef: nnx.GraphDef
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    balance_loss_weight: float
    z_loss_weight: float
    grad_accum: int
    skip_nonfinite: bool
    rest: nnx.State | None = None  # non-parameter model state (ModelSpec.rest)
    seed: int = 0  # base of the per-step router-jitter and dropout keys
    logits_z_loss: float = 0.0  # T5X's output z-loss coefficient (train.logits_z_loss)
    loss_chunk: int = 0  # train.loss_chunk: positions per output-loss chunk (0 = all at once)
    sequence_balance_weight: float = 0.0  # DeepSeek-V3's sequence-wise balance loss
    # Selection biases (model.moe.selection_bias): kept off the optimizer, moved by
    # bias_update_rate * sign(mean load - load) after each step over these decoder layers.
    selection_bias: bool = False
    bias_update_rate: float = 0.0
    moe_layer_ids: tuple = ()
    period: int = 1
    scan_head: int = 0  # layers a scanned stack unrolls before its periods (stack.head_of)
    # train.freeze / train.trainable (freezing.py): per parameter leaf, in tree order, whether
    # it is frozen (its gradient dropped where it is computed); None: all train.
    frozen_leaves: tuple[bool, ...] | None = None
    # MuonClip (optimizer.qk_clip = tau > 0): the forward pass reports each attention
    # module's largest logit per head; qk_clip.py rescales its query/key weights after the
    # update. Sites: (param path, aux key(s)); nope: MLA's qk_nope_head_dim.
    qk_clip: float = 0.0
    qk_clip_sites: tuple = ()
    qk_nope: int = 0
    mtp_depth: int = 0  # model.mtp_depth: multi-token prediction modules (models/mtp.py)
    mtp_weight: float = 0.0  # model.mtp_weight: their loss's coefficient lambda
    objective: str = "lm"  # train.objective: lm | dpo (training/dpo.py)
    dpo_beta: float = 0.1
    dpo_label_smoothing: float = 0.0


def step_fns(
    train: TrainOptions,
    opt: OptimizerOptions,
    m: ModelOptions,
    spec,
    optimizer,
    schedule,
    frozen=None,
) -> StepFns:
    """The StepFns of run `train` with optimizer options `opt` of model `m`, for its spec
    (models/spec.py: model_spec), optimizer and learning-rate schedule
    (training/optimizer.py: make_optimizer); `frozen`: freezing.frozen_tree of the
    parameters (None: all train)."""
    moe = m.moe
    return StepFns(
        frozen_leaves=None if frozen is None else tuple(jax.tree.leaves(frozen)),
        graphdef=spec.graphdef,
        optimizer=optimizer,
        schedule=schedule,
        balance_loss_weight=moe.balance_loss_weight,
        z_loss_weight=moe.z_loss_weight,
        grad_accum=train.grad_accum,
        skip_nonfinite=train.nonfinite == "skip",
        rest=spec.rest,
        seed=train.seed,
        logits_z_loss=train.logits_z_loss,
        loss_chunk=train.loss_chunk,
        sequence_balance_weight=moe.sequence_balance_weight,
        selection_bias=bool(moe.num_experts and moe.router.selection_bias),
        bias_update_rate=moe.bias_update_rate,
        moe_layer_ids=moe_layer_keys(m),
        period=period_of(m),
        scan_head=head_of(m) if m.scan_layers else 0,
        qk_clip=opt.qk_clip,
        qk_clip_sites=attention_sites(m) if opt.qk_clip else (),
        qk_nope=m.qk_nope_head_dim if m.attention == "mla" else 0,
        mtp_depth=m.mtp_depth,
        mtp_weight=m.mtp_weight,
        objective=train.objective,
        dpo_beta=train.dpo_beta,
        dpo_label_smoothing=train.dpo_label_smoothing,
    )


def moe_layer_keys(m) -> tuple:
    """The aux keys of the decoder's MoE layers in model order: layer ids, then the MTP
    modules' (models/mtp.py mtp_key) whose blocks are MoE."""
    depth, n = m.mtp_depth, m.num_layers
    main = tuple(i for i in range(n) if is_moe_layer(m, i))
    return main + tuple(mtp_key(k) for k in range(depth) if is_moe_layer(m, n + k))


def forward(
    graphdef,
    params,
    batch,
    *,
    train: bool,
    rest=None,
    rng=None,
    max_logits=False,
    record_routing: bool = False,
):
    """logits [B, L, V] f32 and MoE aux {layer: dict} for a decoder or encoder-decoder batch.

    Positions of loss weight 0 (padding; a decoder-only window's last real token, whose
    prediction is padding too) count in no MoE loss or routing statistic (the complexity
    vectors): with causal attention nothing they route reaches a weighted prediction. Packed
    rows (segment ids) count every token of a document instead: a prompt's tokens are not
    scored but route like any other.
    `max_logits` (decoders): each layer's aux also holds its attention's largest logit per
    head (models/transformer.py MAX_LOGIT), for MuonClip. `record_routing` (decoders): each
    MoE layer's aux holds its chosen experts, "experts" [B, L, K] (-1: unused slot).
    """
    model = merge_model(graphdef, params, rest, rng)
    return _call(
        model, batch, train=train, head=True, max_logits=max_logits, record_routing=record_routing
    )


def forward_hidden(
    graphdef, params, batch, *, train: bool, rest=None, rng=None, max_logits: bool = False
):
    """`forward` stopped before the output layer: (its input [B, L, D], (head matrix [D, V],
    logit scale), aux), for chunked_loss.chunked_output_losses."""
    model = merge_model(graphdef, params, rest, rng)
    hidden_BLD, aux = _call(model, batch, train=train, head=False, max_logits=max_logits)
    return hidden_BLD, model.output_weights(), aux


def real_positions_BL(batch):
    """bool [B, L]: the decoder positions that hold tokens (for the MoE statistics): those
    of a document in packed rows, else those with loss weight > 0; None = all."""
    if "segment_ids" in batch:
        return batch["segment_ids"] > 0
    return batch["weights"] > 0 if "weights" in batch else None


def _call(model, batch, *, train: bool, head: bool, max_logits: bool = False, record_routing=False):
    """The model on a batch's fields (data/batch_fields.py)."""
    token_mask = real_positions_BL(batch)
    segments = batch.get("segment_ids")
    if "encoder_inputs" in batch:
        return model(
            batch["encoder_inputs"],
            batch["inputs"],
            train=train,
            token_mask_BL=token_mask,
            head=head,
            segment_ids_BL=segments,
            encoder_segment_ids_BS=batch.get("encoder_segment_ids"),
        )
    extra = {"max_logits": True} if max_logits else {}
    if "routing" in batch:  # recorded experts, replayed under model.moe.replay
        extra["routing_BLMK"] = batch["routing"]
    if record_routing:
        extra["record_routing"] = True
    return model(
        batch["inputs"],
        train=train,
        token_mask_BL=token_mask,
        head=head,
        segment_ids_BL=segments,
        positions_BL=batch.get("positions"),
        **extra,
    )


def real_tokens_BM(batch, layers) -> jax.Array:
    """Real tokens float32 [B, M] of each example in each MoE layer (`layers`: aux keys in
    model order), as `forward` masks them: the encoder's non-padding tokens in encoder
    layers, the positions of loss weight > 0 elsewhere. With routing_BM's fractions they
    give the curriculum its top-2 token counts."""
    b, length = batch["inputs"].shape
    decoder_B = jnp.full((b,), length, jnp.float32)
    real_BL = real_positions_BL(batch)
    if real_BL is not None:
        decoder_B = jnp.sum(real_BL, axis=1).astype(jnp.float32)
    columns = [decoder_B] * len(layers)
    if "encoder_inputs" in batch:
        encoder_B = jnp.sum(batch["encoder_inputs"] != 0, axis=1).astype(jnp.float32)
        columns = [encoder_B if str(i).startswith("encoder") else decoder_B for i in layers]
    return jnp.stack(columns, axis=1)


def token_nll(logits_BLV, targets_BL):
    return optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL)


def logits_z_loss_sum(logits_BLV, weights_BL):
    """Sum over target tokens of logsumexp(logits)^2 (T5X's z-loss, before its coefficient):
    it pulls the softmax normaliser towards 1, which keeps bf16 logits well scaled."""
    log_z = jax.nn.logsumexp(logits_BLV, axis=-1)
    return jnp.sum(jnp.square(log_z) * weights_BL)


def moe_summary(aux: dict) -> dict:
    """Scalar MoE metrics: means over MoE layers plus per-layer top-2 fractions."""
    if not aux:
        return {}
    layers = list(aux)  # models give aux in layer order (sorted() put decoder_10 first)
    out = {key: jnp.mean(jnp.stack([aux[i][key] for i in layers])) for key in SCALAR_MOE_KEYS}
    out["balance_loss"] = jnp.mean(jnp.stack([aux[i]["balance_loss"] for i in layers]))
    out["router_z_loss"] = jnp.mean(jnp.stack([aux[i]["router_z_loss"] for i in layers]))
    for i in layers:
        out[f"top2_fraction/layer_{i}"] = aux[i]["top2_fraction"]
    return out


def _head_losses(hidden_BLD, w_DV, scale, targets_BL, weights_BL, fns: StepFns, z: bool):
    """(weighted NLL sum, weighted logsumexp^2 sum or None) of the output layer on hidden
    states: whole, or `fns.loss_chunk` positions at a time."""
    if fns.loss_chunk:
        nll_sum, z_sum = chunked_output_losses(
            hidden_BLD, w_DV, scale, targets_BL, weights_BL, fns.loss_chunk
        )
        return nll_sum, z_sum if z else None
    logits = head_logits(hidden_BLD, w_DV, scale)
    nll_sum = jnp.sum(token_nll(logits, targets_BL) * weights_BL)
    return nll_sum, logits_z_loss_sum(logits, weights_BL) if z else None


def _output_losses(params, batch, rng, fns: StepFns):
    """(weighted NLL sum, weighted logsumexp^2 sum or None when unused, MoE aux, the MTP
    modules' weighted NLL sums [D] or None): from the full logits, or chunk by chunk with
    `fns.loss_chunk` (the logits never whole). MTP module k's targets and weights are the
    batch's moved k places left (models/mtp.py)."""
    max_logits = bool(fns.qk_clip)
    if not (fns.loss_chunk or fns.mtp_depth):
        kwargs = {"train": True, "rest": fns.rest, "rng": rng, "max_logits": max_logits}
        logits, aux = forward(fns.graphdef, params, batch, **kwargs)
        nll_sum = jnp.sum(token_nll(logits, batch["targets"]) * batch["weights"])
        z_sum = logits_z_loss_sum(logits, batch["weights"]) if fns.logits_z_loss else None
        return nll_sum, z_sum, aux, None
    model = merge_model(fns.graphdef, params, fns.rest, rng)
    hidden_BLD, aux = _call(model, batch, train=True, head=False, max_logits=max_logits)
    w_DV, scale = model.output_weights()
    targets, weights = batch["targets"], batch["weights"]
    z = bool(fns.logits_z_loss)
    nll_sum, z_sum = _head_losses(hidden_BLD, w_DV, scale, targets, weights, fns, z)
    if not fns.mtp_depth:
        return nll_sum, z_sum, aux, None
    segments = batch.get("segment_ids")
    states, mtp_aux = model.mtp_states(
        hidden_BLD,
        batch["inputs"],
        train=True,
        positions_BL=batch.get("positions"),
        token_mask_BL=real_positions_BL(batch),
        segment_ids_BL=segments,
        max_logits=max_logits,
    )
    mtp_D = jnp.stack(
        [
            _head_losses(
                h, w_DV, scale, shifted(targets, k + 1), mtp_weights(batch, k + 1), fns, False
            )[0]
            for k, h in enumerate(states)
        ]
    )
    return nll_sum, z_sum, aux | mtp_aux, mtp_D


def mtp_weights(batch, depth: int):
    """The loss weights of MTP module `depth` (1-based): the weight of the target `depth`
    places ahead, 0 where that lies in another document of a packed row."""
    return ahead_in_document(batch["weights"], depth, batch.get("segment_ids"))


def mtp_totals(batch, depth: int):
    """Target weight of each MTP module over the batch [D] (at least 1)."""
    return jnp.stack([jnp.maximum(jnp.sum(mtp_weights(batch, k + 1)), 1.0) for k in range(depth)])


def _split_max_logits(aux: dict, fns: StepFns) -> tuple[dict, dict]:
    """(MoE aux without the attention maxima and without layers left empty, {} or
    {"max_logits_NH": the maxima [N, H] in site_keys order})."""
    if not fns.qk_clip:
        return aux, {}
    keys = site_keys(fns.qk_clip_sites)
    maxima = jnp.stack([aux[key][MAX_LOGIT] for key in keys])
    aux = {i: {k: v for k, v in a.items() if k != MAX_LOGIT} for i, a in aux.items()}
    return {i: a for i, a in aux.items() if a}, {"max_logits_NH": maxima}


def _dpo_loss(params, reference, batch, total_pairs, rng, fns: StepFns):
    """(the DPO loss of the batch's pairs / total_pairs, its sums, the policy's MoE aux);
    the reference's forward pass shares the policy's noise (the same `rng`)."""
    kwargs = {"train": True, "rest": fns.rest, "rng": rng}
    logits, aux = forward(fns.graphdef, params, batch, **kwargs)
    ref_logits, _ = forward(fns.graphdef, reference, batch, **kwargs)
    sums = dpo.dpo_sums(
        dpo.response_logps(logits, batch),
        dpo.response_logps(jax.lax.stop_gradient(ref_logits), batch),
        dpo.valid_pairs(batch),
        fns.dpo_beta,
        fns.dpo_label_smoothing,
    )
    return sums["dpo_loss_sum"] / total_pairs, sums | {"nll_sum": sums["dpo_loss_sum"]}, aux


def _loss(params, batch, total_weight, rng, fns: StepFns, mtp_total_D=None, reference=None):
    if fns.objective == "dpo":
        loss, extra, aux = _dpo_loss(params, reference, batch, total_weight, rng, fns)
        z_sum = mtp_D = None
    else:
        nll_sum, z_sum, aux, mtp_D = _output_losses(params, batch, rng, fns)
        aux, extra = _split_max_logits(aux, fns)
        loss = nll_sum / total_weight
        extra["nll_sum"] = nll_sum
    if mtp_D is not None:
        # DeepSeek-V3: lambda / D * sum_k of module k's mean NLL. Divided by the whole
        # batch's target counts, so micro-batch terms add up to it.
        loss = loss + fns.mtp_weight / fns.mtp_depth * jnp.sum(mtp_D / mtp_total_D)
        extra["mtp_nll_sum_D"] = mtp_D
    if fns.logits_z_loss:
        # Divided by the whole batch's target count, so micro-batch terms add up to the mean.
        z = fns.logits_z_loss * z_sum / total_weight
        loss = loss + z
        extra["logits_z_loss"] = z
    if aux:
        layers = list(aux)
        balance = sum(aux[i]["balance_loss"] for i in layers) * fns.balance_loss_weight
        z = sum(aux[i]["router_z_loss"] for i in layers) * fns.z_loss_weight
        loss = loss + (balance + z) / fns.grad_accum
        # Weighted sums (what the loss adds); balance_loss / router_z_loss are unweighted means.
        extra |= {"weighted_balance_loss": balance, "weighted_router_z_loss": z}
        if fns.sequence_balance_weight:
            seq = sum(aux[i]["sequence_balance_loss"] for i in layers)
            seq = seq * fns.sequence_balance_weight
            loss = loss + seq / fns.grad_accum
            extra["weighted_sequence_balance_loss"] = seq
        if fns.bias_update_rate:  # per-layer loads for the balancing update, layer order
            extra["expert_load_ME"] = jnp.stack([aux[i]["expert_load"] for i in layers])
        extra |= moe_summary(aux)
        extra["routing_BM"] = jnp.stack([aux[i]["top2_per_example"] for i in layers], axis=1)
        extra["tokens_BM"] = real_tokens_BM(batch, layers)
    return loss, extra


def train_step(state, batch, fns: StepFns, constants=None):
    """One optimizer step (with `grad_accum` micro-batches scanned in sequence).
    `constants`: what the loss reads but never trains, {"base": a LoRA run's frozen base
    (training/lora_run.py), joined to the trained leaves of `state["params"]` for the
    forward pass; "reference": DPO's reference, a tree like `state["params"]` joined to the
    base alike}."""
    params = state["params"]
    constants = constants or {}
    base = constants.get("base")

    def whole(trained):
        return trained if base is None else join(base, trained)

    reference = whole(constants["reference"]) if "reference" in constants else None
    if fns.objective == "dpo":
        total_weight = dpo.pair_count(batch)
    else:
        total_weight = jnp.maximum(jnp.sum(batch["weights"]), 1.0)
    frozen = None
    if fns.frozen_leaves is not None:
        frozen = jax.tree.unflatten(jax.tree.structure(params), fns.frozen_leaves)

    def loss_of_trained(trained, *args):
        return _loss(whole(trained), *args, reference=reference)

    def grad_fn(*args):
        (loss, extra), grads = jax.value_and_grad(loss_of_trained, has_aux=True)(*args)
        return (loss, extra), mask_gradients(grads, frozen)

    rng = jax.random.fold_in(jax.random.key(fns.seed), state["step"])
    mtp_total_D = mtp_totals(batch, fns.mtp_depth) if fns.mtp_depth else None
    if fns.grad_accum == 1:
        (_, extra), grads = grad_fn(params, batch, total_weight, rng, fns, mtp_total_D)
    else:
        micro = jax.tree.map(
            lambda x: x.reshape(fns.grad_accum, x.shape[0] // fns.grad_accum, *x.shape[1:]),
            batch,
        )

        def body(grads_sum, micro_and_index):
            micro_batch, index = micro_and_index
            micro_rng = jax.random.fold_in(rng, index)
            (_, extra), grads = grad_fn(
                params, micro_batch, total_weight, micro_rng, fns, mtp_total_D
            )
            return jax.tree.map(jnp.add, grads_sum, grads), extra

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, extras = jax.lax.scan(body, zeros, (micro, jnp.arange(fns.grad_accum)))
        extra = {
            key: (
                jnp.sum(value, 0)
                if key in SUMMED_KEYS
                else value.reshape(-1, *value.shape[2:])
                if key in ("routing_BM", "tokens_BM")
                else jnp.max(value, 0)
                if key == "max_logits_NH"
                else jnp.mean(value, 0)
            )
            for key, value in extras.items()
        }
        if "weighted_balance_loss" in extra:  # each micro-batch's term was already divided
            extra["weighted_balance_loss"] /= fns.grad_accum
            extra["weighted_router_z_loss"] /= fns.grad_accum
            if "weighted_sequence_balance_loss" in extra:
                extra["weighted_sequence_balance_loss"] /= fns.grad_accum

    updates, opt_state = fns.optimizer.update(grads, state["opt_state"], params)
    new_params = optax.apply_updates(params, updates)
    if fns.selection_bias:
        new_params = balancing.keep_selection_biases(new_params, params)
    if fns.bias_update_rate:
        loads_ME = extra.pop("expert_load_ME")
        loads = dict(zip(fns.moe_layer_ids, loads_ME, strict=True))
        new_params = balancing.update_selection_biases(
            new_params, loads, fns.bias_update_rate, fns.period, fns.scan_head
        )
    if fns.qk_clip:
        maxima_NH = extra.pop("max_logits_NH")
        new_params = qk_clip(new_params, maxima_NH, fns.qk_clip_sites, fns.qk_clip, fns.qk_nope)
        extra["max_attention_logit"] = jnp.max(maxima_NH)
    nll = extra.pop("nll_sum") / total_weight
    if fns.objective == "dpo":  # the batch's means over its pairs
        sums = {key: extra.pop(key) for key in dpo.SUM_KEYS}
        extra |= {k: v for k, v in dpo.dpo_metrics(sums, total_weight).items() if k != "loss"}
    if fns.mtp_depth:  # the modules' mean NLL, apart from the main model's `loss`
        mtp_D = extra.pop("mtp_nll_sum_D") / mtp_total_D
        extra["mtp_loss"] = jnp.mean(mtp_D)
        if fns.mtp_depth > 1:
            extra |= {f"mtp_loss/depth_{k + 1}": mtp_D[k] for k in range(fns.mtp_depth)}
    finite = jnp.isfinite(nll) & jnp.isfinite(optax.tree.norm(grads))
    new_state = {"step": state["step"] + 1, "params": new_params, "opt_state": opt_state}
    if fns.skip_nonfinite:
        # Keep the old parameters and optimizer state, but count the step.
        kept = {"step": new_state["step"], "params": params, "opt_state": state["opt_state"]}
        new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, kept)
    metrics = {
        "loss": nll,
        "learning_rate": fns.schedule(state["step"]),
        "grad_norm": optax.tree.norm(grads),
        "finite": finite,
        **extra,
    }
    return new_state, metrics


def jit_train_step(fns: StepFns, state_shardings, batch_shardings, constant_shardings=None):
    """`train_step` jitted for these shardings; the input state is donated. With
    `constant_shardings` (a LoRA run's base, DPO's reference: train_step's `constants`) it
    takes them as a third argument."""
    if constant_shardings is None:
        return jax.jit(
            functools.partial(train_step, fns=fns),
            in_shardings=(state_shardings, batch_shardings),
            out_shardings=(state_shardings, None),
            donate_argnums=0,
        )
    return jax.jit(
        lambda state, batch, constants: train_step(state, batch, fns, constants),
        in_shardings=(state_shardings, batch_shardings, constant_shardings),
        out_shardings=(state_shardings, None),
        donate_argnums=0,
    )


def eval_step(params, batch, graphdef, rest=None, record_routing: bool = False):
    """Sums over the batch: weighted NLL, correct argmax predictions, target weight.
    `record_routing`: also "experts_BLMK", each position's chosen experts per MoE layer
    (model order) and slot, -1 unused (`eval --record_routing`)."""
    logits, aux = forward(graphdef, params, batch, train=False, rest=rest,
                          record_routing=record_routing)  # fmt: skip
    weights = batch["weights"]
    nll = token_nll(logits, batch["targets"])
    correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)
    recorded = {}
    if record_routing:
        recorded["experts_BLMK"] = jnp.stack([a["experts"] for a in aux.values()], axis=2)
    return recorded | {
        "nll_sum": jnp.sum(nll * weights),
        "correct_sum": jnp.sum(correct * weights),
        "weight_sum": jnp.sum(weights),
        "nll_per_example": jnp.sum(nll * weights, -1),
        "weight_per_example": jnp.sum(weights, -1),
    }


def eval_metrics(totals) -> dict:
    """loss (mean NLL per target token), perplexity, accuracy and token count from the sums
    of `eval_step` added over batches (host numbers)."""
    weight = max(float(totals["weight_sum"]), 1.0)
    loss = float(totals["nll_sum"]) / weight
    return {
        "loss": loss,
        "perplexity": float(np.exp(min(loss, 50.0))),  # capped: a diverged model stays finite
        "accuracy": float(totals["correct_sum"]) / weight,
        "num_tokens": int(totals["weight_sum"]),
    }
