"""Paths as users type them: relative, with `~`, with spaces, or remote (`gs://...`).

Local paths are made absolute once, where the user's input enters (config keys when the
config is loaded, checkpoint arguments when flags are parsed, the training workdir when
`train` starts), and passed down as they are: Orbax and TensorStore refuse relative paths,
and a later `chdir` must not move a run. Remote URIs pass through untouched.
"""

import os
import re

# A scheme of two or more letters: `C:/x` (a Windows drive) stays a local path.
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+://")

# Data specs `KIND:PATH` whose argument is a local path or glob (tfds:NAME is not).
PATH_SPEC_KINDS = ("jsonl", "text", "parquet")


def is_remote(path) -> bool:
    """True for a URI such as `gs://bucket/run` (stored by a client library, not the OS)."""
    return bool(_URI.match(str(path)))


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


def finished_steps(directory) -> list[int]:
    """Sorted steps of the complete checkpoints in `directory` (an etils epath.Path).

    Locally Orbax writes `N.orbax-checkpoint-tmp` and renames it to `N` when complete; an
    object store has no atomic rename, so there Orbax writes `N/` directly and adds
    `N/commit_success.txt` last: a remote `N/` without it is a save cut short.
    """
    if not directory.exists():  # on an object store a folder exists while it holds objects
        return []
    remote = is_remote(directory)
    return sorted(
        int(child.name)
        for child in directory.iterdir()
        if child.name.isdigit() and (not remote or (child / "commit_success.txt").exists())
    )
