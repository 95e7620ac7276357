"""Packing: one token stream per split, cached as .npy, read as windows of seq_len + 1.

The stream is every document's tokens followed by EOS (and preceded by BOS when the
tokenizer's own config asks for one, as Llama's does), concatenated (documents without
tokens are skipped). Example i is the window stream[i*L : i*L + L + 1] (L = seq_len):
inputs are its first L tokens, targets its last L. Consecutive windows share one token, so
every token after the first is a target exactly once. There is no mask across documents
(GPT-style). The train split keeps whole windows only; eval adds the last, partial window,
padded with weight 0.
"""

import itertools
import os
import shutil
from collections.abc import Iterable

import numpy as np

from jaxmoe.data.tokenizer import Tokenizer
from jaxmoe.storage.temporaries import make_temporary, remove_dead_temporaries

_DOCS_PER_CHUNK = 512


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id: uint16 halves the cache."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class NpyWriter:
    """A 1-D .npy of `dtype` written piece by piece and renamed into place whole by `close`:
    values go to a raw temporary file, then the header (which needs the final length) and
    the raw bytes make the .npy. `discard` removes what an unclosed writer left."""

    def __init__(self, path: str, dtype):
        self.path, self.dtype, self.count = path, np.dtype(dtype), 0
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        remove_dead_temporaries(folder)  # a killed run's (SIGKILL: nothing else removes them)
        raw_fd, self._raw_path = make_temporary(folder, suffix=".raw")
        self._raw = os.fdopen(raw_fd, "wb")

    def append(self, values: np.ndarray) -> None:
        values = np.asarray(values, self.dtype)
        self._raw.write(values.tobytes())
        self.count += values.size

    def close(self) -> None:
        self._raw.close()
        header = {
            "descr": np.lib.format.dtype_to_descr(self.dtype),
            "fortran_order": False,
            "shape": (self.count,),
        }
        npy_fd, npy_path = make_temporary(os.path.dirname(self.path), suffix=".npy")
        try:
            with os.fdopen(npy_fd, "wb") as out, open(self._raw_path, "rb") as raw:
                np.lib.format.write_array_header_1_0(out, header)
                shutil.copyfileobj(raw, out, 1 << 24)
            os.chmod(npy_path, 0o644)  # mkstemp makes it private; a cache may be shared
            os.replace(npy_path, self.path)
        finally:
            if os.path.exists(npy_path):
                os.remove(npy_path)
            self.discard()

    def discard(self) -> None:
        self._raw.close()
        if os.path.exists(self._raw_path):
            os.remove(self._raw_path)

    def __enter__(self) -> "NpyWriter":
        return self

    def __exit__(self, kind, error, trace) -> None:
        if kind is None:
            self.close()
        else:
            self.discard()


def write_token_cache(documents: Iterable[str], tokenizer: Tokenizer, path: str) -> None:
    """Tokenizes documents into a 1-D .npy token stream at `path`, atomically (NpyWriter),
    chunk by chunk."""
    eos = [tokenizer.eos_id]
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    with NpyWriter(path, token_dtype(tokenizer.vocab_size)) as writer:
        docs = iter(documents)
        while chunk := list(itertools.islice(docs, _DOCS_PER_CHUNK)):
            encoded = [bos + ids + eos for ids in tokenizer.encode_batch(chunk) if ids]
            writer.append(np.fromiter(itertools.chain.from_iterable(encoded), writer.dtype))


def load_tokens(path: str) -> np.ndarray:
    """The cached token stream, memory-mapped (nothing is read until sliced)."""
    return np.load(path, mmap_mode="r", allow_pickle=False)


class PackedWindows:
    """Examples of one split: windows of seq_len + 1 tokens over a token stream.

    With `partial_last`, a final window shorter than seq_len + 1 (holding at least one
    target) is included; its missing positions are padded and carry weight 0.
    """

    def __init__(self, tokens_N: np.ndarray, seq_len: int, pad_id: int, partial_last: bool):
        if tokens_N.ndim != 1:
            raise ValueError(f"token stream must be 1-D, got shape {tokens_N.shape}")
        self.tokens_N = tokens_N
        self.seq_len = int(seq_len)
        self.pad_id = int(pad_id)
        num_targets = max(tokens_N.shape[0] - 1, 0)
        if partial_last:
            self._num_windows = -(-num_targets // self.seq_len)  # ceil
        else:
            self._num_windows = num_targets // self.seq_len

    @property
    def num_tokens(self) -> int:
        return int(self.tokens_N.shape[0])

    def __len__(self) -> int:
        return self._num_windows

    def windows(self, ids_B: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Windows [B, L+1] (int32, padded) and their validity mask [B, L+1] (bool)."""
        ids_B = np.asarray(ids_B, dtype=np.int64)
        if ids_B.size and (ids_B.min() < 0 or ids_B.max() >= len(self)):
            raise IndexError(f"example ids out of range [0, {len(self)}): {ids_B}")
        positions_BW = ids_B[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        valid_BW = positions_BW < self.num_tokens
        # One fancy-indexing read of the memmap: only these windows' pages are touched.
        tokens_BW = self.tokens_N[np.minimum(positions_BW, self.num_tokens - 1)]
        tokens_BW = np.where(valid_BW, tokens_BW, self.pad_id).astype(np.int32)
        return tokens_BW, valid_BW

    def __getitem__(self, index: int) -> np.ndarray:
        """Window `index` as int32 [L+1] (padded when partial)."""
        return self.windows(np.array([index]))[0][0]

    def batch(self, ids_B: np.ndarray) -> dict[str, np.ndarray]:
        """A training batch of these examples; ids < 0 give padding rows (weight 0).

        Returns inputs, targets int32 [B, L], weights float32 [B, L], example_ids int32 [B].
        """
        ids_B = np.asarray(ids_B, dtype=np.int64)
        real_B = ids_B >= 0
        tokens_BW, valid_BW = self.windows(np.where(real_B, ids_B, 0))
        valid_BW &= real_B[:, None]
        tokens_BW = np.where(valid_BW, tokens_BW, self.pad_id).astype(np.int32)
        return {
            "inputs": tokens_BW[:, :-1],
            "targets": tokens_BW[:, 1:],
            "weights": valid_BW[:, 1:].astype(np.float32),
            "example_ids": ids_B.astype(np.int32),
        }
