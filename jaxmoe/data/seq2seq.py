"""T5 span corruption over the packed token streams: the encoder-decoder training task.

Example i is the raw window stream[i*N : (i+1)*N] of the split's token stream (documents
followed by EOS, see packing.py); windows do not overlap. A random share `data.noise_density`
of its tokens, in spans of mean length `data.mean_noise_span`, is masked, as T5's
`random_spans_noise_mask` does it: span lengths are random segmentations, the window starts
with an unmasked span and alternates. The encoder reads the unmasked tokens with each masked
span replaced by one sentinel; the decoder predicts each masked span after its sentinel; both
end with EOS:

    raw      a b c d e f g h        (masked: c d, h)
    encoder  a b S0 e f g S1 EOS
    targets  S0 c d S1 h EOS        (each unmasked span becomes the next sentinel)

Sentinels are T5's extra ids. A tokenizer that defines `<extra_id_0>`, `<extra_id_1>`, ...
(T5's tokenizer.json, a SentencePiece model with them as pieces) gives their ids, wherever
they sit. Otherwise they are the `EXTRA_IDS` ids above the tokenizer's vocabulary, the first
sentinel being the top one (S_k = tokenizer vocab + EXTRA_IDS - 1 - k), exactly T5's
`<extra_id_k>` with its own SentencePiece model (which seqio extends by 100 ids). The mask
of example i depends only on (train.seed, i), so batches are reproducible and resumable like
the LM task's.

N is the longest raw window whose encoder input fits `train.seq_len` (T5's
`random_spans_helper`); the decoder length follows from N. Id 0 pads both sides (the model
masks encoder id 0; padded targets carry weight 0).
"""

import numpy as np

from jaxmoe.data.options import DataOptions, TrainSection

EXTRA_IDS = 100  # T5's sentinel count (its SentencePiece vocabulary's `extra_ids`)
SPAN_SEED_TAG = 0x5E95E9  # keeps mask streams apart from the shuffle's default_rng([seed, epoch])


def check_noise(noise_density: float, mean_noise_span: float) -> None:
    if not 0.0 < noise_density < 1.0:
        raise ValueError(f"data.noise_density={noise_density} must be in (0, 1)")
    if mean_noise_span < 1.0:
        raise ValueError(f"data.mean_noise_span={mean_noise_span} must be at least 1")


def span_counts(length: int, noise_density: float, mean_noise_span: float) -> tuple[int, int]:
    """(masked tokens, masked spans) of a window of `length` >= 2 tokens, as T5 rounds them."""
    num_noise = min(max(round(length * noise_density), 1), length - 1)
    num_spans = max(round(num_noise / mean_noise_span), 1)
    # T5 can ask for more unmasked spans than unmasked tokens when the density is extreme.
    return num_noise, min(num_spans, length - num_noise)


def corrupted_lengths(length: int, noise_density: float, mean_noise_span: float) -> tuple[int, int]:
    """(encoder length, decoder length) of a corrupted window, EOS included."""
    num_noise, num_spans = span_counts(max(length, 2), noise_density, mean_noise_span)
    if length < 2:  # T5 masks a length-2 window and keeps its first (never masked) token
        return 2, 2
    return length - num_noise + num_spans + 1, num_noise + num_spans + 1


def raw_length_for(encoder_len: int, noise_density: float, mean_noise_span: float) -> int:
    """The longest raw window whose corrupted encoder input fits `encoder_len` tokens."""
    if encoder_len < 3:
        raise ValueError(f"train.seq_len={encoder_len}: span corruption needs at least 3")
    # Corruption never lengthens a window by more than its EOS (one sentinel per span of at
    # least one token), so encoder_len - 1 fits; lengths grow with the window, so walk up.
    n = encoder_len - 1
    while corrupted_lengths(n + 1, noise_density, mean_noise_span)[0] <= encoder_len:
        n += 1
    return n


def random_segmentation(num_items: int, num_segments: int, rng) -> np.ndarray:
    """Lengths [num_segments] of a uniformly random split of num_items into non-empty runs."""
    cuts = np.sort(rng.choice(num_items - 1, num_segments - 1, replace=False)) + 1
    return np.diff(np.concatenate([[0], cuts, [num_items]]))


def noise_mask(length: int, noise_density: float, mean_noise_span: float, rng) -> np.ndarray:
    """bool [length]: True where masked. Alternating spans, starting with an unmasked one."""
    padded = max(length, 2)
    num_noise, num_spans = span_counts(padded, noise_density, mean_noise_span)
    noise_lengths = random_segmentation(num_noise, num_spans, rng)
    kept_lengths = random_segmentation(padded - num_noise, num_spans, rng)
    lengths = np.stack([kept_lengths, noise_lengths], axis=1).reshape(-1)
    is_noise = np.tile(np.array([False, True]), num_spans)
    return np.repeat(is_noise, lengths)[:length]


