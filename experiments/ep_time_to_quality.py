"""Wall time to top-2's quality on expert-parallel processes, with and without the curriculum.

The adaptive-gating paper's Table 3 (Li et al. 2023) is the training time until each gate
reaches top-2's quality, with data and expert parallelism on 8 GPUs, where a device whose
experts get more rows makes the others wait. Here each run is 2 processes
(`launch/local.sh --module experiments.ep_worker`), one CPU device each, each pinned to its
own core, the experts split between them (one expert group per process), so the exchange
of every MoE layer really waits for the busier process. Per seed:

1. top-2 is trained for --reference_steps; its final eval loss, evaluated with its own gate
   and with top-1 gating, are the two targets;
2. every other arm (dense, top-1, adaptive T=0.1, adaptive T=0.1 with the paper's routing
   curriculum) is trained for --budget_steps with the same constant learning rate after
   warmup (a curve that does not depend on the budget); its wall time to each target is
   read off its eval curve (own gate to the own-gate target, top-1 evaluation to the top-1
   target; linear interpolation between evaluations), or "not reached" with the best loss.

Wall time is the sum of the steps' wall times (dispatch to the new state ready, waiting in
the collectives included; compiling, evaluation and the curriculum's host bookkeeping
excluded, the latter reported). In profiled windows (jax.profiler, a few steps each epoch)
each process's time inside the step's collectives is measured, and the wait is the time a
process spent in them beyond the other's. The adaptive arms also record the rows each
expert received, per example and layer, every step: experiments.stragglers predicts the
wait from them (the busiest expert group) and the curriculum's effect by re-cutting the
recorded epochs in each order; both predictions are reported beside the measurements.

Run it alone on the host (it uses both cores): under `flock /tmp/jaxmoe-heavy.lock`. The
1-minute load average is recorded before and after every run, and each run is judged by
benchmarks.peer_harness.is_quiet; the tables say "not quiet" where it failed.

    python -m experiments ep_time_to_quality --out runs/ep --json      # 3 seeds (~1 h quiet)
    python -m experiments ep_time_to_quality --out /tmp/ep --quick     # smoke test (~5 min)
    python -m experiments ep_time_to_quality --report runs/ep/ep_time_to_quality.json
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.peer_harness import is_quiet, load_average
from benchmarks.results import add_json_flag, markdown_table, write_json
from experiments import stragglers
from experiments.adaptive_vs_fixed import reach

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = "top2"
# arm: (ep_worker variant, data.curriculum)
ARMS = {
    "top2": ("top2", "none"),
    "top1": ("top1", "none"),
    "adaptive_T0.1": ("adaptive_T0.1", "none"),
    "adaptive_T0.1_curriculum": ("adaptive_T0.1", "paper"),
    "dense": ("dense", "none"),
}
CURRICULUM_PAIR = ("adaptive_T0.1", "adaptive_T0.1_curriculum")
GATES = ("own", "top1")
# Li et al. 2023, Table 3 (time to top-2's quality, relative to top-2, six tasks, 8 A100s).
PAPER_TIME = {"dense": "0.82-0.89x", "top1": "0.93-1.14x", "top2": "1x",
              "adaptive_T0.1": "0.77-0.89x"}  # fmt: skip
PROCESSES = 2


def launch(arm: str, seed: int, steps: int, args, out: Path, log) -> dict:
    """One arm's run on PROCESSES pinned processes; its process JSONs and the load around it."""
    variant, curriculum = ARMS[arm]
    run_dir = out / f"seed{seed}" / arm
    done = run_dir / "process_0.json"
    if args.resume and done.exists() and (run_dir / "run.json").exists():
        log(f"== seed {seed} {arm}: reusing {run_dir}")
        return json.loads((run_dir / "run.json").read_text())
    run_dir.mkdir(parents=True, exist_ok=True)
    worker = [
        "--out", str(run_dir), "--variant", variant, "--seed", str(seed), "--steps", str(steps),
        "--layers", str(args.layers), "--eval_every", str(args.eval_every),
        "--eval_batches", str(args.eval_batches), "--warmup_steps", str(args.warmup_steps),
        "--curriculum", curriculum, "--profile", windows(steps, args),
        "--compile_cache", str(out / "jax_cache"),
        *(["--probe"] if variant.startswith("adaptive") else []),
        *(x for kv in args.set for x in ("--set", kv)),
    ]  # fmt: skip
    command = ["bash", str(ROOT / "launch" / "local.sh"), str(PROCESSES), "--devices_per_process",
               "1", "--module", "experiments.ep_worker", "--", *worker]  # fmt: skip
    env = {**os.environ, "PYTHON": sys.executable, "JAXMOE_LOCAL_LOGDIR": str(run_dir / "logs")}
    for attempt in (1, 2):  # a loaded host can time out Gloo's first connection: retry once
        load_before = settled_load(args.settle_s, log)
        log(f"== seed {seed} {arm}: {steps} steps on {PROCESSES} processes "
            f"(load {load_before:.2f})")  # fmt: skip
        started = time.time()
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        load_after = load_average()
        if not done.returncode:
            break
        tail = "\n".join(done.stdout.strip().splitlines()[-15:])
        if attempt == 2:
            raise RuntimeError(f"seed {seed} {arm}: the run exited {done.returncode}:\n{tail}")
        log(f"   the run exited {done.returncode}, once more (logs: {run_dir / 'logs'}):\n{tail}")
    for line in done.stdout.splitlines():
        if "ms/step" in line:
            log("   " + line)
    processes = [json.loads((run_dir / f"process_{i}.json").read_text()) for i in range(PROCESSES)]
    result = {
        "arm": arm,
        "seed": seed,
        "steps": steps,
        "processes": processes,
        "load_before": load_before,
        "load_after": load_after,
        "quiet": is_quiet([load_before, load_after], own_threads=PROCESSES),
        "run_s": time.time() - started,
    }
    (run_dir / "run.json").write_text(json.dumps(result))
    return result


