"""The config schema: `JobConfig`, one frozen section per package it configures (its keys'
types, defaults, one-line docs and checks), and `typed(values)`, a JobConfig from a config
file's or a stored config's nested mapping.

| section     | schema                                                               |
|-------------|----------------------------------------------------------------------|
| `model`     | jaxmoe/models/options.py `ModelOptions`                              |
| `model.moe` | jaxmoe/models/options.py `MoEOptions`, with its gate and router keys |
|             | (models/moe/gates.py `GateOptions`, router.py `RouterOptions`)       |
| `train`     | jaxmoe/training/options.py `TrainOptions`                            |
| `optimizer` | jaxmoe/training/options.py `OptimizerOptions`                        |
| `mesh`      | jaxmoe/parallel/options.py `MeshOptions`                             |
| `data`      | jaxmoe/data/options.py `DataOptions`                                 |

Each section checks its own keys when it is made; checks that span sections (the expert
axis against the experts) are JobConfig's. A config file's own top-level sections (its
EXTRA_KEYS, a converter's `source`) are not part of the schema: they travel as plain dicts
in `JobConfig.extra`, stored with the checkpoints as they were set.
"""

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jaxmoe.data.options import DataOptions, span_corruption
from jaxmoe.errors import ConfigError
from jaxmoe.fields import (
    Options,
    as_dict,
    choices,
    is_section,
    need,
    section,
    section_class,
    value_type,
)
from jaxmoe.models.options import ModelOptions
from jaxmoe.parallel.options import MeshOptions
from jaxmoe.training.options import OptimizerOptions, TrainOptions


@dataclass(frozen=True)
class JobConfig(Options):
    """A whole config, typed and checked; each part of jaxmoe takes its own section."""

    model: ModelOptions = section(ModelOptions, "the architecture")
    train: TrainOptions = section(TrainOptions, "the run: steps, batches, evaluations")
    optimizer: OptimizerOptions = section(OptimizerOptions, "the update rule and schedule")
    mesh: MeshOptions = section(MeshOptions, "the device mesh")
    data: DataOptions = section(DataOptions, "the text, its tokenizer and batches")
    # A config file's own sections (EXTRA_KEYS) and a converter's `source`, as plain dicts.
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        experts, expert_axis = self.model.moe.num_experts, self.mesh.expert
        need(
            not experts or expert_axis in (-1, 1) or experts % expert_axis == 0,
            f"mesh.expert={expert_axis} does not divide model.moe.num_experts={experts}",
        )
        _check_context(self)
        self._check_data_and_optimizer()
        _check_lora(self)
        _check_dpo(self)
        _check_replay(self)

    def _check_data_and_optimizer(self) -> None:
        """The data format and the optimizer's qk_clip against the model."""
        data, arch = self.data, self.model.arch
        if arch == "encoder_decoder" and data.format not in ("text", "seq2seq"):
            raise ConfigError(
                f"data.format={data.format!r} is for decoder-only models; "
                f"model.arch=encoder_decoder reads data.format=seq2seq (inputs/targets) or "
                f"text (span corruption)"
            )
        if arch != "encoder_decoder" and data.format == "seq2seq":
            raise ConfigError(
                "data.format='seq2seq' needs model.arch=encoder_decoder (a decoder-only model "
                "reads data.format=prompt_completion)"
            )
        if arch == "encoder_decoder" and data.format == "text" and data.packing == "documents":
            raise ConfigError(
                "data.packing=documents packs whole examples: span corruption (model.arch="
                "encoder_decoder, data.format=text) reads windows of one stream "
                "(data.packing=concat)"
            )
        if self.optimizer.qk_clip:
            if arch != "decoder":
                raise ConfigError("optimizer.qk_clip > 0 is implemented for decoder models only")
            if self.model.qk_norm != "none":
                raise ConfigError(
                    f"optimizer.qk_clip > 0 with model.qk_norm={self.model.qk_norm!r}: the norm "
                    "undoes any rescaling of the query/key weights (use one or the other)"
                )

    @property
    def span_corruption(self) -> bool:
        """Whether the data is read as T5 span corruption (an encoder-decoder on text): what
        the data pipeline needs to know of the model (`build_data(..., spans=...)`)."""
        return span_corruption(self.model.arch, self.data.format)

    def to_dict(self) -> dict:
        """Every key as nested plain dicts (what a checkpoint stores), extras included."""
        out = {name: as_dict(getattr(self, name)) for name in SECTIONS}
        return out | {name: _plain(value) for name, value in self.extra.items()}


