#!/usr/bin/env bash
# Start the same jaxmoral command on every worker of a Cloud TPU VM pod slice.
#
#   launch/tpu_pod.sh --tpu=NAME --zone=ZONE [--project=P] [--queued] [--slices=N] \
#       -- train --gin_file=configs/core/large_tpu_pod.gin --gin.MODEL_DIR="'gs://bucket/run'"
#
# It copies nothing by hand: every worker clones (or updates) the repository at the same commit
# (this checkout's HEAD, which must be on origin, or JAXMORAL_COMMIT), installs `.[tpu]` into its
# own .venv (again when setup.cfg or pyproject.toml changed), then runs the command. JAX
# discovers the pod's workers by itself on TPU VMs (jax.distributed.initialize() needs no
# arguments there). MODEL_DIR is a bucket URL (gs://BUCKET/run, written with the
# workers' service account) or a folder every worker sees (NFS, gcsfuse).
#   --queued   : the slice was made with `gcloud compute tpus queued-resources create`; the
#                nodes are named NAME-0 .. NAME-(slices-1) (multi-slice: one command per slice,
#                MEGASCALE variables set by the runtime).
set -euo pipefail
TPU="" ZONE="" PROJECT="" QUEUED=0 SLICES=1
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
REPO_URL="${JAXMORAL_REPO_URL:-$(git -C "$ROOT" remote get-url origin 2>/dev/null || echo '')}"
COMMIT="${JAXMORAL_COMMIT:-$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo main)}"
while [ $# -gt 0 ]; do
  case "$1" in
    --tpu=*) TPU="${1#*=}" ;;
    --zone=*) ZONE="${1#*=}" ;;
    --project=*) PROJECT="${1#*=}" ;;
    --queued) QUEUED=1 ;;
    --slices=*) SLICES="${1#*=}" ;;
    --) shift; break ;;
    *) echo "unknown flag $1" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$TPU" ] && [ -n "$ZONE" ] || { echo "usage: $0 --tpu=NAME --zone=ZONE [--project=P] [--queued] [--slices=N] -- COMMAND" >&2; exit 2; }
[ -n "$REPO_URL" ] || { echo "set JAXMORAL_REPO_URL (no git remote 'origin' found)" >&2; exit 2; }
[ "$#" -gt 0 ] || { echo "no command after --: e.g. -- train --gin_file=..." >&2; exit 2; }
if [ "$SLICES" -gt 1 ] && [ "$QUEUED" -eq 0 ]; then
  echo "--slices=$SLICES needs --queued (a multi-slice queued resource)" >&2; exit 2
fi
# The workers check out COMMIT from the repository's origin: a commit that is only here would
# fail on every worker after the ssh round trip, so say it now.
if [ -z "${JAXMORAL_COMMIT:-}" ]; then
  if [ -z "$(git -C "$ROOT" branch -r --list 'origin/*' --contains "$COMMIT" 2>/dev/null)" ]; then
    echo "commit $COMMIT is on no branch of origin: push it, or set JAXMORAL_COMMIT" >&2; exit 2
  fi
  if [ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    echo "warning: uncommitted changes here are not on the workers (they run $COMMIT)" >&2
  fi
fi
CMD=$(printf '%q ' "$@")
# Reinstalled when the package's metadata changed since the worker's last install (a commit
# that adds a dependency), as the Makefile's stamp does.
# One command a line: under set -e a failure inside an && chain (a fetch) would go unnoticed.
REMOTE="set -e
if [ ! -d jaxmoral ]; then git clone -q '$REPO_URL' jaxmoral; fi
cd jaxmoral
git fetch -q origin
git checkout -q '$COMMIT'
want=\$(cat setup.cfg pyproject.toml 2>/dev/null | sha256sum | cut -d' ' -f1)
if [ ! -x .venv/bin/jaxmoral ] || [ \"\$(cat .venv/.installed 2>/dev/null)\" != \"\$want\" ]; then
  python3 -m venv .venv
  .venv/bin/pip install -q -U pip
  .venv/bin/pip install -q -e '.[tpu]'
  echo \"\$want\" > .venv/.installed
fi
.venv/bin/jaxmoral $CMD"
PROJECT_FLAG=()
[ -n "$PROJECT" ] && PROJECT_FLAG=(--project="$PROJECT")
nodes=("$TPU")
if [ "$QUEUED" -eq 1 ] && [ "$SLICES" -gt 1 ]; then
  nodes=(); for ((s = 0; s < SLICES; s++)); do nodes+=("$TPU-$s"); done
fi
pids=()
for node in "${nodes[@]}"; do
  gcloud compute tpus tpu-vm ssh "$node" --zone="$ZONE" "${PROJECT_FLAG[@]}" --worker=all \
    --command="$REMOTE" &
  pids+=("$!")
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit "$status"
