#!/usr/bin/env bash
# Nsight Compute on the svdq GEMM: one launch of the sm_90a kernel at one
# shape under each CACHE_DIT_SVDQ_GEMM schedule, with the sections that say
# what bounds it (throughput of SM, memory and pipes; shared-memory
# wavefronts; warp states; scheduler issue).
#
#   bench/ncu_svdq.sh --lib build-gpu/kernels/libcache_dit_cuda_ops.so --out DIR \
#                     [--shape 4608,3072,3072] [--schedules sm90,sm90-overlap]
#
# For each schedule: DIR/<schedule>.ncu-rep, DIR/<schedule>.txt (the
# details page) and DIR/<schedule>.raw.csv (every metric collected: the stall
# reasons and pipe utilizations the details page only summarizes) and
# DIR/<schedule>.sass.csv (per SASS instruction: executions and warp stall
# samples by reason). The kernel runs in bench/svdq.py's GEMM child (its inputs,
# its warm-up); the profiled launch is the first timed one. Clocks are left
# alone (--clock-control none, the device notes' advice), so durations match
# the benchmark's.
set -euo pipefail
LIB="" OUT="" SHAPE="4608,3072,3072" SCHEDULES="sm90,sm90-overlap"
while [ $# -gt 0 ]; do
  case "$1" in
    --lib) LIB="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --shape) SHAPE="$2"; shift 2 ;;
    --schedules) SCHEDULES="$2"; shift 2 ;;
    -h | --help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "ncu_svdq.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
[ -n "$LIB" ] && [ -n "$OUT" ] || { echo "ncu_svdq.sh: --lib and --out are required" >&2; exit 2; }
NCU="${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p "$OUT"
IFS=, read -r M K N <<< "$SHAPE"
for schedule in ${SCHEDULES//,/ }; do
  # The child runs the quantizer once, then the GEMM 3 times to warm up and
  # once timed (svdq.device_time): skip 3 launches of gemm_kernel.
  CACHE_DIT_SVDQ_GEMM="$schedule" "$NCU" --clock-control none -f -o "$OUT/$schedule" \
    -k regex:gemm_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats \
    --section LaunchStats --section Occupancy --section SourceCounters \
    "${PYTHON:-python3}" "$HERE/svdq.py" --lib "$LIB" --iters 1 --gemm-only "[[$M, $K, $N]]" \
    --json "$OUT/$schedule.times.json" > "$OUT/$schedule.log" 2>&1 || {
      echo "ncu_svdq.sh: $schedule failed"; tail -n 20 "$OUT/$schedule.log"; continue; }
  "$NCU" -i "$OUT/$schedule.ncu-rep" --page details > "$OUT/$schedule.txt"
  "$NCU" -i "$OUT/$schedule.ncu-rep" --page raw --csv > "$OUT/$schedule.raw.csv"
  "$NCU" -i "$OUT/$schedule.ncu-rep" --page source --print-source sass --csv > "$OUT/$schedule.sass.csv" || true
  echo "ncu_svdq.sh: $schedule -> $OUT/$schedule.txt"
done