SECTIONS = tuple(f.name for f in dataclasses.fields(JobConfig) if is_section(f))


def typed(values: Mapping) -> JobConfig:
    """A JobConfig from a nested mapping of keys (a ConfigDict or dicts): an unknown key, a
    value of the wrong type, a value outside its choices or its range, or an impossible
    combination is a one-line ConfigError naming the key. Keys it lacks take their
    defaults; top-level sections outside the schema go to `extra`."""
    extra = {name: _plain(values[name]) for name in values if name not in SECTIONS}
    sections = {name: values[name] for name in SECTIONS if name in values}
    return dataclasses.replace(_build(JobConfig, sections, ""), extra=extra)


def _plain(value):
    """A ConfigDict (or dict) section as plain nested dicts."""
    if hasattr(value, "items"):
        return {key: _plain(child) for key, child in value.items()}
    return value


def _check_context(job: JobConfig) -> None:
    """mesh.context > 1 (models/context_parallel.py): what the split sequence supports."""
    parts, model = job.mesh.context, job.model
    if parts in (-1, 1):
        return
    if model.arch != "decoder":
        raise ConfigError(f"mesh.context={parts} splits decoder sequences only (model.arch)")
    if job.train.seq_len % (2 * parts):
        raise ConfigError(
            f"mesh.context={parts}: train.seq_len={job.train.seq_len} must be a multiple of "
            f"2 x mesh.context = {2 * parts} (an early and a late chunk per device)"
        )
    if model.dropout_rate:
        raise ConfigError(
            f"mesh.context={parts} has no attention-probability dropout: set "
            f"model.dropout_rate=0 (got {model.dropout_rate})"
        )
    if job.optimizer.qk_clip:
        raise ConfigError(
            f"mesh.context={parts} has no MuonClip logit statistics yet: set "
            f"optimizer.qk_clip=0 (got {job.optimizer.qk_clip})"
        )
    # Ulysses splits the query heads over the axis (MLA gathers its latent instead).
    ulysses = model.context_strategy == "ulysses" and model.attention != "mla"
    if ulysses and model.num_heads % parts:
        raise ConfigError(
            f"model.context_strategy=ulysses splits the query heads over mesh.context: "
            f"model.num_heads={model.num_heads} does not divide by {parts} "
            "(use all_gather or ring)"
        )
    if model.moe.num_experts and model.moe.capacity_factor > 0:
        raise ConfigError(
            f"mesh.context={parts} needs dropless experts (model.moe.capacity_factor=0): "
            "capacity drops by token order, which the split layout changes"
        )


def _check_lora(job: JobConfig) -> None:
    """train.lora against the model and the optimizer (training/lora_run.py)."""
    if not job.train.lora.enabled:
        return
    if job.model.arch != "decoder":
        raise ConfigError("train.lora is implemented for decoder models (model.arch=decoder)")
    if job.optimizer.qk_clip:
        raise ConfigError(
            "optimizer.qk_clip rescales the query/key weights, which train.lora keeps frozen"
        )
    if job.model.moe.num_experts and job.model.moe.bias_update_rate:
        raise ConfigError(
            "model.moe.bias_update_rate moves the selection biases, which train.lora keeps "
            "frozen (set it to 0)"
        )


def _check_dpo(job: JobConfig) -> None:
    """train.objective=dpo against the data and the loss options (training/dpo.py)."""
    t, data = job.train, job.data
    preference = data.format == "preference"
    if (t.objective == "dpo") != preference:
        raise ConfigError(
            f"train.objective={t.objective!r} with data.format={data.format!r}: preference "
            "pairs (data.format=preference) are what train.objective=dpo trains on, and only it"
        )
    if not preference:
        return
    for culprit, unsupported in (
        (f"data.streaming={data.streaming}", data.streaming),
        (f"train.loss_chunk={t.loss_chunk}", t.loss_chunk > 0),
        (f"train.logits_z_loss={t.logits_z_loss}", t.logits_z_loss > 0),
        (f"model.mtp_depth={job.model.mtp_depth}", job.model.mtp_depth > 0),
        (f"optimizer.qk_clip={job.optimizer.qk_clip}", job.optimizer.qk_clip > 0),
    ):
        if unsupported:
            raise ConfigError(f"train.objective=dpo is not supported with {culprit} (unset it)")