def sentinel_table(sentinels, count: int) -> np.ndarray:
    """Ids of sentinels 0, 1, ...: given, or (an int) counting down from the first."""
    if np.ndim(sentinels) == 0:
        return int(sentinels) - np.arange(count)
    return np.asarray(sentinels, dtype=np.int64)


def replace_spans(tokens: np.ndarray, mask: np.ndarray, sentinels) -> np.ndarray:
    """Tokens with each run of `mask` replaced by the next sentinel: `sentinels` is the id
    list, or the first id (the next ones count down)."""
    return _replace_rows(tokens[None], mask[None], sentinels)[0]


def _replace_rows(tokens_RN: np.ndarray, mask_RN: np.ndarray, sentinels) -> np.ndarray:
    """`replace_spans` of every row at once; rows must keep equally many tokens."""
    previous_RN = np.zeros_like(mask_RN)
    previous_RN[:, 1:] = mask_RN[:, :-1]
    starts_RN = mask_RN & ~previous_RN
    table = sentinel_table(sentinels, mask_RN.shape[1] + 1)
    # Before the first start the index is -1: np.where discards that lookup.
    sentinels_RN = table[np.cumsum(starts_RN, axis=1) - 1]
    values_RN = np.where(starts_RN, sentinels_RN, tokens_RN)
    return values_RN[~(mask_RN & previous_RN)].reshape(len(tokens_RN), -1)


def tokenizer_sentinels(tokenizer) -> np.ndarray | None:
    """Ids of the tokenizer's own `<extra_id_0>`, `<extra_id_1>`, ..., or None if it has none."""
    ids = []
    while (token_id := tokenizer.token_id(f"<extra_id_{len(ids)}>")) is not None:
        ids.append(token_id)
    return np.array(ids, dtype=np.int64) if ids else None


def corrupt(tokens: np.ndarray, rng, noise: tuple[float, float], sentinels, eos_id: int):
    """(encoder ids, target ids) of one window of any length, EOS-terminated; `noise` is
    (noise_density, mean_noise_span), `rng` draws its mask."""
    mask = noise_mask(len(tokens), *noise, rng)
    encoder = np.concatenate([replace_spans(tokens, mask, sentinels), [eos_id]])
    return encoder, np.concatenate([replace_spans(tokens, ~mask, sentinels), [eos_id]])


def corrupt_rows(tokens_RN: np.ndarray, rngs, noise: tuple[float, float], sentinels, eos_id: int):
    """`corrupt` of R windows of equal length N at once (one rng per row, the same draws in
    the same order): (encoder ids [R, E], target ids [R, D])."""
    rows, n = tokens_RN.shape
    num_noise, num_spans = span_counts(n, *noise)
    lengths_RS = np.empty((rows, 2 * num_spans), np.int64)  # kept, noise, kept, ...
    for r, rng in enumerate(rngs):  # only the draws stay per example
        lengths_RS[r, 1::2] = random_segmentation(num_noise, num_spans, rng)
        lengths_RS[r, 0::2] = random_segmentation(n - num_noise, num_spans, rng)
    # Span number of every position: +1 where each span after the first starts.
    bumps_RN = np.zeros((rows, n + 1), np.int64)
    np.put_along_axis(bumps_RN, np.cumsum(lengths_RS, axis=1)[:, :-1], 1, axis=1)
    mask_RN = np.cumsum(bumps_RN[:, :n], axis=1) % 2 == 1
    eos_R1 = np.full((rows, 1), eos_id, np.int64)
    encoder = _replace_rows(tokens_RN, mask_RN, sentinels)
    targets = _replace_rows(tokens_RN, ~mask_RN, sentinels)
    return np.concatenate([encoder, eos_R1], 1), np.concatenate([targets, eos_R1], 1)


