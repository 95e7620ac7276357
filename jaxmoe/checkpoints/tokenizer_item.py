"""A checkpoint holds its tokenizer: `<checkpoint>/tokenizer/`, the files that define it.

Every checkpoint jaxmoe writes (each training step, `convert t5x|hf|gqa|upcycle`) carries a
copy of the tokenizer it was made with: the SentencePiece model as `tokenizer.model`, or a
Hugging Face `tokenizer.json`, with the side files Hugging Face keeps beside them
(SIDE_FILES). Its stored `data.tokenizer` names that copy relative to the checkpoint
("tokenizer" or "tokenizer/tokenizer.model"), so the checkpoint moves, copies and mirrors
with its tokenizer, and nothing is ever re-trained or looked up from `data.*` at use time.

Training checkpoints save it as an Orbax item (TokenizerFilesSave), written and committed
with the step like `params`; converted ones get the folder in their staging directory.
"""

import dataclasses
import os

import jax
import orbax.checkpoint as ocp
from etils import epath

from jaxmoe.errors import ConfigError
from jaxmoe.storage.paths import is_remote

TOKENIZER_DIR = "tokenizer"
SIDE_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",  # the chat template, where transformers >= 4.43 saves it
)


def tokenizer_files(tokenizer) -> dict[str, bytes]:
    """{file name: bytes} of the files that define `tokenizer` (an opened Tokenizer or
    HFTokenizer): its model file under the conventional name, plus the side files beside it."""
    source = epath.Path(tokenizer.path)
    main = "tokenizer.json" if source.name.endswith(".json") else "tokenizer.model"
    files = {main: source.read_bytes()}
    if not is_remote(tokenizer.path):  # side files are only read locally (tokenizer.py)
        for name in SIDE_FILES:
            side = source.parent / name
            if side.is_file():
                files[name] = side.read_bytes()
    return files


def stored_name(files: dict[str, bytes]) -> str:
    """`data.tokenizer` as the checkpoint stores it: relative to the checkpoint."""
    return TOKENIZER_DIR if "tokenizer.json" in files else f"{TOKENIZER_DIR}/tokenizer.model"


def write_tokenizer_files(folder, files: dict[str, bytes]) -> None:
    """`files` written into `folder` (made if missing)."""
    folder = epath.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)


def copy_tokenizer_dir(src_checkpoint, dst_checkpoint) -> bool:
    """`src_checkpoint`/tokenizer/ copied into `dst_checkpoint` (convert gqa / upcycle);
    False when the source holds none. Regular files only: a symlink is never followed."""
    source = epath.Path(src_checkpoint) / TOKENIZER_DIR
    if not source.is_dir():
        return False
    local = not is_remote(source)
    files = {
        child.name: child.read_bytes()
        for child in source.iterdir()
        if not local or (child.is_file() and not os.path.islink(child))
    }
    write_tokenizer_files(epath.Path(dst_checkpoint) / TOKENIZER_DIR, files)
    return True


def check_tokenizer_fits(tokenizer, model_vocab: int, where: str) -> None:
    """ConfigError when `tokenizer` has ids the model's `model_vocab` rows cannot embed."""
    if model_vocab and tokenizer.vocab_size > model_vocab:
        raise ConfigError(
            f"{where} ({tokenizer.path}) has {tokenizer.vocab_size} ids, more than the "
            f"model's vocabulary of {model_vocab} (model.vocab_size): its ids past "
            f"{model_vocab - 1} have no embedding"
        )


class TokenizerFilesHandler(ocp.handlers.CheckpointHandler):
    """Orbax handler of the `tokenizer` item: a few small files, written by process 0."""

    def save(self, directory: epath.Path, args: "TokenizerFilesSave") -> None:
        if jax.process_index() == 0:
            write_tokenizer_files(directory, args.files)

    def restore(self, directory: epath.Path, args=None) -> dict[str, bytes]:
        return {child.name: child.read_bytes() for child in directory.iterdir()}

    def metadata(self, directory: epath.Path):
        return None


@ocp.args.register_with_handler(TokenizerFilesHandler, for_save=True)
@dataclasses.dataclass
class TokenizerFilesSave(ocp.args.CheckpointArgs):
    files: dict


@ocp.args.register_with_handler(TokenizerFilesHandler, for_restore=True)
@dataclasses.dataclass
class TokenizerFilesRestore(ocp.args.CheckpointArgs):
    pass
