"""The `model` and `model.moe` config sections: every key's type, default and one-line doc,
and the checks of their values, run when a section is made (`__post_init__`; jaxmoe/config
builds sections from config files and stored configs).

The option lists come from the modules that implement the options, so a new gate, dispatch
or activation is a choice here without touching jaxmoe/config. The gate's and the router's
keys are their own sections (models/moe/gates.py `GateOptions`, router.py `RouterOptions`),
nested flat in `MoEOptions`: `model.moe.threshold` is `MoEOptions.gate.threshold`.
"""

import dataclasses
from dataclasses import dataclass

from jaxmoe.errors import ConfigError
from jaxmoe.fields import Options, check_choices, need, option, section
from jaxmoe.models.attention import QK_NORMS, ROPE_TYPES
from jaxmoe.models.attention_kernel import ATTENTION_KERNELS
from jaxmoe.models.context_parallel import ContextStrategy
from jaxmoe.models.gpt_oss_options import check_gpt_oss_options
from jaxmoe.models.layer_kinds import dense_layer_ids, is_moe_layer
from jaxmoe.models.layers import ACTIVATIONS
from jaxmoe.models.mla import ATTENTION_KINDS
from jaxmoe.models.moe.dispatch import DISPATCHES, resolve_dispatch
from jaxmoe.models.moe.expert_parallel import EXCHANGES
from jaxmoe.models.moe.gates import BALANCE_FRACTIONS, GATES, GateOptions, num_slots
from jaxmoe.models.moe.glu import CLAMPED_SWIGLU
from jaxmoe.models.moe.router import TOPK_GATES, RouterOptions
from jaxmoe.models.quantization import QuantizationKind, Scaling
from jaxmoe.models.stack import REMAT_POLICIES