class SpanCorruptionExamples:
    """Span-corrupted windows of one split, addressed by example index (like PackedWindows).

    `batch(ids_B)` returns encoder_inputs int32 [B, train.seq_len], inputs / targets int32
    [B, L_dec], weights float32 [B, L_dec], example_ids int32 [B]; ids < 0 give padding rows.
    """

    def __init__(
        self,
        tokens_N: np.ndarray,
        *,
        encoder_len: int,
        seed: int,
        tokenizer_vocab: int,
        eos_id: int,
        sentinels: np.ndarray | None = None,
        noise_density: float = 0.15,
        mean_noise_span: float = 3.0,
        partial_last: bool = False,
    ):
        check_noise(noise_density, mean_noise_span)
        if tokens_N.ndim != 1:
            raise ValueError(f"token stream must be 1-D, got shape {tokens_N.shape}")
        self.tokens_N = tokens_N
        self.noise_density, self.mean_noise_span = noise_density, mean_noise_span
        self.encoder_len, self.seed, self.eos_id = int(encoder_len), int(seed), int(eos_id)
        self.raw_len = raw_length_for(self.encoder_len, noise_density, mean_noise_span)
        self.decoder_len = corrupted_lengths(self.raw_len, noise_density, mean_noise_span)[1]
        num_spans = span_counts(self.raw_len, noise_density, mean_noise_span)[1]
        self.first_sentinel = int(tokenizer_vocab) + EXTRA_IDS - 1
        if sentinels is None:
            sentinels = sentinel_table(self.first_sentinel, EXTRA_IDS)
        self.sentinels = np.asarray(sentinels, dtype=np.int64)
        if num_spans > len(self.sentinels):
            raise ValueError(
                f"train.seq_len={encoder_len}: span corruption masks {num_spans} spans per "
                f"example but there are only {len(self.sentinels)} sentinel ids"
            )
        whole, rest = divmod(self.num_tokens, self.raw_len)
        self._num_examples = whole + (1 if partial_last and rest else 0)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens_N.shape[0])

    def __len__(self) -> int:
        return self._num_examples

    def example(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(encoder ids, target ids) of example `index`, EOS-terminated, unpadded."""
        if not 0 <= index < len(self):
            raise IndexError(f"example id {index} out of range [0, {len(self)})")
        start = index * self.raw_len
        tokens = np.asarray(self.tokens_N[start : start + self.raw_len], dtype=np.int64)
        rng = np.random.default_rng([SPAN_SEED_TAG, self.seed, int(index)])
        return corrupt(tokens, rng, self._noise(), self.sentinels, self.eos_id)

    def _noise(self) -> tuple[float, float]:
        return self.noise_density, self.mean_noise_span

    def _corrupt_whole(self, ids_R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(encoder ids [R, E], target ids [R, D]) of whole windows, EOS-terminated: what
        `example` gives each (the same random draws, in the same order), built row-wise."""
        n = self.raw_len
        tokens_RN = np.asarray(self.tokens_N[ids_R[:, None] * n + np.arange(n)], np.int64)
        rngs = [np.random.default_rng([SPAN_SEED_TAG, self.seed, int(i)]) for i in ids_R]
        return corrupt_rows(tokens_RN, rngs, self._noise(), self.sentinels, self.eos_id)

    def batch(self, ids_B: np.ndarray) -> dict[str, np.ndarray]:
        ids_B = np.asarray(ids_B, dtype=np.int64)
        b = len(ids_B)
        encoder = np.zeros((b, self.encoder_len), np.int32)
        targets = np.zeros((b, self.decoder_len), np.int32)
        weights = np.zeros((b, self.decoder_len), np.float32)
        if ids_B.size and ids_B.max() >= len(self):
            raise IndexError(f"example ids out of range [0, {len(self)}): {ids_B}")
        # Whole windows all have raw_len tokens, so they are corrupted together, row-wise.
        full = (ids_B >= 0) & ((ids_B + 1) * self.raw_len <= self.num_tokens)
        rows = np.flatnonzero(full)
        if rows.size:
            enc_RE, target_RD = self._corrupt_whole(ids_B[rows])
            encoder[rows, : enc_RE.shape[1]] = enc_RE
            targets[rows, : target_RD.shape[1]] = target_RD
            weights[rows, : target_RD.shape[1]] = 1.0
        for row in np.flatnonzero((ids_B >= 0) & ~full):  # the partial last window (eval)
            enc_ids, target_ids = self.example(int(ids_B[row]))
            encoder[row, : len(enc_ids)] = enc_ids
            targets[row, : len(target_ids)] = target_ids
            weights[row, : len(target_ids)] = 1.0
        inputs = np.zeros_like(targets)
        inputs[:, 1:] = targets[:, :-1]  # decoder input: targets shifted right, 0 to start
        return {
            "encoder_inputs": encoder,
            "inputs": inputs,
            "targets": targets,
            "weights": weights,
            "example_ids": ids_B.astype(np.int32),
        }


def span_corruption_split(
    data: DataOptions, train: TrainSection, tokenizer, split_key: str, partial_last: bool
):
    """SpanCorruptionExamples over the split named by `data.<split_key>` (cached stream):
    encoder windows of train.seq_len, masks seeded by train.seed."""
    from jaxmoe.data.sources import token_stream

    examples = SpanCorruptionExamples(
        token_stream(data, tokenizer, split_key),
        encoder_len=train.seq_len,
        seed=train.seed,
        tokenizer_vocab=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
        sentinels=tokenizer_sentinels(tokenizer),
        noise_density=data.noise_density,
        mean_noise_span=data.mean_noise_span,
        partial_last=partial_last,
    )
    if len(examples) == 0:
        raise ValueError(
            f"train.seq_len={train.seq_len}: the {getattr(data, split_key)!r} split of "
            f"data.source={data.source!r} ({examples.num_tokens} tokens) is shorter than one "
            f"span-corruption window of {examples.raw_len} tokens"
        )
    return examples
