"""Peak memory per device and compile time of a pod or GPU-cluster train step against MaxText,
ahead of time.

Both systems compile the same training step for a TPU topology or an NVIDIA GPU cluster on
this host (compile-only devices: libtpu's, or JAX's CUDA plugin's; no TPU or GPU needed),
each in its own process, one after the other (never two compiles at once): `jaxmoe compile
--json` and MaxText's `maxtext.trainers.pre_train.train_compile`, whose "Memory analysis"
line gives the same per-device sum jaxmoe reports as peak_hbm_bytes (arguments + outputs -
aliases + temporaries + generated code). TPU cases:

- mixtral_8x7b: Mixtral-8x7B on v5p-256 (128 chips), 128 sequences of 2048 tokens per step
  (one per chip, no micro-batches), bf16 compute, f32 weights, AdamW, fsdp 16 x expert 8,
  full remat. jaxmoe runs its adaptive gate (configs/mixtral_8x7b_adaptive.py), MaxText
  Mixtral's top-2; both size their expert buffers for two experts per token.
- qwen3_30b_a3b: Qwen3-30B-A3B (configs/qwen3_30b_a3b.py: 48 layers, 128 experts of 768,
  top-8 renormalised, head QK-norm) on v5p-64 (32 chips), 128 sequences of 4096 tokens per
  step (4 per chip, no micro-batches), fsdp 4 x expert 8, full remat, bf16 compute, f32
  weights, AdamW; MaxText's own qwen3-30b-a3b model with sparse_matmul and megablox.
- deepseek2_16b: DeepSeek-V2-Lite (configs/deepseek2_16b.py: 27 layers, multi-head latent
  attention, a dense first layer, 64 experts of 1408 top-6 plus 2 shared) on v5p-32 (16
  chips), 64 sequences of 4096 tokens (4 per chip), fsdp 2 x expert 8, otherwise as above;
  MaxText's deepseek2-16b.
- deepseek3_671b_fsdp512: DeepSeek-V3 (configs/deepseek3_671b.py: 61 layers, 3 dense, 256
  experts of 2048 top-8 sigmoid with group-limited routing 8/4 and a shared expert, MLA with
  q_lora 1536 / kv_lora 512, YaRN, one MTP module) on v5p-1024 (512 chips) at MaxText's own
  guide's step (docs/guides/optimization/benchmark_and_performance.md): fsdp 512 x expert 1,
  2 sequences of 8192 tokens per chip (1024 per step), bf16 compute, f32 weights, AdamW,
  full remat; MaxText's deepseek3-671b with the same routing groups and one MTP layer
  (mtp_num_layers=1, weight 0.3).
- deepseek3_671b: the same step on the mesh jaxmoe's config prefers, fsdp 32 x expert 16;
  MaxText on that mesh too (`allow_split_physical_axes=true`: 16 is no product of the
  8x8x8 torus's axis sizes).
- moe16_gpt2_medium: the 16-expert GPT-2-medium MoE (configs/moe16_gpt2_medium.py) on v5p-8
  (4 chips, expert 4): 256 sequences of 1024 tokens in 8 micro-batches, tied embeddings,
  GELU-gated experts; MaxText with the same sizes through its Mixtral block (RMSNorm, rotary
  positions, as jaxmoe).
- llama3_8b_65k: a Llama-3-8B-sized dense model (configs/llama3_8b.py) on v5p-64, 4
  sequences of 65,536 tokens, each split over mesh.context = 8 (MaxText:
  ici_context_parallelism=8, its default all-gather strategy and load balancing), fsdp 4;
  llama3_8b_65k_no_context: the same model without the context axis, one whole sequence
  per chip (fsdp 32). qwen3_30b_a3b_65k: Qwen3-30B-A3B at 65,536 tokens, 8 sequences,
  context 4 x expert 8.
- mixtral_8x7b_int8, qwen3_30b_a3b_int8: those steps with model.quantization=int8 (MaxText:
  quantization=int8, AQT); jaxmoe's rows add its compiled products by operand types
  (`dot_types`: "s8 x s8 -> s32" are the int8 ones).

GPU cases (H100 nodes of 8, one 4096-token sequence per GPU, no micro-batches, full remat,
bf16 compute, f32 weights, AdamW, cuDNN flash attention, dropless experts through
`ragged_dot`; MaxText with sparse_matmul and without megablox, its GPU settings). MaxText
runs through benchmarks/maxtext_gpu_compile.py on jaxmoe's compile-only devices for the
same cluster, in its own venv with JAX's CUDA plugin (`--maxtext_gpu_venv`, default
~/.cache/maxtext_gpu_venv: `pip install "maxtext[tpu]==0.2.5" "jax[cuda13]==0.12.0.1"`):

- mixtral_8x7b_h100: Mixtral-8x7B top-2 (configs/mixtral_8x7b_adaptive.py:top2) on
  h100-32 (4 nodes), 32 x 4096 tokens, fsdp 4 x expert 8;
- qwen3_30b_a3b_h100: Qwen3-30B-A3B on h100-16 (2 nodes), 16 x 4096 tokens, fsdp 2 x
  expert 8;
- deepseek2_16b_h100: DeepSeek-V2-Lite on h100-8 (1 node), 8 x 4096 tokens, expert 8.

The two venvs carry different compilers (jaxmoe's jax 0.10.2 with libtpu 0.0.42.1 here,
MaxText's jax 0.12 with libtpu 0.0.52), and the older libtpu reports about 2.3 GiB more
temporaries per chip for the same jaxmoe program on Mixtral-8x7B, none of them in its own
buffer assignment. So when MaxText's venv is there jaxmoe is compiled a second time with
that venv's interpreter (row `jaxmoe@maxtext_env`): same compiler, same program, and the
peak ratio is taken from that row. Each row records its interpreter's jax and libtpu.

Compile time is the wall time of each whole process (start-up, tracing, lowering and the
XLA compile), and its CPU time; on a loaded host wall times stretch, so the 1-minute load
average is recorded around every compile and a run with more than half the cores of load
from elsewhere is flagged `"quiet": false`. MaxText needs Python >= 3.12 in its own
virtual environment (`--maxtext_venv`, default ~/.cache/maxtext_venv):

    python3.12 -m venv ~/.cache/maxtext_venv
    ~/.cache/maxtext_venv/bin/pip install "maxtext[tpu]==0.2.5"
    python -m benchmarks pod_compile_peer [--cases mixtral_8x7b]   # a table
    python -m benchmarks pod_compile_peer --json   # + docs/results/DATE-pod_compile_peer.json
    python -m benchmarks pod_compile_peer --cases qwen3_30b_a3b --systems maxtext jaxmoe@maxtext_env
    python -m benchmarks pod_compile_peer --cases mixtral_8x7b_h100 \
        --systems maxtext jaxmoe@maxtext_env

Without that venv the MaxText column is skipped with one line and jaxmoe is still measured.
For GPU cases, `jaxmoe` runs under this interpreter, which needs the `gpu` extra;
`jaxmoe@maxtext_env` under MaxText's, whose CUDA plugin and cuDNN then compile both.
"""

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.peer_harness import (
    DEFAULT_MAXTEXT_VENV,
    ROOT,
    is_quiet,
    load_average,
    venv_python,
)
from benchmarks.results import add_json_flag, publish

