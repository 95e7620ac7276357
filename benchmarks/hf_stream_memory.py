"""Peak host memory of `jaxmoe export hf` and `jaxmoe convert hf` on a multi-GB MoE model.

A random-weight Mixtral-style decoder (parameters drawn and saved with `save_params`, no
training) is exported to sharded safetensors, imported back in the unrolled and the scanned
layout, and the scanned import exported again (it must give the same files). Every step
runs in its own process; its peak resident memory is ru_maxrss from wait4. The same steps on
a tiny model of the same architecture measure the fixed cost (interpreter, JAX, Orbax,
TensorStore), so `peak - tiny peak` is what the model's tensors cost; streaming keeps it a
small multiple of the largest single tensor, far below the model's size.

    python -m benchmarks hf_stream_memory [--preset 2.5GB] [--workdir DIR] [--keep] [--json]
"""

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.results import add_json_flag, markdown_table, publish

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20
# Mixtral-style top-2 MoE decoders (exportable as MixtralForCausalLM), float32 parameters.
_MIXTRAL = (
    "model.moe.gating=top2",
    "model.moe.renormalize=True",
    "model.moe.single_weight=one",
    "model.moe.capacity_factor=0.0",
    "model.moe.every=1",
    "model.moe.num_experts=8",
    "model.tie_embeddings=False",
)
PRESETS = {
    # vocab, d_model, heads, kv heads, head_dim, expert ffn, layers
    "tiny": (256, 32, 4, 2, 8, 48, 2),
    "200MB": (8000, 512, 8, 4, 64, 1408, 3),
    "2.5GB": (32000, 1024, 16, 4, 64, 2816, 8),
}
# The shard size that splits each preset into several files.
SHARD_SIZES = {"tiny": "100KB", "200MB": "50MB", "2.5GB": "1GB"}


def preset_config(name: str):
    from jaxmoe.config.loading import load_config

    vocab, d, heads, kv, head_dim, ffn, layers = PRESETS[name]
    return load_config(
        str(ROOT / "configs" / "default.py"),
        [
            *_MIXTRAL,
            f"model.vocab_size={vocab}",
            f"model.d_model={d}",
            f"model.num_heads={heads}",
            f"model.num_kv_heads={kv}",
            f"model.head_dim={head_dim}",
            f"model.ffn_dim={ffn}",
            f"model.moe.ffn_dim={ffn}",
            f"model.num_layers={layers}",
        ],
    )


def make_checkpoint(path: Path, preset: str, seed: int = 0) -> int:
    """A checkpoint of random float32 parameters (unit-scale); returns its size in bytes."""
    from jaxmoe.checkpoints.manager import save_params
    from jaxmoe.checkpoints.trees import flatten, unflatten
    from jaxmoe.models.spec import abstract_params
    from jaxmoe.models.stack import unrolled_config

    config = preset_config(preset)
    rng = np.random.default_rng(seed)
    leaves = flatten(abstract_params(unrolled_config(config.model)))
    params = {
        p: rng.standard_normal(a.shape, np.float32) / np.float32(a.shape[0] ** 0.5)
        for p, a in leaves.items()
    }
    save_params(str(path), unflatten(params), config)
    return sum(a.nbytes for a in params.values())


# Runs `jaxmoe ARGS` and writes its VmHWM (peak resident bytes) to $HWM_FILE at exit. Not
# ru_maxrss from wait4: Linux carries the parent's peak into a child across fork + exec.
_MEASURED = """
import atexit, os, runpy, sys
def hwm():
    kb = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
    open(os.environ["HWM_FILE"], "w").write(str(kb * 1024))
atexit.register(hwm)
sys.argv = ["jaxmoe", *sys.argv[1:]]
runpy.run_module("jaxmoe.cli", run_name="__main__")
"""


def peak_rss(args: list[str]) -> int:
    """Run `jaxmoe ARGS` in a fresh process (cwd: the repository); its peak resident
    memory in bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        hwm = Path(tmp) / "hwm"
        env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", HWM_FILE=str(hwm))
        command = [sys.executable, "-c", _MEASURED, *args]
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        if done.returncode:
            raise RuntimeError(f"jaxmoe {' '.join(args)} exited with {done.returncode}")
        return int(hwm.read_text())


def largest_tensor(hf_dir: Path) -> int:
    """Bytes of the largest tensor in an HF safetensors directory (headers only)."""
    from jaxmoe.conversions.hf.importer import SafetensorsFolder

    folder = SafetensorsFolder(hf_dir)
    return max(4 * int(np.prod(folder.shape(n), dtype=np.int64)) for n in folder.names)


def run_steps(work: Path, preset: str) -> dict:
    """Make the preset's checkpoint, run the four steps; peaks in bytes and sizes."""
    shard = ["--max_shard_size", SHARD_SIZES[preset]]
    model_bytes = make_checkpoint(work / "src", preset)
    src, hf, unrolled, scanned, hf2 = (
        str(work / n) for n in ("src", "hf", "unrolled", "scanned", "hf2")
    )
    steps = {
        "export": ["export", "hf", src, hf, *shard],
        "import": ["convert", "hf", hf, unrolled],
        "import_scanned": ["convert", "hf", hf, scanned, "--config.model.scan_layers=1"],
        "export_scanned": ["export", "hf", scanned, hf2, *shard],
    }
    peaks = {name: peak_rss(command) for name, command in steps.items()}
    files = sorted(p.name for p in (work / "hf").iterdir() if p.suffix == ".safetensors")
    same = filecmp.cmpfiles(work / "hf", work / "hf2", files, shallow=False)[0] == files
    return {
        "model_bytes": model_bytes,
        "largest_tensor_bytes": largest_tensor(work / "hf"),
        "safetensors_files": len(files),
        "round_trip_identical": same,
        "peak_bytes": peaks,
    }


def report(preset: str, tiny: dict, big: dict) -> dict:
    largest = big["largest_tensor_bytes"]
    rows = {
        step: {
            "peak_MiB": round(peak / MiB),
            "tiny_peak_MiB": round(tiny["peak_bytes"][step] / MiB),
            "increase_MiB": round((peak - tiny["peak_bytes"][step]) / MiB),
            "increase_over_largest_tensor": round((peak - tiny["peak_bytes"][step]) / largest, 2),
        }
        for step, peak in big["peak_bytes"].items()
    }
    return {
        "preset": preset,
        "model_MiB": round(big["model_bytes"] / MiB),
        "largest_tensor_MiB": round(largest / MiB, 1),
        "safetensors_files": big["safetensors_files"],
        "round_trip_identical": big["round_trip_identical"],
        "steps": rows,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="2.5GB", choices=[p for p in PRESETS if p != "tiny"])
    parser.add_argument("--workdir", default=None, help="default: a temporary directory")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints written")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    base = Path(args.workdir or tempfile.mkdtemp(prefix="hf_stream_"))
    try:
        results = {}
        for preset in ("tiny", args.preset):
            (base / preset).mkdir(parents=True, exist_ok=True)
            results[preset] = run_steps(base / preset, preset)
        summary = report(args.preset, results["tiny"], results[args.preset])
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    header = ["step", "peak MiB", "tiny MiB", "+MiB", "x largest"]
    rows = [
        [step, row["peak_MiB"], row["tiny_peak_MiB"], row["increase_MiB"],
         row["increase_over_largest_tensor"]]
        for step, row in summary["steps"].items()
    ]  # fmt: skip
    publish("hf_stream_memory", summary, markdown_table(header, rows), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