def settled_load(limit_s: float, log) -> float:
    """The 1-minute load average once the previous run's own processes have left it (it
    decays over about a minute): waits until it is at most half the cores, or `limit_s`."""
    half = (os.cpu_count() or 1) / 2
    waited = 0.0
    while load_average() > half and waited < limit_s:
        time.sleep(5)
        waited += 5
    if waited:
        log(f"   waited {waited:.0f} s for the load to settle ({load_average():.2f})")
    return load_average()


def windows(steps: int, args) -> str:
    """Profiled windows: --profile_steps steps from step 40 of every epoch (and of the run)."""
    if not args.profile_steps:
        return ""
    starts = range(min(40, steps // 4), steps - args.profile_steps + 1, args.steps_per_epoch)
    return ",".join(f"{s}:{args.profile_steps}" for s in starts)


def cumulative_wall(walls: list[float]) -> np.ndarray:
    """[0, t1, t1 + t2, ...]: the first step (a program's first call) at the median."""
    walls_S = np.asarray(walls, np.float64)
    walls_S[0] = np.median(walls_S)
    return np.concatenate([[0.0], np.cumsum(walls_S)])


def waits(run: dict) -> dict:
    """Measured in the profiled windows, per process: seconds per step inside the step's
    all-to-alls and other collectives, and the wait: the collective time beyond the process
    that spent least in them in the same step."""
    per = [p["profile"] for p in run["processes"]]
    if not per[0]:
        return {}
    total_PS, a2a_PS, spans = [], [], []
    for windows_of_p in per:
        steps = [s for w in windows_of_p for s in w["steps"]]
        total_PS.append([s["all_to_all_s"] + s["other_collectives_s"] for s in steps])
        a2a_PS.append([s["all_to_all_s"] for s in steps])
        spans.append([s["span_s"] for s in steps])
    total_PS, a2a_PS = np.asarray(total_PS), np.asarray(a2a_PS)
    wait_PS = total_PS - total_PS.min(axis=0, keepdims=True)
    return {
        "profiled_steps": int(total_PS.shape[1]),
        "collectives_s": total_PS.mean(axis=1).tolist(),
        "all_to_all_s": a2a_PS.mean(axis=1).tolist(),
        "wait_s": wait_PS.mean(axis=1).tolist(),
        "wait_per_step_s": float(wait_PS.sum(axis=0).mean()),
        "program_span_s": float(np.mean(spans)),
        "wait_PS": wait_PS.tolist(),
    }


def arm_result(run: dict, targets: dict) -> dict:
    """Wall time to each target, the step times, the waits, the routing shares."""
    first = run["processes"][0]
    cum = cumulative_wall(first["walls"])
    evals = first["evals"]
    steps = [e["step"] for e in evals]
    profiled = {w["first_step"] + k for w in first["profile"] for k in range(len(w["steps"]))}
    walls = np.asarray(first["walls"])
    outside = [w for k, w in enumerate(walls, 1) if k not in profiled]
    inside = [w for k, w in enumerate(walls, 1) if k in profiled]
    row = {
        "steps": run["steps"],
        "train_wall_s": float(cum[-1]),
        "median_step_s": float(np.median(outside or walls)),
        "median_profiled_step_s": float(np.median(inside)) if inside else None,
        "median_step_cpu_s": [float(np.median(p["cpus"])) for p in run["processes"]],
        "curriculum_host_s": max(p["curriculum_host_s"] for p in run["processes"]),
        "load": [run["load_before"], run["load_after"]],
        "quiet": run["quiet"],
        "final_loss_own": evals[-1]["loss_own"],
        "final_loss_top1": evals[-1]["loss_top1"],
        "concentrated_init": evals[0].get("concentrated"),
        "concentrated_final": evals[-1].get("concentrated"),
        "p1_concentrated_init": evals[0].get("p1_concentrated"),
        "p1_concentrated_final": evals[-1].get("p1_concentrated"),
        "waits": waits(run),
        "curve": [{**e, "wall_s": float(cum[e["step"]])} for e in evals],
    }
    # The load-robust clock: each step's CPU time on the busier process (work done, waiting
    # excluded), summed; what a quiet host's wall time would be without the waits.
    cpu = cumulative_wall(np.max([p["cpus"] for p in run["processes"]], axis=0))
    row["train_cpu_s"] = float(cpu[-1])
    for gate in GATES:
        losses = [e[f"loss_{gate}"] for e in evals]
        hit = reach(steps, losses, cum, targets[gate])
        row[f"wall_s_to_target_{gate}"] = None if hit is None else hit[1]
        row[f"steps_to_target_{gate}"] = None if hit is None else hit[0]
        hit_cpu = reach(steps, losses, cpu, targets[gate])
        row[f"cpu_s_to_target_{gate}"] = None if hit_cpu is None else hit_cpu[1]
        best = int(np.argmin(losses))
        row[f"best_loss_{gate}"] = losses[best]
        row[f"best_step_{gate}"] = steps[best]
    return row


def run_seed(seed: int, args, out: Path, log) -> dict:
    reference = launch(REFERENCE, seed, args.reference_steps, args, out, log)
    final = reference["processes"][0]["evals"][-1]
    targets = {gate: final[f"loss_{gate}"] for gate in GATES}
    log(f"   targets: own gate {targets['own']:.4f}, top-1 evaluation {targets['top1']:.4f}")
    arms = {REFERENCE: arm_result(reference, targets)}
    runs = {REFERENCE: reference}
    for arm in args.arms:
        if arm != REFERENCE:
            runs[arm] = launch(arm, seed, args.budget_steps, args, out, log)
            arms[arm] = arm_result(runs[arm], targets)
    for gate in GATES:
        for clock in ("wall", "cpu"):
            base = arms[REFERENCE][f"{clock}_s_to_target_{gate}"]
            for row in arms.values():
                mine = row[f"{clock}_s_to_target_{gate}"]
                ratio = mine / base if mine is not None and base else None
                row[f"{clock}_vs_top2_{gate}"] = ratio
    return {
        "targets": targets,
        "arms": arms,
        "curriculum": curriculum_analysis(seed, runs, args, out),
    }


def steps_record(out: Path, seed: int, arm: str) -> dict | None:
    path = out / f"seed{seed}" / arm / "steps.npz"
    if not path.exists():
        return None
    data = dict(np.load(path))
    data["step"] = np.arange(1, len(data["example_ids"]) + 1)
    data["top2_BM"] = data["routing_BM"]
    return data


def curriculum_analysis(seed: int, runs: dict, args, out: Path) -> dict:
    """Per adaptive arm: epoch-to-epoch correlation of the complexity vectors; the wait the
    busiest-group model predicts for the profiled steps beside the measured one; and for
    the arm without curriculum the predicted effect of each order on the critical rows."""
    result = {}
    spe = args.steps_per_epoch
    for arm in CURRICULUM_PAIR:
        record = steps_record(out, seed, arm)
        if record is None or arm not in runs:
            continue
        entry = {"epoch_correlations": stragglers.epoch_correlations(record, spe)}
        first = runs[arm]["processes"][0]
        measured = waits(runs[arm])
        rows_S = [
            stragglers.ep_step_rows(r.transpose(1, 0, 2), PROCESSES) for r in record["rows_MBE"]
        ]
        profiled = [w["first_step"] + k for w in first["profile"] for k in range(len(w["steps"]))]
        if measured and profiled:
            wait_rows_PS = np.stack([rows_S[s - 1]["wait_G"] for s in profiled], axis=1)
            entry["profiled_wait_rows"] = wait_rows_PS.mean(axis=1).tolist()
            entry["measured_wait_s"] = measured["wait_s"]
            # How well the rows explain the measured wait, step by step (both processes).
            x, y = wait_rows_PS.ravel(), np.asarray(measured["wait_PS"]).ravel()
            entry["wait_vs_rows_r"] = (
                float(np.corrcoef(x, y)[0, 1]) if x.std() and y.std() else None
            )
        entry["critical_rows_per_step"] = float(np.mean([r["critical"] for r in rows_S]))
        entry["balanced_rows_per_step"] = float(np.mean([r["balanced"] for r in rows_S]))
        if arm == CURRICULUM_PAIR[0]:
            epochs = (len(rows_S) - 1) // spe + 1
            entry["simulated_orders"] = {
                str(e): stragglers.simulate_ep_epoch(
                    record, e, spe, seed, args.batch_size, PROCESSES, args.shuffles
                )
                for e in range(1, epochs)
                if (e + 1) * spe <= len(rows_S)
            }
        result[arm] = entry
    return result


def seconds_per_row(args, out: Path) -> dict | None:
    """The cost of one more expert row (forward + backward, one core): stragglers'
    measure_curve on one pinned process at this model's shapes, its slope over the tokens."""
    path = out / "row_cost.json"
    if not path.exists():
        command = ["taskset", "-c", "0", sys.executable, "-m", "experiments.stragglers",
                   "--curve_only", str(path), "--per_device", str(args.batch_size // PROCESSES),
                   "--ffn", str(args.expert_ffn), "--rounds", str(args.rounds)]  # fmt: skip
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}  # fmt: skip
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode:
            print(f"row cost not measured: {done.stderr.strip()[-300:]}", file=sys.stderr)
            return None
    curve = json.loads(path.read_text())
    tokens = curve["shape"]["tokens"]
    return {
        **curve,
        "seconds_per_row": curve["fit"]["slope"] * curve["all_top2_seconds"] / tokens,
    }


def summarize(report: dict) -> dict:
    """{arm: {key: {mean, std, values, reached, seeds}}} over seeds."""
    seeds = list(report["seeds"].values())
    keys = [f"{w}_{g}" for g in GATES for w in ("wall_s_to_target", "wall_vs_top2",
            "cpu_s_to_target", "cpu_vs_top2", "steps_to_target", "best_loss")]  # fmt: skip
    keys += ["median_step_s", "final_loss_own", "final_loss_top1", "train_wall_s"]
    out = {}
    for arm in dict.fromkeys(a for s in seeds for a in s["arms"]):
        rows = [s["arms"][arm] for s in seeds if arm in s["arms"]]
        out[arm] = {}
        for key in keys:
            values = [r[key] for r in rows if r.get(key) is not None]
            out[arm][key] = {
                "mean": float(np.mean(values)) if values else None,
                "std": float(np.std(values, ddof=1)) if len(values) > 1 else None,
                "values": values,
                "reached": len(values),
                "seeds": len(rows),
            }
        waits_ = [r["waits"] for r in rows if r["waits"]]
        out[arm]["wait_s"] = (
            np.mean([w["wait_s"] for w in waits_], axis=0).tolist() if waits_ else None
        )
        out[arm]["collectives_s"] = (
            np.mean([w["collectives_s"] for w in waits_], axis=0).tolist() if waits_ else None
        )
        out[arm]["quiet"] = all(r["quiet"] for r in rows)
    return out


def _stat(stat, fmt="{:.1f}", suffix="") -> str:
    if stat["mean"] is None:
        return f"not reached (0/{stat['seeds']})"
    text = fmt.format(stat["mean"]) + suffix
    if stat["std"] is not None:
        text += f" ± {fmt.format(stat['std'])}"
    if stat["reached"] < stat["seeds"]:
        text += f" ({stat['reached']}/{stat['seeds']})"
    return text


def _pair(values) -> str:
    return "-" if values is None else ", ".join(f"{x:.3f}" for x in values)


def table(report: dict) -> str:
    header = ["arm", "wall s to top-2's loss (own gate)", "vs top-2", "wall s (top-1 eval)",
              "vs top-2", "busier process's CPU s vs top-2 (own / top-1 eval)",
              "best loss own / top-1", "median step s",
              "in collectives, s/step (p0, p1)", "wait, s/step (p0, p1)", "host",
              "paper: time vs top-2 (Table 3)"]  # fmt: skip
    rows = []
    for arm, s in report["summary"].items():
        rows.append([
            arm, _stat(s["wall_s_to_target_own"]), _stat(s["wall_vs_top2_own"], "{:.2f}", "x"),
            _stat(s["wall_s_to_target_top1"]), _stat(s["wall_vs_top2_top1"], "{:.2f}", "x"),
            _stat(s["cpu_vs_top2_own"], "{:.2f}", "x") + " / "
            + _stat(s["cpu_vs_top2_top1"], "{:.2f}", "x"),
            f"{s['best_loss_own']['mean']:.3f} / {s['best_loss_top1']['mean']:.3f}",
            _stat(s["median_step_s"], "{:.3f}"), _pair(s["collectives_s"]), _pair(s["wait_s"]),
            "quiet" if s["quiet"] else "NOT QUIET", PAPER_TIME.get(arm, "-"),
        ])  # fmt: skip
    targets = [s["targets"] for s in report["seeds"].values()]
    note = ("Targets (top-2's final eval loss, own gate / top-1 evaluation) per seed: "
            + "; ".join(f"{t['own']:.4f} / {t['top1']:.4f}" for t in targets))  # fmt: skip
    return markdown_table(header, rows) + "\n\n" + note


def curriculum_table(report: dict) -> str:
    per_row = (report.get("row_cost") or {}).get("seconds_per_row")
    rows = []
    for seed, s in report["seeds"].items():
        cur = s["curriculum"]
        for arm in CURRICULUM_PAIR:
            if arm not in cur or arm not in s["arms"]:
                continue
            a, c = s["arms"][arm], cur[arm]
            corr = ", ".join(f"{x['within_layer_r']:.2f}" for x in c["epoch_correlations"])
            wait_rows = c.get("profiled_wait_rows") and sum(c["profiled_wait_rows"])
            predicted = wait_rows * per_row if wait_rows and per_row else None
            rows.append([
                seed, arm, a["wall_s_to_target_own"], a["median_step_s"],
                None if not a["waits"] else a["waits"]["wait_per_step_s"], wait_rows, predicted,
                c.get("wait_vs_rows_r"), c["critical_rows_per_step"], c["balanced_rows_per_step"],
                corr,
            ])  # fmt: skip
    header = ["seed", "arm", "wall s to top-2's loss", "median step s",
              "measured wait s/step (both)", "predicted wait rows/step (both)",
              "predicted wait s/step", "r(wait, rows)", "busiest-group rows/step",
              "balanced rows/step", "epoch-to-epoch r, within layers"]  # fmt: skip
    sims = []
    for seed, s in report["seeds"].items():
        for epoch, sim in (
            s["curriculum"].get(CURRICULUM_PAIR[0], {}).get("simulated_orders", {}).items()
        ):
            none, paper = sim["none"]["critical_rows"], sim["paper"]["critical_rows"]
            sims.append([seed, epoch, none, paper, sim["magnitude"]["critical_rows"],
                         sim["none"]["balanced_rows"], f"{none / paper - 1:+.2%}"])  # fmt: skip
    sim_header = ["seed", "epoch", "busiest-group rows/step, shuffled", "paper order",
                  "magnitude order", "balanced", "shuffled vs paper"]  # fmt: skip
    return markdown_table(header, rows) + "\n\n" + markdown_table(sim_header, sims)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="", help="directory for the runs and the JSON")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--layers", type=int, default=6, help="decoder layers, every one MoE")
    p.add_argument("--reference_steps", type=int, default=None, help="top-2's: default 314")
    p.add_argument("--budget_steps", type=int, default=None, help="the others': default 628")
    p.add_argument("--eval_every", type=int, default=None, help="default 20")
    p.add_argument("--eval_batches", type=int, default=3, help="validation batches (0: all)")
    p.add_argument("--warmup_steps", type=int, default=20)
    p.add_argument("--profile_steps", type=int, default=8, help="per profiled window; 0: none")
    p.add_argument("--shuffles", type=int, default=10, help="draws of the shuffled order")
    p.add_argument("--rounds", type=int, default=15, help="timing rounds of the row cost")
    p.add_argument(
        "--settle_s",
        type=float,
        default=120,
        help="longest wait before a run for the load average to settle",
    )
    p.add_argument("--resume", action="store_true", help="reuse finished runs under --out")
    p.add_argument("--quick", action="store_true", help="2 layers, few steps: a smoke test")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--report", default="", help="train nothing: re-render this JSON's tables")
    add_json_flag(p)
    args = p.parse_args(argv)
    if not args.report and not args.out:
        p.error("--out is required (or --report)")
    quick = args.quick
    args.layers = 2 if quick else args.layers
    args.reference_steps = args.reference_steps or (12 if quick else 314)
    args.budget_steps = args.budget_steps or (16 if quick else 628)
    args.eval_every = args.eval_every or (4 if quick else 20)
    args.arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(args.arms) - set(ARMS))
    if unknown:
        p.error(f"--arms: unknown {unknown}; choose from {list(ARMS)}")
    args.seeds = [int(x) for x in args.seeds.split(",") if x]
    # The model's fixed sizes (time_to_target.MODEL): batch 16 of the embedded corpus.
    args.batch_size, args.expert_ffn, args.steps_per_epoch = 16, 256, 157
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.report:
        report = json.loads(Path(args.report).read_text())
        print(table(report), "", curriculum_table(report), sep="\n", flush=True)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(message):
        print(message, flush=True)

    started = time.time()
    report = {"settings": {}, "seeds": {}}
    for seed in args.seeds:
        report["seeds"][str(seed)] = run_seed(seed, args, out, log)
        report["row_cost"] = seconds_per_row(args, out)
        first = next(iter(report["seeds"][str(seed)]["arms"].values()))
        report["settings"] = {
            "processes": PROCESSES,
            "devices": "1 CPU device per process, each pinned to its own core (taskset)",
            "layers": args.layers,
            "reference_steps": args.reference_steps,
            "budget_steps": args.budget_steps,
            "eval_every": args.eval_every,
            "eval_batches": args.eval_batches,
            "warmup_steps": args.warmup_steps,
            "schedule": "constant after linear warmup",
            "profile_steps": args.profile_steps,
            "quick": args.quick,
            "overrides": args.set,
            "cpu_count": os.cpu_count(),
            "wall_s": time.time() - started,
            "steps_per_epoch": args.steps_per_epoch,
            "reference_load": first["load"],
        }
        report["summary"] = summarize(report)
        report["quiet"] = all(a["quiet"] for a in report["summary"].values())
        (out / "ep_time_to_quality.json").write_text(json.dumps(report, indent=1))
    print(table(report), "", curriculum_table(report), sep="\n", flush=True)
    write_json("ep_time_to_quality", report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