DEFAULT_MAXTEXT_GPU_VENV = os.environ.get("MAXTEXT_GPU_VENV", "~/.cache/maxtext_gpu_venv")
GiB = 2**30
SAME_COMPILER = "jaxmoe@maxtext_env"  # jaxmoe run by MaxText's interpreter
SYSTEMS = ("maxtext", "jaxmoe", SAME_COMPILER)

# DeepSeek-V3 at MaxText's guide's step: 2 x 8192 tokens per chip, bf16 compute with f32
# weights, full remat, DeepSeek's group-limited routing (8 groups, 4 used) and one MTP layer
# as configs/deepseek3_671b.py has them.
DEEPSEEK3_MAXTEXT = [
    "model_name=deepseek3-671b",
    "per_device_batch_size=2",
    "max_target_length=8192",
    "n_routing_groups=8",
    "topk_routing_group=4",
    "mtp_num_layers=1",
    "mtp_loss_scaling_factor=0.3",
    "remat_policy=full",
    "sparse_matmul=true",
    "megablox=true",
    "dtype=bfloat16",
    "weight_dtype=float32",
]

# Each case: the jaxmoe config, topology and overrides, and MaxText's key=value settings for
# the same step.
CASES = {
    "mixtral_8x7b": {
        "topology": "v5p-256",
        "jaxmoe": [
            "configs/mixtral_8x7b_adaptive.py",
            "--config.train.batch_size=128",
            "--config.train.grad_accum=1",
            "--config.train.seq_len=2048",
        ],
        "maxtext": [
            "model_name=mixtral-8x7b",
            "per_device_batch_size=1",
            "max_target_length=2048",
            "ici_fsdp_parallelism=16",
            "ici_expert_parallelism=8",
            "remat_policy=full",
            "sparse_matmul=true",
            "megablox=true",
            "dtype=bfloat16",
            "weight_dtype=float32",
        ],
    },
    "qwen3_30b_a3b": {
        "topology": "v5p-64",
        "jaxmoe": ["configs/qwen3_30b_a3b.py"],  # 128 x 4096 tokens, fsdp 4 x expert 8
        "maxtext": [
            "model_name=qwen3-30b-a3b",
            "per_device_batch_size=4",
            "max_target_length=4096",
            "ici_fsdp_parallelism=4",
            "ici_expert_parallelism=8",
            "remat_policy=full",
            "sparse_matmul=true",
            "megablox=true",
            "dtype=bfloat16",
            "weight_dtype=float32",
        ],
    },
    "deepseek2_16b": {
        "topology": "v5p-32",
        "jaxmoe": ["configs/deepseek2_16b.py"],  # 64 x 4096 tokens, fsdp 2 x expert 8
        "maxtext": [
            "model_name=deepseek2-16b",
            "per_device_batch_size=4",
            "max_target_length=4096",
            "ici_fsdp_parallelism=2",
            "ici_expert_parallelism=8",
            "remat_policy=full",
            "sparse_matmul=true",
            "megablox=true",
            "dtype=bfloat16",
            "weight_dtype=float32",
        ],
    },
    "deepseek3_671b_fsdp512": {
        "topology": "v5p-1024",
        "jaxmoe": ["configs/deepseek3_671b.py", "--config.mesh.expert=1"],
        "maxtext": [*DEEPSEEK3_MAXTEXT, "ici_fsdp_parallelism=512"],
    },
    "deepseek3_671b": {
        "topology": "v5p-1024",
        "jaxmoe": ["configs/deepseek3_671b.py"],  # fsdp 32 x expert 16
        # 16 is no product of the 8x8x8 torus's axis sizes: MaxText must split a physical axis
        "maxtext": [
            *DEEPSEEK3_MAXTEXT,
            "ici_fsdp_parallelism=32",
            "ici_expert_parallelism=16",
            "allow_split_physical_axes=true",
        ],
    },
    "moe16_gpt2_medium": {
        "topology": "v5p-8",
        "jaxmoe": ["configs/moe16_gpt2_medium.py"],  # 256 x 1024 tokens, 8 micro-batches
        "maxtext": [
            "decoder_block=mixtral",
            "base_num_decoder_layers=24",
            "base_emb_dim=1024",
            "base_num_query_heads=16",
            "base_num_kv_heads=16",
            "head_dim=64",
            "base_mlp_dim=2816",
            "base_moe_mlp_dim=2816",
            "num_experts=16",
            "num_experts_per_tok=2",
            "mlp_activations=[gelu,linear]",
            "vocab_size=32768",
            "logits_via_embedding=true",
            "per_device_batch_size=8",  # 8 x 4 chips x 8 micro-batches = 256 sequences
            "gradient_accumulation_steps=8",
            "max_target_length=1024",
            "ici_fsdp_parallelism=1",
            "ici_expert_parallelism=4",
            "remat_policy=full",
            "sparse_matmul=true",
            "megablox=true",
            "dtype=bfloat16",
            "weight_dtype=float32",
        ],
    },
}


