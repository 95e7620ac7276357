"""The config schema: one frozen dataclass per section, each owned by the package it
configures (its keys' types, defaults, one-line docs and checks), and `typed(config)`, the
checked typed view of a ConfigDict.

| section     | schema                                         |
|-------------|------------------------------------------------|
| `model`     | jaxmoe/models/options.py `ModelOptions`        |
| `model.moe` | jaxmoe/models/options.py `MoEOptions`          |
| `train`     | jaxmoe/training/options.py `TrainOptions`      |
| `optimizer` | jaxmoe/training/options.py `OptimizerOptions`  |
| `mesh`      | jaxmoe/parallel/options.py `MeshOptions`       |
| `data`      | jaxmoe/data/options.py `DataOptions`           |

Checks that span sections (the expert axis against the experts) live here, in
`_check_across`. A config file's own top-level sections (its EXTRA_KEYS, a converter's
`source`) are not part of the schema and pass through untyped.
"""

import dataclasses
import difflib
from dataclasses import dataclass, field

from jaxmoe.data.options import DataOptions
from jaxmoe.errors import ConfigError
from jaxmoe.models.options import ModelOptions
from jaxmoe.parallel.options import MeshOptions
from jaxmoe.training.options import OptimizerOptions, TrainOptions


@dataclass(frozen=True)
class JobConfig:
    """The typed, checked view of a whole config (see `typed`)."""

    model: ModelOptions = field(default_factory=ModelOptions)
    train: TrainOptions = field(default_factory=TrainOptions)
    optimizer: OptimizerOptions = field(default_factory=OptimizerOptions)
    mesh: MeshOptions = field(default_factory=MeshOptions)
    data: DataOptions = field(default_factory=DataOptions)


SECTIONS = tuple(f.name for f in dataclasses.fields(JobConfig))


def typed(config) -> JobConfig:
    """`config` (a ConfigDict or nested dict) as frozen dataclasses, checked as it is built:
    an unknown key, a value of the wrong type, a value outside its choices or its range, or
    an impossible combination is a one-line ConfigError naming the key. Keys it lacks take
    their defaults."""
    job = _build(JobConfig, {s: config[s] for s in SECTIONS if s in config}, "")
    for section in (job.model, job.train, job.optimizer, job.mesh, job.data):
        section.check()
    _check_across(job)
    return job


def _check_across(job: JobConfig) -> None:
    experts, expert_axis = job.model.moe.num_experts, job.mesh.expert
    if experts and expert_axis not in (-1, 1) and experts % expert_axis:
        raise ConfigError(
            f"mesh.expert={expert_axis} does not divide model.moe.num_experts={experts}"
        )
    _check_context(job)
    data, arch = job.data, job.model.arch
    if arch == "encoder_decoder" and data.format not in ("text", "seq2seq"):
        raise ConfigError(
            f"data.format={data.format!r} is for decoder-only models; model.arch=encoder_decoder "
            f"reads data.format=seq2seq (inputs/targets) or text (span corruption)"
        )
    if arch != "encoder_decoder" and data.format == "seq2seq":
        raise ConfigError(
            "data.format='seq2seq' needs model.arch=encoder_decoder (a decoder-only model "
            "reads data.format=prompt_completion)"
        )
    if arch == "encoder_decoder" and data.format == "text" and data.packing == "documents":
        raise ConfigError(
            "data.packing=documents packs whole examples: span corruption (model.arch="
            "encoder_decoder, data.format=text) reads windows of one stream (data.packing=concat)"
        )
    if job.optimizer.qk_clip:
        if job.model.arch != "decoder":
            raise ConfigError("optimizer.qk_clip > 0 is implemented for decoder models only")
        if job.model.qk_norm != "none":
            raise ConfigError(
                f"optimizer.qk_clip > 0 with model.qk_norm={job.model.qk_norm!r}: the norm "
                "undoes any rescaling of the query/key weights (use one or the other)"
            )


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
    if model.moe.num_experts and model.moe.capacity_factor > 0:
        raise ConfigError(
            f"mesh.context={parts} needs dropless experts (model.moe.capacity_factor=0): "
            "capacity drops by token order, which the split layout changes"
        )


def leaf_fields(cls=JobConfig, prefix: str = "") -> dict[str, dataclasses.Field]:
    """'model.moe.num_experts' -> its dataclass field, for every key of the schema."""
    out = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type):
            out.update(leaf_fields(f.type, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = f
    return out


def key_type(key: str) -> type | None:
    """The schema's type of `key` (int, float, bool or str); None for a key it does not know
    (one of a config file's own EXTRA_KEYS)."""
    found = _LEAVES.get(key)
    return None if found is None else found.type


def unknown_key_message(key: str, known: list[str]) -> str:
    """`unknown config key 'a.b' (did you mean 'a.c'?)`: the line for a key nobody reads."""
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown config key {key!r}{hint}"


def _build(cls, values, prefix: str):
    """`cls` from a mapping of its keys: nested sections recursively, leaves type-checked."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    for name in values:
        if name not in names:
            raise ConfigError(unknown_key_message(prefix + name, list(_LEAVES)))
    kwargs = {}
    for name, f in names.items():
        if name not in values:
            continue
        value, key = values[name], prefix + name
        if dataclasses.is_dataclass(f.type):
            if not hasattr(value, "keys"):
                raise ConfigError(f"{key}={value!r}: expected a section of keys")
            kwargs[name] = _build(f.type, value, key + ".")
            continue
        value = _as_type(key, value, f.type)
        allowed = f.metadata["choices"]
        if allowed and value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {list(allowed)}")
        kwargs[name] = value
    return cls(**kwargs)


def _as_type(key: str, value, kind: type):
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
        choices = f.metadata["choices"]
        tail = f" [{' | '.join(repr(c) for c in choices)}]" if choices else ""
        lines.append(f"{key} ({f.type.__name__}, {f.default!r}): {f.metadata['doc']}{tail}")
    return lines
