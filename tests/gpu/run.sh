#!/usr/bin/env bash
# GPU runner: build on a CUDA host and run every suite, GPU ones included.
#
#   tests/gpu/run.sh [--prefix DEBS_DIR]
#
# - Offline dependencies: with --prefix DEBS_DIR, or when <repo>/.offline/debs
#   exists, sources deploy/offline/use-prefix.sh DEBS_DIR (unpacks into
#   <repo>/.offline/prefix and exports the paths CMake and the loader need);
#   wheels in ${CACHE_DIT_WHEELS:-<repo>/.offline/wheels} (the test
#   dependencies, deploy/offline/fetch-wheels.sh) go to <build dir>/pydeps.
# - Python: the `python3` on PATH (the host's torch install); no venv, no pip.
#   CACHE_DIT_PYTHON overrides it.
# - CUDA targets: from `nvidia-smi --query-gpu=compute_cap` (9.0 -> 90a, 8.9 ->
#   89, 10.0 -> 100, ...) unless CACHE_DIT_CUDA_ARCH_LIST is set.
# - Builds with deploy/build.sh into ${CACHE_DIT_GPU_BUILD_DIR:-<repo>/build-gpu}
#   (installs nothing), then runs `ctest` (all labels, gpu included) and
#   `python3 -m pytest` on tests/kernels and tests/python (one process each,
#   CACHE_DIT_GPU_SUITES overrides) with CACHE_DIT_OPD_BUILD_DIR set;
#   CACHE_DIT_GPU_CTEST_ARGS / CACHE_DIT_GPU_PYTEST_ARGS add arguments to each
#   (`-L gpu` / `-m gpu`: only the tests CI cannot run).
# - Logs and JUnit files go to ${OUT:-<build dir>/results}.
# The last line is `N passed, N failed, N skipped` counted from both JUnit
# files (errors count as failed). Exit status is non-zero when anything failed
# or when nothing passed. A failed build prints the tail of its log and ends
# with `0 passed, 1 failed`.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 1
DEBS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) [ $# -ge 2 ] || { echo "tests/gpu/run.sh: --prefix needs a folder" >&2; exit 2; }; DEBS="$2"; shift 2 ;;
    --prefix=*) DEBS="${1#--prefix=}"; shift ;;
    -h | --help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "tests/gpu/run.sh: unknown argument '$1' (usage: tests/gpu/run.sh [--prefix DEBS_DIR])" >&2; exit 2 ;;
  esac
done

BUILD_DIR="${CACHE_DIT_GPU_BUILD_DIR:-$ROOT/build-gpu}"
RESULTS="${OUT:-$BUILD_DIR/results}"
mkdir -p "$RESULTS"
RESULTS="$(cd "$RESULTS" && pwd)"
rm -f "$RESULTS"/ctest.xml "$RESULTS"/pytest-*.xml
START=$SECONDS

say() { echo "gpu/run.sh: $*"; }
# Ends the run when a step before the tests fails: one failure, no passes.
abort() {
  say "$1"
  if [ -n "${2-}" ] && [ -f "$2" ]; then
    echo "----- last 60 lines of $2 -----"
    tail -n 60 "$2"
    echo "-----"
  fi
  echo "0 passed, 1 failed" | tee "$RESULTS/summary.txt"
  exit 1
}

# ---- dependencies -------------------------------------------------------------
if [ -z "$DEBS" ] && [ -d "$ROOT/.offline/debs" ]; then DEBS="$ROOT/.offline/debs"; fi
if [ -n "$DEBS" ]; then
  # shellcheck source=deploy/offline/use-prefix.sh
  source "$ROOT/deploy/offline/use-prefix.sh" "$DEBS" > "$RESULTS/prefix.log" 2>&1 ||
    abort "offline prefix from $DEBS failed" "$RESULTS/prefix.log"
  tail -n 1 "$RESULTS/prefix.log"
fi

PY="${CACHE_DIT_PYTHON:-$(command -v python3 || true)}"
[ -n "$PY" ] || abort "python3 not found on PATH"
export CACHE_DIT_PYTHON="$PY"
export CACHE_DIT_OPD_BUILD_DIR="$BUILD_DIR"
if ! command -v nvcc > /dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi

