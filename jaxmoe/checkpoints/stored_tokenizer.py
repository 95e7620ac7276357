"""`data.tokenizer` as a checkpoint stores it, and the file it names when read back.

`convert hf` copies the source's tokenizer into DST/tokenizer/ and stores `data.tokenizer`
relative to the checkpoint directory ("tokenizer" or "tokenizer/tokenizer.model"), so a
checkpoint moved, copied or mirrored to gs:// still finds it. A checkpoint is untrusted
input: a relative path in its config passes `safe_paths.join_inside` (no `..`, no URL, no
symlink out), else the config is refused in one line. An absolute path (older checkpoints)
is read only when it lies inside the checkpoint, and an older converted checkpoint's own
copy is used, with a warning, when it was moved away from the path it stores; any other is
refused in one line that says how to name a tokenizer.
`--config.data.tokenizer=FILE` replaces the stored value before any of this
(restore.checkpoint_config).
"""

import logging
import os

from etils import epath

from jaxmoe.checkpoints.safe_paths import join_inside
from jaxmoe.checkpoints.tokenizer_item import TOKENIZER_DIR
from jaxmoe.storage.paths import is_remote

log = logging.getLogger(__name__)


def resolve_stored_tokenizer(step_dir, stored: str) -> str:
    """The tokenizer path that a checkpoint in `step_dir` (local or remote) names with
    `data.tokenizer` = `stored`: relative ones joined to `step_dir`; ValueError if one
    would leave it. An absolute one is accepted only inside `step_dir` (or as an older
    converted checkpoint's own copy, moved): a received checkpoint never makes jaxmoe
    read a file of the sender's choosing."""
    if not stored:
        return stored
    if is_remote(stored) or os.path.isabs(stored):
        own = None if is_remote(stored) else _own_copy(step_dir, stored)
        if own:
            log.warning(
                "the checkpoint's data.tokenizer=%s does not exist (converted elsewhere and "
                "moved): using its own copy %s", stored, own
            )  # fmt: skip
            return own
        root = str(step_dir).rstrip("/") + "/"
        if not stored.startswith(root):
            raise ValueError(f"{stored!r} lies outside the checkpoint {str(step_dir)!r}")
        stored = stored[len(root) :]
    return join_inside(step_dir, stored)


def _own_copy(step_dir, stored: str) -> str | None:
    """The checkpoint's own tokenizer when `stored` is the absolute path that an older
    `convert hf` wrote (DST/tokenizer[/tokenizer.model]) and no longer exists."""
    for tail in (TOKENIZER_DIR, f"{TOKENIZER_DIR}/tokenizer.model"):
        if stored.endswith("/" + tail) and not epath.Path(stored).exists():
            own = join_inside(step_dir, tail)
            if epath.Path(own).exists():
                return own
    return None


def inherited_tokenizer(path: str, src_step_dir) -> tuple[str, str] | None:
    """For a checkpoint derived from the local one in `src_step_dir` (convert gqa /
    upcycle) whose `data.tokenizer` is `path`: (the source's own tokenizer folder, to be
    copied into the new checkpoint; `data.tokenizer` relative to that copy) when `path`
    lies in that folder, else None (the path stays as it is)."""
    if is_remote(src_step_dir):
        return None
    own = join_inside(src_step_dir, TOKENIZER_DIR)
    if path != own and not path.startswith(own + "/"):
        return None
    return own, TOKENIZER_DIR + path[len(own) :]
