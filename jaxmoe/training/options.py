"""The `train` and `optimizer` config sections: every key's type, default and one-line doc,
and the checks of their values (run when a section is made)."""

from dataclasses import dataclass
from typing import Literal

from jaxmoe.errors import ConfigError
from jaxmoe.fields import Options, check_choices, need, option, section
from jaxmoe.training.freezing import parse_groups
from jaxmoe.training.lora_options import LoraOptions
from jaxmoe.training.optimizer import OPTIMIZERS, SCHEDULES
from jaxmoe.training.profiling import parse_profile_steps


@dataclass(frozen=True)
class TrainOptions(Options):
    """train: the length and batch of the run, its evaluations, checkpoints and logging."""

    steps: int = option(600, "optimizer steps")
    batch_size: int = option(16, "global batch (sequences per step)")
    seq_len: int = option(128, "tokens per sequence")
    seed: int = option(0, "parameter init and data order")
    grad_accum: int = option(1, "micro-batches per step (batch_size must divide by it)")
    log_every: int = option(20, "steps between train lines in metrics.jsonl")
    eval_every: int = option(200, "steps between evaluations (0 = only at the end)")
    eval_batches: int = option(0, "validation batches per evaluation (0 = the whole split)")
    checkpoint_every: int = option(200, "steps between checkpoints (and one at the end)")
    max_to_keep: int = option(3, "checkpoints kept on disk")
    init_from: str = option("", "checkpoint to take parameters from (fresh optimizer state)")
    init_optimizer: bool = option(
        False, "with init_from: also take its optimizer state (moments, steps)"
    )
    nonfinite: str = option(
        "stop", "on a non-finite loss or gradient: stop | skip (the step)", ("stop", "skip")
    )
    max_skipped_steps: int = option(
        10, "nonfinite=skip: stop after this many skipped steps in a row"
    )
    profile_steps: str = option("", '"START:END": trace steps START+1..END into WORKDIR/profile')
    peak_flops: float = option(
        0.0, "FLOP/s of one device for `mfu` (0 = from the device kind, if known)"
    )
    wandb: str = option(
        "", 'Weights & Biases PROJECT[/RUN_NAME] ("" = off; WANDB_MODE=offline works)'
    )
    logits_z_loss: float = option(
        0.0, "output z-loss: coef * mean(logsumexp(logits)^2) over targets"
    )
    freeze: str = option(
        "",
        "parameter groups kept fixed, a comma list of router | experts | shared_experts | "
        "dense_ffn | attention | norms | embeddings | head (training/freezing.py)",
    )
    trainable: str = option("", 'the only groups trained, the rest frozen ("" = all)')
    loss_chunk: int = option(
        0,
        "training loss: apply the output layer to this many positions of every sequence at "
        "a time, recomputed in the backward pass (a divisor of seq_len; 0 = the whole "
        "[batch, seq_len, vocab] logits at once)",
    )
    objective: Literal["lm", "dpo"] = option(
        "lm",
        "lm (next-token NLL) | dpo (preference pairs against the frozen initial model; "
        "data.format=preference; docs/post_training.md)",
    )
    dpo_beta: float = option(0.1, "dpo: beta, the strength of the implicit KL to the reference")
    dpo_label_smoothing: float = option(
        0.0, "dpo: the share of pairs taken as mislabelled (conservative DPO; TRL's)"
    )
    lora: LoraOptions = section(LoraOptions, "LoRA adapters on a frozen base (rank 0 = off)")

    def __post_init__(self) -> None:
        check_choices(self, "train.")
        for key in ("steps", "batch_size", "seq_len", "grad_accum", "log_every"):
            value = getattr(self, key)
            need(value > 0, f"train.{key}={value} must be positive")
        need(
            self.max_skipped_steps > 0,
            f"train.max_skipped_steps={self.max_skipped_steps} must be positive",
        )
        need(
            self.batch_size % self.grad_accum == 0,
            f"train.batch_size={self.batch_size} is not divisible by "
            f"train.grad_accum={self.grad_accum}",
        )
        # 0 means "only at the end" / "the whole split" / "seed 0"; below 0 means nothing.
        for key in ("eval_every", "checkpoint_every", "eval_batches", "seed"):
            value = getattr(self, key)
            need(value >= 0, f"train.{key}={value} must be >= 0")
        need(self.max_to_keep >= 1, f"train.max_to_keep={self.max_to_keep} must be >= 1")
        need(self.peak_flops >= 0, f"train.peak_flops={self.peak_flops} must be >= 0")
        try:
            parse_profile_steps(self.profile_steps)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        try:
            parse_groups(self.freeze, "train.freeze")
            parse_groups(self.trainable, "train.trainable")
        except ValueError as error:
            raise ConfigError(str(error)) from None
        need(
            not (self.freeze and self.trainable),
            f"train.freeze={self.freeze!r} and train.trainable={self.trainable!r}: set one",
        )
        need(self.logits_z_loss >= 0, f"train.logits_z_loss={self.logits_z_loss} must be >= 0")
        need(
            not (self.lora.enabled and self.freeze),
            f"train.freeze={self.freeze!r} with train.lora: the base is frozen already "
            "(train.trainable names base groups to train in full beside the adapters)",
        )
        need(self.dpo_beta > 0, f"train.dpo_beta={self.dpo_beta} must be > 0")
        need(
            0 <= self.dpo_label_smoothing < 0.5,
            f"train.dpo_label_smoothing={self.dpo_label_smoothing} not in [0, 0.5)",
        )
        need(self.loss_chunk >= 0, f"train.loss_chunk={self.loss_chunk} must be >= 0")
        need(
            not self.loss_chunk or self.seq_len % self.loss_chunk == 0,
            f"train.loss_chunk={self.loss_chunk} does not divide train.seq_len={self.seq_len}",
        )