def _variant(base: str, topology: str, jaxmoe: list[str], maxtext: list[str]) -> dict:
    """Case `base` with more jaxmoe overrides and MaxText settings (a later MaxText key=value
    replaces the base's)."""
    case = CASES[base]
    keys = {item.split("=")[0] for item in maxtext}
    kept = [item for item in case["maxtext"] if item.split("=")[0] not in keys]
    return {"topology": topology, "jaxmoe": case["jaxmoe"] + jaxmoe, "maxtext": kept + maxtext}


# Long sequences (issue 50): 65,536 tokens per sequence split over mesh.context (MaxText:
# ici_context_parallelism, its default all-gather strategy and load balancing), and the same
# model without the context axis; int8 training (MaxText: quantization=int8, AQT).
LLAMA3_8B_MAXTEXT = [
    "model_name=llama3-8b",
    "max_target_length=65536",
    "remat_policy=full",
    "dtype=bfloat16",
    "weight_dtype=float32",
    "scan_layers=true",
]
CASES |= {
    "llama3_8b_65k": {
        "topology": "v5p-64",
        "jaxmoe": ["configs/llama3_8b.py"],  # 4 x 65536 tokens, context 8 x fsdp 4
        "maxtext": [
            *LLAMA3_8B_MAXTEXT,
            "per_device_batch_size=0.125",
            "ici_context_parallelism=8",
            "ici_fsdp_parallelism=4",
        ],
    },
    "llama3_8b_65k_no_context": {
        "topology": "v5p-64",
        "jaxmoe": ["configs/llama3_8b.py:no_context"],  # 32 x 65536 tokens, fsdp 32
        "maxtext": [*LLAMA3_8B_MAXTEXT, "per_device_batch_size=1", "ici_fsdp_parallelism=32"],
    },
    "qwen3_30b_a3b_65k": _variant(
        "qwen3_30b_a3b",
        "v5p-64",
        [
            "--config.train.seq_len=65536",
            "--config.train.batch_size=8",
            "--config.mesh.fsdp=1",
            "--config.mesh.context=4",
        ],
        [
            "max_target_length=65536",
            "per_device_batch_size=0.25",
            "ici_fsdp_parallelism=1",
            "ici_context_parallelism=4",
        ],
    ),
    "mixtral_8x7b_int8": _variant(
        "mixtral_8x7b", "v5p-256", ["--config.model.quantization=int8"], ["quantization=int8"]
    ),
    "qwen3_30b_a3b_int8": _variant(
        "qwen3_30b_a3b", "v5p-64", ["--config.model.quantization=int8"], ["quantization=int8"]
    ),
}