@dataclass(frozen=True)
class MoEOptions(Options):
    """model.moe: the mixture-of-experts FFN layers, their gate and their router."""

    num_experts: int = option(8, "experts per MoE layer; 0 = dense model")
    every: int = option(1, "an MoE FFN in every `every`-th layer (others dense)")
    ffn_dim: int = option(256, "hidden size of one expert")
    gate: GateOptions = section(GateOptions, "the gate: experts per token, weights", flat=True)
    eval_gating: str = option("", 'gate at evaluation time; "" = same as `gating`', ("", *GATES))
    capacity_factor: float = option(0.0, "0 = dropless; > 0 = fixed capacity that drops overflow")
    balance_loss_weight: float = option(0.01, "load-balancing loss coefficient")
    balance_fractions: str = option(
        "auto", "balance loss counts: auto (adaptive top1) | top1 | chosen", BALANCE_FRACTIONS
    )
    z_loss_weight: float = option(0.001, "router z-loss coefficient")
    expert_dropout_rate: float = option(
        -1.0,
        "training: dropout on an expert's hidden units, one mask per expert and step "
        "(T5X EXPERT_DROPOUT_RATE); -1 = model.dropout_rate",
    )
    jitter: float = option(0.0, "multiplicative router-input noise in training (0 = off)")
    router_bias: bool = option(False, "a router bias [E] (Flaxformer RouterWeights use_bias)")
    expert_bias: bool = option(False, "biases on every expert's gate/up and down projections")
    block_size: int = option(256, "rows per expert block in the block dispatch")
    dispatch: str = option("auto", "token dispatch (capacity: GShard fixed buffers)", DISPATCHES)
    ep_exchange: str = option(
        "auto",
        "expert-parallel token exchange: ragged (sized to the routing, ragged_all_to_all) | "
        "padded (worst-case all_to_all) | auto (padded on CPU, ragged on GPU/TPU)",
        EXCHANGES,
    )
    ep_buffer_factor: float = option(
        2.0,
        "ragged: receive buffer = this x the balanced load (local tokens x slots); overflow "
        "goes in further rounds through it (dropless) or is dropped (capacity)",
    )
    # Today's designs (docs/moe.md "Today's designs"; the routing rule: moe/router.py).
    router: RouterOptions = section(RouterOptions, "scores and their choice", flat=True)
    bias_update_rate: float = option(
        0.0,
        "aux-loss-free balancing: bias += rate * sign(mean load - load) per step (0 = off)",
    )
    sequence_balance_weight: float = option(
        0.0,
        "DeepSeek-V3's sequence-wise balance loss coefficient (0 = off)",
    )
    num_shared_experts: int = option(0, "always-on shared experts (one FFN), 0 = none")
    shared_ffn_dim: int = option(0, "hidden size of one shared expert; 0 = ffn_dim")
    shared_expert_gate: bool = option(
        False,
        "scale the shared output by sigmoid(x w), w [D, 1] (Qwen2-MoE)",
    )
    first_dense_layers: int = option(0, "layers 0..k-1 dense (DeepSeek first_k_dense)")
    dense_layers: str = option("", 'dense layer ids, e.g. "0,3" (Qwen mlp_only_layers)')
    replay: bool = option(
        False,
        "router replay: each token's experts from the batch's recorded `routing` (every gate; "
        "masked slots for variable counts), combine weights from the live router "
        "(docs/post_training.md)",
    )

    @property
    def eval_gate(self) -> GateOptions:
        """The gate at evaluation time (`eval_gating`, "" = the training gate)."""
        if not self.eval_gating or self.eval_gating == self.gate.gating:
            return self.gate
        return dataclasses.replace(self.gate, gating=self.eval_gating)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        """The ranges and combinations of the MoE keys (those against the model's depth:
        ModelOptions). A dense model (num_experts=0) checks only its own keys' choices."""
        check_choices(self, "model.moe.")
        experts = self.num_experts
        need(experts >= 0, f"model.moe.num_experts={experts} must be >= 0")
        if not experts:
            return
        need(
            experts >= 2,
            f"model.moe.num_experts={experts}: an MoE layer needs >= 2 experts "
            "(model.moe.num_experts=0 is the dense model)",
        )
        need(self.every >= 1, f"model.moe.every={self.every} must be >= 1")
        for key in ("ffn_dim", "block_size"):
            value = getattr(self, key)
            need(value >= 1, f"model.moe.{key}={value} must be a positive integer")
        for key in ("top_k", "max_k"):
            value = getattr(self.gate, key)
            need(
                value <= experts,
                f"model.moe.{key}={value} exceeds model.moe.num_experts={experts}",
            )
        need(
            self.expert_dropout_rate == -1.0 or 0.0 <= self.expert_dropout_rate < 1.0,
            f"model.moe.expert_dropout_rate={self.expert_dropout_rate} not in [0, 1) or -1",
        )
        # An expert receives at most every token of a group once (capacity factor E / K): a
        # larger factor only sizes unused buffers, and 1e9 overflows int32 at the first step.
        need(
            0 <= self.capacity_factor <= experts,
            f"model.moe.capacity_factor: expected a number in [0, model.moe.num_experts="
            f"{experts}], got {self.capacity_factor!r} (0 = dropless)",
        )
        need(0 <= self.jitter < 1, f"model.moe.jitter={self.jitter} not in [0, 1)")
        need(
            self.ep_buffer_factor > 0,
            f"model.moe.ep_buffer_factor={self.ep_buffer_factor} must be > 0",
        )
        try:
            resolve_dispatch(self.dispatch, self.capacity_factor, backend="cpu")
        except ValueError as error:
            raise ConfigError(str(error)) from None
        self._check_today()

    def _check_today(self) -> None:
        """The router's keys against the experts and the gates, and the shared experts."""
        experts, router = self.num_experts, self.router
        for key in ("bias_update_rate", "sequence_balance_weight"):
            value = getattr(self, key)
            need(value >= 0, f"model.moe.{key}={value} must be >= 0")
        for key in ("num_shared_experts", "shared_ffn_dim", "first_dense_layers"):
            value = getattr(self, key)
            need(value >= 0, f"model.moe.{key}={value} must be >= 0")
        need(
            not self.shared_expert_gate or self.num_shared_experts > 0,
            "model.moe.shared_expert_gate needs model.moe.num_shared_experts > 0",
        )
        need(
            self.bias_update_rate == 0 or router.selection_bias,
            "model.moe.bias_update_rate > 0 needs model.moe.selection_bias=True",
        )
        n_group, topk_group = router.n_group, router.topk_group
        need(
            experts % n_group == 0,
            f"model.moe.n_group={n_group} must divide num_experts={experts}",
        )
        need(
            n_group == 1 or experts // n_group >= 2,
            f"model.moe.n_group={n_group}: a group is scored by its two best experts, so it "
            f"needs >= 2 of the num_experts={experts}",
        )
        if router.plain:
            return
        # Sigmoid scores, a selection bias and group limits are defined for top-k choice,
        # which the adaptive gates mask (router.py); top-p reads sums of softmax probabilities.
        for key, gating in (("gating", self.gate.gating), ("eval_gating", self.eval_gating)):
            need(
                not gating or gating in TOPK_GATES,
                f"model.moe.{key}={gating!r}: router_scoring=sigmoid, selection_bias and "
                "n_group > 1 need a top-k gate (" + " | ".join(TOPK_GATES) + ")",
            )
        reachable = topk_group * (experts // n_group)
        for gate in {self.gate, self.eval_gate}:
            slots = num_slots(gate)
            need(
                slots <= reachable,
                f"model.moe.top_k: {slots} experts per token exceed the {reachable} in "
                f"topk_group={topk_group} of n_group={n_group} groups",
            )


@dataclass(frozen=True)
class ModelOptions(Options):
    """model: the architecture (and its compute dtype, remat and attention blocking)."""

    arch: str = option("decoder", "the architecture", ("decoder", "encoder_decoder"))
    vocab_size: int = option(0, "0: take the tokenizer's vocabulary size")
    num_layers: int = option(
        4, "decoder layers (encoder_decoder: also the encoder's, unless set below)"
    )
    num_encoder_layers: int = option(0, "encoder_decoder only; 0: same as num_layers")
    encoder_num_kv_heads: int = option(0, "encoder_decoder: encoder KV heads; 0: num_heads (MHA)")
    d_model: int = option(128, "width of the residual stream")
    num_heads: int = option(4, "query heads")
    num_kv_heads: int = option(2, "key/value heads: = num_heads is MHA, 1 is MQA, between is GQA")
    head_dim: int = option(32, "width of one attention head")
    ffn_dim: int = option(512, "hidden size of a dense (gated) FFN")
    activation: str = option(
        "silu",
        "gated FFN activation: silu (SwiGLU) | gelu (T5.1.1) | relu | swiglu_clamped (GPT-OSS "
        "experts)",
        (*ACTIVATIONS, CLAMPED_SWIGLU),
    )
    norm_eps: float = option(1e-6, "RMSNorm epsilon")
    rope_theta: float = option(10000.0, "rotary base; 0 disables rotary positions")
    rope_type: str = option(
        "default",
        "rotary frequency scaling (default: none; yarn: rope_yarn.py)",
        (*ROPE_TYPES, "yarn"),
    )
    rope_factor: float = option(
        1.0, "linear / llama3: context-extension factor frequencies divide by"
    )
    rope_low_freq_factor: float = option(
        1.0, "llama3: wavelengths over original_max_len / this scaled"
    )
    rope_high_freq_factor: float = option(
        4.0, "llama3: wavelengths under original_max_len / this kept"
    )
    rope_original_max_len: int = option(8192, "llama3: the context length before the extension")
    qkv_bias: bool = option(
        False, "biases on the query/key/value projections (Qwen2); none on the output"
    )
    tie_embeddings: bool = option(False, "share the input embedding with the output layer")
    ffn_gated: bool = option(
        True, "act(x wi_0) * (x wi_1) wo; False: act(x wi) wo (T5 v1.0, Switch Base)"
    )
    dtype: str = option(
        "float32", "compute dtype; parameters stay float32", ("float32", "bfloat16")
    )
    attention_block: int = option(
        -1, "causal self-attention query block; -1 auto (CPU only), 0 dense"
    )
    attention_kernel: str = option(
        "auto",
        "softmax(qk)v kernel: xla (jaxmoe's einsums) | dot_product_attention (jax.nn's; cuDNN "
        "on GPU) | splash (Pallas splash attention, TPU; docs/tpu_kernels.md) | auto "
        "(dot_product_attention on GPU, else xla); docs/gpu.md",
        ATTENTION_KERNELS,
    )
    remat: str = option("none", "backward-pass recompute policy", tuple(REMAT_POLICIES))
    context_strategy: ContextStrategy = option(
        "all_gather",
        "mesh.context > 1: attention gathers every key/value block at once (all_gather), "
        "passes them around the axis (ring) or exchanges heads for sequence with all-to-alls "
        "(ulysses: num_heads divisible by mesh.context); MLA gathers its latent in all three; "
        "docs/long_context.md",
    )
    quantization: QuantizationKind = option(
        "none",
        "projections' and experts' products in int8 (TPU v5) or fp8 (H100/B200, TPU v7), "
        "straight-through gradients, f32 master weights; docs/quantization.md",
    )
    quantization_scaling: Scaling = option(
        "channel",
        "quantization scales: channel (one per token row / weight column) | tensor (one per "
        "matrix); current scaling from each step's own max",
    )
    scan_layers: bool = option(
        False, "run the blocks under one scan (compile time independent of depth)"
    )
    relpos_buckets: int = option(32, "encoder_decoder: T5 relative-position buckets")
    relpos_max_distance: int = option(128, "encoder_decoder: T5 relative-position max distance")
    dropout_rate: float = option(
        0.0, "training only: embeddings, attention and FFN outputs, final norm"
    )
    max_len: int = option(0, "context: longest sequence trained on (train sets it); 0 = unknown")
    # GPT-OSS (docs/gpt_oss.md): per-layer attention windows, sinks, biases, clamped SwiGLU.
    sliding_window: int = option(0, "window W of the sliding layers: keys q-W < k <= q; 0 = none")
    layer_types: str = option(
        "",
        'per-layer attention: comma list of sliding | full, repeated down the stack ("sliding,'
        'full" alternates); "" = all sliding when sliding_window > 0',
    )
    attention_sinks: bool = option(False, "a learned per-head sink logit in each softmax")
    out_bias: bool = option(False, "a bias on the attention output projection (GPT-OSS)")
    swiglu_alpha: float = option(1.702, "swiglu_clamped: the sigmoid's gain alpha")
    swiglu_limit: float = option(7.0, "swiglu_clamped: gate clamped above, up to +-limit")
    qk_norm: str = option(
        "none",
        "RMSNorm on queries/keys before rotary: head (Qwen3) | projection (OLMoE) | none",
        QK_NORMS,
    )
    # Multi-head latent attention (DeepSeek-V2/V3; docs/mla.md, models/mla.py).
    attention: str = option(
        "gqa",
        "self-attention: gqa (MHA/GQA/MQA by num_kv_heads) | mla (latent keys/values)",
        ATTENTION_KINDS,
    )
    q_lora_rank: int = option(0, "mla: rank of the low-rank query path; 0 = full-rank queries")
    kv_lora_rank: int = option(512, "mla: width of the compressed key/value latent (cached)")
    qk_nope_head_dim: int = option(128, "mla: per-head query/key dims without rotary")
    qk_rope_head_dim: int = option(64, "mla: rotary query dims per head = the shared rotary key")
    v_head_dim: int = option(128, "mla: per-head value width")
    rope_beta_fast: float = option(32.0, "yarn: dims turning more often than this kept")
    rope_beta_slow: float = option(1.0, "yarn: dims turning less often than this interpolated")
    rope_mscale: float = option(0.0, "yarn: mscale of the rotary factor (0 = not given)")
    rope_mscale_all_dim: float = option(
        0.0, "yarn: mscale_all_dim; softmax scale times mscale(factor, it)**2 (0 = off)"
    )
    rope_attention_factor: float = option(
        0.0, "yarn: rotary q/k multiplier; 0 = derived from factor and the mscales"
    )
    rope_truncate: bool = option(True, "yarn: round the ramp's ends to whole dims")
    # Multi-token prediction (DeepSeek-V3; docs/mtp.md, models/mtp.py).
    mtp_depth: int = option(
        0, "multi-token prediction modules D (module k predicts k + 1 tokens ahead); 0 = none"
    )
    mtp_weight: float = option(
        0.3, "mtp: the loss adds mtp_weight / D * sum of the modules' NLL (DeepSeek-V3: 0.3)"
    )
    moe: MoEOptions = section(MoEOptions, "the mixture-of-experts layers")

    def with_vocab(self, tokenizer_vocab: int) -> "ModelOptions":
        """vocab_size = 0 (a training config) takes the tokenizer's size, as training does;
        a smaller explicit size cannot embed the tokenizer's ids."""
        if self.vocab_size == 0:
            return dataclasses.replace(self, vocab_size=tokenizer_vocab)
        need(
            self.vocab_size >= tokenizer_vocab,
            f"model.vocab_size={self.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer_vocab})",
        )
        return self

    def __post_init__(self) -> None:
        """Ranges and combinations of the model keys (and of model.moe's against them)."""
        check_choices(self, "model.")
        for key in ("num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "ffn_dim"):
            value = getattr(self, key)
            need(value > 0, f"model.{key}={value} must be positive")
        need(
            self.num_heads % self.num_kv_heads == 0,
            f"model.num_heads={self.num_heads} is not divisible by "
            f"model.num_kv_heads={self.num_kv_heads}",
        )
        need(
            not self.rope_theta or self.head_dim % 2 == 0,
            f"model.head_dim={self.head_dim} must be even for rotary positions (model.rope_theta)",
        )
        self._check_rope()
        check_gpt_oss_options(self)
        self._check_latent()
        need(
            not self.qkv_bias or self.arch == "decoder",
            "model.qkv_bias=True is implemented for decoder models only (model.arch='decoder')",
        )
        need(
            self.attention_block >= -1,
            f"model.attention_block={self.attention_block} must be -1 (auto), 0 (dense) or a "
            "block size",
        )
        self._check_quantization()
        self._check_today()
        need(
            0.0 <= self.dropout_rate < 1.0,
            f"model.dropout_rate={self.dropout_rate} not in [0, 1)",
        )
        for key in ("vocab_size", "max_len", "num_encoder_layers", "encoder_num_kv_heads"):
            value = getattr(self, key)
            need(value >= 0, f"model.{key}={value} must be >= 0 (0 = the default)")
        need(self.norm_eps > 0, f"model.norm_eps={self.norm_eps} must be positive")
        self._check_mtp()
        if self.arch == "encoder_decoder":
            for key in ("relpos_buckets", "relpos_max_distance"):
                value = getattr(self, key)
                need(value > 0, f"model.{key}={value} must be positive")

    def _check_quantization(self) -> None:
        """model.quantization: decoder models, and an MoE dispatch with quantized products."""
        if self.quantization == "none":
            return
        need(
            self.arch == "decoder",
            f"model.quantization={self.quantization!r} is implemented for decoder models only",
        )
        if self.moe.num_experts:
            from jaxmoe.models.moe.dispatch import resolve_dispatch

            try:
                resolve_dispatch(self.moe.dispatch, self.moe.capacity_factor, "cpu", quantized=True)
            except ValueError as error:
                raise ConfigError(str(error)) from None

    def _check_mtp(self) -> None:
        need(self.mtp_depth >= 0, f"model.mtp_depth={self.mtp_depth} must be >= 0 (0 = none)")
        need(self.mtp_weight >= 0, f"model.mtp_weight={self.mtp_weight} must be >= 0")
        if not self.mtp_depth:
            return
        need(self.arch == "decoder", "model.mtp_depth > 0 is implemented for decoders only")
        need(
            not self.sliding_window,
            "model.mtp_depth > 0 with model.sliding_window: the MTP blocks' attention kind "
            "is not defined by model.layer_types",
        )

    def _check_today(self) -> None:
        """qk_norm and the MoE options of today's designs that depend on the model."""
        need(
            self.qk_norm == "none" or self.arch == "decoder",
            f"model.qk_norm={self.qk_norm!r} is implemented for decoder models only",
        )
        moe = self.moe
        if not moe.num_experts:
            return
        depths = {"model.num_layers": self.num_layers}
        if self.arch == "encoder_decoder" and self.num_encoder_layers:
            depths["model.num_encoder_layers"] = self.num_encoder_layers
        # Layer i is MoE when (i + 1) % every == 0: with every > the deepest stack no layer
        # is, and the run would silently train a dense model.
        need(
            moe.every <= max(depths.values()),
            f"model.moe.every={moe.every} exceeds "
            + " and ".join(f"{k}={v}" for k, v in depths.items())
            + ": no layer would be MoE (model.moe.num_experts=0 is the dense model)",
        )
        need(
            moe.bias_update_rate == 0 or self.arch == "decoder",
            "model.moe.bias_update_rate > 0 is implemented for decoder models only",
        )
        try:
            dense_layer_ids(moe.dense_layers, self.num_layers)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        from jaxmoe.models.stack import check_scannable

        if self.arch == "decoder":
            need(
                any(is_moe_layer(self, i) for i in range(self.num_layers)),
                "model.moe: first_dense_layers / dense_layers leave no MoE layer "
                "(model.moe.num_experts=0 is the dense model)",
            )
        try:
            check_scannable(self)
        except ValueError as error:
            raise ConfigError(str(error)) from None

    def _check_rope(self) -> None:
        if self.rope_type != "default":
            need(
                self.rope_theta > 0,
                f"model.rope_type={self.rope_type!r} needs model.rope_theta > 0",
            )
            need(self.rope_factor > 0, f"model.rope_factor={self.rope_factor} must be positive")
        if self.rope_type == "llama3":
            low, high = self.rope_low_freq_factor, self.rope_high_freq_factor
            need(
                0 < low < high,
                f"model.rope_low_freq_factor={low} and model.rope_high_freq_factor={high} "
                "must satisfy 0 < low < high",
            )
            need(
                self.rope_original_max_len > 0,
                f"model.rope_original_max_len={self.rope_original_max_len} must be positive",
            )

    def _check_latent(self) -> None:
        """model.attention=mla and YaRN (implemented for MLA only)."""
        if self.rope_type == "yarn":
            need(
                self.rope_original_max_len > 0,
                f"model.rope_original_max_len={self.rope_original_max_len} must be positive",
            )
            need(
                self.rope_beta_fast > 0 and self.rope_beta_slow > 0,
                "model.rope_beta_fast and model.rope_beta_slow must be positive",
            )
        if self.attention != "mla":
            return
        need(self.arch == "decoder", "model.attention='mla' is implemented for decoders only")
        for key in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, key)
            need(value > 0, f"model.{key}={value} must be positive for model.attention='mla'")
        for key in ("q_lora_rank", "qk_nope_head_dim"):
            value = getattr(self, key)
            need(value >= 0, f"model.{key}={value} must be >= 0")
        need(
            self.qk_rope_head_dim % 2 == 0,
            f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even (rotary pairs)",
        )
        need(self.rope_theta > 0, "model.attention='mla' needs rotary positions (rope_theta > 0)")
        need(
            not self.qkv_bias and self.qk_norm == "none",
            "model.attention='mla' has no qkv_bias or qk_norm (its latents are normed)",
        )
