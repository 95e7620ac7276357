#!/usr/bin/env bash
# Run a jaxmoe job on a Cloud TPU VM slice: create or reuse the slice, check ahead of time
# that the train step fits the topology (jaxmoe compile), install jaxmoe on every worker,
# run the same command on all workers and stream their logs.
#
#   launch/tpu_pod.sh --name my-slice --zone us-east5-a --accelerator v5p-128 \
#       [--project P] [--version v2-alpha-tpuv5] [--spot] [--num_slices 1] \
#       [--skip_compile_check] [--dry_run] -- train --config configs/X.py --workdir gs://bucket/run
#
# --dry_run prints every command instead of running it. The workdir should be a gs:// path
# so all workers share checkpoints; rerunning the same command resumes after a preemption.
set -euo pipefail

name="" zone="" accelerator="" project="" version="" spot=0 dry_run=0 check=1 num_slices=1
usage() { sed -n '2,12p' "$0" >&2; exit 2; }
while [[ $# -gt 0 && "$1" != "--" ]]; do
  case "$1" in
    --name) name=$2; shift 2 ;;
    --zone) zone=$2; shift 2 ;;
    --accelerator) accelerator=$2; shift 2 ;;
    --project) project=$2; shift 2 ;;
    --version) version=$2; shift 2 ;;
    --num_slices) num_slices=$2; shift 2 ;;
    --spot) spot=1; shift ;;
    --skip_compile_check) check=0; shift ;;
    --dry_run) dry_run=1; shift ;;
    -h|--help) usage ;;
    *) echo "tpu_pod.sh: unknown flag $1" >&2; usage ;;
  esac
done
[[ $# -gt 0 ]] && shift
[[ -n "$name" && -n "$zone" && -n "$accelerator" && $# -gt 0 ]] || usage
job=("$@")

# The runtime image that matches each TPU generation.
if [[ -z "$version" ]]; then
  case "$accelerator" in
    v5p-*) version=v2-alpha-tpuv5 ;;
    v5litepod-*|v5e-*) version=v2-alpha-tpuv5-lite ;;
    v6e-*) version=v2-alpha-tpuv6e ;;
    *) version=tpu-ubuntu2204-base ;;
  esac
fi
gcloud_flags=(--zone "$zone")
[[ -n "$project" ]] && gcloud_flags+=(--project "$project")

quote() { printf '%q ' "$@"; }
run() {
  if ((dry_run)); then echo "+ $(quote "$@")"; else "$@"; fi
}

here=$(cd "$(dirname "$0")/.." && pwd)

# 1. Does the step fit? Compile for the topology here, before paying for the slice.
config=""
for ((i = 0; i < ${#job[@]}; i++)); do
  [[ "${job[$i]}" == "--config" ]] && config=${job[$((i + 1))]}
done
overrides=()
for arg in "${job[@]}"; do [[ "$arg" == --config.* ]] && overrides+=("$arg"); done
if ((check)) && [[ "${job[0]}" == "train" && -n "$config" ]]; then
  topology=${accelerator/v5litepod/v5e}
  if ((dry_run)); then
    echo "+ $(quote jaxmoe compile --config "$config" --topology "$topology" --num_slices "$num_slices" "${overrides[@]}")"
  elif ! jaxmoe compile --config "$config" --topology "$topology" --num_slices "$num_slices" "${overrides[@]}"; then
    echo "tpu_pod.sh: the train step does not fit $accelerator (see above); refusing to start." >&2
    echo "tpu_pod.sh: change the mesh/batch/remat settings, or pass --skip_compile_check." >&2
    exit 2
  fi
fi

# 2. Create the slice unless it exists. Several slices (multislice) are one queued resource
# whose nodes are NAME-0 .. NAME-(N-1); JAX joins them over the data-center network and
# jaxmoe's mesh puts only the data/fsdp axes across them (mesh.dcn_data, mesh.dcn_fsdp).
nodes=("$name")
if ((num_slices > 1)); then
  nodes=()
  for ((s = 0; s < num_slices; s++)); do nodes+=("$name-$s"); done
  if ((dry_run)) || ! gcloud compute tpus queued-resources describe "$name" "${gcloud_flags[@]}" >/dev/null 2>&1; then
    create=(gcloud compute tpus queued-resources create "$name" "${gcloud_flags[@]}"
            --node-count "$num_slices" --node-prefix "$name"
            --accelerator-type "$accelerator" --runtime-version "$version")
    ((spot)) && create+=(--spot)
    if ((dry_run)); then
      echo "# (creates the queued resource only if 'gcloud compute tpus queued-resources describe $name' fails)"
    fi
    run "${create[@]}"
    if ! ((dry_run)); then
      echo "tpu_pod.sh: waiting for queued resource $name to become ACTIVE..." >&2
      until [[ "$(gcloud compute tpus queued-resources describe "$name" "${gcloud_flags[@]}" \
                  --format='value(state.state)')" == ACTIVE ]]; do sleep 30; done
    fi
  fi
elif ((dry_run)) || ! gcloud compute tpus tpu-vm describe "$name" "${gcloud_flags[@]}" >/dev/null 2>&1; then
  create=(gcloud compute tpus tpu-vm create "$name" "${gcloud_flags[@]}"
          --accelerator-type "$accelerator" --version "$version")
  ((spot)) && create+=(--spot)
  if ((dry_run)); then
    echo "# (creates the slice only if 'gcloud compute tpus tpu-vm describe $name' fails)"
  fi
  run "${create[@]}"
fi

# 3. Ship this checkout (code + configs) as a wheel and install it with libtpu on every worker.
run python3 -m pip wheel --no-deps -q -w "$here/dist" "$here"
for node in "${nodes[@]}"; do
  run gcloud compute tpus tpu-vm scp --recurse "$here/dist" "$here/configs" "$node": \
    --worker=all "${gcloud_flags[@]}"
  run gcloud compute tpus tpu-vm ssh "$node" --worker=all "${gcloud_flags[@]}" \
    --command "python3 -m pip install -q --upgrade pip && python3 -m pip install -q \"\$(ls ~/dist/jaxmoe-*.whl | tail -1)[tpu]\""
done

# 4. The same command on every worker of every slice; JAX finds its peers from the TPU
# metadata (and, across slices, from the multislice runtime's environment).
remote="cd ~ && PATH=\$HOME/.local/bin:\$PATH jaxmoe $(quote "${job[@]}")"
pids=()
for node in "${nodes[@]}"; do
  if ((dry_run)) || ((${#nodes[@]} == 1)); then
    run gcloud compute tpus tpu-vm ssh "$node" --worker=all "${gcloud_flags[@]}" --command "$remote"
  else
    gcloud compute tpus tpu-vm ssh "$node" --worker=all "${gcloud_flags[@]}" --command "$remote" &
    pids+=($!)
  fi
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit "$status"
