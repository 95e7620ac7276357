"""DPO (train.objective=dpo, training/dpo.py) on preference pairs (data.format=preference).

References: the loss and the reported rewards of one train step against the DPO formula
(TRL's sigmoid loss with label smoothing) evaluated in numpy on the log-probabilities of the
policy's and the reference's logits; the packing of pairs (two consecutive documents of one
window, never split); and, on the tiny Qwen3-MoE with LoRA through `jaxmoe train`, held-out
pairs whose preference accuracy rises above the reference's (slow lane).
"""

import json
import math

import jax
import numpy as np
import pytest

from jaxmoe.data.document_packing import PackedDocuments
from jaxmoe.models import build_model
from jaxmoe.models.spec import model_params, model_rngs, model_spec
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.training.optimizer import make_optimizer
from jaxmoe.training.state import init_state, state_shardings
from jaxmoe.training.steps import forward, jit_train_step, step_fns
from tests.helpers import tiny_config

BETA, EPS = 0.5, 0.1


def pair_batch():
    """One row holding two pairs (segments 1-2 and 3-4) and a second row with one pair,
    responses scored on their last tokens (as prompt + response EOS would be)."""
    rng = np.random.default_rng(0)
    inputs = rng.integers(0, 128, (2, 16)).astype(np.int32)
    targets = rng.integers(0, 128, (2, 16)).astype(np.int32)
    segments = np.array(
        [[1] * 4 + [2] * 4 + [3] * 3 + [4] * 5, [1] * 6 + [2] * 7 + [0] * 3], np.int32
    )
    weights = np.zeros((2, 16), np.float32)
    for row, seg in enumerate(segments):
        for s in range(1, seg.max() + 1):
            where = np.flatnonzero(seg == s)
            weights[row, where[2:]] = 1.0  # two prompt tokens, then the scored response
    positions = np.zeros((2, 16), np.int32)
    for row in range(2):
        for s in range(1, segments[row].max() + 1):
            where = np.flatnonzero(segments[row] == s)
            positions[row, where] = np.arange(len(where))
    return {"inputs": inputs, "targets": targets, "weights": weights, "segment_ids": segments,
            "positions": positions}  # fmt: skip


def hand_dpo(policy_logits, reference_logits, batch):
    """Mean DPO loss and metrics over the batch's pairs, in numpy float64."""

    def logps(logits):
        x = np.asarray(logits, np.float64)
        x = x - x.max(-1, keepdims=True)
        logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
        token = np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
        out = []
        for row in range(2):
            seg = batch["segment_ids"][row]
            sums = [np.sum((token[row] * batch["weights"][row])[seg == s]) for s in
                    range(1, seg.max() + 1)]  # fmt: skip
            out += [(sums[i], sums[i + 1]) for i in range(0, len(sums), 2)]
        return np.array(out)

    pi, ref = logps(policy_logits), logps(reference_logits)
    logits = (pi[:, 0] - pi[:, 1]) - (ref[:, 0] - ref[:, 1])
    sig = 1 / (1 + np.exp(-BETA * logits))
    losses = -(1 - EPS) * np.log(sig) - EPS * np.log(1 - sig)
    chosen, rejected = BETA * (pi[:, 0] - ref[:, 0]), BETA * (pi[:, 1] - ref[:, 1])
    return {
        "loss": losses.mean(),
        "rewards_chosen": chosen.mean(),
        "rewards_rejected": rejected.mean(),
        "rewards_margin": (chosen - rejected).mean(),
        "rewards_accuracy": (chosen > rejected).mean(),
        "logps_accuracy": (pi[:, 0] > pi[:, 1]).mean(),
    }


