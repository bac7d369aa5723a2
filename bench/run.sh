#!/usr/bin/env bash
# The benchmark of issue 7, on a CUDA host:
#
#   source deploy/offline/use-prefix.sh .offline/debs   # the daemon's LD_LIBRARY_PATH (offline hosts)
#   bench/run.sh [--quick] [--build DIR] [--out DIR] [--only CASES] ...
#
# Writes bench/results/<date>-<gpu>[-quick].{json,md,png} and prints the table;
# progress goes to stderr. `bench/run.sh --help` lists the options. PYTHON picks
# the interpreter (default python3). The environment passes through to the
# daemon and every child process.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="${repo}${PYTHONPATH:+:${PYTHONPATH}}"
exec "${PYTHON:-python3}" -m bench "$@"
