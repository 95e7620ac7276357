"""experiments/ep_worker.py and ep_time_to_quality.py: the collectives found in a compiled
program, the time inside them read from profiler events, the wait between processes, the
time to a target; and (slow) two real expert-parallel processes on launch/local.sh, whose
recorded expert rows must agree with the training step's own routing metrics."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments import ep_time_to_quality as driver
from experiments import ep_worker

ROOT = Path(__file__).resolve().parents[1]


def test_collectives_of_a_compiled_program():
    mesh = jax.make_mesh((2,), ("expert",), devices=jax.devices()[:2])

    def exchange(x):
        def per_device(x):
            y = jax.lax.all_to_all(x, "expert", 0, 0, tiled=True)
            return jax.lax.psum(y, "expert")

        return jax.shard_map(per_device, mesh=mesh, in_specs=P("expert"), out_specs=P())(x)

    x = jax.device_put(jnp.ones((4, 3)), NamedSharding(mesh, P("expert")))
    with jax.set_mesh(mesh):
        text = jax.jit(exchange).lower(x).compile().as_text()
    kinds = ep_worker.collective_ops(text)
    assert sorted(kinds.values()) == ["all-to-all", "other"], kinds
    assert ep_worker.module_name(text) == "jit_exchange"


def test_collective_seconds_per_execution_from_trace_events():
    kinds = {"all-to-all.1": "all-to-all", "all-reduce": "other"}

    def event(op, ts, dur, run, module="jit_step"):
        return {"ts": ts, "dur": dur, "args": {"hlo_module": module, "hlo_op": op, "run_id": run}}

    events = [
        event("fusion", 0, 100, "a"),
        event("all-to-all.1", 100, 400, "a"),
        event("all-reduce", 500, 50, "a"),
        event("all-to-all.1", 2000, 30, "b"),  # the second step, microseconds
        event("fusion", 2030, 10, "b"),
        event("all-to-all.1", 900, 999, "c", module="jit_probe"),  # another program
    ]
    steps = ep_worker.collective_seconds(events, "jit_step", kinds)
    assert steps == [
        {"all_to_all_s": 400e-6, "other_collectives_s": 50e-6, "span_s": pytest.approx(550e-6)},
        {"all_to_all_s": 30e-6, "other_collectives_s": 0.0, "span_s": pytest.approx(40e-6)},
    ]
    assert ep_worker.parse_windows("10:4,40") == [(10, 4), (40, 8)]


def test_wait_is_the_collective_time_beyond_the_other_process():
    # Step 1: p0 in collectives 0.5 s, p1 0.2 s (p0 waited 0.3 s); step 2 the other way.
    def process(totals):
        steps = [{"all_to_all_s": t, "other_collectives_s": 0.0, "span_s": 1.0} for t in totals]
        return {"profile": [{"first_step": 5, "steps": steps}]}

    got = driver.waits({"processes": [process([0.5, 0.1]), process([0.2, 0.3])]})
    np.testing.assert_allclose(got["wait_s"], [0.15, 0.1])
    assert got["wait_per_step_s"] == pytest.approx(0.25)
    assert got["profiled_steps"] == 2


def test_time_to_target_uses_the_wall_clock_and_the_first_step_at_the_median():
    # Steps of 1, 2, 2, 2 s: the first at the median (2 s), so 2, 4, 6, 8 s after steps 1-4.
    # The own-gate loss reaches 3.0 halfway between the evaluations at steps 2 and 4.
    evals = [
        {"step": 0, "loss_own": 5.0, "loss_top1": 5.0},
        {"step": 2, "loss_own": 4.0, "loss_top1": 4.5},
        {"step": 4, "loss_own": 2.0, "loss_top1": 4.4},
    ]
    proc = {"walls": [1.0, 2.0, 2.0, 2.0], "cpus": [1.0] * 4, "evals": evals, "profile": [],
            "curriculum_host_s": 0.0}  # fmt: skip
    run = {"steps": 4, "processes": [proc, proc], "load_before": 0.1, "load_after": 1.9,
           "quiet": True}  # fmt: skip
    row = driver.arm_result(run, {"own": 3.0, "top1": 4.0})
    assert row["steps_to_target_own"] == pytest.approx(3.0)
    assert row["wall_s_to_target_own"] == pytest.approx(6.0)
    assert row["cpu_s_to_target_own"] == pytest.approx(3.0)  # 1 CPU second a step
    assert row["wall_s_to_target_top1"] is None  # not reached: the best loss says how far
    assert row["best_loss_top1"] == 4.4 and row["best_step_top1"] == 4
    assert row["train_wall_s"] == pytest.approx(8.0)


def test_local_launcher_runs_another_module():
    done = subprocess.run(
        ["bash", "launch/local.sh", "2", "--devices_per_process", "1", "--module",
         "experiments.ep_worker", "--", "--help"],
        cwd=ROOT, env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:]
    assert "[0] usage:" in done.stdout and "[1] usage:" in done.stdout


@pytest.mark.slow
def test_two_expert_parallel_processes(tmp_path):
    """6 steps of a 2-layer adaptive model on 2 pinned processes, one expert group each."""
    out = tmp_path / "run"
    command = ["bash", "launch/local.sh", "2", "--devices_per_process", "1", "--module",
               "experiments.ep_worker", "--", "--out", str(out), "--variant", "adaptive_T0.1",
               "--steps", "6", "--layers", "2", "--eval_every", "6", "--eval_batches", "1",
               "--probe", "--profile", "3:2"]  # fmt: skip
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("XLA_FLAGS", None)  # one device per process
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:]
    processes = [json.loads((out / f"process_{i}.json").read_text()) for i in range(2)]
    for p in processes:
        assert p["mesh"]["expert"] == 2 and len(p["walls"]) == 6
        (window,) = p["profile"]
        assert window["first_step"] == 4 and len(window["steps"]) == 2
        assert all(s["all_to_all_s"] > 0 for s in window["steps"])
    assert [e["step"] for e in processes[0]["evals"]] == [0, 6]
    steps = np.load(out / "steps.npz")
    rows_SMBE, routing_SBM = steps["rows_MBE"], steps["routing_BM"]
    assert rows_SMBE.shape == (6, 2, 16, 8) and routing_SBM.shape == (6, 16, 2)
    # Independent of the probe: the train step's own top-2 fraction per example and layer.
    # Every token keeps one or two experts, so the rows of an example in a layer are its
    # 64 tokens plus its two-expert tokens.
    rows_SBM = rows_SMBE.sum(-1).transpose(0, 2, 1)
    np.testing.assert_allclose(rows_SBM, 64 * (1 + routing_SBM), atol=0.5)
    assert sorted(set(steps["example_ids"][:2].ravel())) == sorted(steps["example_ids"][:2].ravel())
