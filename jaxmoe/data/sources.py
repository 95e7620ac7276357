"""From config to prepared data: documents of a split, tokenizer, cached token streams.

Everything is prepared once and cached under `data.cache_dir` (default ~/.cache/jaxmoe):
  tfds/local/<source hash>/jaxmoe_local_text/...   local documents as array_record
  tokenizers/spm_<vocab>_<hash>.model              keyed by (train data, vocab size)
  tokens/<hash>.npy                                keyed by (source, split, tokenizer file)
Each file appears atomically, so processes sharing the cache never see half a file.

A remote cache (`gs://...`) holds the tokenizers and token streams; they are read, and the
streams memory-mapped, from a local copy under ~/.cache/jaxmoe/remote/, fetched once per
machine. Local sources are prepared under that copy too (they are local documents anyway).
A remote `data.data_dir` (prepared TFDS datasets) is handed to TFDS as it is: TFDS reads
gs:// itself (metadata through etils epath, array_record files through their own client).
"""

import dataclasses
import functools
import hashlib
import os
from collections.abc import Sequence

import numpy as np

from jaxmoe.compat.optional import require
from jaxmoe.data import corpus
from jaxmoe.data.formats import RecordFields
from jaxmoe.data.options import DataOptions
from jaxmoe.data.packing import PackedWindows, load_tokens, write_token_cache
from jaxmoe.data.tokenizer import Tokenizer, cached_tokenizer, open_tokenizer
from jaxmoe.storage.mirror import Mirror
from jaxmoe.storage.paths import absolute_path, is_remote

# Bump when the token stream layout changes, so old token caches are not reused.
PACKING_VERSION = "eos-after-doc-v1"
_EXAMPLES_VERSION = "examples-v1"  # the same for example caches (document_packing.py)


@dataclasses.dataclass(frozen=True)
class SplitDocuments:
    """Random-access documents of one split, and a hash that identifies their content."""

    documents: Sequence[str]
    fingerprint: str
    split: str


def cache_dir(data: DataOptions) -> str:
    """The local folder of the data cache (for a remote cache, its local copy)."""
    configured = absolute_path(data.cache_dir or "~/.cache/jaxmoe")
    if not is_remote(configured):
        return configured
    scheme, rest = configured.split("://", 1)
    return os.path.join(os.path.expanduser("~/.cache/jaxmoe/remote"), scheme, rest.strip("/"))


def cache_mirror(data: DataOptions, folder: str) -> Mirror | None:
    """The Mirror of cache subfolder `folder` when data.cache_dir is remote, else None."""
    configured = data.cache_dir
    if not is_remote(configured):
        return None
    return Mirror(f"{configured.rstrip('/')}/{folder}", os.path.join(cache_dir(data), folder))


def data_dir(data: DataOptions) -> str:
    if data.data_dir:
        return absolute_path(data.data_dir)
    return os.path.join(cache_dir(data), "tfds")


def validation_fraction(data: DataOptions) -> float:
    return corpus.check_fraction(data.validation_fraction)


def _split_key(data: DataOptions, key: str) -> str:
    """The split named by config key `key` ("train_split"/"eval_split"), checked."""
    split = getattr(data, key)
    spec = corpus.parse_source(data.source)
    if spec.is_local and split not in corpus.LOCAL_SPLITS:
        raise ValueError(
            f"data.{key}={split!r}: data.source={data.source!r} has splits {corpus.LOCAL_SPLITS}"
        )
    return split


def open_split(data: DataOptions, split_key: str) -> SplitDocuments:
    """Documents of the split named by `data.<split_key>`, preparing a local source first."""
    # Imported here: commands that read no data (`jaxmoe compile`) then run without
    # tensorflow_datasets installed, e.g. in another project's venv with its own libtpu.
    for package in ("tensorflow_datasets", "array_record"):
        require(package, f"reading data.source={data.source!r}")
    from jaxmoe.data import tfds_text

    spec = corpus.parse_source(data.source)
    if data.format != "text" and spec.kind not in ("jsonl", "parquet"):
        raise ValueError(
            f"data.format={data.format!r} reads records of jsonl:GLOB or parquet:GLOB "
            f"sources, not data.source={data.source!r}"
        )
    split = _split_key(data, split_key)
    text_key = data.text_key or "text"
    fields = RecordFields.of(data)
    if spec.is_local:
        fraction = validation_fraction(data)
        source_hash = corpus.local_fingerprint(spec, fraction, fields)
        # Prepared from local files, so kept local: a remote data_dir is for TFDS datasets.
        prepared = data_dir(data)
        if is_remote(prepared):
            prepared = os.path.join(cache_dir(data), "tfds")
        local_dir = os.path.join(prepared, "local", source_hash[:20])
        documents = functools.partial(
            corpus.local_documents, spec, fraction=fraction, fields=fields
        )
        try:
            tfds_text.prepare_local_dataset(documents, local_dir)
        except ValueError as e:
            raise ValueError(
                f"data.source={data.source!r} (data.validation_fraction={fraction}): {e}"
            ) from None
        source = tfds_text.TextSource(tfds_text.LOCAL_DATASET_NAME, split, local_dir)
        identity = f"{source_hash}|{split}"
    else:
        tfds_dir = data_dir(data)
        try:
            source = tfds_text.TextSource(spec.arg, split, tfds_dir, text_key)
        except ValueError as e:
            raise ValueError(f"data.source={data.source!r}, data.{split_key}: {e}") from None
        identity = f"tfds|{spec.arg}|{source.version}|{tfds_dir}|{split}|{text_key}|{len(source)}"
    fingerprint = hashlib.sha256(identity.encode()).hexdigest()
    return SplitDocuments(source, fingerprint, split)


