#!/usr/bin/env bash
# Run a jaxmoral command on GPU hosts.
#
# Single host (all local GPUs, one process):
#   launch/gpu.sh -- train --gin_file=configs/core/small_gpu.gin --gin.MODEL_DIR=/runs/small
# Multi-host, explicit (run the same line on every host, changing JAX_PROCESS_ID):
#   JAX_COORDINATOR_ADDRESS=host0:12355 JAX_NUM_PROCESSES=4 JAX_PROCESS_ID=$RANK launch/gpu.sh -- train ...
# Multi-host under SLURM (one task per host; jaxmoral detects SLURM_JOB_ID / SLURM_NTASKS and
# jax.distributed reads SLURM's variables):
#   sbatch --nodes=4 --ntasks-per-node=1 --gpus-per-node=8 --wrap "srun launch/gpu.sh -- train ..."
#
# `--install` first installs the project with the `gpu` extra (jax[cuda12]) and the `seqio`
# extra (seqio, TensorFlow CPU) into .venv; JAXMORAL_EXTRAS=gpu leaves TensorFlow out (a host
# that cannot install it trains from a DATA_CACHE written elsewhere by `jaxmoral cache`).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
if [ "${1:-}" = "--install" ]; then
  shift
  python3 -m venv "$ROOT/.venv"
  "$ROOT/.venv/bin/pip" install --quiet --upgrade pip
  "$ROOT/.venv/bin/pip" install --quiet -e "$ROOT[${JAXMORAL_EXTRAS:-gpu,seqio}]"
fi
[ "${1:-}" = "--" ] && shift
JAXMORAL="$ROOT/.venv/bin/jaxmoral"
[ -x "$JAXMORAL" ] || { echo "no $JAXMORAL: run $0 --install -- COMMAND once" >&2; exit 2; }
# Let XLA use most of GPU memory up front and overlap collectives with compute, unless the
# caller chose otherwise.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
case "${XLA_FLAGS:-}" in
  *xla_gpu_enable_latency_hiding_scheduler*) ;;
  *) export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true" ;;
esac
exec "$JAXMORAL" "$@"
