"""`jaxmoe lm-eval` on 1 process against 2 (launch/local.sh): whole-command and per-request time.

Builds a small random dense decoder (jaxmoe's 512-piece tokenizer) and three lm-eval custom
tasks written into --workdir (loglikelihood, loglikelihood_rolling and generate_until; nothing
downloaded), then runs the same `jaxmoe lm-eval` command under `launch/local.sh N
--devices_per_process 4` for each N in --processes, interleaved (1, 2, 2, 1, 1, 2, ...) for
--repeats rounds, so a change in the host's load falls on both alike.

Each run reports the whole command's wall time, and from the `jaxmoe-lm-eval-timing` lines the
backend prints per process and phase (lm_eval_backend.JaxmoeLM._phase): start-up (launch to
the model's load starting: Python, jax, lm-eval and the distributed join), the model load,
each request kind's time and the part of it spent compiling (jax.monitoring's trace, lowering
and compile events), and the gathers. The per-request time is the request loops' wall time
without compiling: for each request kind the slowest process's (seconds - compile seconds),
since the others wait for it at the gather, summed and divided by every process's requests.
Each run's lm-eval results are compared with the first 1-process run's (equal metrics).
`uptime`'s 1-minute load is read before each run (the host is shared).

    python -m benchmarks lm_eval_processes --repeats 3 --json
    python -m benchmarks lm_eval_processes --repeats 1 --unpinned  # + 2, JAXMOE_LOCAL_PIN=0
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.results import add_json_flag, markdown_table, publish
from jaxmoe.inference.across_processes import TIMING_TAG

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("bench_mc", "bench_text", "bench_gen")
TEXT = (
    "the river runs to the sea and a small boat waits by the old stone bridge while rain "
    "falls on green hills where sheep walk slowly under grey clouds near the village"
)
MODEL = (
    "model.moe.num_experts=0",
    "model.vocab_size=512",
    "model.num_layers=2",
    "model.d_model=128",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.head_dim=32",
    "model.ffn_dim=512",
    "train.seq_len=64",
    "data.vocab_size=512",
)
# Per task: its output type, prompt fields and metric (the rest in task_config).
TASKS = {
    "bench_mc": {
        "output_type": "multiple_choice",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    },
    "bench_text": {
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "metric_list": [
            {"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False}
        ],
    },
    "bench_gen": {
        "output_type": "generate_until",
        "doc_to_text": "Q: {{question}}\nA:",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    },
}


def task_config(name: str, folder: Path, gen_tokens: int) -> dict:
    """lm-eval's task config for `name`, its data in folder/NAME.jsonl."""
    config = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(folder / f"{name}.jsonl")}},
        "test_split": "test",
        **TASKS[name],
    }
    if name == "bench_gen":
        config["generation_kwargs"] = {
            "until": ["\n"], "max_gen_toks": gen_tokens, "do_sample": False
        }  # fmt: skip
    return config


# The summary's columns (medians over a setting's runs), in the order time passes.
PHASES = {
    "wall_s": "wall s",
    "spawn_s": "spawn s",
    "imports_s": "imports s",
    "join_s": "join s",
    "setup_s": "lm-eval set-up s",
    "model_load_s": "model load s",
    "tasks_s": "tasks s",
    "compile_s": "request compile s",
    "loop_without_compile_s": "request loop s (no compile)",
    "gather_s": "gather s",
    "tail_s": "metrics+exit s",
    "per_request_ms": "ms/request (no compile)",
    "load_1min": "load (1 min)",
}


def sentence(rng, low: int, high: int) -> str:
    """low to high - 1 words drawn from TEXT's."""
    return " ".join(rng.choice(TEXT.split(), int(rng.integers(low, high))))


