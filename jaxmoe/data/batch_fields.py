"""The fields of a batch: the one place that names them, with their dtypes and axes.

A batch is a dict of numpy arrays, B rows each (this process's rows of the global batch).
Fields with a length axis (`axis`) lay it out as axis 1; a model that splits the sequence
(context parallelism) splits exactly the fields of `SEQUENCE_FIELDS`, each along its own
length ("decoder": the length of `inputs`, "encoder": of `encoder_inputs`). Packed rows
(data.packing=documents) carry segment ids and positions; a batch without them is one
sequence per row (positions 0, 1, ... and every token sees every earlier one). Preference
data (data.format=preference, train.objective=dpo) packs each pair as two consecutive
documents of one row: segments 2j + 1 (chosen) and 2j + 2 (rejected) are pair j of the row.
"""

import dataclasses

import numpy as np

DECODER, ENCODER = "decoder", "encoder"


@dataclasses.dataclass(frozen=True)
class BatchField:
    name: str
    dtype: type
    axis: str | None  # the length axis (axis 1), or None for one value per row
    doc: str


FIELDS = (
    BatchField("inputs", np.int32, DECODER, "the token ids the (decoder) model reads"),
    BatchField("targets", np.int32, DECODER, "the id to predict at each position"),
    BatchField(
        "weights",
        np.float32,
        DECODER,
        "loss weight of each target: 1 scored, 0 not (padding, prompts, user turns)",
    ),
    BatchField(
        "segment_ids",
        np.int32,
        DECODER,
        "packed rows: the document of each position (1, 2, ... in the row; 0 = padding); "
        "attention never crosses documents",
    ),
    BatchField(
        "positions", np.int32, DECODER, "packed rows: each token's position in its document"
    ),
    BatchField("encoder_inputs", np.int32, ENCODER, "encoder-decoder: the ids the encoder reads"),
    BatchField(
        "encoder_segment_ids",
        np.int32,
        ENCODER,
        "encoder-decoder packed rows: the encoder side's documents, numbered as the decoder's",
    ),
    BatchField(
        "encoder_positions", np.int32, ENCODER, "encoder-decoder packed rows: encoder positions"
    ),
    BatchField(
        "routing",
        np.int32,
        DECODER,
        "router replay (model.moe.replay): each position's recorded experts [B, L, M, K] per "
        "MoE layer and gate slot, -1 = none",
    ),
    BatchField("example_ids", np.int32, None, "the examples' global ids (-1: a padding row)"),
)
BY_NAME = {f.name: f for f in FIELDS}
SEQUENCE_FIELDS = tuple(f.name for f in FIELDS if f.axis is not None)
# The fields that describe packing: present together or not at all.
PACKING_FIELDS = {DECODER: ("segment_ids", "positions"),
                  ENCODER: ("encoder_segment_ids", "encoder_positions")}  # fmt: skip


def check_batch(batch: dict) -> None:
    """ValueError naming the field for an unknown field, a wrong dtype, or a length that
    differs from its axis' (what a batch built elsewhere, e.g. by a user, can get wrong)."""
    lengths: dict[str, tuple[str, int]] = {}
    for name, value in batch.items():
        field = BY_NAME.get(name)
        if field is None:
            raise ValueError(f"batch field {name!r} is not one of {sorted(BY_NAME)}")
        if np.asarray(value).dtype != field.dtype:
            raise ValueError(
                f"batch field {name!r} is {np.asarray(value).dtype}, not {field.dtype}"
            )
        if field.axis is None:
            continue
        length = np.shape(value)[1]
        seen = lengths.setdefault(field.axis, (name, length))
        if seen[1] != length:
            raise ValueError(
                f"batch fields {seen[0]!r} and {name!r} have lengths {seen[1]} and {length}"
            )
    for names in PACKING_FIELDS.values():
        if (names[0] in batch) != (names[1] in batch):
            raise ValueError(f"batch fields {names[0]!r} and {names[1]!r} come together")