# MaxText's GPU settings shared by the GPU cases: dropless experts through ragged_dot (no
# megablox: a TPU kernel), cuDNN flash attention, as jaxmoe's defaults on GPU.
_MAXTEXT_GPU = [
    "max_target_length=4096",
    "remat_policy=full",
    "sparse_matmul=true",
    "megablox=false",
    "dtype=bfloat16",
    "weight_dtype=float32",
    "attention=cudnn_flash_jax",
]
# One sequence per GPU; MaxText's batch is per device of one 8-GPU node, so x nodes.
GPU_CASES = {
    "mixtral_8x7b_h100": {
        "platform": "gpu",
        "topology": "h100-32",
        "jaxmoe": [
            "configs/mixtral_8x7b_adaptive.py:top2",
            "--config.train.batch_size=32",
            "--config.train.grad_accum=1",
            "--config.train.seq_len=4096",
        ],
        "maxtext": [
            "model_name=mixtral-8x7b",
            "per_device_batch_size=4",
            "ici_fsdp_parallelism=4",
            "ici_expert_parallelism=8",
            *_MAXTEXT_GPU,
        ],
    },
    "qwen3_30b_a3b_h100": {
        "platform": "gpu",
        "topology": "h100-16",
        "jaxmoe": ["configs/qwen3_30b_a3b.py", "--config.train.batch_size=16"],
        "maxtext": [
            "model_name=qwen3-30b-a3b",
            "per_device_batch_size=2",
            "ici_fsdp_parallelism=2",
            "ici_expert_parallelism=8",
            *_MAXTEXT_GPU,
        ],
    },
    "deepseek2_16b_h100": {
        "platform": "gpu",
        "topology": "h100-8",
        "jaxmoe": ["configs/deepseek2_16b.py", "--config.train.batch_size=8"],
        "maxtext": [
            "model_name=deepseek2-16b",
            "per_device_batch_size=1",
            "ici_fsdp_parallelism=1",
            "ici_expert_parallelism=8",
            *_MAXTEXT_GPU,
        ],
    },
}
CASES |= GPU_CASES