def _check_replay(job: JobConfig) -> None:
    """model.moe.replay against the data it reads its routing from (moe/replay.py)."""
    moe, data = job.model.moe, job.data
    if not moe.replay:
        return
    if not moe.num_experts or job.model.arch != "decoder":
        raise ConfigError("model.moe.replay needs an MoE decoder (model.arch=decoder)")
    if data.format not in ("prompt_completion", "chat", "preference"):
        raise ConfigError(
            f"model.moe.replay reads each example's recorded `routing` field: data.format="
            f"{data.format!r} has none (prompt_completion | chat | preference)"
        )
    if data.streaming:
        raise ConfigError(
            "model.moe.replay reads routing from the prepared cache: data.streaming=false"
        )
    if data.shards or data.mixture:
        raise ConfigError(
            "model.moe.replay reads routing from one whole split: unset data.shards and "
            "data.mixture"
        )
    if job.mesh.context not in (-1, 1):
        raise ConfigError(
            f"model.moe.replay with mesh.context={job.mesh.context}: the recorded routing is "
            "not split over the context axis yet (mesh.context=1)"
        )


def leaf_fields(cls: type = JobConfig, prefix: str = "") -> dict[str, dataclasses.Field]:
    """'model.moe.num_experts' -> its dataclass field, for every key of the schema."""
    out = {}
    for f in dataclasses.fields(cls):
        if is_section(f):
            inner = prefix if f.metadata["flat"] else f"{prefix}{f.name}."
            out.update(leaf_fields(section_class(f), inner))
        elif "doc" in f.metadata:  # a key (JobConfig.extra is none)
            out[prefix + f.name] = f
    return out


def key_type(key: str) -> type | None:
    """The schema's type of `key` (int, float, bool or str); None for a key it does not know
    (one of a config file's own EXTRA_KEYS)."""
    found = _LEAVES.get(key)
    return None if found is None else value_type(found)


def unknown_key_message(key: str, known: list[str]) -> str:
    """`unknown config key 'a.b' (did you mean 'a.c'?)`: the line for a key nobody reads."""
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown config key {key!r}{hint}"


def _build(cls: type, values: Mapping, prefix: str):
    """`cls` from a mapping of its keys (a flat section's among them): nested sections
    recursively, leaves type-checked; the sections check their values as they are made."""
    own = list(leaf_fields(cls, prefix)) + [
        f"{prefix}{f.name}" for f in dataclasses.fields(cls) if is_section(f)
    ]
    for name in values:
        if prefix + name not in own:
            raise ConfigError(unknown_key_message(prefix + name, list(_LEAVES)))
    kwargs = {}
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if is_section(f) and f.metadata["flat"]:
            names = {g.name for g in dataclasses.fields(section_class(f))}
            own_values = {k: v for k, v in values.items() if k in names}
            kwargs[f.name] = _build(section_class(f), own_values, prefix)
        elif f.name not in values:
            continue
        elif is_section(f):
            if not hasattr(values[f.name], "keys"):
                raise ConfigError(f"{key}={values[f.name]!r}: expected a section of keys")
            kwargs[f.name] = _build(section_class(f), values[f.name], key + ".")
        else:
            kwargs[f.name] = as_type(key, values[f.name], value_type(f))
    return cls(**kwargs)


def as_type(key: str, value, kind: type):
    """`value` as the schema's `kind`: an int is a float too, nothing else converts."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    raise ConfigError(f"{key}={value!r}: expected {kind.__name__}, got {type(value).__name__}")


_LEAVES = leaf_fields()


def describe() -> list[str]:
    """One line per key: `key (type, default): doc [choices]`, in the schema's order."""
    lines = []
    for key, f in _LEAVES.items():
        allowed = choices(f)
        tail = f" [{' | '.join(repr(c) for c in allowed)}]" if allowed else ""
        kind = value_type(f).__name__
        lines.append(f"{key} ({kind}, {f.default!r}): {f.metadata['doc']}{tail}")
    return lines
