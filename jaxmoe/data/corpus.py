"""Local text corpora: the embedded default corpus and the user's own text files.

Two local sources, named by `data.source`:

- ``"embedded"``: the English prose every CPython ships in ``pydoc_data.topics.topics``
  (~0.47 MB, 79 entries on CPython 3.11). One document per topic entry, in key order. Its
  content differs between Python versions, so it is fingerprinted by content.
- ``"text:GLOB"``: UTF-8 text files matched by GLOB (``~`` expanded, ``**`` recursive).
  Each blank-line-separated paragraph is one document (a single long file, a book for
  instance, still yields a validation split; packing concatenates the paragraphs again,
  separated by EOS). A paragraph is the text between runs of blank lines, without the
  surrounding line breaks; its own indentation and inner newlines are kept exactly.
  Files are read in sorted path order, paragraphs in file order.
- ``"jsonl:GLOB"``: JSON-lines files, one document per line, its text in the field
  `data.text_key` (default ``text``); ``"parquet:GLOB"``: Parquet files, one document per
  row of the column `data.text_key`. Files in sorted path order, records in file order;
  blank lines and null or empty texts are skipped. With a fine-tuning `data.format` a
  record's fields make its document instead (formats.RecordFields: their JSON).

A document goes to the validation split when a hash of its key (the topic name; the
paragraph's text for files, so duplicated paragraphs never straddle the two splits) falls
below `validation_fraction`: deterministic, independent of order and of other documents.
For jsonl and parquet the key is the document's text (its JSON for fine-tuning formats).
"""

import dataclasses
import glob
import hashlib
import json
import os
import pydoc_data.topics
import re
from collections.abc import Iterator

from jaxmoe.data.formats import RecordFields

TEXT = RecordFields("text", ("text",))

TRAIN = "train"
VALIDATION = "validation"
LOCAL_SPLITS = (TRAIN, VALIDATION)

# One or more blank (whitespace-only) lines separate paragraphs.
_PARAGRAPH_BREAK = re.compile(r"\n[ \t\r\f\v]*(?:\n[ \t\r\f\v]*)*\n")


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """A parsed `data.source`: kind is "embedded", one of FILE_KINDS or "tfds"; arg the glob
    or name."""

    kind: str
    arg: str = ""

    @property
    def is_local(self) -> bool:
        return self.kind == "embedded" or self.kind in FILE_KINDS


# Local sources read from files matched by a glob.
FILE_KINDS = ("text", "jsonl", "parquet")


def parse_source(source: str) -> SourceSpec:
    """Parses `data.source` ("embedded" | "text:GLOB" | "jsonl:GLOB" | "parquet:GLOB" |
    "tfds:NAME")."""
    if source == "embedded":
        return SourceSpec("embedded")
    kind, sep, arg = source.partition(":")
    if sep and kind in (*FILE_KINDS, "tfds") and arg:
        return SourceSpec(kind, arg)
    raise ValueError(
        f"data.source={source!r} is not one of 'embedded', 'text:GLOB', 'jsonl:GLOB', "
        f"'parquet:GLOB', 'tfds:NAME'"
    )


def in_validation(key: str, fraction: float) -> bool:
    """Whether the document with this key belongs to the validation split."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def check_fraction(fraction: float) -> float:
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"data.validation_fraction={fraction!r} must lie strictly in (0, 1)")
    return float(fraction)


def embedded_documents(split: str, fraction: float) -> Iterator[str]:
    """Yields the embedded corpus' documents of `split`, in topic-key order."""
    topics = pydoc_data.topics.topics
    for key in sorted(topics):
        if in_validation(key, fraction) == (split == VALIDATION) and topics[key]:
            yield topics[key]


def embedded_fingerprint(fraction: float) -> str:
    """Content hash of the embedded corpus (it changes between Python versions)."""
    topics = pydoc_data.topics.topics
    h = hashlib.sha256(f"embedded|{fraction!r}".encode())
    for key in sorted(topics):
        h.update(b"\0" + key.encode("utf-8") + b"\0" + topics[key].encode("utf-8"))
    return h.hexdigest()


