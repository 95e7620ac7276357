"""Stragglers and the curriculum: synchronous data-parallel steps simulated on measured numbers.

In a synchronous data-parallel step every device waits for the slowest, the one whose shard
sent the most tokens to two experts; the paper's curriculum (Li et al. 2023) orders the data
so that a step's shards route alike (their Table 6: 9-22% more training time without it).
One CPU device cannot show that, so it is simulated from three measured inputs:

1. each training example's per-layer top-2 fractions as an adaptive model trained them
   (experiments.time_to_target's routing.npz: epoch 0 orders epoch 1 under the curriculum,
   epoch 1's own fractions time it);
2. the time of one MoE layer (forward + backward, the real dropless dispatch) on one
   device's shard against that shard's top-2 share, measured here (benchmarks.moe_layer's
   forced routing) and fitted by a line; the paper's Table 1 curve is the second reading;
3. the loader's order: the seeded shuffle (`none`), the paper's cosine order (`paper`) and
   jaxmoe's `magnitude` order (jaxmoe.data.curriculum.epoch_order), cut into global
   batches of devices x per-device examples, each cut into contiguous shards.

Model: device time = sum over MoE layers of time(shard's top-2 share in that layer); step
time = the slowest device's. Left out: communication (all-reduce, expert all-to-all), expert
parallelism (experts on other devices), the attention and embedding time (the same on every
device, so it adds to both orders alike and shrinks the relative effect), and any effect of
the order on convergence (the time to target assumes the same tokens to target either way).

    python -m experiments stragglers --routing runs/ttt/routing.npz --json
    python -m experiments stragglers --routing runs/ttt/routing.npz --curve none   # no timing
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from benchmarks.results import add_json_flag, markdown_table, publish

DEVICES = (8, 64, 256)
ORDERS = ("none", "paper", "magnitude")
# Li et al. 2023, Table 1: MoE-layer time (normalised to top-2) at top-2 shares 0, .2, .5, .8.
PAPER_CURVE = {"top2_share": [0.0, 0.2, 0.5, 0.8, 1.0], "time": [0.67, 0.76, 0.92, 0.97, 1.0]}
SHARES = tuple(np.round(np.linspace(0.0, 1.0, 6), 2))


def linear_time(intercept: float, slope: float):
    """time(share) = intercept + slope * share (vectorised)."""
    return lambda share: intercept + slope * np.asarray(share, dtype=np.float64)


def table_time(shares, times):
    """Piecewise-linear time(share) through measured points."""
    return lambda share: np.interp(np.asarray(share, dtype=np.float64), shares, times)


def fit_line(shares, times) -> tuple[float, float]:
    """Least-squares (intercept, slope) of times against shares."""
    slope, intercept = np.polyfit(np.asarray(shares, float), np.asarray(times, float), 1)
    return float(intercept), float(slope)


def shard_shares(top2_NM, tokens_N, ids_PB) -> np.ndarray:
    """Top-2 share of each device's shard in each layer, float [P, M]: the token-weighted
    mean of its examples' fractions."""
    weights_PB = tokens_N[ids_PB].astype(np.float64)
    fractions_PBM = top2_NM[ids_PB].astype(np.float64)
    return np.einsum("pb,pbm->pm", weights_PB, fractions_PBM) / weights_PB.sum(1)[:, None]


def simulate_steps(order, top2_NM, tokens_N, devices: int, per_device: int, layer_time) -> dict:
    """Step times of `order` (example ids) cut into steps of devices x per_device examples
    (the last incomplete step dropped, as the loader does): {slowest, mean device} [steps]."""
    global_batch = devices * per_device
    steps = len(order) // global_batch
    if steps == 0:
        raise ValueError(
            f"{len(order)} examples make no step of {devices} devices x {per_device} examples"
        )
    ids_SPB = np.asarray(order[: steps * global_batch]).reshape(steps, devices, per_device)
    device_SP = np.stack(
        [layer_time(shard_shares(top2_NM, tokens_N, ids_PB)).sum(-1) for ids_PB in ids_SPB]
    )
    return {"step": device_SP.max(1), "mean_device": device_SP.mean(1)}


