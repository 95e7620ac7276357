"""Host-side routing counters and their summary: the pure half of `jaxmoe analyze-routing`.

A token "went to two experts" in a MoE layer when the layer's gate kept two (or more) expert
slots for it: the same definition as the training metric `top2_fraction`. Counters live in
numpy on the host and grow with the vocabulary and the number of layers, never with the
number of analysed tokens: per stack (decoder, and encoder for encoder-decoder models) the
count of every token id and of every position; per MoE layer the top-2 count of every token
id and of every position. Everything in the summary is derived from these totals.
"""

import dataclasses

import numpy as np

STACKS = ("encoder", "decoder")


@dataclasses.dataclass
class RoutingCounts:
    """Totals over the analysed data.

    layers: MoE layer names in model order; layer_stacks: the stack of each layer.
    token_count_SV [S, V] / position_count_SP [S, P]: valid tokens per stack by id / position.
    top2_MV [M, V] / top2_MP [M, P]: tokens sent to two experts per layer by id / position.
    """

    layers: list[str]
    layer_stacks: list[str]
    vocab_size: int
    token_count_SV: np.ndarray = dataclasses.field(init=False)
    position_count_SP: np.ndarray = dataclasses.field(init=False)
    top2_MV: np.ndarray = dataclasses.field(init=False)
    top2_MP: np.ndarray = dataclasses.field(init=False)

    def __post_init__(self):
        if len(self.layers) != len(self.layer_stacks):
            raise ValueError(f"{len(self.layers)} layer names but {len(self.layer_stacks)} stacks")
        for stack in self.layer_stacks:
            if stack not in STACKS:
                raise ValueError(f"layer stack {stack!r} is not one of {STACKS}")
        num_stacks, num_layers = len(STACKS), len(self.layers)
        self.token_count_SV = np.zeros((num_stacks, self.vocab_size), np.int64)
        self.top2_MV = np.zeros((num_layers, self.vocab_size), np.int64)
        self.position_count_SP = np.zeros((num_stacks, 0), np.int64)
        self.top2_MP = np.zeros((num_layers, 0), np.int64)

    @property
    def stacks(self) -> list[str]:
        """The stacks that hold MoE layers, in STACKS order."""
        return [s for s in STACKS if s in self.layer_stacks]

    def layers_of(self, stack: str) -> list[int]:
        return [m for m, s in enumerate(self.layer_stacks) if s == stack]

    def _grow_positions(self, length: int) -> None:
        extra = length - self.position_count_SP.shape[1]
        if extra > 0:
            self.position_count_SP = np.pad(self.position_count_SP, ((0, 0), (0, extra)))
            self.top2_MP = np.pad(self.top2_MP, ((0, 0), (0, extra)))

    def add(self, stack: str, tokens_BL, valid_BL, top2_MBL) -> None:
        """Count one batch of one stack: token ids [B, L], validity [B, L] (bool) and, for
        each MoE layer of the stack in model order, whether the token went to two experts."""
        tokens_BL, valid_BL = np.asarray(tokens_BL), np.asarray(valid_BL, bool)
        top2_MBL = np.asarray(top2_MBL, bool)
        layer_ids = self.layers_of(stack)
        if top2_MBL.shape != (len(layer_ids), *tokens_BL.shape) or valid_BL.shape != (
            tokens_BL.shape
        ):
            raise ValueError(
                f"{stack}: top2 masks {top2_MBL.shape} and validity {valid_BL.shape} do not "
                f"match {len(layer_ids)} layers x tokens {tokens_BL.shape}"
            )
        ids_N = tokens_BL[valid_BL].astype(np.int64)
        if ids_N.size == 0:
            return
        if ids_N.min() < 0 or ids_N.max() >= self.vocab_size:
            raise ValueError(
                f"{stack}: token id {int(ids_N.max())} outside the model's vocabulary "
                f"[0, {self.vocab_size})"
            )
        positions_N = np.nonzero(valid_BL)[1]
        self._grow_positions(int(positions_N.max()) + 1)
        length = self.position_count_SP.shape[1]
        s = STACKS.index(stack)
        self.token_count_SV[s] += np.bincount(ids_N, minlength=self.vocab_size)
        self.position_count_SP[s] += np.bincount(positions_N, minlength=length)
        for row, m in enumerate(layer_ids):
            hit_N = top2_MBL[row][valid_BL]
            self.top2_MV[m] += np.bincount(ids_N[hit_N], minlength=self.vocab_size)
            self.top2_MP[m] += np.bincount(positions_N[hit_N], minlength=length)


def _rate(top2, tokens) -> float | None:
    return float(top2) / float(tokens) if tokens else None


def frequency_bucket_edges(max_count: int, base: int) -> list[tuple[int, int]]:
    """Log-spaced count ranges [lo, hi] (inclusive): 1..base-1, base..base^2-1, ..."""
    if base < 2:
        raise ValueError(f"frequency bucket base must be >= 2, got {base}")
    edges, lo = [], 1
    while lo <= max(max_count, 1):
        edges.append((lo, lo * base - 1))
        lo *= base
    return edges