MEMORY_FIELDS = (
    "generated_code_size_in_bytes",
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
)


def parse_memory_analysis(log: str) -> dict:
    """Bytes from MaxText's `Memory analysis: CompiledMemoryStats(...)` line, with the peak."""
    line = re.search(r"Memory analysis: CompiledMemoryStats\((.*?)\)", log)
    if not line:
        raise RuntimeError("MaxText printed no 'Memory analysis' line")
    fields = dict(re.findall(r"(\w+)=(\d+)", line.group(1)))
    stats = {name: int(fields[name]) for name in MEMORY_FIELDS}
    peak = (
        stats["argument_size_in_bytes"]
        + stats["output_size_in_bytes"]
        - stats["alias_size_in_bytes"]
        + stats["temp_size_in_bytes"]
        + stats["generated_code_size_in_bytes"]
    )
    return {
        "peak_hbm_bytes": peak,
        "argument_bytes": stats["argument_size_in_bytes"],
        "temp_bytes": stats["temp_size_in_bytes"],
    }


def is_gpu_case(case: dict) -> bool:
    return case.get("platform") == "gpu"


def maxtext_command(venv: Path, case: dict, output_dir: str) -> list[str]:
    """MaxText's train_compile for a case (its base.yml comes from the installed package);
    for a GPU cluster, through benchmarks/maxtext_gpu_compile.py (which finds base.yml)."""
    if is_gpu_case(case):
        runner = [str(venv / "bin" / "python"), "-m", "benchmarks.maxtext_gpu_compile"]
        return [*runner, case["topology"], *case["maxtext"], f"base_output_directory={output_dir}"]
    base = venv / "lib"
    configs = sorted(base.glob("python3*/site-packages/maxtext/configs/base.yml"))
    if not configs:
        raise RuntimeError(f"no maxtext/configs/base.yml under {base}")
    return [
        str(venv / "bin" / "python"),
        "-m",
        "maxtext.trainers.pre_train.train_compile",
        str(configs[-1]),
        f"compile_topology={case['topology']}",
        "compile_topology_num_slices=1",
        *case["maxtext"],
        "run_name=aot",
        f"base_output_directory={output_dir}",
        "dataset_type=synthetic",
    ]


def jaxmoe_command(case: dict, python: str = sys.executable) -> list[str]:
    config, *overrides = case["jaxmoe"]
    return [python, "-m", "jaxmoe.cli", "compile", "--config", config,
            "--topology", case["topology"], "--json", *overrides]  # fmt: skip


