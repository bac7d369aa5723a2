#!/usr/bin/env bash
# Build the libFuzzer targets (tests/fuzz/) with clang and run each over a copy
# of its committed seed corpus.
#
#   tests/fuzz/run.sh [--build-dir DIR] [--seconds N | --runs N] [target...]
#
# Build folder : --build-dir, else ${CACHE_DIT_FUZZ_BUILD_DIR:-<repo>/build-fuzz};
#                configured when it has no CMakeCache.txt (clang, Ninja,
#                CACHE_DIT_FUZZ=ON, no kernels: cmake/CacheDitFuzz.cmake), then
#                brought up to date with only the fuzz targets asked for.
# Budget       : --seconds N per target (libFuzzer -max_total_time; default 20,
#                the CI run) or --runs N inputs per target (-runs).
# Targets      : ring_record_fuzz call_proto_fuzz dispatch_fuzz bind_request_fuzz
#                bind_reply_fuzz session_header_fuzz safetensors_fuzz (default: all; dispatch_fuzz
#                only where the Python at ${CACHE_DIT_PYTHON:-<repo>/.venv/bin/python}
#                imports torch).
# The committed corpus (tests/fuzz/corpus/<target>/) is copied to a scratch
# folder and never written. A crash, leak, timeout, out-of-memory or violated
# invariant is a finding: its input goes to
# ${CACHE_DIT_FUZZ_ARTIFACTS:-<build dir>/fuzz-artifacts}/<target>/, the path is
# printed, and the script exits 1 (after running the other targets). Per
# target it prints executions, executions per second and libFuzzer's final
# coverage (cov: edges, ft: features). Reproduce one input with
# `<build dir>/tests/fuzz/<target> <file>` (OPD_FUZZ_VERBOSE=1 says more).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD_DIR="${CACHE_DIT_FUZZ_BUILD_DIR:-$ROOT/build-fuzz}"
ALL=(ring_record_fuzz call_proto_fuzz dispatch_fuzz bind_request_fuzz bind_reply_fuzz session_header_fuzz safetensors_fuzz)
SECONDS_EACH=20
RUNS=""
TARGETS=()
usage() { sed -n '2,25p' "$0"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) [ $# -ge 2 ] || { echo "run.sh: --build-dir needs a value" >&2; exit 2; }; BUILD_DIR="$2"; shift 2 ;;
    --build-dir=*) BUILD_DIR="${1#--build-dir=}"; shift ;;
    --seconds) [ $# -ge 2 ] || { echo "run.sh: --seconds needs a value" >&2; exit 2; }; SECONDS_EACH="$2"; RUNS=""; shift 2 ;;
    --seconds=*) SECONDS_EACH="${1#--seconds=}"; RUNS=""; shift ;;
    --runs) [ $# -ge 2 ] || { echo "run.sh: --runs needs a value" >&2; exit 2; }; RUNS="$2"; shift 2 ;;
    --runs=*) RUNS="${1#--runs=}"; shift ;;
    -h | --help) usage; exit 0 ;;
    -*) echo "run.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *) TARGETS+=("$1"); shift ;;
  esac
