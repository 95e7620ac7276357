"""Streaming (`data.streaming=True`): lanes rebuild each shuffled document stream exactly,
processes split the lanes, and the state resumes exactly (in-process and via the trainer).

References: a per-lane Python loop over documents shuffled by np.random.default_rng.
"""

import json

import numpy as np
import pytest

from jaxmoe.data.stream import StreamBatches

DOCS = [f"doc {i}: " + "x" * (i % 7) * 3 for i in range(23)] + [""]  # one empty document


class CharTokenizer:
    """Test double: one id per character (its code point), EOS = 1, no BOS."""

    eos_id, bos_id = 1, None

    def encode(self, text):
        return [ord(c) for c in text]


def stream(rows=slice(0, 4), seq_len=5, seed=0):
    return StreamBatches(DOCS, CharTokenizer(), seq_len, 4, seed, rows)


def stack_states(*states):
    """What allgather gives: one array per process, stacked."""
    return lambda local: np.stack([np.asarray(s["lanes"]) for s in states])


def test_each_lane_reads_its_shuffled_documents_in_order():
    batches = stream()
    windows = [next(batches)["inputs"] for _ in range(60)]
    for lane in range(4):
        read = [int(t) for w in windows for t in w[lane]]  # inputs: the windows less overlap
        expected = []
        for epoch in range(10):
            order = np.random.default_rng([0, epoch]).permutation(len(DOCS))
            for index in order[lane::4]:
                ids = [ord(c) for c in DOCS[index]]
                expected += [*ids, 1] if ids else []
        assert read == expected[: len(read)]


def test_targets_are_inputs_shifted_and_weights_one():
    batch = next(stream())
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    assert batch["weights"].all() and batch["inputs"].shape == (4, 5)


def test_resume_and_processes_reproduce_the_uninterrupted_batches():
    full = stream()
    expected = [next(full)["inputs"] for _ in range(40)]
    first = stream()
    for _ in range(13):
        next(first)
    state = json.loads(
        json.dumps(first.gather_state(first.get_state(), stack_states(first.get_state())))
    )
    halves = [stream(slice(0, 2)), stream(slice(2, 4))]
    for half in halves:
        half.set_state(state)
    for step in range(13, 40):
        together = np.concatenate([next(h)["inputs"] for h in halves])
        np.testing.assert_array_equal(together, expected[step])
    # Two processes' lanes gathered give the one-process state.
    local = [h.get_state() for h in halves]
    gathered = halves[0].gather_state(local[0], stack_states(*local))
    assert gathered == full.gather_state(full.get_state(), stack_states(full.get_state()))
    with pytest.raises(ValueError, match="num_documents"):
        StreamBatches(DOCS[:-1], CharTokenizer(), 5, 4, 0, slice(0, 4)).set_state(state)


def test_streaming_run_trains_and_resumes_exactly(tmp_path):
    from jaxmoe.training.loop import train
    from tests.test_train import read_metrics, run_config

    def config(steps):
        return run_config(
            tmp_path / "cache", steps, "data.streaming=True", "train.checkpoint_every=3"
        )

    train(config(6), str(tmp_path / "full"), progress=False)
    train(config(3), str(tmp_path / "cut"), progress=False)
    summary = train(config(6), str(tmp_path / "cut"), progress=False)  # resumes at step 3
    full, cut = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut")
    for step in (4, 5, 6):
        assert cut[step]["loss"] == pytest.approx(full[step]["loss"], abs=1e-6), step
    assert np.isfinite(summary["eval"]["loss"])
    tokens = list((tmp_path / "cache" / "tokens").iterdir())
    assert [p.name.split("_")[0] for p in tokens] == ["validation"]  # no train token cache


@pytest.mark.slow
def test_stream_resumed_after_sigkill_matches_uninterrupted(tmp_path):
    from tests.test_faults import jaxmoe, losses, start, train_args, wait_for_step

    def args(workdir):
        extra = ("--config.data.streaming=True", "--config.train.checkpoint_every=2")
        return train_args(workdir, tmp_path / "cache", 8, *extra)

    assert jaxmoe(args(tmp_path / "full")).returncode == 0
    process = start(args(tmp_path / "cut"))
    wait_for_step(tmp_path / "cut", 5, process)
    process.kill()
    process.wait()
    checkpoints = tmp_path / "cut" / "checkpoints"
    kept = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    result = jaxmoe(args(tmp_path / "cut"))
    assert result.returncode == 0, result.stderr[-2000:]
    reference, resumed = losses(tmp_path / "full"), losses(tmp_path / "cut")
    compared = range(kept[-1] + 1, 9)
    assert len(compared) >= 2, f"killed too late to test a resume: checkpoints {kept}"
    for step in compared:
        assert resumed[step] == pytest.approx(reference[step], abs=1e-6), step