# ---- Python test dependencies without an index (deploy/offline/fetch-wheels.sh)
WHEELS="${CACHE_DIT_WHEELS:-$ROOT/.offline/wheels}"
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  "$PY" -m pip install --quiet --no-deps --no-index --upgrade --target "$BUILD_DIR/pydeps" "$WHEELS"/*.whl \
    > "$RESULTS/wheels.log" 2>&1 || abort "installing the wheels of $WHEELS failed" "$RESULTS/wheels.log"
  export PYTHONPATH="$BUILD_DIR/pydeps${PYTHONPATH:+:$PYTHONPATH}"
  say "test wheels from $WHEELS: $(cd "$WHEELS" && ls -- *.whl | paste -sd' ' -)"
fi

# ---- CUDA targets -------------------------------------------------------------
GPU_INFO="$(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader 2> /dev/null || true)"
if [ -n "$GPU_INFO" ]; then
  say "GPUs: $(echo "$GPU_INFO" | paste -sd';' -)"
else
  say "WARNING: nvidia-smi lists no GPU; GPU tests will fail or skip"
fi
if [ -z "${CACHE_DIT_CUDA_ARCH_LIST-}" ] && [ -n "$GPU_INFO" ]; then
  ARCHS=""
  for cap in $(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2> /dev/null | tr -d ' ' | sort -u); do
    case "$cap" in
      9.0) a=90a ;;
      *.*) a="${cap%%.*}${cap#*.}" ;;
      *) continue ;;
    esac
    ARCHS="${ARCHS:+$ARCHS;}$a"
  done
  [ -n "$ARCHS" ] && export CACHE_DIT_CUDA_ARCH_LIST="$ARCHS"
fi
say "python $PY ($("$PY" -c 'import torch; print("torch", torch.__version__)' 2> /dev/null || echo 'no torch')),"\
    "CUDA targets ${CACHE_DIT_CUDA_ARCH_LIST:-<CMake default>}, build $BUILD_DIR, results $RESULTS"

# ---- build --------------------------------------------------------------------
say "building (log: $RESULTS/build.log)"
./deploy/build.sh --no-install --build-dir "$BUILD_DIR" > "$RESULTS/build.log" 2>&1 ||
  abort "build FAILED after $((SECONDS - START)) s" "$RESULTS/build.log"
say "built in $((SECONDS - START)) s"

# ---- tests --------------------------------------------------------------------
say "== ctest (all labels)"
# In parallel, except the tests labelled gpu: each of those runs alone
# (RUN_SERIAL, cmake/OpdTargets.cmake).
# shellcheck disable=SC2086 # word splitting of the extra arguments is intended
ctest --test-dir "$BUILD_DIR" -j "$(nproc)" --output-on-failure --no-tests=error ${CACHE_DIT_GPU_CTEST_ARGS-} \
  --output-junit "$RESULTS/ctest.xml" 2>&1 | tee "$RESULTS/ctest.log"
CTEST_RC=${PIPESTATUS[0]}

# One pytest process per suite (tests/kernels loads the kernel library, tests/python
# the client; both define namespace cache_dit_cuda_ops).
if [ -d "$ROOT/python" ]; then export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"; fi
export CACHE_DIT_OPD_REQUIRE_BUILD=1
JUNIT=("$RESULTS/ctest.xml" "$CTEST_RC")
for suite in ${CACHE_DIT_GPU_SUITES:-tests/kernels tests/python}; do
  say "== pytest $suite"
  name="$(basename "$suite")"
  # shellcheck disable=SC2086
  "$PY" -m pytest "$suite" -q -rs --durations=15 ${CACHE_DIT_GPU_PYTEST_ARGS-} --junitxml="$RESULTS/pytest-$name.xml" 2>&1 | tee "$RESULTS/pytest-$name.log"
  JUNIT+=("$RESULTS/pytest-$name.xml" "${PIPESTATUS[0]}")
done

# ---- summary ------------------------------------------------------------------
# Testcases with <failure> or <error> count as failed, <skipped> (or ctest's
# notrun/disabled) as skipped, the rest as passed. A runner that exited
# non-zero without a failing testcase (crash, no tests, exit 5) adds one failure.
COUNTS="$("$PY" tests/junit_summary.py "${JUNIT[@]}")" || COUNTS="0 1 0"
read -r N_PASS N_FAIL N_SKIP <<< "$COUNTS"

say "ctest exit $CTEST_RC, $((SECONDS - START)) s in all; logs and JUnit in $RESULTS"
echo "$N_PASS passed, $N_FAIL failed, $N_SKIP skipped" | tee "$RESULTS/summary.txt"
if [ "$N_FAIL" -ne 0 ] || [ "$N_PASS" -eq 0 ]; then exit 1; fi
exit 0