def write_tasks(folder: Path, docs: int, gen_tokens: int) -> None:
    """The three task files and their data: `docs` multiple-choice questions (4 choices),
    docs / 2 texts and docs / 2 generation prompts, of varied lengths (seeded)."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    rows = {
        "bench_mc": [
            {
                "question": sentence(rng, 3, 20),
                "choices": [sentence(rng, 1, 6) for _ in range(4)],
                "answer": int(rng.integers(4)),
            }
            for _ in range(docs)
        ],
        "bench_text": [{"text": sentence(rng, 10, 120)} for _ in range(docs // 2)],
        "bench_gen": [
            {"question": sentence(rng, 3, 20), "answer": sentence(rng, 1, 3)}
            for _ in range(docs // 2)
        ],
    }
    for name in NAMES:
        lines = "".join(json.dumps(row) + "\n" for row in rows[name])
        (folder / f"{name}.jsonl").write_text(lines)
        # JSON is YAML: lm-eval reads the config as written.
        config = task_config(name, folder, gen_tokens)
        (folder / f"{name}.yaml").write_text(json.dumps(config, indent=1))


def write_checkpoint(folder: Path) -> Path:
    """A random dense decoder with peaked predictions and jaxmoe's 512-piece tokenizer
    (trained on the embedded corpus into folder/cache)."""
    import jax

    from jaxmoe.checkpoints.manager import save_params
    from jaxmoe.config.loading import load_config
    from jaxmoe.conversions.hf.importer import abstract_params
    from jaxmoe.data.sources import load_tokenizer

    cache = folder / "cache"
    config = load_config(str(ROOT / "configs" / "default.py"), [*MODEL, f"data.cache_dir={cache}"])
    tokenizer = load_tokenizer(config.data).path
    config = load_config(
        str(ROOT / "configs" / "default.py"), [*MODEL, f"data.tokenizer={tokenizer}"]
    )
    rng = np.random.default_rng(5)
    params = jax.tree.map(
        lambda a: (a.ndim == 1) + rng.standard_normal(a.shape, np.float32) / a.shape[0] ** 0.5,
        abstract_params(config.model),
    )
    save_params(str(folder / "ckpt"), params, config)
    return folder / "ckpt"


def load_1min() -> float:
    return os.getloadavg()[0]


def run_once(processes: int, checkpoint: Path, tasks: Path, out: Path, args, pin: bool) -> dict:
    """One `jaxmoe lm-eval` under launch/local.sh: wall time and every timing record."""
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PYTHONPATH": str(ROOT),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "JAXMOE_LOCAL_PIN": "1" if pin else "0",
    }
    command = [
        "bash", "launch/local.sh", str(processes), "--devices_per_process", "4", "--",
        "lm-eval", "--model_args", f"checkpoint={checkpoint},mesh=data:4",
        "--tasks", ",".join(NAMES), "--include_path", str(tasks),
        "--batch_size", str(args.batch_size), "--output_path", str(out),
    ]  # fmt: skip
    load = load_1min()
    launched = time.time()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.time() - launched
    if done.returncode != 0:
        sys.exit(f"lm_eval_processes: {processes} processes failed:\n{done.stdout[-3000:]}")
    (out / "stdout.txt").write_text(done.stdout)
    records = []
    for line in done.stdout.splitlines():
        _, tag, payload = line.partition(f"{TIMING_TAG} ")
        if tag:  # stderr can follow on the same line (local.sh merges the two)
            records.append(json.JSONDecoder().raw_decode(payload)[0])
    (results_file,) = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]
    return {"launched": launched, "wall_s": wall, "load_1min": load, "records": records,
            "results": results}  # fmt: skip


def median(values):
    """The median, ignoring None (a phase a platform could not time)."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def summarise(run: dict) -> dict:
    """Where one run's time went: launch to each process's start, imports (to the distributed
    join), the join, lm-eval's set-up and the model load, building the tasks' requests, each
    request kind (compile apart), the gathers and the rest (metrics, writing, exit); each
    phase as its slowest process's, since the processes meet after it."""
    records = run["records"]

    def of(phase):
        return [r for r in records if r["phase"] == phase]

    def end(r):
        return r["start"] + r["seconds"]

    joins, loads = of("join"), of("load")
    kinds = sorted({r["phase"] for r in records} - {"join", "load", "gather"})
    firsts = {}
    for r in records:
        if r["phase"] in kinds:
            firsts[r["process"]] = min(firsts.get(r["process"], end(r)), r["start"])
    steady = compile_s = requests = 0.0
    per_kind = {}
    for kind in kinds:
        mine = of(kind)
        per_kind[kind] = {
            "requests": [r["requests"] for r in mine],
            "tokens": [r["tokens"] for r in mine],
            "seconds": [round(r["seconds"], 3) for r in mine],
            "compile_seconds": [round(r["compile_seconds"], 3) for r in mine],
        }
        steady += max(r["seconds"] - r["compile_seconds"] for r in mine)
        compile_s += max(r["compile_seconds"] for r in mine)
        requests += sum(r["requests"] for r in mine)
    gathered = {}
    for r in of("gather"):
        gathered[r["process"]] = gathered.get(r["process"], 0.0) + r["seconds"]
    started = [r["process_started"] for r in joins if r.get("process_started")]
    load_end = {r["process"]: end(r) for r in loads}
    join_end = {r["process"]: end(r) for r in joins}
    return {
        "spawn_s": min(started) - run["launched"] if started else None,
        "imports_s": max(r["start"] - r["process_started"] for r in joins) if started else None,
        "join_s": max(r["seconds"] for r in joins),
        "setup_s": max(r["start"] - join_end[r["process"]] for r in loads),
        "model_load_s": max(r["seconds"] for r in loads),
        "model_compile_s": max(r["compile_seconds"] for r in loads),
        "tasks_s": max(firsts[p] - load_end[p] for p in firsts),
        "compile_s": compile_s,
        "loop_without_compile_s": steady,
        "gather_s": max(gathered.values(), default=0.0),
        "tail_s": run["launched"] + run["wall_s"] - max(map(end, records)),
        "requests": int(requests),
        "per_request_ms": 1e3 * steady / max(requests, 1),
        "kinds": per_kind,
        "records": records,
    }