def matching_files(pattern: str, kind: str = "text") -> list[str]:
    """Sorted absolute paths of the regular files matching `pattern`; raises if none."""
    expanded = os.path.expanduser(pattern)
    paths = sorted(os.path.abspath(p) for p in glob.glob(expanded, recursive=True))
    paths = [p for p in paths if os.path.isfile(p)]
    if not paths:
        raise ValueError(f"data.source='{kind}:{pattern}' matches no files")
    return paths


def split_paragraphs(text: str) -> list[str]:
    """Splits text at blank lines; drops empty pieces and the line breaks around each."""
    pieces = (p.strip("\r\n") for p in _PARAGRAPH_BREAK.split(text))
    return [p for p in pieces if p.strip()]


def read_text_file(path: str) -> str:
    try:
        # newline="" keeps "\r\n" as written, so decode(encode(doc)) reproduces the file.
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"data.source file {path!r} is not UTF-8 text ({e.reason})") from None


def text_documents(pattern: str, split: str, fraction: float) -> Iterator[str]:
    """Yields the paragraphs of the files matching `pattern` that belong to `split`."""
    for path in matching_files(pattern):
        for paragraph in split_paragraphs(read_text_file(path)):
            if in_validation(paragraph, fraction) == (split == VALIDATION):
                yield paragraph


def files_fingerprint(spec: SourceSpec, fraction: float, fields: RecordFields) -> str:
    """Hash of (path, size, mtime) of every matched file: cheap, and changes on edits."""
    # The fields change jsonl/parquet documents only; text files keep their old hash.
    key = "" if spec.kind == "text" else f"|{fields.describe()}"
    h = hashlib.sha256(f"{spec.kind}|{fraction!r}{key}".encode())
    for path in matching_files(spec.arg, spec.kind):
        st = os.stat(path)
        h.update(f"\0{path}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()


def jsonl_texts(path: str, fields: RecordFields):
    """The documents of a JSON-lines file, in line order (blank lines and empty texts
    skipped)."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{line_no}: not JSON ({e})") from None
            text = fields.read(record, f"{path}:{line_no}")
            if text is not None:
                yield text


def parquet_texts(path: str, fields: RecordFields):
    """The documents of a Parquet file's `fields` columns, row by row (nulls and empty texts
    skipped)."""
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError on non-parquet files
        raise ValueError(f"{path}: not a Parquet file ({e})") from None
    names = file.schema_arrow.names
    for key in fields.keys:
        if key not in names:
            what = "data.text_key" if fields.format == "text" else "field"
            raise ValueError(f"{path}: no column {what}={key!r} (columns: {names})")
    row = 0
    for batch in file.iter_batches(columns=list(fields.keys), batch_size=4096):
        for record in batch.to_pylist():
            row += 1
            text = fields.read(record, f"{path}: row {row}")
            if text is not None:
                yield text


def record_documents(spec: SourceSpec, split: str, fraction: float, fields: RecordFields):
    """Yields the documents of the jsonl / parquet files of `spec` that belong to `split`."""
    read = jsonl_texts if spec.kind == "jsonl" else parquet_texts
    for path in matching_files(spec.arg, spec.kind):
        for text in read(path, fields):
            if in_validation(text, fraction) == (split == VALIDATION):
                yield text


def local_documents(
    spec: SourceSpec, split: str, fraction: float, fields: RecordFields = TEXT
) -> Iterator[str]:
    """Yields the documents of a local source's split ("train" or "validation")."""
    if split not in LOCAL_SPLITS:
        raise ValueError(f"split {split!r} of data.source is not one of {LOCAL_SPLITS}")
    if spec.kind == "embedded":
        return embedded_documents(split, fraction)
    if spec.kind == "text":
        return text_documents(spec.arg, split, fraction)
    return record_documents(spec, split, fraction, fields)


def local_fingerprint(spec: SourceSpec, fraction: float, fields: RecordFields = TEXT) -> str:
    if spec.kind == "embedded":
        return embedded_fingerprint(fraction)
    return files_fingerprint(spec, fraction, fields)