done
case "$BUILD_DIR" in /*) ;; *) BUILD_DIR="$PWD/$BUILD_DIR" ;; esac
for n in $SECONDS_EACH $RUNS; do
  case "$n" in '' | *[!0-9]*) echo "run.sh: '$n' is not a count" >&2; exit 2 ;; esac
done
for t in "${TARGETS[@]}"; do
  case " ${ALL[*]} " in *" $t "*) ;; *) echo "run.sh: unknown target '$t' (targets: ${ALL[*]})" >&2; exit 2 ;; esac
done
ARTIFACTS="${CACHE_DIT_FUZZ_ARTIFACTS:-$BUILD_DIR/fuzz-artifacts}"

# ---- configure (once) and build ------------------------------------------------
PY="${CACHE_DIT_PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3 || true)"
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  CC_="${CACHE_DIT_FUZZ_CC:-clang}"
  CXX_="${CACHE_DIT_FUZZ_CXX:-clang++}"
  command -v "$CXX_" > /dev/null || { echo "run.sh: $CXX_ not found (deploy/install.sh installs clang)" >&2; exit 1; }
  # nvcc is not needed (no kernels), but CMake finds the CUDA toolkit through it.
  if ! command -v nvcc > /dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
  ARGS=(-S "$ROOT" -B "$BUILD_DIR" -DCMAKE_C_COMPILER="$CC_" -DCMAKE_CXX_COMPILER="$CXX_"
        -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCACHE_DIT_FUZZ=ON -DCACHE_DIT_BUILD_KERNELS=OFF)
  command -v ninja > /dev/null && ARGS+=(-G Ninja)
  if [ -n "$PY" ] && "$PY" -c 'import torch' 2> /dev/null; then
    ARGS+=("-DCACHE_DIT_PYTHON=$PY")
  else
    echo "run.sh: no torch in ${PY:-python3}: dispatch_fuzz is not built" >&2
    ARGS+=(-DCACHE_DIT_BUILD_NATIVE_CLIENT=OFF)
  fi
  echo "run.sh: cmake ${ARGS[*]}"
  cmake "${ARGS[@]}" > "$BUILD_DIR.configure.log" 2>&1 || { cat "$BUILD_DIR.configure.log" >&2; exit 1; }
fi
if [ "${#TARGETS[@]}" -eq 0 ]; then
  for t in "${ALL[@]}"; do
    if [ "$t" = dispatch_fuzz ] && ! grep -q '^CACHE_DIT_BUILD_NATIVE_CLIENT:BOOL=ON' "$BUILD_DIR/CMakeCache.txt"; then
      continue
    fi
    TARGETS+=("$t")
  done
fi
echo "run.sh: building ${TARGETS[*]} in $BUILD_DIR"
cmake --build "$BUILD_DIR" -j "$(nproc)" --target "${TARGETS[@]}"

# ---- run ------------------------------------------------------------------------
SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/opd-fuzz.XXXXXX")"
trap 'rm -rf "$SCRATCH"' EXIT
if [ -n "$RUNS" ]; then BUDGET=(-runs="$RUNS"); else BUDGET=(-max_total_time="$SECONDS_EACH"); fi
# As tests/run.sh's sanitizer step: the CUDA runtime (linked, and loaded with
# libtorch_cuda) maps memory where ASan's shadow gap would be on a GPU host.
export ASAN_OPTIONS="protect_shadow_gap=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
FOUND=0
ROWS=()
for t in "${TARGETS[@]}"; do
  exe="$BUILD_DIR/tests/fuzz/$t"
  work="$SCRATCH/$t"
  mkdir -p "$work/corpus" "$ARTIFACTS/$t"
  [ -d "$ROOT/tests/fuzz/corpus/$t" ] && cp "$ROOT/tests/fuzz/corpus/$t/"* "$work/corpus/" 2> /dev/null || true
  log="$work/log"
  echo "run.sh: $t ${BUDGET[*]}"
  rc=0
  # -max_len: a ring slot is 2048 bytes; every target's input fits 4096.
  # -rss_limit_mb: libtorch alone takes ~500 MB in dispatch_fuzz.
  "$exe" "${BUDGET[@]}" -print_final_stats=1 -max_len=4096 -timeout=25 -rss_limit_mb=4096 \
    -artifact_prefix="$ARTIFACTS/$t/" "$work/corpus" > "$log" 2>&1 || rc=$?
  execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)"
  rate="$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)"
  final="$(grep -E '^#[0-9]+' "$log" | grep -E 'cov: [0-9]+' | tail -1 || true)"
  cov="$(sed -E -n 's/.* cov: ([0-9]+).*/\1/p' <<< "$final")"
  ft="$(sed -E -n 's/.* ft: ([0-9]+).*/\1/p' <<< "$final")"
  corp="$(sed -E -n 's/.* corp: ([0-9]+)\/.*/\1/p' <<< "$final")"
  crashes="$(sed -n "s/.*Test unit written to //p" "$log")"
  result=ok
  if [ "$rc" -ne 0 ] || [ -n "$crashes" ]; then
    result="FINDING (exit $rc)"
    FOUND=1
    echo "run.sh: $t: finding; log tail:" >&2
    grep -v '^#[0-9]' "$log" | tail -40 >&2
    for c in $crashes; do echo "run.sh: $t: input: $c" >&2; done
    cp "$log" "$ARTIFACTS/$t/log"
  fi
  ROWS+=("$(printf '%-20s %12s %10s %7s %7s %7s  %s' "$t" "${execs:-?}" "${rate:-?}" "${cov:-?}" "${ft:-?}" "${corp:-?}" "$result")")
done

printf '\n%-20s %12s %10s %7s %7s %7s  %s\n' target executions exec/s cov ft corpus result
printf '%s\n' "${ROWS[@]}"
[ "$FOUND" -eq 0 ] || { echo "run.sh: findings above; inputs under $ARTIFACTS" >&2; exit 1; }
