#!/usr/bin/env bash
# Several GPU steps in one call with one time budget, for hosts lent by the
# minute (the device tool: one call, results under $OUT, a few files back).
#
#   tests/gpu/batch.sh [--budget SECONDS] STEP...
#
# Builds once into ${CACHE_DIT_GPU_BUILD_DIR:-build-gpu} (the offline prefix
# from .offline/debs when it exists, the wheels of .offline/wheels into
# <build>/pydeps, as tests/gpu/run.sh does), then runs the steps in order,
# each under `timeout` with what is left of the budget (default 480 s) less
# 15 s for the end, and ends by packing $OUT (default <build>/results) into
# $OUT/all.tgz. Steps:
#   svdq-tests      pytest tests/kernels/test_svdq_gpu.py
#   svdq-bench[=S]  bench/svdq.py, timing schedules S (comma-separated;
#                   default all; "none": the table alone) against the
#                   default                              -> $OUT/svdq.json
#   ncu-svdq[=S]    bench/ncu_svdq.sh for schedules S (default sm90,sm90-overlap)
#   probe-wgmma[=P] opd_wgmma_loop_probe, runs P (comma-separated; default all)
#   probe-traffic[=M]  opd_traffic_probe: DRAM bandwidth of each read : write mix
#                   (M: MiB the 1 : 1 case reads, default 1024)
#   kernels-bench[=O]  bench/kernels.py, ops whose name contains O (default all)
#                                                        -> $OUT/kernels[.N].json
#   probe-handoff[=B]  bench/probes/handoff.sh: the hand-off's GPU ceiling, one
#                   context and a process per client, without and under MPS;
#                   B: the bytes each call's copy moves (default 1 MiB)
#   ctest-gpu       ctest -L gpu
#   kernels-gpu[=K] pytest tests/kernels -m gpu (-k K when given)
#   python-gpu      pytest tests/python -m gpu
#   all             tests/gpu/run.sh (every suite)
#   bench-quick[=C[|A]]  bench/run.sh --quick, cases C (comma-separated;
#                   default all), extra daemon flags A  -> $OUT/bench[.N]
#   bench-full[=F[|A]]  bench/run.sh (the full suite) with bench/run.sh flags F
#                   (space-separated, e.g. "--mps --only pipelined") and extra
#                   daemon flags A (e.g. "--ring-capacity 8")
#                                                        -> $OUT/bench-full[.N]
# Each step's output goes to $OUT/<step>[.N].log (N counts repeats of a step);
# its last lines and its exit status are printed as it ends.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 1
BUDGET=480
if [ "${1-}" = "--budget" ]; then BUDGET="$2"; shift 2; fi
[ $# -gt 0 ] || { sed -n '2,30p' "$0"; exit 2; }
BUILD="${CACHE_DIT_GPU_BUILD_DIR:-$ROOT/build-gpu}"
OUT="${OUT:-$BUILD/results}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
T0=$SECONDS
say() { echo "batch.sh [$((SECONDS - T0)) s]: $*"; }
left() { echo $((BUDGET - 15 - (SECONDS - T0))); }
pack() {
  tar czf "/tmp/batch-$$.tgz" -C "$OUT" --exclude all.tgz . && mv "/tmp/batch-$$.tgz" "$OUT/all.tgz"
  say "packed $OUT/all.tgz"
}
trap pack EXIT

if [ -d "$ROOT/.offline/debs" ]; then
  # shellcheck source=deploy/offline/use-prefix.sh
  source "$ROOT/deploy/offline/use-prefix.sh" "$ROOT/.offline/debs" > "$OUT/prefix.log" 2>&1 ||
    { say "offline prefix failed"; tail -n 20 "$OUT/prefix.log"; exit 1; }
fi
if ! command -v nvcc > /dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
export CACHE_DIT_CUDA_ARCH_LIST="${CACHE_DIT_CUDA_ARCH_LIST:-90a}"
./deploy/build.sh --no-install --build-dir "$BUILD" > "$OUT/build.log" 2>&1 ||
  { say "build FAILED"; tail -n 60 "$OUT/build.log"; exit 1; }
say "built"
if compgen -G "$ROOT/.offline/wheels/*.whl" > /dev/null; then
  python3 -m pip install --quiet --no-deps --no-index --upgrade --target "$BUILD/pydeps" "$ROOT"/.offline/wheels/*.whl \
    > "$OUT/wheels.log" 2>&1 || say "wheels failed (see wheels.log)"
  export PYTHONPATH="$BUILD/pydeps${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
export CACHE_DIT_OPD_BUILD_DIR="$BUILD" CACHE_DIT_OPD_REQUIRE_BUILD=1
LIB="$BUILD/kernels/libcache_dit_cuda_ops.so"

RC=0
declare -A SEEN
for step in "$@"; do
  name="${step%%=*}" arg=""
  [ "$name" != "$step" ] && arg="${step#*=}"
  n=$((${SEEN[$name]:-0} + 1)) && SEEN[$name]=$n
  tag="$name$([ "$n" -gt 1 ] && echo ".$n")"
  limit="$(left)"
  if [ "$limit" -le 10 ]; then say "$tag: not started, the budget is spent"; RC=1; continue; fi
  say "$tag (up to $limit s)"
  case "$name" in
    svdq-tests) cmd=(python3 -m pytest tests/kernels/test_svdq_gpu.py -q -rs -p no:cacheprovider) ;;
    svdq-bench) cmd=(python3 bench/svdq.py --lib "$LIB" --json "$OUT/svdq.json") ;;
    ncu-svdq) cmd=(bench/ncu_svdq.sh --lib "$LIB" --out "$OUT/ncu" --schedules "${arg:-sm90,sm90-overlap}") ;;
    probe-wgmma) cmd=("$BUILD/bench/probes/opd_wgmma_loop_probe" ${arg//,/ }) ;;
    probe-traffic) cmd=("$BUILD/bench/probes/opd_traffic_probe" ${arg:+"$arg"}) ;;
    kernels-bench) cmd=(python3 bench/kernels.py --lib "$LIB" --json "$OUT/kernels${tag#kernels-bench}.json" ${arg:+--only "$arg"}) ;;
    probe-handoff) cmd=(bench/probes/handoff.sh "$BUILD/bench/probes/opd_stream_queues_probe" ${arg:+200 "$arg"}) ;;
    ctest-gpu) cmd=(ctest --test-dir "$BUILD" --output-on-failure -L gpu) ;;
    kernels-gpu) cmd=(python3 -m pytest tests/kernels -m gpu -q -rs -p no:cacheprovider ${arg:+-k "$arg"}) ;;
    python-gpu) cmd=(python3 -m pytest tests/python -m gpu -q -rs -p no:cacheprovider) ;;
    all) cmd=(env OUT="$OUT/run" tests/gpu/run.sh) ;;
    bench-quick)
      cmd=(bench/run.sh --quick --no-readme --build "$BUILD" --out "$OUT/bench${tag#bench-quick}")
      [ -n "${arg%%|*}" ] && cmd+=(--only "${arg%%|*}") ;;
    bench-full)
      # shellcheck disable=SC2206  # F is a list of flags
      cmd=(bench/run.sh --no-readme --build "$BUILD" --out "$OUT/bench-full${tag#bench-full}" ${arg%%|*}) ;;
    *) say "unknown step '$name'"; RC=2; continue ;;
  esac
  [ "$name" = svdq-bench ] && [ -n "$arg" ] && cmd+=(--schedules "${arg/#none/}")
  # bench-quick and bench-full: what follows a '|' is extra daemon flags.
  [[ "$name" == bench-* && "$arg" == *"|"* ]] && cmd+=(--daemon-args "${arg#*|}")
  timeout "$limit" "${cmd[@]}" > "$OUT/$tag.log" 2>&1
  rc=$?
  tail -n 25 "$OUT/$tag.log"
  say "$tag: exit $rc$([ "$rc" -eq 124 ] && echo ' (timed out)')"
  [ "$rc" -ne 0 ] && RC=1
  # timeout signals the step's process group; daemons its tests started in
  # sessions of their own outlive it and would hold the GPU (and parked
  # waits) under the next step's tests and timings.
  if [ "$rc" -eq 124 ] && pkill -TERM -f "$BUILD/server/cache-dit-opd" 2> /dev/null; then
    sleep 2
    pkill -KILL -f "$BUILD/server/cache-dit-opd" 2> /dev/null
    say "$tag: stopped the daemons it left running"
  fi
done
exit "$RC"