def timed(command: list[str], env: dict) -> tuple[subprocess.CompletedProcess, dict]:
    """Run one compile process; its wall and CPU seconds and the load average around it."""
    load_before = load_average()
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - started
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    timing = {
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "load_before": round(load_before, 2),
        "load_after": round(load_average(), 2),
    }
    return result, timing


def compile_env() -> dict:
    # Compiling never touches TPU hardware; a process holding libtpu's lock must not stop it.
    return {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_SKIP_MDS_QUERY": "1"}


def error_line(log: str) -> str:
    """The line of a failed run's log that names its exception (the last `...Error: ...`
    line: JAX prints hints such as "report a bug at ..." after it), else its last line."""
    lines = [line.strip() for line in log.strip().splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b.*:", line)]
    return (errors or lines or [""])[-1]


def run_maxtext(venv: Path, case: dict) -> dict:
    env = compile_env()
    if is_gpu_case(case):  # benchmarks.maxtext_gpu_compile imports jaxmoe from this checkout
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as out:
        result, timing = timed(maxtext_command(venv, case, out), env)
    log = result.stdout + result.stderr
    if result.returncode:
        return {"error": f"MaxText exited {result.returncode}: {error_line(log)}", **timing}
    return {**parse_memory_analysis(log), **timing}


COMPILER_PACKAGES = ("jax", "libtpu", "jax-cuda13-plugin", "jax-cuda12-plugin",
                     "nvidia-cudnn-cu13", "nvidia-cudnn-cu12")  # fmt: skip


def compiler_versions(python: str, gpu: bool = False) -> dict:
    """The jax and libtpu versions an interpreter compiles with; for GPU cases jax, its CUDA
    plugin and cuDNN (those installed)."""
    names = COMPILER_PACKAGES[2:] if gpu else COMPILER_PACKAGES[1:2]
    code = (
        "import importlib.metadata as m, json\n"
        "def v(k):\n"
        "    try: return m.version(k)\n"
        "    except m.PackageNotFoundError: return None\n"
        f"print(json.dumps({{k: v(k) for k in {('jax', *names)!r} if v(k)}}))"
    )
    result = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return json.loads(result.stdout) if result.returncode == 0 else {}


def run_jaxmoe(case: dict, python: str = sys.executable) -> dict:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**compile_env(), "PYTHONPATH": path}  # this checkout's jaxmoe
    result, timing = timed(jaxmoe_command(case, python), env)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = result.stderr.strip().splitlines()[-1:]
        return {"error": f"jaxmoe compile exited {result.returncode}: {tail}", **timing}
    report_ = json.loads(lines[-1])
    if "peak_hbm_bytes" not in report_:
        return {"error": report_.get("error", report_.get("verdict")), **timing}
    keys = ("peak_hbm_bytes", "argument_bytes", "temp_bytes", "compile_s", "lower_s", "verdict")
    # dot types (quantization), model FLOPs, and on GPU the kernels and fallbacks
    extra = ("dot_types", "model_flops_per_step", "gpu_kernels", "attention_fallbacks")
    extra += ("collectives_across_hosts",)
    return {
        **{k: report_[k] for k in keys},
        **{k: report_[k] for k in extra if k in report_},
        **timing,
    }


def run(args) -> dict:
    rows, loads = [], []
    wanted = set(args.systems)
    for name in args.cases:
        case = CASES[name]
        gpu = is_gpu_case(case)
        venv = Path(args.maxtext_gpu_venv if gpu else args.maxtext_venv).expanduser()
        maxtext_python = venv_python(venv)
        have_maxtext = maxtext_python is not None
        if not have_maxtext:
            print(f"MaxText is not installed in {venv}: its column is skipped", file=sys.stderr)
        pythons = [sys.executable] + ([str(maxtext_python)] if have_maxtext else [])
        versions = {python: compiler_versions(python, gpu) for python in pythons}
        row = {"case": name, "topology": case["topology"]}
        if have_maxtext and "maxtext" in wanted:
            compiler = versions[str(maxtext_python)]
            row["maxtext"] = run_maxtext(venv, case) | {"compiler": compiler}
        if "jaxmoe" in wanted:
            row["jaxmoe"] = run_jaxmoe(case) | {"compiler": versions[sys.executable]}
        if have_maxtext and SAME_COMPILER in wanted:  # the same program, MaxText's jax/libtpu
            compiler = versions[str(maxtext_python)]
            same = run_jaxmoe(case, str(maxtext_python)) | {"compiler": compiler}
            row[SAME_COMPILER] = same
        for system in SYSTEMS:
            if system in row:
                loads += [row[system]["load_before"], row[system]["load_after"]]
        mt, jm = row.get("maxtext", {}), row.get(SAME_COMPILER, row.get("jaxmoe", {}))
        if "peak_hbm_bytes" in mt and "peak_hbm_bytes" in jm:
            row["jaxmoe_over_maxtext_peak"] = round(jm["peak_hbm_bytes"] / mt["peak_hbm_bytes"], 3)
            row["jaxmoe_over_maxtext_wall"] = round(jm["wall_s"] / mt["wall_s"], 2)
            row["jaxmoe_over_maxtext_cpu"] = round(jm["cpu_s"] / mt["cpu_s"], 2)
        rows.append(row)
    # A compile keeps about one core busy.
    venvs = {"maxtext_venv": args.maxtext_venv, "maxtext_gpu_venv": args.maxtext_gpu_venv}
    return {"rows": rows, **venvs, "quiet": is_quiet(loads or [0.0], 1)}


def _gib(system: dict) -> str:
    if "peak_hbm_bytes" not in system:
        return system.get("error", "-")
    return f"{system['peak_hbm_bytes'] / GiB:.2f} GiB"


def table(result: dict) -> str:
    lines = [
        "| case | topology | system | peak per device | compile wall (CPU) | load | compiler |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        for system in SYSTEMS:
            if system not in row:
                continue
            s = row[system]
            timing = f"{s['wall_s']:.0f} s ({s['cpu_s']:.0f} s)"
            load = f"{s['load_before']:.1f}-{s['load_after']:.1f}"
            compiler = ", ".join(f"{k} {v}" for k, v in s.get("compiler", {}).items())
            lines.append(
                f"| {row['case']} | {row['topology']} | {system} | {_gib(s)} | {timing} | {load} "
                f"| {compiler} |"
            )
        if "jaxmoe_over_maxtext_peak" in row:
            peak = f"{row['jaxmoe_over_maxtext_peak']:.2f}x"
            wall, cpu = row["jaxmoe_over_maxtext_wall"], row["jaxmoe_over_maxtext_cpu"]
            timing = f"{wall:.2f}x ({cpu:.2f}x)"
            lines.append(f"| {row['case']} | | jaxmoe / MaxText | {peak} | {timing} | | same |")
    if not result["quiet"]:
        lines.append(
            "NOT A QUIET RUN: other processes loaded the host; compile times are stretched"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--maxtext_venv", default=DEFAULT_MAXTEXT_VENV, help="MaxText's venv")
    parser.add_argument(
        "--maxtext_gpu_venv",
        default=DEFAULT_MAXTEXT_GPU_VENV,
        help="MaxText's venv with JAX's CUDA plugin, for the GPU cases",
    )
    parser.add_argument(
        "--systems",
        nargs="+",
        choices=SYSTEMS,
        default=list(SYSTEMS),
        help="rows to compile (on a loaded host: maxtext and jaxmoe@maxtext_env, back to back)",
    )
    add_json_flag(parser)
    args = parser.parse_args(argv)
    result = run(args)
    publish("pod_compile_peer", result, table(result), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
