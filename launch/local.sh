#!/usr/bin/env bash
# Start N jaxmoe processes on this machine, each with its own simulated CPU devices, joined
# into one run through a coordinator on a free localhost port. This is how multi-host
# behaviour (collectives across processes, per-process data shards, collective checkpoints)
# is tested without a pod.
#
#   launch/local.sh N [--devices_per_process D] -- train --config configs/default.py --workdir W
#
# Exits with the first non-zero exit code among the processes (then stops the others, which
# would otherwise wait forever in a collective), or 0. Process i logs to stdout with an
# "[i] " prefix; JAXMOE_LOCAL_LOGDIR=DIR also keeps each process's log in DIR/process_i.log.
set -euo pipefail

usage() { echo "usage: $0 N [--devices_per_process D] -- JAXMOE_ARGS..." >&2; exit 2; }
[[ $# -ge 1 && "$1" =~ ^[0-9]+$ && "$1" -ge 1 ]] || usage
num_processes=$1; shift
devices=4
while [[ $# -gt 0 && "$1" != "--" ]]; do
  case "$1" in
    --devices_per_process) devices=$2; shift 2 ;;
    *) usage ;;
  esac
done
[[ $# -gt 0 ]] && shift  # the "--"
[[ $# -gt 0 ]] || usage

python=${PYTHON:-python3}
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
logdir=${JAXMOE_LOCAL_LOGDIR:-}
[[ -n "$logdir" ]] && mkdir -p "$logdir"

pids=()
for ((i = 0; i < num_processes; i++)); do
  (
    export JAX_PLATFORMS=cpu
    # Last occurrence wins: this overrides a device count inherited from the caller.
    export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$devices"
    cmd=("$python" -m jaxmoe "$@" --coordinator_address "127.0.0.1:$port"
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