def load_tokenizer(data: DataOptions) -> Tokenizer:
    """The tokenizer named by `data.tokenizer` (SentencePiece .model, Hugging Face
    tokenizer.json or a folder holding one), or one trained on the train split (of the
    mixture's first source when `data.mixture` is set). A `train.init_from` checkpoint's
    own tokenizer is named in `data.tokenizer` before this, by the command (training:
    config.stored.inherit_tokenizer): data never reads checkpoints."""
    if data.tokenizer:
        return open_tokenizer(absolute_path(data.tokenizer), data.eos_token)
    from jaxmoe.data.mixture import primary_source

    train = open_split(primary_source(data), "train_split")
    return cached_tokenizer(
        train.documents,
        train.fingerprint,
        data.vocab_size,
        cache_dir(data),
        cache_mirror(data, "tokenizers"),
    )


def token_stream(data: DataOptions, tokenizer: Tokenizer, split_key: str) -> np.ndarray:
    """The split named by `data.<split_key>` as one memory-mapped token stream [N].

    The split is tokenized once; later calls only memory-map the cached stream.
    """
    return _cached_stream(data, tokenizer, open_split(data, split_key))


def _cached_stream(data: DataOptions, tokenizer: Tokenizer, split: SplitDocuments) -> np.ndarray:
    key = f"{PACKING_VERSION}|{split.fingerprint}|{tokenizer.sha256}"
    name = f"{split.split}_{hashlib.sha256(key.encode()).hexdigest()[:20]}.npy"
    path = os.path.join(cache_dir(data), "tokens", name)
    mirror = cache_mirror(data, "tokens")
    if not os.path.exists(path) and not (mirror and mirror.pull(name)):
        write_token_cache(split.documents, tokenizer, path)
        if mirror:
            mirror.push(name)
    return load_tokens(path)


def packed_split(
    data: DataOptions, seq_len: int, tokenizer: Tokenizer, split_key: str, partial_last: bool
) -> PackedWindows:
    """Windows of seq_len + 1 tokens (train.seq_len) over the split named by
    `data.<split_key>`."""
    split = open_split(data, split_key)
    if seq_len <= 0:
        raise ValueError(f"train.seq_len={seq_len} must be positive")
    tokens = _cached_stream(data, tokenizer, split)
    windows = PackedWindows(tokens, seq_len, tokenizer.pad_id, partial_last)
    if windows.num_tokens < 2:
        raise ValueError(
            f"data.{split_key}={split.split!r} of data.source={data.source!r} holds "
            f"{windows.num_tokens} tokens: too little text"
        )
    if len(windows) == 0:
        raise ValueError(
            f"train.seq_len={seq_len} is longer than the {split.split!r} split of "
            f"data.source={data.source!r} ({windows.num_tokens} tokens)"
        )
    return windows


def example_cache(data: DataOptions, tokenizer, split: SplitDocuments, routing=None):
    """The split's example cache (document_packing.py), written once, for data.format: its
    columns {name: (values, offsets)}. `routing` (routing_record.RoutingShape; router
    replay): each example's recorded routing is a column too."""
    from jaxmoe.data import document_packing as dp
    from jaxmoe.data.formats import ExampleEncoder

    encoder = ExampleEncoder(data, tokenizer, routing=routing)
    key = dp.cache_key(_EXAMPLES_VERSION, split.fingerprint, tokenizer.sha256, encoder.identity)
    stem = os.path.join(cache_dir(data), "tokens", f"{split.split}_{key}.examples")
    columns = dp.example_columns(encoder)
    mirror = cache_mirror(data, "tokens")
    names = dp.cache_files(stem, columns)
    if not dp.cache_complete(stem) and not (mirror and all(mirror.pull(n) for n in names)):
        dp.write_example_cache(split.documents, encoder, stem)
        if mirror:
            for name in names:
                mirror.push(name)
    return dp.load_example_cache(stem)


def document_split(
    data: DataOptions, seq_len: int, tokenizer, split_key: str, report=print, routing=None
):
    """The split named by `data.<split_key>` as whole examples packed into windows of
    seq_len (train.seq_len, data.packing=documents); prints how many and the share of
    padding. `routing`: see example_cache."""
    from jaxmoe.data.document_packing import PackedDocuments

    split = open_split(data, split_key)
    if seq_len <= 1:
        raise ValueError(f"train.seq_len={seq_len} must be at least 2")
    mode = "split" if data.format == "text" else data.truncation
    pad_id = 0 if data.format == "seq2seq" else tokenizer.pad_id
    windows = PackedDocuments(
        example_cache(data, tokenizer, split, routing),
        seq_len,
        pad_id,
        mode,
        data.targets_len,
        pairs=data.format == "preference",
    )
    report(f"data: {split.split} split of data.source={data.source!r}: {windows.describe()}")
    if len(windows) == 0:
        raise ValueError(
            f"data.source={data.source!r}: the {split.split!r} split has no example that fits "
            f"train.seq_len={seq_len} (data.truncation={data.truncation!r})"
        )
    return windows
