#!/usr/bin/env bash
# Run a jaxmoral command locally on CPU (or the local accelerators), in one or more processes.
#
#   launch/local.sh [-n NUM_PROCESSES] [-d DEVICES_PER_PROCESS] -- train --gin_file=... --gin.MODEL_DIR=...
#
# With -n > 1 every process gets JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, so
# `jax.distributed.initialize` (called by jaxmoral.partitioning.initialize_distributed) joins them
# with CPU collectives over localhost: the same code path a multi-host pod takes. Each line of
# output is prefixed with its process; when one process fails, the others are stopped and the
# launcher exits with the failed one's status; Ctrl-C or SIGTERM lets every process save and stop
# (SIGKILL after JAXMORAL_STOP_GRACE_SECONDS, 60 by default). Needs bash 4.3 or later.
set -euo pipefail
NUM_PROCESSES=1
DEVICES_PER_PROCESS=""
PORT="${JAXMORAL_COORDINATOR_PORT:-12355}"
while getopts "n:d:p:" opt; do
  case "$opt" in
    n) NUM_PROCESSES="$OPTARG" ;;
    d) DEVICES_PER_PROCESS="$OPTARG" ;;
    p) PORT="$OPTARG" ;;
    *) echo "usage: $0 [-n processes] [-d cpu devices per process] [-p port] -- COMMAND ..." >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ "${1:-}" = "--" ] && shift
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
JAXMORAL="${JAXMORAL:-$ROOT/.venv/bin/jaxmoral}"
if [ -n "$DEVICES_PER_PROCESS" ]; then
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$DEVICES_PER_PROCESS"
fi
if [ "$NUM_PROCESSES" -eq 1 ]; then
  exec "$JAXMORAL" "$@"
fi
if ((BASH_VERSINFO[0] < 4 || (BASH_VERSINFO[0] == 4 && BASH_VERSINFO[1] < 3))); then
  echo "launch/local.sh: -n $NUM_PROCESSES needs bash 4.3 or later (wait -n); this is $BASH_VERSION" >&2
  exit 2
fi
# Each process and its output filter in a process group of its own (job control), so that one
# signal reaches all of it. Stopping is SIGTERM first (jaxmoral takes it as a preemption notice:
# the processes agree on a step, save it and exit), then SIGKILL after a grace period: a
# process whose peer is gone can never reach that agreement and would wait for ever.
set -m
pids=()
stop_all() {  # $1: seconds between SIGTERM and SIGKILL
  local pid waited=0
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  while [ -n "$(jobs -rp)" ] && [ "$waited" -lt "$1" ]; do sleep 1; waited=$((waited + 1)); done
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
}
STOP_GRACE="${JAXMORAL_STOP_GRACE_SECONDS:-60}"
trap 'stop_all "$STOP_GRACE"; exit 130' INT
trap 'stop_all "$STOP_GRACE"; exit 143' TERM
for ((i = 0; i < NUM_PROCESSES; i++)); do
  # The subshell and its filter outlive SIGTERM (a no-op trap, which exec resets for jaxmoral),
  # so the group runs, and prints, until jaxmoral itself is done. The subshell's own stderr is
  # dropped (bash's "Killed" job lines); jaxmoral's goes through the filter with its stdout.
  (
    trap ':' TERM
    JAX_COORDINATOR_ADDRESS="127.0.0.1:$PORT" JAX_NUM_PROCESSES="$NUM_PROCESSES" \
      JAX_PROCESS_ID="$i" "$JAXMORAL" "$@" 2>&1 | {
        trap ':' TERM
        while IFS= read -r line || [ -n "$line" ]; do printf '[process %d] %s\n' "$i" "$line"; done
      }
    exit "${PIPESTATUS[0]}"
  ) 2>/dev/null &
  pids+=("$!")
done
set +m  # the groups stay; no job-status lines ("Terminated") on the terminal
status=0
for ((n = 0; n < NUM_PROCESSES; n++)); do
  code=0
  wait -n || code=$?
  if [ "$code" -ne 0 ]; then
    how="status $code"
    [ "$code" -gt 128 ] && how="$how (signal $((code - 128)))"
    echo "launch/local.sh: a process exited with $how; stopping the others" >&2
    status=$code
    stop_all $((STOP_GRACE < 10 ? STOP_GRACE : 10))
    wait || true
    break
  fi
done
exit "$status"
