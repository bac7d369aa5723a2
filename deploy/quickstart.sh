#!/usr/bin/env bash
# The README's main job: install what is missing, build, start a daemon on
# GPU 0, call every served op through it from Python against the PyTorch
# reference, print the table, stop the daemon.
#
#   ./deploy/quickstart.sh
#
# Needs a CUDA GPU (exits 2 with a message when there is none). On a host
# without a package registry, run `source deploy/offline/use-prefix.sh` first
# and set CACHE_DIT_SKIP_INSTALL=1 (the host's python3 then needs torch and
# grpcio already).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if ! command -v nvidia-smi > /dev/null || ! nvidia-smi -L > /dev/null 2>&1; then
  echo "quickstart: a CUDA GPU is needed (nvidia-smi finds none); nothing was started." >&2
  echo "quickstart: on a machine without a GPU, run the tests instead: ./tests/run.sh" >&2
  exit 2
fi

if [ "${CACHE_DIT_SKIP_INSTALL:-0}" != "1" ]; then ./deploy/install.sh; fi
PY="${CACHE_DIT_PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
CACHE_DIT_PYTHON="$PY" ./deploy/build.sh

RUN="$(mktemp -d)"
DAEMON="$ROOT/build/server/cache-dit-opd"
"$DAEMON" --device 0 --socket "$RUN/opd.sock" --log-level warn > "$RUN/daemon.log" 2>&1 &
PID=$!
trap 'kill -TERM $PID 2> /dev/null; wait $PID 2> /dev/null; rm -rf "$RUN"' EXIT
for _ in $(seq 100); do [ -S "$RUN/opd.sock" ] && break; sleep 0.1; done
[ -S "$RUN/opd.sock" ] || { echo "quickstart: the daemon did not start:" >&2; cat "$RUN/daemon.log" >&2; exit 1; }

CACHE_DIT_OPD_ADDRESS="unix:$RUN/opd.sock" PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}" \
  "$PY" examples/check_every_op.py
