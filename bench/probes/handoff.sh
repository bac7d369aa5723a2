#!/usr/bin/env bash
# The hand-off probes of docs/DESIGN.md section 7 in one go (tests/gpu/batch.sh
# step probe-handoff): `opd_stream_queues_probe pairs` (one context) and
# `xpairs` (a process per client and one for the daemon), first without MPS,
# then under a private MPS server (its own pipe and log directories, asked to
# quit at the end), as the daemon is deployed for many clients.
#   bench/probes/handoff.sh PROBE_BINARY [CALLS] [BYTES]   (BYTES: the copy each call runs, default 1 MiB)
set -u
probe="$1" calls="${2:-200}" bytes="${3:-1048576}" rc=0
echo "== without MPS"
"$probe" pairs "$calls" "$bytes" || rc=1
"$probe" xpairs "$calls" "$bytes" || rc=1
tmp="$(mktemp -d)"
export CUDA_MPS_PIPE_DIRECTORY="$tmp/pipe" CUDA_MPS_LOG_DIRECTORY="$tmp/log"
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d || { echo "nvidia-cuda-mps-control -d failed"; exit 1; }
trap 'echo quit | timeout 10 nvidia-cuda-mps-control; tail -n 5 "$CUDA_MPS_LOG_DIRECTORY"/*.log 2>/dev/null' EXIT
echo "== under MPS"
"$probe" pairs "$calls" "$bytes" || rc=1
"$probe" xpairs "$calls" "$bytes" || rc=1
exit $rc
