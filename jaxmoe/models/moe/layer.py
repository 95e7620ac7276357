"""The mixture-of-experts FFN layer: f32 router, a gate from gates.py, gated-FFN experts.

Parameters (logical axis names in parentheses; converters rely on these names):
  router [D, E] ("embed", None), wi_0 / wi_1 [E, D, F] ("expert", "embed", "expert_mlp"),
  wo [E, F, D] ("expert", "expert_mlp", "embed"). Expert e computes
  act(x wi_0[e]) * (x wi_1[e]) wo[e], like layers.GatedMLP.

With `model.ffn_gated` False the experts are ungated, act(x wi[e]) wo[e]: wi [E, D, F]
replaces wi_0 / wi_1. They run through the same gated dispatch code as (wi, wi, wo) with the
gate layers.ungated_gate_fn (exact in value and gradient; one extra matmul per expert).

With `moe.router_bias` the router also has router_bias [E] (None), added to the logits
(Flaxformer's RouterWeights with use_bias; its default and the released Switch / ST-MoE
configs have none).

Today's designs (router.py has the routing rule): with `moe.selection_bias` the layer has
selection_bias [E] (None), added to the scores for choosing experts only and never trained
by the optimizer (its gradient is stopped; training/steps.py keeps the optimizer's update
off it and applies `moe.bias_update_rate` balancing instead). With `moe.num_shared_experts`
> 0 a shared FFN `shared/{wi_0, wi_1, wo}` (like layers.GatedMLP, width num_shared_experts
* (shared_ffn_dim or ffn_dim)) is added to every token's output, scaled by
sigmoid(x shared_gate/kernel [D, 1]) when `moe.shared_expert_gate` (Qwen2-MoE).

`MoE(options, d_model, rngs=...)(x_BLD, train=..., token_mask_BL=...)` returns (y_BLD, aux) with aux
scalars `top2_fraction`, `expert_load_cv`, `dropped_fraction`, `exchange_overflow`,
`balance_loss`,
`router_z_loss` (losses unweighted), `top2_per_example` [B], `expert_load` [E] (token-slots
per expert, real tokens) and, when `moe.sequence_balance_weight` > 0,
`sequence_balance_loss` (unweighted). `token_mask_BL` (bool, None
= every token) marks the real tokens: padding still goes through the experts (its output is
unused) but counts in none of the aux values, so they equal those of the batch without its
padding. Dispatch choices are in dispatch.py; under a mesh with more than one device the FFN
runs in expert_parallel.py.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.models.layers import (
    MLP,
    GatedMLP,
    activation_fn,
    adapted_weight,
    dropout_module,
    dropout_multiplier,
    fan_in_init,
    make_param,
    ungated_gate_fn,
)
from jaxmoe.models.moe import dispatch, expert_bias, expert_parallel, gates, router
from jaxmoe.models.moe.glu import expert_activation
from jaxmoe.models.options import ModelOptions, MoEOptions
from jaxmoe.models.quantization import NONE, Quantization


class MoE(nnx.Module):
    """Router + gate + experts; see the module docstring for shapes and outputs."""

    def __init__(
        self,
        options: MoEOptions,
        d_model: int,
        *,
        rngs: nnx.Rngs,
        act=None,
        gated: bool = True,
        activation: str = "silu",
        dropout_rate: float = 0.0,
        quant: Quantization = NONE,
    ):
        """`options`: model.moe; `act`: the experts' activation (glu.expert_activation;
        default `activation`'s); `activation`, `dropout_rate`: the shared experts' (and,
        for expert_dropout_rate = -1, the experts' dropout); `quant`: how the experts'
        products compute (quantization.py)."""
        num_experts, ffn = options.num_experts, options.ffn_dim
        self.num_experts = num_experts
        self.gated = gated
        elementwise = activation_fn if gated else ungated_gate_fn
        self.act = elementwise(activation) if act is None else act
        self.train_gate, self.eval_gate = options.gate, options.eval_gate
        self.capacity_factor = options.capacity_factor
        self.quant = quant  # the experts' products (quantization.py)
        self.impl = dispatch.resolve_dispatch(
            options.dispatch, self.capacity_factor, quantized=quant.enabled
        )
        self.block_size = options.block_size
        self.jitter = options.jitter
        self.balance_fractions = options.balance_fractions
        self.ep_exchange = options.ep_exchange
        self.ep_buffer_factor = options.ep_buffer_factor
        # Router init: unit-variance logits for unit-RMS inputs, so the initial probabilities
        # are neither uniform (every adaptive token would take two experts) nor one-hot.
        self.router = make_param(rngs, fan_in_init((0,)), (d_model, num_experts), ("embed", None))
        if options.router_bias:
            self.router_bias = make_param(rngs, nnx.initializers.zeros, (num_experts,), (None,))
        expert_in = ("expert", "embed", "expert_mlp")
        shape_in = (num_experts, d_model, ffn)
        if self.gated:
            self.wi_0 = make_param(rngs, fan_in_init((1,)), shape_in, expert_in)
            self.wi_1 = make_param(rngs, fan_in_init((1,)), shape_in, expert_in)
        else:
            self.wi = make_param(rngs, fan_in_init((1,)), shape_in, expert_in)
        expert_out = ("expert", "expert_mlp", "embed")
        self.wo = make_param(rngs, fan_in_init((1,)), (num_experts, ffn, d_model), expert_out)
        if options.expert_bias:  # GPT-OSS: biases on each expert's projections (expert_bias.py)
            zeros = nnx.initializers.zeros
            hidden_axes = ("expert", "expert_mlp")
            self.wi_0_bias = make_param(rngs, zeros, (num_experts, ffn), hidden_axes)
            self.wi_1_bias = make_param(rngs, zeros, (num_experts, ffn), hidden_axes)
            self.wo_bias = make_param(rngs, zeros, (num_experts, d_model), ("expert", "embed"))
        rate = expert_dropout_rate(options, dropout_rate)
        self.expert_dropout = dropout_module(rate, rngs, False)
        self.jitter_rngs = rngs["jitter"].fork() if self.jitter > 0 else None
        self.router_cfg = options.router
        if self.router_cfg.selection_bias:
            self.selection_bias = make_param(rngs, nnx.initializers.zeros, (num_experts,), (None,))
        self.sequence_balance = options.sequence_balance_weight > 0
        if options.num_shared_experts:
            width = options.num_shared_experts * (options.shared_ffn_dim or ffn)
            mlp = GatedMLP if self.gated else MLP
            self.shared = mlp(
                d_model, width, activation, dropout_rate=dropout_rate, quant=quant, rngs=rngs
            )
            if options.shared_expert_gate:
                self.shared_gate = SharedGate(d_model, rngs=rngs)

    @classmethod
    def of_model(cls, model: ModelOptions, *, rngs: nnx.Rngs) -> "MoE":
        """The MoE layer of `model` (its model.moe, width, activation, dropout and
        quantization)."""
        elementwise = activation_fn if model.ffn_gated else ungated_gate_fn
        return cls(
            model.moe,
            model.d_model,
            rngs=rngs,
            act=expert_activation(model, elementwise),
            gated=model.ffn_gated,
            activation=model.activation,
            dropout_rate=model.dropout_rate,
            quant=Quantization.from_config(model),
        )

    def route_probs(self, x_BLD: jax.Array, *, train: bool) -> tuple[jax.Array, jax.Array]:
        """Router logits and probabilities, f32 [B*L, E] each (jitter only in training; the
        router bias added when there is one). Routing analysis calls this too, so its
        decisions are the layer's to the bit."""
        router_in = x_BLD.astype(jnp.float32)
        if train and self.jitter_rngs is not None:  # model.moe.jitter > 0
            noise = jax.random.uniform(
                self.jitter_rngs(), router_in.shape, jnp.float32, 1 - self.jitter, 1 + self.jitter
            )
            router_in = router_in * noise
        router_DE = adapted_weight(self, "router", jnp.float32)  # + a LoRA adapter, if any
        logits_TE = router_in.reshape(-1, router_in.shape[-1]) @ router_DE
        if hasattr(self, "router_bias"):
            logits_TE = logits_TE + self.router_bias[...]
        return logits_TE, router.router_scores(logits_TE, self.router_cfg.router_scoring)

    def route(self, x_BLD: jax.Array, *, train: bool, gate_cfg=None):
        """(logits_TE, scores_TE, Routing) of the layer's router: `route_probs` plus the gate
        (the training or evaluation one unless `gate_cfg` is given) and router.py's rule."""
        if gate_cfg is None:
            gate_cfg = self.train_gate if train else self.eval_gate
        logits_TE, scores_TE = self.route_probs(x_BLD, train=train)
        bias_E = None
        if self.router_cfg.selection_bias:
            # Balancing moves the bias (training/steps.py); the loss must not.
            bias_E = jax.lax.stop_gradient(self.selection_bias[...])
        return logits_TE, scores_TE, router.route(scores_TE, bias_E, self.router_cfg, gate_cfg)

    def __call__(
        self,
        x_BLD: jax.Array,
        *,
        train: bool,
        token_mask_BL: jax.Array | None = None,
        replay_BLK: jax.Array | None = None,
        record: bool = False,
    ) -> tuple[jax.Array, dict]:
        """`replay_BLK` (int [B, L, K], -1 = an unused slot; model.moe.replay): the experts
        of each token from a record, weighted by the live router (router.replay). `record`:
        aux["experts"] int32 [B, L, K] holds each token's chosen experts, -1 where a slot
        is unused (what `--record_routing` writes)."""
        batch, length, dim = x_BLD.shape
        if dim != self.router.shape[0]:
            raise ValueError(
                f"MoE: x has shape {x_BLD.shape}, expected last dim {self.router.shape[0]}"
            )
        gate_cfg = self.train_gate if train else self.eval_gate
        if replay_BLK is None:
            logits_TE, scores_TE, routing = self.route(x_BLD, train=train, gate_cfg=gate_cfg)
        else:
            logits_TE, scores_TE = self.route_probs(x_BLD, train=train)
            experts_TK = replay_BLK.reshape(batch * length, -1)
            routing = router.replay(scores_TE, experts_TK, self.router_cfg, gate_cfg)
        slots = routing.indices.shape[-1]

        def per_seq(a_TK):
            return a_TK.reshape(batch, length, slots)

        indices_BLK, weights_BLK, mask_BLK = map(per_seq, routing)
        capacity = 0
        keep_BLK = mask_BLK
        if self.capacity_factor > 0:
            capacity = dispatch.expert_capacity(
                self.capacity_factor, length, slots, self.num_experts
            )
            keep_BLK = dispatch.capacity_keep(indices_BLK, mask_BLK, self.num_experts, capacity)

        dtype = x_BLD.dtype
        # The expert stacks in the compute dtype, each with its LoRA adapters added (one per
        # expert, models/lora.py) when it has them.
        if self.gated:
            wi_0, wi_1, wo = (adapted_weight(self, n, dtype) for n in ("wi_0", "wi_1", "wo"))
        else:
            wi_0 = wi_1 = adapted_weight(self, "wi", dtype)
            wo = adapted_weight(self, "wo", dtype)
        # T5X's expert dropout: each expert's hidden units, one mask per expert shared by all
        # the tokens it serves this step (Flaxformer vmaps MlpBlock over experts, mask
        # broadcast along the tokens). On rows of wo that is the same product, value and
        # gradient, for every dispatch and exchange: (h * m_e) wo_e = h (m_e[:, None] * wo_e).
        keep_EF1 = dropout_multiplier(self.expert_dropout, (*wo.shape[:2], 1), dtype, train)
        if keep_EF1 is not None:
            wo = wo * keep_EF1
        experts: dispatch.Experts = (wi_0, wi_1, wo)
        x_in = x_BLD
        if hasattr(self, "wo_bias"):
            biases = (self.wi_0_bias[...].astype(dtype), self.wi_1_bias[...].astype(dtype))
            x_in, experts = expert_bias.with_bias_column(x_BLD, experts, *biases)
        routed = (x_in, indices_BLK, weights_BLK, keep_BLK, experts)
        mesh = expert_parallel.current_mesh()
        overflow_BLK = jnp.zeros(keep_BLK.shape, bool)
        if mesh is None:
            impl = (
                self.impl
                if train
                else dispatch.inference_dispatch(self.impl, batch * length, capacity)
            )
            y_BLD = dispatch.local_moe_ffn(
                *routed,
                act=self.act,
                impl=impl,
                block_size=self.block_size,
                capacity=capacity,
                quant=self.quant,
            )
        else:
            y_BLD, overflow_BLK = expert_parallel.sharded_moe_ffn(
                mesh,
                *routed,
                act=self.act,
                impl=self.impl,
                block_size=self.block_size,
                capacity=capacity,
                quant=self.quant,
                exchange=self.ep_exchange,
                buffer_factor=self.ep_buffer_factor,
            )
        if capacity:  # capacity mode: what overflowed the exchange's buffer was dropped
            keep_BLK = keep_BLK & ~overflow_BLK

        if token_mask_BL is None:
            token_mask_BL = jnp.ones((batch, length), bool)
        token_mask_BL = jnp.asarray(token_mask_BL, bool)
        aux = routing_metrics(routing, mask_BLK, keep_BLK, self.num_experts, token_mask_BL)
        if record:
            aux["experts"] = jnp.where(mask_BLK, indices_BLK, -1).astype(jnp.int32)
        token_mask_T = token_mask_BL.reshape(-1)
        # Assignments past the expert-parallel receive buffer: sent in further rounds when
        # dropless, dropped (and in dropped_fraction) with a capacity. Real tokens only.
        real_BLK = mask_BLK & token_mask_BL[..., None]
        assigned = jnp.maximum(jnp.sum(real_BLK.astype(jnp.float32)), 1.0)
        aux["exchange_overflow"] = jnp.sum((overflow_BLK & real_BLK).astype(jnp.float32)) / assigned
        norm_scores_TE = router.normalised_scores(scores_TE, self.router_cfg.router_scoring)
        aux["balance_loss"] = gates.balance_loss(
            norm_scores_TE, routing, gate_cfg.gating, self.balance_fractions, token_mask_T
        )
        aux["router_z_loss"] = gates.z_loss(logits_TE, token_mask_T)
        aux["expert_load"] = router.expert_load(routing, self.num_experts, token_mask_T)
        if self.sequence_balance:
            aux["sequence_balance_loss"] = router.sequence_balance_loss(
                norm_scores_TE.reshape(batch, length, -1), indices_BLK, mask_BLK, token_mask_BL
            )
        y_BLD = y_BLD.astype(dtype)
        if hasattr(self, "wo_bias"):  # the ones column's output dropped, the down bias added
            bias_BLD = expert_bias.down_bias(indices_BLK, weights_BLK, keep_BLK, self.wo_bias[...])
            y_BLD = y_BLD[..., :dim] + bias_BLD.astype(dtype)
        if hasattr(self, "shared"):
            shared_BLD, _ = self.shared(x_BLD, train=train)
            if hasattr(self, "shared_gate"):
                shared_BLD = shared_BLD * self.shared_gate(x_BLD)
            y_BLD = y_BLD + shared_BLD
        return y_BLD, aux


def expert_dropout_rate(options: MoEOptions, dropout_rate: float) -> float:
    """`model.moe.expert_dropout_rate`, -1 (the default) meaning the model's `dropout_rate`
    (T5X's EXPERT_DROPOUT_RATE = %DROPOUT_RATE)."""
    rate = options.expert_dropout_rate
    return dropout_rate if rate == -1.0 else rate


class SharedGate(nnx.Module):
    """Qwen2-MoE's shared-expert gate: sigmoid(x kernel), kernel [D, 1] ("embed", None)."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.kernel = make_param(rngs, fan_in_init((0,)), (dim, 1), ("embed", None))

    def __call__(self, x_BLD):
        """[B, L, 1] in x's dtype (the product in f32: a gate is a probability)."""
        logit_BL1 = x_BLD.astype(jnp.float32) @ self.kernel[...]
        return jax.nn.sigmoid(logit_BL1).astype(x_BLD.dtype)


def routing_metrics(
    routing: gates.Routing, mask_BLK, keep_BLK, num_experts: int, token_mask_BL
) -> dict:
    """top2_fraction, top2_per_example [B], expert_load_cv, dropped_fraction, kept_fraction
    (f32), over the real tokens of token_mask_BL (bool [B, L]); an example without any
    gives 0. kept_fraction: the share of the K slots the gate kept (adaptive gates mask)."""
    real_BL = token_mask_BL.astype(jnp.float32)
    multi_BL = (jnp.sum(mask_BLK, axis=-1) >= 2).astype(jnp.float32) * real_BL
    chosen_TK = routing.mask * real_BL.reshape(-1, 1)
    load_E = jnp.sum(
        jax.nn.one_hot(routing.indices, num_experts, dtype=jnp.float32) * chosen_TK[..., None],
        axis=(0, 1),
    )
    assigned = jnp.sum(mask_BLK * real_BL[..., None])
    kept = jnp.sum(keep_BLK * real_BL[..., None])
    return {
        "top2_fraction": jnp.sum(multi_BL) / jnp.maximum(jnp.sum(real_BL), 1.0),
        "top2_per_example": jnp.sum(multi_BL, axis=1) / jnp.maximum(jnp.sum(real_BL, axis=1), 1.0),
        # Population std / mean of the per-expert assignment counts (before any drop).
        "expert_load_cv": jnp.std(load_E) / jnp.maximum(jnp.mean(load_E), 1e-9),
        "dropped_fraction": 1.0 - kept / jnp.maximum(assigned, 1.0),
        "kept_fraction": assigned / jnp.maximum(jnp.sum(real_BL) * mask_BLK.shape[-1], 1.0),
    }