def test_a_dpo_step_reports_the_hand_computed_loss_and_rewards():
    config = tiny_config(
        "model.moe.num_experts=4", "data.format=preference", "train.objective=dpo",
        f"train.dpo_beta={BETA}", f"train.dpo_label_smoothing={EPS}", "train.batch_size=2",
    )  # fmt: skip
    mesh = make_mesh(config.mesh.replace(expert=1), jax.devices()[:1])
    spec = model_spec(config.model, mesh)
    optimizer, schedule = make_optimizer(config.optimizer, 4)
    _, shardings = state_shardings(mesh, spec, optimizer)
    state = init_state(config.model, 1, optimizer, shardings, mesh)
    _, reference = model_params(build_model(config.model, rngs=model_rngs(jax.random.key(2))))
    batch = pair_batch()
    with jax.set_mesh(mesh):
        policy_logits, _ = forward(
            spec.graphdef, state["params"], batch, train=True, rest=spec.rest
        )
        reference_logits, _ = forward(spec.graphdef, reference, batch, train=True, rest=spec.rest)
        want = hand_dpo(policy_logits, reference_logits, batch)
        fns = step_fns(config.train, config.optimizer, config.model, spec, optimizer, schedule)
        step = jit_train_step(fns, shardings, None, {"reference": shardings["params"]})
        _, metrics = step(state, batch, {"reference": reference})
    assert abs(want["rewards_margin"]) > 0.05 and 0 < want["rewards_accuracy"] < 1
    for key, value in want.items():
        assert float(metrics[key]) == pytest.approx(value, rel=1e-4, abs=1e-5), key


def test_pairs_are_packed_together_or_left_out_together():
    """Pairs (examples 2i, 2i + 1) go to one window as consecutive documents, chosen first;
    a pair whose two responses do not fit one window is dropped whole."""
    lengths = [4, 5, 3, 3, 9, 2, 5, 5]  # pair 2: 8 + 1 predictions, over the window of 8
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids = np.arange(offsets[-1], dtype=np.int32)
    weights = np.ones(offsets[-1], np.uint8)
    columns = {"ids": (ids, offsets), "weights": (weights, offsets)}
    packed = PackedDocuments(columns, seq_len=8, pad_id=0, mode="left", pairs=True)
    assert packed.counts == {"pairs dropped": 1}
    batch = packed.batch(np.arange(len(packed)))
    seen = []
    for row in range(len(packed)):
        seg, inputs = batch["segment_ids"][row], batch["inputs"][row]
        for s in range(1, seg.max() + 1, 2):
            chosen, rejected = inputs[seg == s], inputs[seg == s + 1]
            example = int(np.searchsorted(offsets, chosen[0], side="right")) - 1
            assert example % 2 == 0 and rejected[0] == offsets[example + 1]
            seen.append(example // 2)
    assert sorted(seen) == [0, 1, 3]


def test_dpo_needs_preference_data():
    from jaxmoe.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train\.objective='dpo' with data\.format='text'"):
        tiny_config("train.objective=dpo")


@pytest.mark.slow  # ~40 s: a LoRA DPO run of 120 steps on the tiny Qwen3-MoE
def test_dpo_raises_held_out_preference_accuracy(tmp_path, capsys):
    from jaxmoe.cli import main
    from tests import tiny_chat_model

    tiny_chat_model.build_checkpoint(tmp_path / "hf")
    tiny_chat_model.write_preferences(tmp_path / "pairs.jsonl", 240, seed=0)
    assert main(["convert", "hf", str(tmp_path / "hf"), str(tmp_path / "base")]) == 0
    argv = [
        "train", "--workdir", str(tmp_path / "run"),
        f"--config.train.init_from={tmp_path / 'base'}",
        f"--config.data.source=jsonl:{tmp_path / 'pairs.jsonl'}",
        f"--config.data.cache_dir={tmp_path / 'cache'}", "--config.data.format=preference",
        "--config.data.validation_fraction=0.15", "--config.train.objective=dpo",
        "--config.train.lora.rank=8", "--config.train.steps=120", "--config.train.batch_size=8",
        "--config.train.seq_len=64", "--config.train.eval_every=120",
        "--config.optimizer.learning_rate=0.02", "--config.optimizer.warmup_steps=2",
        "--no_progress",
    ]  # fmt: skip
    assert main(argv) == 0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    final = [json.loads(line) for line in lines if '"split": "eval"' in line][-1]
    assert final["pairs"] >= 20
    assert final["loss"] < math.log(2) - 0.2  # log 2: the reference's own loss
    assert final["rewards_accuracy"] >= 0.8
    assert final["logps_accuracy"] >= final["reference_logps_accuracy"] + 0.2
    train = [json.loads(line) for line in lines if '"split": "train"' in line]
    assert {"rewards_margin", "rewards_accuracy", "rewards_chosen"} <= set(train[-1])
