#!/usr/bin/env bash
# Start N jaxmoe processes on this machine, each with its own simulated CPU devices, joined
# into one run through a coordinator on a free localhost port. This is how multi-host
# behaviour (collectives across processes, per-process data shards, collective checkpoints)
# is tested without a pod.
#
#   launch/local.sh N [--devices_per_process D] -- train --config configs/default.py --workdir W
#   launch/local.sh N [--devices_per_process D] --module M -- ARGS   # python -m M ARGS instead
#
# Exits with the first non-zero exit code among the processes (then stops the others, which
# would otherwise wait forever in a collective), or 0. Process i logs to stdout with an
# "[i] " prefix; JAXMOE_LOCAL_LOGDIR=DIR also keeps each process's log in DIR/process_i.log.
#
# Process i runs pinned (taskset) to its own share of the cores this script may use: XLA:CPU,
# Eigen and torch size their thread pools from the affinity mask, and N unpinned processes
# would each start pools for every core and contend for them (measured on a 2-core host:
# lm-eval's request loops on 2 processes took 0.71x the 1-process time per request pinned,
# 0.88x unpinned; docs/results/2026-12-02_lm_eval_processes.md). More processes than cores
# share cores round-robin. JAXMOE_LOCAL_PIN=0 runs them unpinned.
set -euo pipefail

usage() { echo "usage: $0 N [--devices_per_process D] [--module M] -- JAXMOE_ARGS..." >&2; exit 2; }
[[ $# -ge 1 && "$1" =~ ^[0-9]+$ && "$1" -ge 1 ]] || usage
num_processes=$1; shift
devices=4
module=jaxmoe # an experiment's worker (experiments/ep_worker.py) takes the same start-up flags
while [[ $# -gt 0 && "$1" != "--" ]]; do
  case "$1" in
    --devices_per_process) devices=$2; shift 2 ;;
    --module) module=$2; shift 2 ;;
    *) usage ;;
  esac
done
[[ $# -gt 0 ]] && shift  # the "--"
[[ $# -gt 0 ]] || usage

python=${PYTHON:-python3}
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
logdir=${JAXMOE_LOCAL_LOGDIR:-}
[[ -n "$logdir" ]] && mkdir -p "$logdir"

# The cores process i may use: its contiguous share, or one core when there are fewer cores.
cpu_share() {
  "$python" - "$1" "$num_processes" <<'PY'
import os, sys
index, count = map(int, sys.argv[1:])
cores = sorted(os.sched_getaffinity(0))
per = len(cores) // count
share = cores[index * per : (index + 1) * per] if per else [cores[index % len(cores)]]
print(",".join(map(str, share)))
PY
}

pids=()
for ((i = 0; i < num_processes; i++)); do
  pin=()
  if [[ "${JAXMOE_LOCAL_PIN:-1}" != 0 ]] && command -v taskset >/dev/null; then
    cpus=$(cpu_share "$i")
    pin=(taskset -c "$cpus")
  fi
  (
    export JAX_PLATFORMS=cpu
    if ((${#pin[@]})); then
      export OMP_NUM_THREADS=$(($(tr -cd , <<<"$cpus" | wc -c) + 1))  # torch (lm-eval)
    fi
    # Last occurrence wins: this overrides a device count inherited from the caller.
    export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$devices"
    cmd=(${pin[@]+"${pin[@]}"} "$python" -m "$module" "$@" --coordinator_address "127.0.0.1:$port"
         --num_processes "$num_processes" --process_id "$i")
    if [[ -n "$logdir" ]]; then
      "${cmd[@]}" 2>&1 | tee "$logdir/process_$i.log" | sed -u "s/^/[$i] /"
      exit "${PIPESTATUS[0]}"
    else
      "${cmd[@]}" 2>&1 | sed -u "s/^/[$i] /"
      exit "${PIPESTATUS[0]}"
    fi
  ) &
  pids+=($!)
done

forward() { kill -TERM "${pids[@]}" 2>/dev/null || true; }
trap forward TERM INT

status=0
for ((n = 0; n < num_processes; n++)); do
  code=0
  wait -n || code=$?  # the next process to finish, in completion order
  if ((code != 0 && status == 0)); then
    status=$code
    kill -TERM "${pids[@]}" 2>/dev/null || true
  fi
done
exit "$status"
