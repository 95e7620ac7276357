"""The tokenizer travels with the model, both ways (docs/hf_interop.md).

`convert hf`: the source's tokenizer files (KEPT_FILES, those present) are copied into
DST/tokenizer/, and `data.tokenizer` points there (its tokenizer.json, else its
tokenizer.model; stored relative to DST, so the checkpoint can move: stored_tokenizer.py)
unless a --config.data.tokenizer override says otherwise, so `eval`, `decode` and
`train --config.train.init_from=DST` use them.

`export hf`: the checkpoint's tokenizer (`data.tokenizer`, or --tokenizer) is written next
to the tensors: a Hugging Face tokenizer (a tokenizer.json, or a SentencePiece model with a
tokenizer_config.json beside it) by copying its files; jaxmoe's own SentencePiece model as
a tokenizer.json (tokenizer.py). The special-token ids jaxmoe reads from that tokenizer
(BOS, EOS and the further stop ids, pad) go into config.json and generation_config.json.
"""

import json
import logging
import os
import shutil
from pathlib import Path

from jaxmoe.checkpoints.manager import CheckpointError
from jaxmoe.checkpoints.safe_paths import resolve_inside
from jaxmoe.checkpoints.stored_tokenizer import TOKENIZER_DIR
from jaxmoe.config.schema import JobConfig
from jaxmoe.conversions.hf.tokenizer import write_hf_tokenizer
from jaxmoe.data.tokenizer import EOS_ID, PAD_ID, open_tokenizer
from jaxmoe.storage.received import TOKENIZER_LIMIT, read_file

log = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
)
GENERATION_CONFIG = "generation_config.json"
KEPT_FILES = (*TOKENIZER_FILES, GENERATION_CONFIG)


def kept_tokenizer(src: Path) -> str:
    """What `data.tokenizer` of a checkpoint converted from `src` names, relative to that
    checkpoint (stored_tokenizer.py): its copy of the tokenizer files, or "" when `src`
    has none. CheckpointError when that file leads out of `src` or is no file (it is
    opened before it is copied)."""
    for name, target in (("tokenizer.json", ""), ("tokenizer.model", "/tokenizer.model")):
        if os.path.lexists(src / name):
            try:
                resolve_inside(src, name)
            except ValueError as error:
                raise CheckpointError(f"{src}: {error}") from None
            return TOKENIZER_DIR + target
    return ""


def _present(folder: Path) -> list[str]:
    """The KEPT_FILES in `folder`: any entry by that name (a FIFO or a link to a device is
    refused when read, never skipped in silence)."""
    return [name for name in KEPT_FILES if os.path.lexists(folder / name)]


def _read_kept(folder: Path, name: str) -> bytes:
    """`folder/name` read as a received file (storage/received.py): resolved inside
    `folder` (a symlink out of it is refused, as for the tensors), a regular file of a
    tokenizer file's size."""
    try:
        return read_file(resolve_inside(folder, name), name, TOKENIZER_LIMIT)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{folder}: {name}: {error}") from None


def keep_tokenizer_files(src: Path, checkpoint: Path) -> None:
    """Copies the tokenizer files of HF checkpoint `src` into `checkpoint`/tokenizer/.
    Reading never leaves `src`: a symlink out of it is refused, as for the tensors."""
    names = _present(src)
    if not names:
        return
    (checkpoint / TOKENIZER_DIR).mkdir(parents=True)
    for name in names:
        (checkpoint / TOKENIZER_DIR / name).write_bytes(_read_kept(src, name))


def _special_ids(tokenizer) -> dict:
    """config.json's special-token ids: those jaxmoe itself uses with `tokenizer`."""
    eos = list(tokenizer.eos_ids) if tokenizer is not None else [EOS_ID]
    pad = tokenizer.pad_token_id if tokenizer is not None else PAD_ID
    return {
        "bos_token_id": getattr(tokenizer, "bos_id", None),
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": pad,
    }


def _copy_hf_tokenizer(path: str, dst: Path) -> None:
    """The files of the HF tokenizer at `path` (a tokenizer.json, a folder, or a
    SentencePiece model with HF files beside it) copied into `dst`."""
    folder = Path(path) if os.path.isdir(path) else Path(path).parent
    for name in _present(folder):
        (dst / name).write_bytes(_read_kept(folder, name))
    if path.endswith(".json") and not os.path.isdir(path):  # any name: tokenizer.json here
        shutil.copyfile(path, dst / "tokenizer.json")
    elif path.endswith(".model"):
        shutil.copyfile(path, dst / "tokenizer.model")


def _is_hf_tokenizer(path: str) -> bool:
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    return (
        path.endswith(".json")
        or os.path.isdir(path)
        or os.path.isfile(os.path.join(folder, "tokenizer_config.json"))
    )


def export_tokenizer(config: JobConfig, dst: Path, tokenizer: str | None) -> dict:
    """Writes the tokenizer (`tokenizer`, default the checkpoint's data.tokenizer) and
    generation_config.json into the export `dst`; returns config.json's special-token ids.
    Without a tokenizer the ids are those of jaxmoe's own SentencePiece models."""
    path = tokenizer or config.data.tokenizer
    encoder_decoder = config.model.arch == "encoder_decoder"
    opened = None
    if path:
        opened = open_tokenizer(path)
        if _is_hf_tokenizer(path):
            _copy_hf_tokenizer(path, dst)
        else:
            try:
                write_hf_tokenizer(path, dst, encoder_decoder)
            except ValueError as error:
                if tokenizer:  # asked for explicitly: a failure is an error
                    raise
                log.warning("no tokenizer.json written: %s", error)  # e.g. T5's SentencePiece
    else:
        log.warning(
            "the checkpoint names no tokenizer (data.tokenizer): none exported (--tokenizer "
            "FILE adds one); special-token ids are jaxmoe's (eos %d, pad %d)", EOS_ID, PAD_ID
        )  # fmt: skip
    ids = _special_ids(opened)
    generation = {}
    if (dst / GENERATION_CONFIG).is_file():  # the source's: keep its sampling settings
        generation = json.loads((dst / GENERATION_CONFIG).read_text())
    generation |= ids
    if encoder_decoder:
        generation["decoder_start_token_id"] = 0  # jaxmoe's T5 decoder starts from id 0
        ids["decoder_start_token_id"] = 0
    (dst / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
    return ids
