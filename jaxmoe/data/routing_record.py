"""Recorded routing (router replay, model.moe.replay): the experts each token was sent to in
each MoE layer, as `eval` and `decode` write them (`--record_routing FILE`) and as training
data carries them (a `routing` field per jsonl record).

The record file is safetensors (no pickle), compact for variable counts: `counts` uint8
[N, M] (experts per token per MoE layer, N tokens of all sequences, M MoE layers), `experts`
int16 [sum of counts] (the ids, token by token, layer by layer, in the gate's slot order) and
`offsets` int64 [S + 1] (where each of the S sequences starts, in tokens). Its metadata
names the format, the MoE layer ids, the experts per layer and the slots of the gate that
chose them. A sequence of n ids has n - 1 routed positions: the last id is never fed to the
model (decoder-only scoring and decoding alike).

In jsonl training data, `routing` is a list over positions of a list over MoE layers of the
expert ids (`[[[3, 1], [0]], ...]`): what `Record.as_lists(s)` gives for sequence s. It
covers the example's n - 1 input positions (n is also accepted, the last ignored); the
preference format's `chosen_routing` / `rejected_routing` cover prompt + response each.
"""

import dataclasses
import itertools
import json
import os

import numpy as np

FORMAT = "jaxmoe-routing-v1"


@dataclasses.dataclass(frozen=True)
class RoutingShape:
    """What a record must fit: the model's MoE layer ids, its experts, its gate's slots."""

    layers: tuple[int, ...]
    num_experts: int
    slots: int

    @property
    def width(self) -> int:
        return len(self.layers) * self.slots


def routing_shape(model) -> RoutingShape | None:
    """The RoutingShape of model section `model` (ModelOptions) when it replays routing,
    else None."""
    moe = model.moe
    if not (moe.num_experts and moe.replay):
        return None
    from jaxmoe.models.moe.gates import num_slots
    from jaxmoe.models.moe.replay import moe_layer_ids

    slots = max(num_slots(moe.gate), num_slots(moe.eval_gate))
    return RoutingShape(tuple(moe_layer_ids(model)), moe.num_experts, slots)


def dense_routing(positions, shape: RoutingShape, length: int, where: str) -> np.ndarray:
    """int16 [length, M * K] of a record given as nested lists (positions x layers x ids),
    -1 in unused slots and past the record; one ValueError naming `where` and the culprit
    for a record that does not fit the model (layers, experts, slots, length)."""
    if not isinstance(positions, list):
        raise ValueError(
            f"{where}: routing must be a list over positions, not {type(positions).__name__}"
        )
    if len(positions) not in (length - 1, length):
        raise ValueError(
            f"{where}: routing covers {len(positions)} positions, the example has {length} "
            f"tokens ({length - 1} routed positions)"
        )
    m, k = len(shape.layers), shape.slots
    out = np.full((length, m, k), -1, np.int16)
    for t, layers in enumerate(positions[: length - 1]):
        if not isinstance(layers, list) or len(layers) != m:
            got = len(layers) if isinstance(layers, list) else type(layers).__name__
            raise ValueError(
                f"{where}: routing position {t} has {got} MoE layers, the model {m} "
                f"(layers {list(shape.layers)})"
            )
        for j, experts in enumerate(layers):
            if not isinstance(experts, list) or not all(
                isinstance(e, int) and not isinstance(e, bool) for e in experts
            ):
                raise ValueError(f"{where}: routing position {t}, layer {j}: not a list of ids")
            if len(experts) > k or not experts:
                raise ValueError(
                    f"{where}: routing position {t}, layer {j}: {len(experts)} experts, the "
                    f"gate takes 1 to {k} per token"
                )
            if min(experts) < 0 or max(experts) >= shape.num_experts:
                raise ValueError(
                    f"{where}: routing position {t}, layer {j}: expert ids {experts} outside "
                    f"[0, {shape.num_experts})"
                )
            out[t, j, : len(experts)] = experts
    return out.reshape(length, m * k)