def position_bucket_edges(length: int) -> list[tuple[int, int]]:
    """Position ranges [lo, hi] (inclusive): 0, 1, 2-3, 4-7, ... up to length - 1."""
    edges = [(0, 0)] if length > 0 else []
    lo = 1
    while lo < length:
        edges.append((lo, min(2 * lo - 1, length - 1)))
        lo *= 2
    return edges


def _label(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _bucket_rows(groups, tokens_G, top2_MG, layers: list[int], names: list[str]) -> list[dict]:
    """Rows of one bucketing: groups are (label, selector) over the G axis."""
    rows = []
    for label, select in groups:
        tokens = int(tokens_G[select].sum())
        per_layer = {names[m]: _rate(top2_MG[m, select].sum(), tokens) for m in layers}
        pooled = int(sum(top2_MG[m, select].sum() for m in layers))
        rows.append(
            {
                "bucket": label,
                "tokens": tokens,
                "top2_rate": _rate(pooled, tokens * len(layers)),
                "top2_rate_per_layer": per_layer,
            }
        )
    return rows


def summarize(
    counts: RoutingCounts, piece=str, *, min_count: int = 20, top_n: int = 15, base: int = 4
) -> dict:
    """Rates from the counters (every rate is a share of valid tokens in [0, 1]).

    A stack's `top2_rate` is the mean over its MoE layers of the per-layer rate (every layer
    of a stack sees the same tokens), as the training metric `top2_fraction` averages layers.
    Pieces: token ids seen at least `min_count` times, ranked by that rate (ties: more
    frequent first, then lower id); `piece(id)` gives the text shown for an id.
    """
    names = counts.layers
    result = {"layers": [], "stacks": {}, "min_count": min_count, "frequency_base": base}
    for m, name in enumerate(names):
        stack = counts.layer_stacks[m]
        tokens = int(counts.token_count_SV[STACKS.index(stack)].sum())
        top2 = int(counts.top2_MV[m].sum())
        result["layers"].append(
            {
                "layer": name,
                "stack": stack,
                "tokens": tokens,
                "top2": top2,
                "top2_rate": _rate(top2, tokens),
            }
        )
    for stack in counts.stacks:
        layers = counts.layers_of(stack)
        count_V = counts.token_count_SV[STACKS.index(stack)]
        position_P = counts.position_count_SP[STACKS.index(stack)]
        tokens = int(count_V.sum())
        pooled = int(counts.top2_MV[layers].sum())
        freq_groups = [
            (_label(lo, hi), (count_V >= lo) & (count_V <= hi))
            for lo, hi in frequency_bucket_edges(int(count_V.max(initial=0)), base)
        ]
        pos_groups = [
            (_label(lo, hi), slice(lo, hi + 1)) for lo, hi in position_bucket_edges(len(position_P))
        ]
        freq_rows = _bucket_rows(freq_groups, count_V, counts.top2_MV, layers, names)
        for row, (_, select) in zip(freq_rows, freq_groups, strict=True):
            row["token_ids"] = int(np.count_nonzero(select))
        result["stacks"][stack] = {
            "layers": [names[m] for m in layers],
            "tokens": tokens,
            "distinct_ids": int(np.count_nonzero(count_V)),
            "top2_rate": _rate(pooled, tokens * len(layers)),
            "by_frequency": freq_rows,
            "by_position": _bucket_rows(pos_groups, position_P, counts.top2_MP, layers, names),
            **_ranked_pieces(counts, stack, layers, piece, min_count, top_n),
        }
    return result


def _ranked_pieces(counts, stack, layers, piece, min_count: int, top_n: int) -> dict:
    """The `top_n` token ids with the highest and the lowest top-2 rates (count >= min_count)."""
    count_V = counts.token_count_SV[STACKS.index(stack)]
    top2_V = counts.top2_MV[layers].sum(axis=0)
    eligible_N = np.nonzero(count_V >= max(min_count, 1))[0]
    rate_N = top2_V[eligible_N] / (count_V[eligible_N] * len(layers))

    def entry(v: int) -> dict:
        c = int(count_V[v])
        return {
            "id": int(v),
            "piece": piece(int(v)),
            "count": c,
            "top2_rate": float(top2_V[v] / (c * len(layers))),
            "top2_rate_per_layer": {
                counts.layers[m]: float(counts.top2_MV[m, v] / c) for m in layers
            },
        }

    # np.lexsort sorts by the last key first: rate, then count (descending), then id.
    high = np.lexsort((eligible_N, -count_V[eligible_N], -rate_N))[:top_n]
    low = np.lexsort((eligible_N, -count_V[eligible_N], rate_N))[:top_n]
    return {
        "eligible_ids": int(eligible_N.size),
        "highest": [entry(eligible_N[i]) for i in high],
        "lowest": [entry(eligible_N[i]) for i in low],
    }
