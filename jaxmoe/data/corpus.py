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

A document goes to the validation split when a hash of its key (the topic name; the
paragraph's text for files, so duplicated paragraphs never straddle the two splits) falls
below `validation_fraction`: deterministic, independent of order and of other documents.
"""

import dataclasses
import glob
import hashlib
import os
import pydoc_data.topics
import re
from collections.abc import Iterator

TRAIN = "train"
VALIDATION = "validation"
LOCAL_SPLITS = (TRAIN, VALIDATION)
DEFAULT_VALIDATION_FRACTION = 0.05

# One or more blank (whitespace-only) lines separate paragraphs.
_PARAGRAPH_BREAK = re.compile(r"\n[ \t\r\f\v]*(?:\n[ \t\r\f\v]*)*\n")


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """A parsed `data.source`: kind is "embedded", "text" or "tfds"; arg the glob or name."""

    kind: str
    arg: str = ""

    @property
    def is_local(self) -> bool:
        return self.kind in ("embedded", "text")


def parse_source(source: str) -> SourceSpec:
    """Parses `data.source` ("embedded" | "text:GLOB" | "tfds:NAME")."""
    if source == "embedded":
        return SourceSpec("embedded")
    kind, sep, arg = source.partition(":")
    if sep and kind in ("text", "tfds") and arg:
        return SourceSpec(kind, arg)
    raise ValueError(f"data.source={source!r} is not one of 'embedded', 'text:GLOB', 'tfds:NAME'")


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


def matching_files(pattern: str) -> list[str]:
    """Sorted absolute paths of the regular files matching `pattern`; raises if none."""
    expanded = os.path.expanduser(pattern)
    paths = sorted(os.path.abspath(p) for p in glob.glob(expanded, recursive=True))
    paths = [p for p in paths if os.path.isfile(p)]
    if not paths:
        raise ValueError(f"data.source='text:{pattern}' matches no files")
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


def text_fingerprint(pattern: str, fraction: float) -> str:
    """Hash of (path, size, mtime) of every matched file: cheap, and changes on edits."""
    h = hashlib.sha256(f"text|{fraction!r}".encode())
    for path in matching_files(pattern):
        st = os.stat(path)
        h.update(f"\0{path}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()


def local_documents(spec: SourceSpec, split: str, fraction: float) -> Iterator[str]:
    """Yields the documents of a local source's split ("train" or "validation")."""
    if split not in LOCAL_SPLITS:
        raise ValueError(f"split {split!r} of data.source is not one of {LOCAL_SPLITS}")
    if spec.kind == "embedded":
        return embedded_documents(split, fraction)
    return text_documents(spec.arg, split, fraction)


def local_fingerprint(spec: SourceSpec, fraction: float) -> str:
    if spec.kind == "embedded":
        return embedded_fingerprint(fraction)
    return text_fingerprint(spec.arg, fraction)
