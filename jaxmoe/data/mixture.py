"""Mixtures of sources: `data.mixture = "jsonl:/a/*.jsonl=0.7,tfds:c4/en=0.3"`.

Every row of a global batch picks its source at random with probability = its weight, from
a generator seeded by (train.seed, step) alone, so the choice is reproducible and needs no
history. Within a source, rows take that source's examples in turn, in a shuffle seeded by
(train.seed, epoch of that source, source index); a small source simply enters more epochs.
The only state is the step and how many examples each source has given (saved in
checkpoints), so resuming continues exactly. Example ids are global: source k's example i
is `offsets[k] + i`. Each process builds only the rows it reads.
"""

import dataclasses
import re

import numpy as np

from jaxmoe.data.corpus import parse_source
from jaxmoe.data.options import DataOptions

# Keeps the mixture's choice stream apart from the shuffles' default_rng([seed, epoch, ...]).
_CHOICE_TAG = 0x313C7


@dataclasses.dataclass(frozen=True)
class Component:
    source: str  # a data.source spec
    weight: float  # normalised: the weights of a mixture sum to 1
    name: str  # short, unique within the mixture: eval lines are `loss/<name>`


def _short_name(source: str) -> str:
    """jsonl:/data/wiki/*.jsonl -> wiki; tfds:c4/en:3.1.0 -> c4_en; embedded -> embedded."""
    kind, _, arg = source.partition(":")
    if kind == "tfds":
        return re.sub(r"[^\w.-]+", "_", arg.split(":")[0]).strip("_") or kind
    for part in reversed(arg.split("/")):
        if part and not re.search(r"[*?\[\]]", part):
            return re.sub(r"\.(jsonl|parquet|txt)$", "", part)
    return kind


def parse_mixture(text: str) -> list[Component]:
    """Parses `data.mixture` ("SOURCE=WEIGHT,SOURCE=WEIGHT"); [] when empty."""
    if not text.strip():
        return []
    components, names = [], set()
    raw = []
    for item in text.split(","):
        source, sep, weight = item.strip().rpartition("=")
        try:
            value = float(weight)
        except ValueError:
            value = float("nan")
        if not sep or not source or not value > 0 or not np.isfinite(value):
            raise ValueError(
                f"data.mixture entry {item.strip()!r} is not SOURCE=WEIGHT with a positive weight"
            )
        try:
            parse_source(source)
        except ValueError as e:
            raise ValueError(f"data.mixture: {e}") from None
        raw.append((source, value))
    total = sum(weight for _, weight in raw)
    for index, (source, weight) in enumerate(raw):
        name = _short_name(source)
        if name in names:
            name = f"{name}_{index}"
        names.add(name)
        components.append(Component(source, weight / total, name))
    return components


def component_data(data: DataOptions, source: str) -> DataOptions:
    """The data section reading `source` alone."""
    return data.replace(source=source, mixture="")


def source_sections(data: DataOptions) -> list[DataOptions]:
    """One data section per source read: the mixture's sources, or `data.source` alone."""
    components = parse_mixture(data.mixture)
    return [component_data(data, c.source) for c in components] or [data]


def primary_source(data: DataOptions) -> DataOptions:
    """The data section whose source trains the tokenizer: the mixture's first source, if
    any."""
    components = parse_mixture(data.mixture)
    return component_data(data, components[0].source) if components else data


def row_sources(weights, seed: int, step: int, batch_size: int) -> np.ndarray:
    """The source index of every row of global batch `step`, int [B]: a pure function of
    (weights, seed, step)."""
    rng = np.random.default_rng([int(seed), int(step), _CHOICE_TAG])
    return rng.choice(len(weights), size=batch_size, p=weights)


class MixtureBatches:
    """Endless iterator over this process's rows of each global batch of a mixture.

    Same interface and batch layout as pipeline.TrainBatches (without epoch orders: a
    curriculum needs a single source).
    """

    def __init__(
        self, components: list[Component], parts: list, batch_size: int, seed: int, rows: slice
    ):
        self.components, self.parts, self.rows = components, parts, rows
        self.global_batch_size, self.seed = int(batch_size), int(seed)
        self.weights = np.array([c.weight for c in components])
        self.sizes = np.array([len(p) for p in parts], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]])
        self.num_examples = int(self.sizes.sum())
        self.num_tokens = sum(p.num_tokens for p in parts)
        self._step = 0
        self._consumed = np.zeros(len(parts), dtype=np.int64)

    def sources_of_step(self, step: int) -> np.ndarray:
        """The source index of every row of global batch `step`, int [B]."""
        return row_sources(self.weights, self.seed, step, self.global_batch_size)

    def _order(self, k: int, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, int(epoch), k + 1]).permutation(self.sizes[k])

    def _local_ids(self, k: int, positions: np.ndarray) -> np.ndarray:
        """Source k's example ids at these positions of its endless shuffled sequence."""
        epochs, within = np.divmod(positions, self.sizes[k])
        ids = np.empty_like(positions)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            ids[mask] = self._order(k, epoch)[within[mask]]
        return ids

    def __iter__(self) -> "MixtureBatches":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        sources_B = self.sources_of_step(self._step)
        # Every process walks the whole global batch to know each source's next position,
        # but reads only its own rows.
        positions_B = np.empty(self.global_batch_size, dtype=np.int64)
        for k in range(len(self.parts)):
            mask = sources_B == k
            positions_B[mask] = self._consumed[k] + np.arange(mask.sum())
            self._consumed[k] += mask.sum()
        self._step += 1
        local_sources, local_positions = sources_B[self.rows], positions_B[self.rows]
        out = None
        for k in np.unique(local_sources):
            mask = local_sources == k
            part = self.parts[k].batch(self._local_ids(k, local_positions[mask]))
            part["example_ids"] = part["example_ids"] + np.int32(self.offsets[k])
            if out is None:
                out = {
                    key: np.zeros((len(local_sources), *v.shape[1:]), v.dtype)
                    for key, v in part.items()
                }
            for key, value in part.items():
                out[key][mask] = value
        return out

    def get_state(self) -> dict:
        return {
            "step": self._step,
            "consumed": [int(c) for c in self._consumed],
            "sources": [c.source for c in self.components],
            "num_examples": [int(n) for n in self.sizes],
            "global_batch_size": self.global_batch_size,
        }

    def set_state(self, state: dict) -> None:
        """Resumes at a position from `get_state` (of any process count)."""
        mine = self.get_state()
        if "consumed" not in state or "step" not in state:
            raise ValueError(
                "data state was saved without data.mixture; it cannot resume a mixture run"
            )
        for key in ("sources", "num_examples", "global_batch_size"):
            if key in state and state[key] != mine[key]:
                raise ValueError(
                    f"data state has {key}={state[key]} but this run has {mine[key]}: the "
                    f"mixture, its data or train.batch_size changed since it was saved"
                )
        self._step = int(state["step"])
        self._consumed = np.array(state["consumed"], dtype=np.int64)
