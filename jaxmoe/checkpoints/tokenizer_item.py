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

import jax
import orbax.checkpoint as ocp
from etils import epath

from jaxmoe.errors import ConfigError
from jaxmoe.storage.paths import is_remote
from jaxmoe.storage.received import JSON_LIMIT, TOKENIZER_LIMIT, read_file

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
    if is_remote(tokenizer.path):
        return {main: source.read_bytes()}  # side files are only read locally (tokenizer.py)
    files = {main: read_file(source, main, TOKENIZER_LIMIT)}
    for name in SIDE_FILES:
        side = source.parent / name
        if side.is_file():
            files[name] = read_file(side, name, JSON_LIMIT)
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


def check_tokenizer_fits(tokenizer, model_vocab: int, where: str) -> None:
    """ConfigError when `tokenizer` has ids the model's `model_vocab` rows cannot embed."""
    if model_vocab and tokenizer.vocab_size > model_vocab:
        largest = tokenizer.vocab_size - 1  # ids run over [0, vocab_size)
        token = tokenizer.token_of_id(largest)
        named = f" (token {token!r})" if token is not None else ""
        raise ConfigError(
            f"{where} ({tokenizer.path}) has ids up to {largest}{named}, past the model's "
            f"vocabulary of {model_vocab} (model.vocab_size): its ids past "
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