def epoch_vectors(record: dict, epoch: int, num_examples: int, steps_per_epoch: int):
    """(top2_NM, seen_N) of one epoch of a recorded run (an example's last record wins)."""
    steps = record["step"]
    in_epoch = (steps - 1) // steps_per_epoch == epoch
    layers = record["top2_BM"].shape[-1]
    top2_NM = np.zeros((num_examples, layers), np.float32)
    seen_N = np.zeros(num_examples, bool)
    ids = record["example_ids"][in_epoch].reshape(-1)
    top2_NM[ids] = record["top2_BM"][in_epoch].reshape(-1, layers)
    seen_N[ids] = True
    return top2_NM, seen_N


# Expert parallelism (experiments/ep_time_to_quality.py measures it on real processes): each
# device holds a contiguous group of E / G experts and computes them on every row the whole
# batch routed there, so a layer's compute waits for the busiest group, not for the device
# whose own tokens took two experts most often (the data-parallel model above).


def group_rows(rows_BME: np.ndarray, groups: int) -> np.ndarray:
    """Rows [B, M, E] kept per example, MoE layer and expert -> [M, G]: the rows each expert
    group (device) receives from the whole batch in each layer."""
    batch, layers, experts = rows_BME.shape
    if experts % groups:
        raise ValueError(f"{experts} experts do not split into {groups} equal groups")
    return rows_BME.reshape(batch, layers, groups, experts // groups).sum(axis=(0, 3))


def ep_step_rows(rows_BME: np.ndarray, groups: int) -> dict:
    """One step's rows: the busiest group's summed over layers (what the step waits for),
    the mean group's (perfect balance), and each group's wait in rows [G]: per layer the
    busiest group's rows minus its own, summed over layers."""
    rows_MG = group_rows(rows_BME, groups).astype(np.float64)
    busiest_M = rows_MG.max(axis=1)
    return {
        "critical": float(busiest_M.sum()),
        "balanced": float(rows_MG.mean(axis=1).sum()),
        "wait_G": (busiest_M[:, None] - rows_MG).sum(axis=0),
    }


def epoch_rows(record: dict, epoch: int, num_examples: int, steps_per_epoch: int):
    """(rows_NME, seen_N): each example's rows per layer and expert in one epoch of a
    recorded run (ep_worker's steps.npz: rows_MBE per step), its last record winning."""
    steps = record["step"]
    in_epoch = (steps - 1) // steps_per_epoch == epoch
    rows_SMBE = record["rows_MBE"][in_epoch]
    s, layers, batch, experts = rows_SMBE.shape
    rows_NME = np.zeros((num_examples, layers, experts), np.float32)
    seen_N = np.zeros(num_examples, bool)
    ids = record["example_ids"][in_epoch].reshape(-1)
    rows_NME[ids] = rows_SMBE.transpose(0, 2, 1, 3).reshape(s * batch, layers, experts)
    seen_N[ids] = True
    return rows_NME, seen_N


def simulate_ep_epoch(record, epoch, steps_per_epoch, seed, batch, groups, shuffles) -> dict:
    """Epoch `epoch` of a recorded expert-parallel run re-cut in each order: the loader's
    shuffle (`shuffles` draws), and the paper's and magnitude curricula ordered by epoch
    - 1's complexity vectors, each example routed as it was in `epoch`. Per order: mean over
    steps of the critical rows (busiest group, summed over layers), the balanced rows, and
    the mean group's wait in rows."""
    from jaxmoe.data.curriculum import epoch_order
    from jaxmoe.data.pipeline import default_epoch_order

    num_examples = int(record["example_ids"].max()) + 1
    before_NM, seen_before = epoch_vectors(record, epoch - 1, num_examples, steps_per_epoch)
    rows_NME, seen_now = epoch_rows(record, epoch, num_examples, steps_per_epoch)
    keep = np.flatnonzero(seen_before & seen_now)
    before_NM, rows_NME = before_NM[keep], rows_NME[keep]
    orders = {
        "none": [
            default_epoch_order(epoch + k, num_examples=len(keep), seed=seed, shuffle=True)
            for k in range(shuffles)
        ],
        **{
            policy: [
                epoch_order(policy, before_NM, np.ones(len(keep), bool), epoch=epoch, seed=seed,
                            batch_size=batch)
            ]
            for policy in ORDERS[1:]
        },
    }  # fmt: skip
    out = {"examples": len(keep)}
    for policy, draws in orders.items():
        steps = [
            ep_step_rows(rows_NME[order[start : start + batch]], groups)
            for order in draws
            for start in range(0, len(order) - batch + 1, batch)
        ]
        out[policy] = {
            "critical_rows": float(np.mean([s["critical"] for s in steps])),
            "balanced_rows": float(np.mean([s["balanced"] for s in steps])),
            "wait_rows": float(np.mean([s["wait_G"].mean() for s in steps])),
            "steps": len(steps) // len(draws),
        }
    return out


def epoch_correlations(record: dict, steps_per_epoch: int) -> list[dict]:
    """Between consecutive epochs of a recorded run, Pearson correlations of the examples'
    complexity vectors (every layer's top-2 fraction): all entries together (layers whose
    mean fractions differ raise it), within each layer (mean over layers), and of the
    examples' means over layers."""
    num_examples = int(record["example_ids"].max()) + 1
    epochs = (int(record["step"].max()) - 1) // steps_per_epoch + 1
    out = []
    for epoch in range(1, epochs):
        before, seen_before = epoch_vectors(record, epoch - 1, num_examples, steps_per_epoch)
        now, seen_now = epoch_vectors(record, epoch, num_examples, steps_per_epoch)
        both = seen_before & seen_now
        if both.sum() < 3:
            continue
        out.append({
            "epochs": [epoch - 1, epoch],
            "examples": int(both.sum()),
            "vectors_r": float(np.corrcoef(before[both].ravel(), now[both].ravel())[0, 1]),
            "within_layer_r": float(np.mean([
                np.corrcoef(before[both][:, m], now[both][:, m])[0, 1]
                for m in range(before.shape[1])
            ])),
            "means_r": float(np.corrcoef(before[both].mean(1), now[both].mean(1))[0, 1]),
        })  # fmt: skip
    return out


def simulate_seed(record, seed, steps_per_epoch, devices, per_device, curves, shuffles) -> dict:
    """{curve: {devices: {order: mean step time}}} for one seed's epoch 1."""
    from jaxmoe.data.curriculum import epoch_order
    from jaxmoe.data.pipeline import default_epoch_order

    num_examples = int(record["example_ids"].max()) + 1
    before_NM, seen_before = epoch_vectors(record, 0, num_examples, steps_per_epoch)
    during_NM, seen_during = epoch_vectors(record, 1, num_examples, steps_per_epoch)
    keep = np.flatnonzero(seen_before & seen_during)  # timed on what epoch 1 measured
    before_NM, during_NM = before_NM[keep], during_NM[keep]
    tokens_N = np.ones(len(keep))  # full-length windows: every example has L tokens
    out = {}
    for name, layer_time in curves.items():
        out[name] = {}
        for p in devices:
            batch = p * per_device
            orders = {
                # The shuffle is random: averaged over several of its draws.
                "none": [
                    default_epoch_order(e, num_examples=len(keep), seed=seed, shuffle=True)
                    for e in range(1, 1 + shuffles)
                ],
                **{
                    policy: [
                        epoch_order(
                            policy,
                            before_NM,
                            np.ones(len(keep), bool),
                            epoch=1,
                            seed=seed,
                            batch_size=batch,
                        )
                    ]
                    for policy in ORDERS[1:]
                },
            }
            row = {}
            for policy, draws in orders.items():
                sims = [
                    simulate_steps(o, during_NM, tokens_N, p, per_device, layer_time) for o in draws
                ]
                row[policy] = {
                    "step": float(np.mean([s["step"].mean() for s in sims])),
                    "mean_device": float(np.mean([s["mean_device"].mean() for s in sims])),
                    "steps": len(sims[0]["step"]),
                }
            out[name][p] = row
    out["examples"] = len(keep)
    out["mean_top2_share"] = float(during_NM.mean())
    corr = np.corrcoef(before_NM.mean(1), during_NM.mean(1))[0, 1]
    out["epoch0_vs_epoch1_correlation"] = float(corr)
    return out


def measure_curve(per_device: int, length: int, d_model, ffn, experts, block, rounds) -> dict:
    """MoE-layer CPU time (fwd + bwd) of one shard against its top-2 share, paired with the
    all-two-experts layer as in benchmarks.moe_layer; and the fitted line."""
    import time

    import jax

    from benchmarks.moe_layer import LayerShape, forced_inputs, make_layer, model_config

    shape = LayerShape(per_device, length, d_model, ffn, experts)
    step, params = make_layer(model_config("adaptive", "auto", 0.0, block, shape), shape)
    inputs = {s: forced_inputs(1.0 - s, shape=shape) for s in SHARES}
    for x in inputs.values():
        jax.block_until_ready(step(params, x))

    def timed(x):
        # CPU time of the process, not wall time: on an oversubscribed host the wall clock
        # measures the queue for a core, the CPU time the layer's work.
        start = time.process_time()
        jax.block_until_ready(step(params, x))
        return time.process_time() - start

    full = inputs[1.0]
    ratios = {s: [] for s in SHARES}
    seconds = {s: [] for s in SHARES}
    for _ in range(rounds):
        before = timed(full)
        for s in SHARES:
            elapsed, after = timed(inputs[s]), timed(full)
            ratios[s].append(elapsed / (0.5 * (before + after)))
            seconds[s].append(elapsed)
            before = after
    ratio = [float(np.median(ratios[s])) for s in SHARES]
    top2_s = float(np.median(seconds[1.0]))
    intercept, slope = fit_line(SHARES, ratio)
    return {
        "shape": {
            "tokens": per_device * length,
            "d_model": d_model,
            "ffn": ffn,
            "experts": experts,
            "block_size": block,
        },
        "top2_share": list(SHARES),
        "time_vs_all_top2": ratio,
        "all_top2_seconds": top2_s,
        "clock": "process CPU time",
        "fit": {"intercept": intercept, "slope": slope},
        "rounds": rounds,
        "backend": jax.default_backend(),
    }


def summarize(per_seed: dict, curves) -> dict:
    """Mean over seeds of each order's step time, and `none` over `paper` / `magnitude`."""
    out = {}
    for name in curves:
        out[name] = {}
        for p in next(iter(per_seed.values()))[name]:
            row = {}
            for policy in ORDERS:
                vals = [s[name][p][policy]["step"] for s in per_seed.values()]
                row[policy] = float(np.mean(vals))
            mean_dev = [s[name][p]["none"]["mean_device"] for s in per_seed.values()]
            row["balanced"] = float(np.mean(mean_dev))  # every device at the mean share
            row["none_vs_paper"] = row["none"] / row["paper"] - 1
            row["none_vs_magnitude"] = row["none"] / row["magnitude"] - 1
            row["steps"] = next(iter(per_seed.values()))[name][p]["none"]["steps"]
            out[name][p] = row
    return out


def table(result: dict) -> str:
    header = ["time curve", "devices", "steps/epoch", "shuffled", "paper order", "magnitude",
              "no straggler", "no curriculum vs paper", "vs magnitude"]  # fmt: skip
    rows = []
    for name, by_p in result["summary"].items():
        for p, r in by_p.items():
            cells = [f"{r[k]:.3f}" for k in ("none", "paper", "magnitude", "balanced")]
            cells += [f"{r['none_vs_paper']:+.1%}", f"{r['none_vs_magnitude']:+.1%}"]
            rows.append([name, p, r["steps"], *cells])
    note = (
        "Step time: the slowest device's summed MoE-layer time, in units of one all-top-2 "
        "layer; mean over seeds (shuffled: also over draws)."
    )
    return markdown_table(header, rows) + "\n\n" + note


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--routing",
        default="",
        help="routing.npz of experiments.time_to_target (comma-separated: several runs)",
    )
    p.add_argument(
        "--curve_only",
        default="",
        metavar="PATH",
        help="only measure the MoE-layer curve (--per_device, --ffn) into PATH",
    )
    p.add_argument("--ffn", type=int, default=256, help="expert width of the measured layer")
    p.add_argument("--variant", default="adaptive_T0.1", help="whose routing to simulate")
    p.add_argument("--devices", default=",".join(map(str, DEVICES)))
    p.add_argument("--per_device", type=int, default=2, help="examples per device and step")
    p.add_argument("--shuffles", type=int, default=20, help="draws of the shuffled order")
    p.add_argument("--curve", choices=["measure", "none"], default="measure",
                   help="measure the MoE-layer curve here, or use only the paper's")  # fmt: skip
    p.add_argument("--rounds", type=int, default=15, help="timing rounds of the curve")
    p.add_argument(
        "--curve_json",
        default="",
        help="take the measured curve from this JSON (an earlier run's, or measure_curve's)",
    )
    p.add_argument("--ttt", default="", help="time_to_target.json: steps to target")
    add_json_flag(p)
    args = p.parse_args(argv)
    if args.curve_only:
        curve = measure_curve(args.per_device, 64, 64, args.ffn, 8, 32, args.rounds)
        Path(args.curve_only).write_text(json.dumps(curve, indent=1))
        return 0
    if not args.routing:
        p.error("--routing is required (or --curve_only)")
    devices = [int(x) for x in args.devices.split(",") if x]
    routing = {}  # keys are seed-prefixed: single-seed runs' files merge without clashes
    for path in args.routing.split(","):
        routing |= dict(np.load(path))
    seeds = sorted({k.split("/")[0] for k in routing if k.endswith(f"/{args.variant}/step")})
    if not seeds:
        raise SystemExit(f"--routing {args.routing}: no records of --variant {args.variant}")
    length = int(routing.get("seq_len", 64))
    curves = {"paper Table 1": table_time(PAPER_CURVE["top2_share"], PAPER_CURVE["time"])}
    measured = None
    if args.curve_json:
        loaded = json.loads(Path(args.curve_json).read_text())
        measured = loaded.get("measured_curve", loaded)
        curves["measured here (fit)"] = linear_time(**measured["fit"])
    elif args.curve == "measure":
        measured = measure_curve(args.per_device, length, 64, 256, 8, 32, args.rounds)
        curves["measured here (fit)"] = linear_time(**measured["fit"])
    per_seed = {}
    for seed_key in seeds:
        rec = {
            k.split("/")[-1]: v
            for k, v in routing.items()
            if k.startswith(f"{seed_key}/{args.variant}/")
        }
        spe = int(routing[f"{seed_key}/steps_per_epoch"])
        seed = int(seed_key.removeprefix("seed"))
        per_seed[seed_key] = simulate_seed(
            rec, seed, spe, devices, args.per_device, curves, args.shuffles
        )
    result = {
        "variant": args.variant,
        "per_device_examples": args.per_device,
        "seq_len": length,
        "paper_curve": PAPER_CURVE,
        "measured_curve": measured,
        "per_seed": per_seed,
        "summary": summarize(per_seed, curves),
    }
    if args.ttt:
        result["time_to_target"] = time_to_target(json.loads(Path(args.ttt).read_text()), result)
    publish("stragglers", result, table(result), args.json)
    return 0


def time_to_target(ttt: dict, result: dict) -> dict:
    """Simulated MoE seconds to the target: tokens to target (the trained run's, assumed the
    same at every batch size and order) / tokens per step x simulated step time."""
    summary = ttt["summary"][result["variant"]]["steps_to_target_own"]
    if summary["mean"] is None:
        return {"reached": False}
    batch, length = (int(x) for x in ttt["settings"]["batch"].split(" tokens")[0].split(" x "))
    tokens = summary["mean"] * batch * length
    measured = result["measured_curve"]
    out = {"tokens_to_target": tokens, "unit": "all-top-2 layer times (fwd + bwd)"}
    for name, by_p in result["summary"].items():
        out[name] = {}
        for p, r in by_p.items():
            steps = tokens / (p * result["per_device_examples"] * length)
            row = {order: steps * r[order] for order in (*ORDERS, "balanced")}
            if measured and name.startswith("measured"):
                unit = measured["all_top2_seconds"]
                row |= {f"{order}_s": row[order] * unit for order in (*ORDERS, "balanced")}
            out[name][p] = row
    return out


if __name__ == "__main__":
    sys.exit(main())
