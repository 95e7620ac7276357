"""The pieces every config section (models/options.py, models/moe/gates.py and router.py,
training/options.py, data/options.py, parallel/options.py) is written with: a key with its
default and one-line doc, a nested section, the checks. It imports nothing of jaxmoe but
errors, so any package's schema can use it (the bottom floor of the layer order).

A section is a frozen dataclass whose `__post_init__` runs its checks, so a section never
exists with a value jaxmoe cannot run; `dataclasses.replace` (or `with_values`) derives a
changed one, checked again. A choice is a `Literal` type (or, for lists built elsewhere,
`option(..., choices=...)`); `check_choices` refuses any other value, once, for every key.
"""

import dataclasses
import types
import typing
from dataclasses import field
from typing import Any, Literal, TypeVar

from jaxmoe.errors import ConfigError

Section = TypeVar("Section")


def option(default: Any, doc: str, choices: tuple = ()) -> Any:
    """A config key: its default, its one-line doc and, for a choice whose values are not a
    Literal type, the allowed values."""
    return field(default=default, metadata={"doc": doc, "choices": tuple(choices)})


def section(cls: type, doc: str, *, flat: bool = False) -> Any:
    """A nested section of keys. `flat`: its keys are written in the parent's namespace
    (`model.moe.threshold` is the gate section's `threshold`), so grouping keys into a
    section never renames one a user types."""
    return field(default_factory=cls, metadata={"doc": doc, "flat": flat, "section": True})


def need(ok: bool, message: str) -> None:
    """A section check: `message` (naming the key and its value) as a one-line ConfigError."""
    if not ok:
        raise ConfigError(message)


def is_section(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("section"))


def section_class(f: dataclasses.Field) -> Any:
    """The dataclass of a section field."""
    if not (isinstance(f.type, type) and dataclasses.is_dataclass(f.type)):
        raise TypeError(f"{f.name}: a section's type is a dataclass, not {f.type!r}")
    return f.type


def choices(f: dataclasses.Field) -> tuple:
    """The values a key allows: its Literal type's, or `option(choices=...)`'s; () = any."""
    if typing.get_origin(f.type) is Literal:
        return typing.get_args(f.type)
    return tuple(f.metadata.get("choices", ()))


def value_type(f: dataclasses.Field) -> type:
    """The Python type of a key's values: a Literal's (str for choices of names)."""
    kind = f.type
    if typing.get_origin(kind) is Literal:
        return type(typing.get_args(kind)[0])
    if isinstance(kind, types.UnionType) or not isinstance(kind, type):
        raise TypeError(f"{f.name}: a config key has one plain type, not {kind!r}")
    return kind


def check_choices(instance: Any, prefix: str) -> None:
    """Every choice key of `instance` holds one of its values (`prefix`: the section's
    dotted name, for the message)."""
    for f in dataclasses.fields(instance):
        allowed = choices(f)
        value = getattr(instance, f.name)
        if allowed and value not in allowed:
            raise ConfigError(f"{prefix}{f.name}={value!r} is not one of {list(allowed)}")


def with_values(instance: Section, **changes: Any) -> Section:
    """`instance` with `changes` (keys of it or of its flat sections), checked again."""
    own = {f.name: f for f in dataclasses.fields(instance)}  # type: ignore[arg-type]
    direct: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in changes.items():
        if key in own:
            direct[key] = value
            continue
        for f in own.values():
            flat_keys = (
                {g.name for g in dataclasses.fields(section_class(f))}
                if f.metadata.get("flat")
                else set()
            )
            if key in flat_keys:
                nested.setdefault(f.name, {})[key] = value
                break
        else:
            raise ConfigError(f"{type(instance).__name__} has no key {key!r}")
    for name, values in nested.items():
        direct[name] = dataclasses.replace(getattr(instance, name), **values)
    return dataclasses.replace(instance, **direct)  # type: ignore[type-var]


class Options:
    """The base of every section: `section.replace(key=value, ...)` derives a changed copy
    (keys of its flat sections too: `moe.replace(top_k=4)`), checked again."""

    def replace(self: Section, **changes: Any) -> Section:
        return with_values(self, **changes)

    def to_dict(self) -> dict:
        """The keys as nested plain dicts, as a config file spells them (as_dict)."""
        return as_dict(self)


def as_dict(instance: Any) -> dict:
    """A section's keys as nested plain dicts, as a config file or a stored config spells
    them (a flat section's keys in its parent's)."""
    out: dict = {}
    for f in dataclasses.fields(instance):
        value = getattr(instance, f.name)
        if not is_section(f):
            out[f.name] = value
        elif f.metadata.get("flat"):
            out.update(as_dict(value))
        else:
            out[f.name] = as_dict(value)
    return out
