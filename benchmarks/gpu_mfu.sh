#!/usr/bin/env bash
# MFU of jaxmoe's train step on one NVIDIA GPU, bf16, at a size that fills an H100/H200.
#
#   bash benchmarks/gpu_mfu.sh [OUT_DIR]        # writes OUT_DIR/gpu_mfu.json (default: .)
#
# Uses the current python if it already sees a GPU through jax; otherwise makes a venv
# (.venv-gpu) and installs jax[cuda12] and jaxmoe into it (needs PyPI). MFU is model FLOPs
# per second (jaxmoe/models/flops.py: matmuls only, forward + backward, no remat recompute) over
# the chip's peak dense bf16 FLOP/s, looked up from nvidia-smi's name (PEAK_FLOPS overrides).
# The model (override any of these through the environment): a Mixtral-style MoE, d_model
# 2048, 8 layers, 16 query / 4 KV heads of 128, 8 SwiGLU experts of 5632, top-2, vocab
# 32768, sequence 4096, batch 8, bf16 compute with f32 parameters and AdamW, remat on:
# ~2.4B parameters (~38 GiB of f32 parameters + Adam state) plus activations.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-.}"
mkdir -p "$OUT_DIR"

PY=python3
if ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; then
  if [ ! -x .venv-gpu/bin/python ]; then
    "$PY" -m venv .venv-gpu
    .venv-gpu/bin/pip install -q --upgrade pip
    .venv-gpu/bin/pip install -q "jax[cuda12]>=0.10.2" -e .
  fi
  PY=.venv-gpu/bin/python
fi
"$PY" -c 'import jax; print("jax", jax.__version__, jax.devices())'

GPU_NAME="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1 || echo unknown)"
if [ -z "${PEAK_FLOPS:-}" ]; then
  case "$GPU_NAME" in
    *H200* | *H100*) PEAK_FLOPS=989e12 ;;  # SXM dense bf16 (no sparsity)
    *A100*) PEAK_FLOPS=312e12 ;;
    *L40S*) PEAK_FLOPS=362e12 ;;
    *) echo "unknown GPU '$GPU_NAME': set PEAK_FLOPS" >&2; exit 1 ;;
  esac
fi
echo "GPU: $GPU_NAME, peak dense bf16 $PEAK_FLOPS FLOP/s"

SETS=(
  "model.dtype=bfloat16"
  "model.remat=${REMAT:-true}"
  "model.vocab_size=${VOCAB:-32768}"
  "model.d_model=${D_MODEL:-2048}"
  "model.num_layers=${LAYERS:-8}"
  "model.num_heads=${HEADS:-16}"
  "model.num_kv_heads=${KV_HEADS:-4}"
  "model.head_dim=${HEAD_DIM:-128}"
  "model.ffn_dim=${DENSE_FFN:-11264}"
  "model.moe.ffn_dim=${EXPERT_FFN:-5632}"
  "model.moe.dispatch=${DISPATCH:-auto}"
  "train.seq_len=${SEQ:-4096}"
  "train.batch_size=${BATCH:-8}"
)
ARGS=()
for item in "${SETS[@]}"; do ARGS+=("--set=$item"); done

# The Markdown table on stdout, the JSON object into OUT_DIR/gpu_mfu.json (run from the
# repository root, where `python -m benchmarks` finds the package).
XLA_PYTHON_CLIENT_MEM_FRACTION="${MEM_FRACTION:-0.95}" "$PY" -m benchmarks train_throughput \
  --variants ${VARIANTS:-top2 adaptive dense} --steps "${STEPS:-20}" --warmup 3 --blocks 1 \
  --peak_flops "$PEAK_FLOPS" --json "$OUT_DIR/gpu_mfu.json" "${ARGS[@]}"

"$PY" - "$OUT_DIR/gpu_mfu.json" <<'EOF'
import json, sys
result = json.load(open(sys.argv[1]))
for row in result["rows"]:
    print(f"{row['variant']:9} {row['tokens_per_s']:10.0f} tok/s  "
          f"{row['flops_per_s'] / 1e12:7.1f} TFLOP/s  MFU {row['mfu']:.1%}")
EOF