@dataclass(frozen=True)
class OptimizerOptions(Options):
    """optimizer: the update rule and the learning-rate schedule."""

    name: str = option(
        "adamw",
        "adamw | adafactor (optax's) | t5x_adafactor (T5X's, T5.1.1's) | muon (Newton-Schulz "
        "matrices, AdamW for the rest; docs/muon.md)",
        OPTIMIZERS,
    )
    learning_rate: float = option(3e-3, "peak learning rate (t5x_rsqrt: the numerator)")
    schedule: str = option(
        "cosine", "cosine | rsqrt | constant | t5x_rsqrt (lr / sqrt(max(step, warmup)))", SCHEDULES
    )
    warmup_steps: int = option(50, "linear warmup steps (t5x_rsqrt: flat until this step)")
    min_lr_ratio: float = option(0.1, "cosine: final learning rate / peak")
    start_step: int = option(
        0, "the schedule starts at this step (uptraining: where the source stopped)"
    )
    schedule_steps: int = option(
        0, "cosine: length of the whole schedule; 0 = start_step + train.steps"
    )
    weight_decay: float = option(0.1, "decoupled weight decay (adamw)")
    b1: float = option(0.9, "first-moment decay")
    b2: float = option(0.95, "second-moment decay")
    eps: float = option(1e-8, "adam epsilon")
    grad_clip_norm: float = option(1.0, "clip the global gradient norm (0 = off)")
    decay_rate: float = option(0.8, "t5x_adafactor: second-moment decay 1 - (t + 1)^-decay_rate")
    clipping_threshold: float = option(
        1.0, "t5x_adafactor: clip each update matrix to this RMS (0 = off)"
    )
    momentum: float = option(0.0, "t5x_adafactor: first-moment decay (0 = none, as T5.1.1)")
    muon_momentum: float = option(0.95, "muon: momentum of the matrices' gradients")
    muon_nesterov: bool = option(True, "muon: Nesterov momentum")
    muon_ns_steps: int = option(5, "muon: Newton-Schulz iterations per update")
    muon_rms: float = option(
        0.2,
        "muon: update RMS matched to AdamW's, rms * sqrt(max(fan_in, fan_out)) (Moonlight's "
        "0.2); 0 = sqrt(max(1, fan_out / fan_in)) (Keller Jordan's)",
    )
    qk_clip: float = option(
        0.0,
        "MuonClip (Kimi K2): after each step, scale a head's query/key weights down so its "
        "largest attention logit of the step would be at most this (0 = off; K2: 100)",
    )

    def __post_init__(self) -> None:
        check_choices(self, "optimizer.")
        need(
            self.learning_rate > 0,
            f"optimizer.learning_rate={self.learning_rate} must be positive",
        )
        need(self.warmup_steps >= 0, f"optimizer.warmup_steps={self.warmup_steps} must be >= 0")
        for key in ("start_step", "schedule_steps"):
            value = getattr(self, key)
            need(value >= 0, f"optimizer.{key}={value} must be >= 0")
        need(0.0 < self.decay_rate <= 1.0, f"optimizer.decay_rate={self.decay_rate} not in (0, 1]")
        need(
            self.clipping_threshold >= 0,
            f"optimizer.clipping_threshold={self.clipping_threshold} < 0",
        )
        need(0.0 <= self.momentum < 1.0, f"optimizer.momentum={self.momentum} not in [0, 1)")
        need(
            0.0 <= self.muon_momentum < 1.0,
            f"optimizer.muon_momentum={self.muon_momentum} not in [0, 1)",
        )
        need(self.muon_ns_steps >= 1, f"optimizer.muon_ns_steps={self.muon_ns_steps} must be >= 1")
        need(self.muon_rms >= 0, f"optimizer.muon_rms={self.muon_rms} must be >= 0")
        need(self.qk_clip >= 0, f"optimizer.qk_clip={self.qk_clip} must be >= 0 (0 = off)")
        for key in ("b1", "b2"):
            value = getattr(self, key)
            need(0.0 <= value < 1.0, f"optimizer.{key}={value} not in [0, 1)")
        for key in ("weight_decay", "grad_clip_norm", "eps"):
            value = getattr(self, key)
            need(value >= 0, f"optimizer.{key}={value} must be >= 0")
        need(
            0.0 <= self.min_lr_ratio <= 1.0,
            f"optimizer.min_lr_ratio={self.min_lr_ratio} not in [0, 1]",
        )
