"""Confine paths named inside checkpoint metadata to the checkpoint's own directory.

A checkpoint is untrusted input: its metadata (T5X TensorStore specs, Orbax placeholders,
HF index files) names the files that hold each tensor. `resolve_inside` is the single gate
every reader passes such a name through before opening anything, so a crafted checkpoint
cannot make jaxmoe read (or write) `/etc/passwd`, a sibling directory or a remote store.
"""

import os
import re
from pathlib import Path

from jaxmoe.storage.paths import is_remote
from jaxmoe.storage.received import not_regular

# A URL scheme ("gs://", "file:", "http:") or a Windows drive ("C:") is never a relative path.
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def resolve_inside(root: str | os.PathLike, relative: str | os.PathLike) -> Path:
    """Returns `root/relative`, fully resolved, after checking that it stays inside `root`.

    Refused (ValueError): empty names, NUL bytes, absolute paths, URLs and drive letters,
    backslashes, `..` components (even ones that would come back inside), names whose
    resolution through symlinks lands outside `root`, and targets that are neither a file
    nor a folder (a FIFO, a device: storage/received.py). Symlinks that stay inside `root`
    are allowed. The target need not exist.
    """
    text = os.fspath(relative)
    if not isinstance(text, str):
        raise ValueError(f"path {text!r} is not text")
    problem = _lexical_problem(text)
    if problem:
        raise ValueError(f"path {text!r} {problem}")
    root_resolved = Path(root).resolve()
    target = (root_resolved / text).resolve()
    if not target.is_relative_to(root_resolved):
        raise ValueError(f"path {text!r} resolves to {target}, outside {root_resolved}")
    try:
        kind = not_regular(target.stat().st_mode)
    except OSError:
        kind = None  # absent (or unreadable): the reader says so
    if kind and kind != "a directory":
        raise ValueError(f"path {text!r} is {kind}, not a file (never read)")
    return target


def join_inside(root: str | os.PathLike, relative: str) -> str:
    """`resolve_inside` for a root that may be remote (`gs://...`): there, where nothing
    resolves symlinks, the same lexical checks and a plain join."""
    if not is_remote(root):
        return str(resolve_inside(root, relative))
    problem = _lexical_problem(os.fspath(relative))
    if problem:
        raise ValueError(f"path {relative!r} {problem}")
    return f"{str(root).rstrip('/')}/{relative}"


def _lexical_problem(text: str) -> str | None:
    """Why `text` cannot be a relative path below a directory, or None if it can."""
    if not text:
        return "is empty"
    if "\x00" in text:
        return "contains a NUL byte"
    if "\\" in text:
        return "contains a backslash"
    if text.startswith("/") or _SCHEME.match(text):
        return "is absolute or a URL"
    if ".." in text.split("/"):
        return "has a '..' component"
    return None


def check_no_symlink_out(directory: str | os.PathLike, within: str | os.PathLike | None = None):
    """ValueError naming the first symlink in the tree under `directory` (or `directory`
    itself) that leads outside `within` (default: `directory`), or the first entry that is
    neither a file nor a folder (a FIFO blocks its reader forever, a device never ends:
    storage/received.py). Readers such as Orbax and TensorStore follow symlinks, so a
    received checkpoint is checked before any is read."""
    top = Path(directory)
    root = Path(within if within is not None else directory).resolve()
    entries = [top] if top.is_symlink() else []
    for folder, dirs, files in os.walk(top.resolve()):
        entries += [Path(folder) / name for name in dirs + files]
    for entry in entries:
        if entry.is_symlink() and not entry.resolve().is_relative_to(root):
            raise ValueError(
                f"{entry.name!r} is a symlink to {entry.resolve()}, outside {root} "
                f"(a checkpoint is read only inside its own directory)"
            )
        kind = not_regular(entry.lstat().st_mode) if not entry.is_symlink() else None
        if kind and kind != "a directory":
            raise ValueError(f"{str(entry)!r} is {kind}, not a file (never read)")
