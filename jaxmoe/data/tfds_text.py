"""TFDS over text: a builder for local documents, and random-access reading of any split.

Local documents (the embedded corpus, text files) are written once by `LocalTextBuilder`
as an array_record TFDS dataset and read back with `tfds.data_source`, exactly like an
already-prepared TFDS dataset named by `data.source = "tfds:NAME"`. Neither building in
array_record format nor `tfds.data_source` needs TensorFlow.
"""

import contextlib
import io
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence

import tensorflow_datasets as tfds
from etils import epath

from jaxmoe.compat.private_apis import tfds_progress_bar_shown

LOCAL_DATASET_NAME = "jaxmoe_local_text"

DocumentsFn = Callable[[str], Iterable[str]]


class LocalTextBuilder(tfds.core.GeneratorBasedBuilder):
    """Writes local documents as a TFDS dataset with one feature, {"text": Text}.

    `documents(split)` yields the documents of each split in `splits`; they are stored in
    the order given (`disable_shuffling`), keyed by their position. Reading back needs no
    `documents`: `tfds.data_source(LOCAL_DATASET_NAME, split=..., data_dir=...)`.
    """

    name = LOCAL_DATASET_NAME
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Local text documents, one example per document."}  # noqa: RUF012

    def __init__(
        self,
        *,
        documents: DocumentsFn | None = None,
        splits: Sequence[str] = ("train", "validation"),
        **kwargs,
    ):
        self._documents = documents
        self._splits = tuple(splits)
        self.documents_written: dict[str, int] = {}
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Local text documents prepared by jaxmoe.",
            features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
            disable_shuffling=True,  # keep documents in the order they were given
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download
        if self._documents is None:
            raise ValueError(f"{LOCAL_DATASET_NAME}: building needs `documents`")
        return {split: self._generate_examples(split) for split in self._splits}

    def _generate_examples(self, split: str) -> Iterator[tuple[int, dict[str, str]]]:
        self.documents_written[split] = 0
        for index, text in enumerate(self._documents(split)):
            self.documents_written[split] = index + 1
            yield index, {"text": text}


@contextlib.contextmanager
def _quiet_build():
    """Silences tfds while building: progress bars (restoring the user's setting after) and
    the "Downloading and preparing" banners it prints to stdout.
    """
    previous = tfds_progress_bar_shown()
    tfds.display_progress_bar(False)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        tfds.display_progress_bar(previous)


@contextlib.contextmanager
def _own_tempdir():
    """Points `tempfile` at a folder of our own for the duration, removed after.

    Each tfds builder of a dataset that is not prepared yet asks the TFDS bucket for its
    metadata through a fresh `tempfile.mkdtemp()` folder it never removes (in
    DatasetInfo.initialize_from_bucket): without this, every build, and every failed open,
    left an empty folder in the user's temp directory. Data preparation runs before any
    other thread of ours starts, so nothing else is handed this folder meanwhile.
    """
    folder = tempfile.mkdtemp(prefix="jaxmoe-tfds-")
    previous = tempfile.tempdir
    tempfile.tempdir = folder
    try:
        yield
    finally:
        tempfile.tempdir = previous
        shutil.rmtree(folder, ignore_errors=True)


def local_dataset_prepared(data_dir: str) -> bool:
    version = str(LocalTextBuilder.VERSION)
    return (epath.Path(data_dir) / LOCAL_DATASET_NAME / version / "dataset_info.json").exists()


def prepare_local_dataset(
    documents: DocumentsFn, data_dir: str, splits: Sequence[str] = ("train", "validation")
) -> None:
    """Builds the array_record dataset under `data_dir` unless it is already there."""
    if local_dataset_prepared(data_dir):
        return
    config = tfds.download.DownloadConfig(try_download_gcs=False)
    builder = None
    try:
        with _own_tempdir(), _quiet_build():
            builder = LocalTextBuilder(documents=documents, splits=splits, data_dir=data_dir)
            builder.download_and_prepare(download_config=config, file_format="array_record")
    except OSError:
        # tfds writes into a temporary folder and renames it: if another process finished
        # the same build first, that rename fails and its result is just as good.
        if not local_dataset_prepared(data_dir):
            raise
    except AssertionError:
        # tfds refuses to write an empty split; say which one, in one line.
        written = builder.documents_written if builder is not None else {}
        empty = [split for split, count in written.items() if count == 0]
        if not empty:
            raise
        raise ValueError(f"split {empty[0]!r} has no documents") from None


class TextSource:
    """Random-access documents of one TFDS split: len(src), src[i] -> str.

    Only the requested records are read (array_record), so a huge split never sits in RAM.
    """

    def __init__(self, name: str, split: str, data_dir: str | None, text_key: str = "text"):
        try:
            with _own_tempdir():
                self._source = tfds.data_source(
                    name, split=split, data_dir=data_dir, download=False
                )
        except Exception as e:  # tfds raises several types, with multi-line messages
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(
                f"cannot open TFDS dataset {name!r} split {split!r} in data_dir {data_dir!r}: "
                f"{first_line}"
            ) from None
        self.name, self.split, self.text_key = name, split, text_key
        info = self._source.dataset_info
        self.version = str(info.version)
        features = info.features.keys() if info.features is not None else ()
        if text_key not in features:
            raise ValueError(
                f"data.text_key={text_key!r} is not a feature of TFDS dataset {name!r} "
                f"(features: {sorted(features)})"
            )

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> str:
        return _as_str(self._source[index][self.text_key])

    def __iter__(self) -> Iterator[str]:
        return self.texts(0, len(self))

    def texts(self, start: int, stop: int) -> Iterator[str]:
        """Documents [start, stop) in order."""
        # Batched reads: array_record serves a list of indices in one call.
        chunk = 256
        for first in range(start, stop, chunk):
            last = min(first + chunk, stop)
            for record in self._source.__getitems__(list(range(first, last))):
                yield _as_str(record[self.text_key])


def _as_str(value) -> str:
    # tfds.features.Text decodes to bytes when read without TensorFlow.
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if hasattr(value, "item"):  # a numpy scalar
        value = value.item()
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    return str(value)
