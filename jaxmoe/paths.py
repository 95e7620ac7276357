"""Local paths versus remote URIs (`gs://bucket/x`): which is which."""

import re

# A scheme of two or more letters: `C:/x` (a Windows drive) stays a local path.
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+://")


def is_remote(path) -> bool:
    """True for a URI such as `gs://bucket/run` (stored by a client library, not the OS)."""
    return bool(_URI.match(str(path)))


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