@dataclasses.dataclass
class Record:
    """A routing record: per sequence, int16 [n, M, K] (-1 unused), and what recorded it."""

    sequences: list[np.ndarray]
    layers: tuple[int, ...]
    num_experts: int
    slots: int

    def as_lists(self, s: int) -> list:
        """Sequence s as jsonl training data's `routing` field."""
        return [[[int(e) for e in slot if e >= 0] for slot in token] for token in self.sequences[s]]

    def check_fits(self, shape: RoutingShape, where: str) -> None:
        """One ValueError unless this record fits a model of `shape`."""
        if self.layers != shape.layers:
            raise ValueError(
                f"{where}: recorded MoE layers {list(self.layers)}, the model's are "
                f"{list(shape.layers)}"
            )
        if self.num_experts != shape.num_experts:
            raise ValueError(
                f"{where}: recorded over {self.num_experts} experts, the model has "
                f"{shape.num_experts}"
            )
        widest = max((int((s >= 0).sum(-1).max()) for s in self.sequences if s.size), default=0)
        if widest > shape.slots:
            raise ValueError(
                f"{where}: up to {widest} experts per token recorded, the gate takes {shape.slots}"
            )


def write_record(path: str, record: Record) -> None:
    """Writes `record` to `path` (safetensors, written whole or not at all)."""
    from safetensors.numpy import save

    from jaxmoe.storage.temporaries import write_atomically

    lengths = [len(s) for s in record.sequences]
    every = (
        np.concatenate(record.sequences)
        if record.sequences
        else np.zeros((0, len(record.layers), record.slots), np.int16)
    )
    valid = every >= 0
    counts = valid.sum(-1).astype(np.uint8)
    experts = every[valid].astype(np.int16)  # token, layer, slot order
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    metadata = {
        "format": FORMAT,
        "layers": json.dumps(list(record.layers)),
        "num_experts": str(record.num_experts),
        "slots": str(record.slots),
    }
    tensors = {"counts": counts, "experts": experts, "offsets": offsets}
    write_atomically(os.path.abspath(path), save(tensors, metadata=metadata))


def read_record(path: str) -> Record:
    """The record at `path`; one ValueError naming the file for anything else."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "np") as f:
            metadata = f.metadata() or {}
            if metadata.get("format") != FORMAT:
                raise ValueError(f"{path}: not a jaxmoe routing record (format {FORMAT})")
            counts, experts, offsets = (f.get_tensor(n) for n in ("counts", "experts", "offsets"))
            layers = tuple(int(i) for i in json.loads(metadata["layers"]))
            num_experts, slots = int(metadata["num_experts"]), int(metadata["slots"])
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: unreadable routing record ({error})") from None
    if counts.shape[1:] != (len(layers),) or int(counts.sum()) != len(experts):
        raise ValueError(f"{path}: damaged routing record (counts and experts disagree)")
    if counts.size and int(counts.max()) > slots:
        raise ValueError(f"{path}: damaged routing record (more experts than slots)")
    valid = np.arange(slots)[None, None, :] < counts[..., None]
    dense = np.full((*counts.shape, slots), -1, np.int16)
    dense[valid] = experts
    sequences = [dense[a:b] for a, b in itertools.pairwise(offsets)]
    return Record(sequences, layers, num_experts, slots)


def attach_routing(record_path: str, jsonl_in: str, jsonl_out: str, field: str = "routing"):
    """Writes `jsonl_in` to `jsonl_out` with each record's `field` set to its sequence of
    the record at `record_path` (line i, not counting empty ones, gets sequence i): training
    data for router replay from what `eval --record_routing` or `decode --record_routing`
    recorded for the same examples."""
    from jaxmoe.storage.temporaries import write_atomically

    record = read_record(record_path)
    with open(jsonl_in, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    if len(lines) != len(record.sequences):
        raise ValueError(
            f"{jsonl_in}: {len(lines)} records, {record_path}: {len(record.sequences)} sequences"
        )
    out = []
    for i, line in enumerate(lines):
        value = json.loads(line)
        value[field] = record.as_lists(i)
        out.append(json.dumps(value))
    write_atomically(os.path.abspath(jsonl_out), ("\n".join(out) + "\n").encode())