def same_results(got: dict, want: dict) -> bool:
    """Every metric of every task equal, up to float32 rounding in the scores."""
    for task, metrics in want.items():
        for key, value in metrics.items():
            other = got.get(task, {}).get(key)
            if isinstance(value, float) and isinstance(other, float):
                if abs(other - value) > 1e-6 * abs(value) + 1e-9:
                    return False
            elif other != value and not key.endswith("stderr,none"):
                return False
    return True


def schedule(settings: list[str], repeats: int) -> list[str]:
    """Interleaved: the order reversed every other round (1, 2, 2, 1, ...)."""
    order = []
    for round_ in range(repeats):
        order += settings if round_ % 2 == 0 else settings[::-1]
    return order


def main(argv=None) -> dict:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the checkpoint is written on the CPU
    parser = argparse.ArgumentParser(prog="python -m benchmarks lm_eval_processes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--docs", type=int, default=256, help="multiple-choice documents")
    parser.add_argument("--gen_tokens", type=int, default=16, help="max_gen_toks")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--unpinned", action="store_true", help="also 2 processes unpinned")
    parser.add_argument("--workdir", default=None, help="default: a temporary folder")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="lm_eval_processes_"))
    write_tasks(work / "tasks", args.docs, args.gen_tokens)
    checkpoint = write_checkpoint(work)
    settings = ["1", "2"] + (["2-unpinned"] if args.unpinned else [])
    runs, reference = [], None
    for index, setting in enumerate(schedule(settings, args.repeats)):
        processes = int(setting[0])
        out = work / f"out_{index}"
        run = run_once(processes, checkpoint, work / "tasks", out, args, "unpinned" not in setting)
        if reference is None and processes == 1:
            reference = run["results"]
        row = {"setting": setting, "round": index // len(settings), "wall_s": run["wall_s"]}
        row |= {"load_1min": run["load_1min"], **summarise(run)}
        row["results_equal_1_process"] = None if reference is None else (
            same_results(run["results"], reference)
        )  # fmt: skip
        runs.append(row)
        print(f"{setting}: {row['wall_s']:.1f} s, {row['per_request_ms']:.2f} ms/request, "
              f"load {row['load_1min']:.2f}", file=sys.stderr, flush=True)  # fmt: skip
    summary = []
    for setting in settings:
        mine = [r for r in runs if r["setting"] == setting]
        summary.append(
            {
                "setting": setting,
                "runs": len(mine),
                **{key: median(r[key] for r in mine) for key in PHASES},
            }
        )
    one = next(s for s in summary if s["setting"] == "1")
    for row in summary:
        row["wall_vs_1"] = row["wall_s"] / one["wall_s"]
        row["per_request_vs_1"] = row["per_request_ms"] / one["per_request_ms"]
    header = ["processes", "runs", *(PHASES[key] for key in PHASES), "ms/request vs 1",
              "wall vs 1"]  # fmt: skip
    table = markdown_table(
        header,
        [[s["setting"], s["runs"], *(s[key] for key in PHASES), s["per_request_vs_1"],
          s["wall_vs_1"]] for s in summary],
    )  # fmt: skip
    result = {
        "benchmark": "lm_eval_processes",
        "args": {k: v for k, v in vars(args).items() if k not in ("json", "workdir")},
        "model": list(MODEL),
        "summary": summary,
        "runs": runs,
        "all_results_equal": all(r["results_equal_1_process"] is not False for r in runs),
    }
    publish("lm_eval_processes", result, table, args.json)
    return result


if __name__ == "__main__":
    main()
