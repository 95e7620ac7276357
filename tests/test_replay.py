"""Router replay (model.moe.replay, models/moe/replay.py, router.replay) and routing records
(data/routing_record.py).

References: a model replaying the routing it recorded itself must give the loss and the
gradients of the live run to the bit (the record holds its own choices, so any difference is
the replay's), for every gate, dropless and with a capacity; a record with other counts per
token than the gate would choose is replayed with those counts; records that do not fit the
model are refused in one line; the batch's routing lands on the positions of the example it
was recorded for. The 8-device (fsdp x expert) runs and transformers' bf16 routing are in
tests/test_replay_sharded.py and tests/test_replay_transformers.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.data.document_packing import PackedDocuments
from jaxmoe.data.routing_record import (
    Record,
    RoutingShape,
    dense_routing,
    read_record,
    routing_shape,
    write_record,
)
from jaxmoe.models import build_model
from jaxmoe.models.spec import model_params, model_rngs
from jaxmoe.training.steps import forward
from tests.helpers import tiny_config

GATES = {
    "top1": (),
    "top2": (),
    "topk": ("model.moe.top_k=3",),
    "adaptive": ("model.moe.threshold=0.5",),
    "top_p": ("model.moe.top_p=0.5", "model.moe.max_k=3"),
    "adaptive_k": ("model.moe.threshold=0.5", "model.moe.max_k=3"),
}


def replay_config(gating: str, *extra):
    return tiny_config(
        "model.num_layers=2", "model.moe.num_experts=4", "model.moe.every=2",
        f"model.moe.gating={gating}", *GATES[gating], "data.format=prompt_completion", *extra,
    )  # fmt: skip


def tokens(seed=0, shape=(2, 16)):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 128, shape), jnp.int32)


def loss_and_grads(config, params, batch, record: bool = False):
    """The training loss's parts that routing touches (NLL, balance and z losses) and its
    gradients, jitted as a train step is; with `record`, also the experts each MoE layer
    chose, [B, L, M, K]."""
    graphdef, _ = model_params(build_model(config.model, rngs=model_rngs(jax.random.key(0))))

    @jax.jit
    def value_and_grad(params, batch):
        def loss(params):
            logits, aux = forward(graphdef, params, batch, train=True, record_routing=record)
            nll = -jnp.mean(jax.nn.log_softmax(logits)[..., 0])
            total = nll + sum(a["balance_loss"] + a["router_z_loss"] for a in aux.values())
            experts = [a["experts"] for a in aux.values()] if record else []
            return total, jnp.stack(experts, axis=2) if record else None

        return jax.value_and_grad(loss, has_aux=True)(params)

    (loss, experts), grads = value_and_grad(params, batch)
    return (loss, grads, experts) if record else (loss, grads)


@pytest.mark.parametrize(
    ("gating", "capacity"), [("adaptive", 0.0), ("top_p", 1.0)], ids=["adaptive", "top_p-capacity"]
)
def test_replaying_its_own_routing_is_bit_identical(gating, capacity):
    config = replay_config(gating, f"model.moe.capacity_factor={capacity}")
    _, params = model_params(build_model(config.model, rngs=model_rngs(jax.random.key(1))))
    batch = {"inputs": tokens()}
    live_loss, live_grads, record = loss_and_grads(config, params, batch, record=True)
    replay = replay_config(gating, f"model.moe.capacity_factor={capacity}", "model.moe.replay=true")
    loss, grads = loss_and_grads(replay, params, batch | {"routing": record})
    assert np.asarray(loss).tobytes() == np.asarray(live_loss).tobytes()
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(live_grads), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    if gating == "top_p":  # a variable count per token really was replayed
        counts = np.asarray((record >= 0).sum(-1))
        assert counts.min() >= 1 and len(np.unique(counts)) > 1


def test_replayed_counts_are_the_recorded_ones_not_the_gates():
    """An adaptive gate replays a record of one expert for some tokens and two for others,
    whatever its threshold would choose; the weights come from the live router."""
    config = replay_config("adaptive", "model.moe.replay=true")
    graphdef, params = model_params(build_model(config.model, rngs=model_rngs(jax.random.key(1))))
    rng = np.random.default_rng(0)
    record = np.full((2, 16, 1, 2), -1, np.int32)
    record[..., 0] = rng.integers(0, 4, (2, 16, 1))
    two = rng.random((2, 16, 1)) < 0.5
    record[..., 1] = np.where(two, (record[..., 0] + 1 + rng.integers(0, 3, (2, 16, 1))) % 4, -1)
    batch = {"inputs": tokens(), "routing": jnp.asarray(record)}
    _, aux = forward(graphdef, params, batch, train=True, record_routing=True)
    for m, layer in enumerate(aux.values()):
        assert np.array_equal(np.asarray(layer["experts"]), record[:, :, m])
        assert float(layer["top2_fraction"]) == pytest.approx(two[..., m].mean())


def test_records_round_trip_with_variable_counts(tmp_path):
    rng = np.random.default_rng(0)
    sequences = []
    for n in (5, 3):
        s = np.full((n, 2, 3), -1, np.int16)
        for t in range(n):
            for m in range(2):
                k = rng.integers(1, 4)
                s[t, m, :k] = rng.choice(8, k, replace=False)
        sequences.append(s)
    path = tmp_path / "r.safetensors"
    write_record(str(path), Record(sequences, (1, 3), 8, 3))
    back = read_record(str(path))
    assert back.layers == (1, 3) and back.num_experts == 8 and back.slots == 3
    for a, b in zip(back.sequences, sequences, strict=True):
        assert np.array_equal(a, b)
    assert back.as_lists(1)[0][0] == [int(e) for e in sequences[1][0, 0] if e >= 0]
    (tmp_path / "bad.safetensors").write_bytes(b"not a record")
    with pytest.raises(ValueError, match=r"bad\.safetensors: unreadable routing record"):
        read_record(str(tmp_path / "bad.safetensors"))


@pytest.mark.parametrize(
    ("routing", "message"),
    [
        ([[[0, 1], [2]]] * 3, r"covers 3 positions, the example has 6 tokens"),
        ([[[0, 1]]] * 5, r"position 0 has 1 MoE layers, the model 2 \(layers \[1, 3\]\)"),
        ([[[0, 9], [1]]] * 5, r"expert ids \[0, 9\] outside \[0, 4\)"),
        ([[[0, 1, 2], [1]]] * 5, r"3 experts, the gate takes 1 to 2 per token"),
        ([[[], [1]]] * 5, r"0 experts, the gate takes 1 to 2"),
    ],
)
def test_a_record_that_does_not_fit_is_one_line(routing, message):
    shape = RoutingShape((1, 3), num_experts=4, slots=2)
    with pytest.raises(ValueError, match=message):
        dense_routing(routing, shape, 6, "train.jsonl line 7")
    record = Record([np.zeros((4, 2, 2), np.int16)], (1, 3), 4, 2)
    with pytest.raises(ValueError, match=r"recorded MoE layers \[1, 3\], the model's are \[1\]"):
        record.check_fits(RoutingShape((1,), 4, 2), "rec.safetensors")


def test_routing_lands_on_the_positions_it_was_recorded_for():
    """Two examples packed in one row: each input position gets the experts recorded for
    that token of its example (the last token of an example is never fed)."""
    config = replay_config("top2", "model.moe.replay=true")
    shape = routing_shape(config.model)
    assert shape == RoutingShape((1,), 4, 2)
    lengths = (5, 4)
    ids = np.arange(sum(lengths), dtype=np.int32) + 10
    routing = np.stack([np.full((1, 2), t % 4) for t in range(len(ids))]).astype(np.int16)
    offsets = np.array([0, 5, 9])
    columns = {
        "ids": (ids, offsets),
        "weights": (np.ones(len(ids), np.uint8), offsets),
        "routing": (routing, offsets),
    }
    batch = PackedDocuments(columns, seq_len=8, pad_id=0, mode="left").batch(np.array([0]))
    assert batch["routing"].shape == (1, 8, 1, 2)
    for col in range(7):  # 4 + 3 positions, then padding
        source = int(batch["inputs"][0, col]) - 10
        assert np.all(batch["routing"][0, col] == source % 4), col
    assert np.all(batch["routing"][0, 7] == -1)


def test_replay_without_routing_data_is_refused():
    from jaxmoe.errors import ConfigError

    with pytest.raises(ConfigError, match=r"data\.format='text' has none"):
        tiny_config("model.moe.replay=true")  # the model section alone passes
