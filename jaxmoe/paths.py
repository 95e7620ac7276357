"""Paths as users type them: relative, with `~`, with spaces, or remote (`gs://...`).

Local paths are made absolute once, where the user's input enters (command-line flags and
config keys), because Orbax and TensorStore refuse relative paths and a later `chdir` must
not move a run. Remote URIs pass through untouched.
"""

import os

# Config keys holding one path each ("" keeps the key's default).
PATH_KEYS = ("train.init_from", "data.tokenizer", "data.cache_dir", "data.data_dir")
# Data specs `KIND:PATH` whose argument is a local path or glob (tfds:NAME is not).
PATH_SPEC_KINDS = ("jsonl", "text", "parquet")


def is_remote(path: str) -> bool:
    """`gs://b/x`, `s3://...`: a URI with a scheme, handled by the storage library."""
    scheme, sep, _ = str(path).partition("://")
    return bool(sep) and scheme.isidentifier()


def absolute_path(path: str) -> str:
    """`~` expanded and made absolute against the current directory; remote and empty
    paths are returned as they are."""
    path = os.fspath(path)
    if not path or is_remote(path):
        return path
    return os.path.abspath(os.path.expanduser(path))


def absolute_data_spec(spec: str) -> str:
    """`jsonl:FILE` / `text:GLOB` with the path made absolute; other specs unchanged."""
    kind, sep, argument = spec.partition(":")
    if sep and kind in PATH_SPEC_KINDS:
        return f"{kind}:{absolute_path(argument)}"
    return spec


def absolute_mixture(mixture: str) -> str:
    """`data.mixture` ("SPEC=WEIGHT,...") with each spec's path made absolute."""
    entries = []
    for entry in mixture.split(","):
        spec, sep, weight = entry.strip().rpartition("=")
        entries.append(f"{absolute_data_spec(spec)}={weight}" if sep else entry)
    return ",".join(entries)


def absolute_config_paths(config) -> None:
    """Make every path-valued key of a ConfigDict absolute, in place."""
    with config.unlocked():
        for key in PATH_KEYS:
            section, leaf = key.split(".")
            if section in config and leaf in config[section]:
                config[section][leaf] = absolute_path(config[section][leaf])
        if "data" in config and "source" in config.data:
            config.data.source = absolute_data_spec(config.data.source)
        if "data" in config and config.data.get("mixture"):
            config.data.mixture = absolute_mixture(config.data.mixture)
