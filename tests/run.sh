#!/usr/bin/env bash
# The project's test command (README, .ci/run). No GPU needed.
#
#   ./tests/run.sh
#
# 1. deploy/install.sh            (skipped with CACHE_DIT_SKIP_INSTALL=1)
# 2. deploy/build.sh              one CUDA target: CACHE_DIT_CUDA_ARCH_LIST,
#                                 default 90a, to keep CI short; -Werror
# 3. ctest -LE gpu                GoogleTest suites that need no device
# 4. pytest tests/kernels, tests/python, tests/bench, tests/deploy -m "not gpu" (one process each;
#    tests/deploy: the Kubernetes manifests, validated offline)
# 5. the C++ suites again under ASan+UBSan, and tests/python against the
#    instrumented daemon and tools
# 6. the concurrency suites under TSan (CACHE_DIT_SANITIZERS, default
#    "asan,tsan", names the steps 5 and 6 that run; "none": neither)
# 7. every fuzzer for 20 s (CACHE_DIT_FUZZ=none skips it)
# ctest and pytest both run whatever the other did; the script exits non-zero
# when any step failed, when ctest found no test, or when pytest collected none
# (its exit code 5). JUnit files and the build folder: ${CACHE_DIT_BUILD_DIR:-build}.
# The last line is `N passed, N failed, N skipped`, summed over ctest and pytest.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
VENV="${CACHE_DIT_VENV:-$ROOT/.venv}"
BUILD_DIR="${CACHE_DIT_BUILD_DIR:-$ROOT/build}"
export CACHE_DIT_BUILD_DIR="$BUILD_DIR"
export CACHE_DIT_CUDA_ARCH_LIST="${CACHE_DIT_CUDA_ARCH_LIST:-90a}"
export CACHE_DIT_OPD_BUILD_DIR="$BUILD_DIR"
# The project's own C++ is built with -Werror here (CI).
export CACHE_DIT_CMAKE_ARGS="-DCACHE_DIT_WERROR=ON${CACHE_DIT_CMAKE_ARGS:+ $CACHE_DIT_CMAKE_ARGS}"
RESULTS="$BUILD_DIR/test-results"
START=$SECONDS

say() { echo "tests/run.sh: $*"; }
status_of() { if [ "$1" -eq 0 ]; then echo ok; else echo "FAILED (exit $1)"; fi; }

# ---- 1. install ---------------------------------------------------------------
if [ "${CACHE_DIT_SKIP_INSTALL:-0}" = "1" ]; then
  say "install skipped (CACHE_DIT_SKIP_INSTALL=1)"
  INSTALL_RC=0
else
  say "== install: deploy/install.sh"
  ./deploy/install.sh
  INSTALL_RC=$?
fi
if [ "$INSTALL_RC" -ne 0 ]; then
  say "install $(status_of "$INSTALL_RC"); nothing else can run"
  echo "0 passed, 1 failed"
  exit 1
fi

PY="$VENV/bin/python"
[ -x "$PY" ] || PY="$(command -v python3)"

# ---- 2. build -----------------------------------------------------------------
say "== build: deploy/build.sh (CUDA targets $CACHE_DIT_CUDA_ARCH_LIST) into $BUILD_DIR"
CACHE_DIT_PYTHON="${CACHE_DIT_PYTHON:-$PY}" ./deploy/build.sh
BUILD_RC=$?
mkdir -p "$RESULTS"
rm -f "$RESULTS/ctest.xml"

# ---- 3. ctest -----------------------------------------------------------------
if [ "$BUILD_RC" -eq 0 ]; then
  say "== ctest (label gpu excluded)"
  ctest --test-dir "$BUILD_DIR" --output-on-failure --no-tests=error -LE gpu \
    --output-junit "$RESULTS/ctest.xml"
  CTEST_RC=$?
else
  say "== ctest not run: the build failed"
  CTEST_RC=1
fi

# ---- 4. pytest ----------------------------------------------------------------
# One pytest process per suite: tests/kernels loads the kernel library, which
# defines namespace cache_dit_cuda_ops; tests/python imports the client, which
# defines it too, and one process can hold only one definition.
if [ -d "$ROOT/python" ]; then export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"; fi
export CACHE_DIT_OPD_REQUIRE_BUILD=1
JUNIT=("$RESULTS/ctest.xml" "$CTEST_RC")
PYTEST_RC=0
for suite in tests/kernels tests/python tests/bench tests/deploy; do
  say "== pytest $suite -m 'not gpu'"
  xml="$RESULTS/pytest-$(basename "$suite").xml"
  rm -f "$xml"
  "$PY" -m pytest "$suite" -q -m "not gpu" --junitxml="$xml"
  rc=$?
  [ "$rc" -eq 5 ] && say "pytest collected no test in $suite (exit 5): counted as a failure"
  [ "$rc" -ne 0 ] && PYTEST_RC=$rc
  JUNIT+=("$xml" "$rc")
done

# ---- 5. sanitizers ------------------------------------------------------------
# The C++ suites once more, built with AddressSanitizer + UndefinedBehaviorSanitizer
# (CACHE_DIT_SANITIZE, cmake/OpdTargets.cmake; leak checks on, a finding fails
# its test) into $BUILD_DIR-asan, then the Python suite against its binaries.
# Left out of ctest: server.daemon_process, which runs pytest (an instrumented
# library cannot be loaded into an uninstrumented Python).
# CACHE_DIT_SANITIZERS=none skips the step.
SAN_RC=0
SANITIZERS="${CACHE_DIT_SANITIZERS:-asan,tsan}"
if [[ ",$SANITIZERS," == *,asan,* ]] && [ "$BUILD_RC" -eq 0 ]; then
  ASAN_DIR="$BUILD_DIR-asan"
  t0=$SECONDS
  say "== sanitizers: ASan+UBSan build into $ASAN_DIR"
  CACHE_DIT_PYTHON="${CACHE_DIT_PYTHON:-$PY}" ./deploy/build.sh --build-dir "$ASAN_DIR" -- \
    -DCACHE_DIT_SANITIZE=address,undefined
  SAN_RC=$?
  rm -f "$RESULTS/ctest-asan.xml"
  if [ "$SAN_RC" -eq 0 ]; then
    say "== ctest under ASan+UBSan (label gpu and server.daemon_process excluded)"
    # protect_shadow_gap=0: the CUDA runtime maps memory where ASan's shadow gap would be.
    ASAN_OPTIONS="protect_shadow_gap=0:detect_leaks=1" UBSAN_OPTIONS="print_stacktrace=1" \
      ctest --test-dir "$ASAN_DIR" --output-on-failure --no-tests=error -LE gpu -E '^server\.daemon_process$' \
      --output-junit "$RESULTS/ctest-asan.xml"
    SAN_RC=$?
  fi
  JUNIT+=("$RESULTS/ctest-asan.xml" "$SAN_RC")
  if [ -x "$ASAN_DIR/server/cache-dit-opd" ]; then
    say "== pytest tests/python -m 'not gpu' against the ASan+UBSan binaries"
    # What the tests start (daemon, fake daemon, opdctl, launcher, generators)
    # is the instrumented build; what Python loads in-process (the native
    # engine, the kernel library) stays $BUILD_DIR's: an uninstrumented Python
    # cannot load an instrumented library. Reports go to files, so that one
    # from a process whose death its test expects still fails the step.
    rm -f "$RESULTS"/asan-python.* "$RESULTS/pytest-python-asan.xml"
    # CACHE_DIT_OPD_SANITIZED=1: RSS figures measure the sanitizer's quarantine
    # here, so the hostile-client tests check descriptors only.
    CACHE_DIT_OPD_SANITIZED=1 CACHE_DIT_OPD_BUILD_DIR="$ASAN_DIR" CACHE_DIT_OPD_LIBRARY_BUILD_DIR="$BUILD_DIR" \
      CACHE_DIT_OPD_NATIVE_LIB="$BUILD_DIR/client/python/libcache_dit_opd_native.so" \
      ASAN_OPTIONS="protect_shadow_gap=0:detect_leaks=1:log_path=$RESULTS/asan-python" \
      UBSAN_OPTIONS="print_stacktrace=1:log_path=$RESULTS/asan-python" \
      "$PY" -m pytest tests/python -q -m "not gpu" --junitxml="$RESULTS/pytest-python-asan.xml"
    rc=$?
    if compgen -G "$RESULTS/asan-python.*" > /dev/null; then
      say "sanitizer reports from processes the Python suite started:"
      head -n 60 "$RESULTS"/asan-python.*
      [ "$rc" -eq 0 ] && rc=1
    fi
    JUNIT+=("$RESULTS/pytest-python-asan.xml" "$rc")
    [ "$rc" -ne 0 ] && SAN_RC=$rc
  fi
  say "sanitizers $(status_of "$SAN_RC") in $((SECONDS - t0)) s"
fi

# ---- 6. ThreadSanitizer -------------------------------------------------------
# The executor, ring, session, lanes and client suites built with
# -fsanitize=thread into $BUILD_DIR-tsan (tests/sanitizers/tsan.sh says which
# and why; tests/sanitizers/tsan.supp names the frames that are not ours).
TSAN_RC=0
if [[ ",$SANITIZERS," == *,tsan,* ]] && [ "$BUILD_RC" -eq 0 ]; then
  t0=$SECONDS
  say "== sanitizers: ThreadSanitizer suites (tests/sanitizers/tsan.sh)"
  CACHE_DIT_PYTHON="${CACHE_DIT_PYTHON:-$PY}" ./tests/sanitizers/tsan.sh --build-dir "$BUILD_DIR-tsan" \
    --junit "$RESULTS/ctest-tsan.xml"
  TSAN_RC=$?
  JUNIT+=("$RESULTS/ctest-tsan.xml" "$TSAN_RC")
  say "ThreadSanitizer $(status_of "$TSAN_RC") in $((SECONDS - t0)) s"
fi

# ---- 7. fuzzers ---------------------------------------------------------------
# Every libFuzzer target (tests/fuzz/README.md) for a short run over a copy of
# its committed corpus; a finding fails the step and keeps its input under
# $BUILD_DIR-fuzz/fuzz-artifacts. CACHE_DIT_FUZZ=none skips it;
# CACHE_DIT_FUZZ_SECONDS sets the time per target (default 20).
FUZZ_RC=0
if [ "${CACHE_DIT_FUZZ:-short}" != "none" ] && [ "$BUILD_RC" -eq 0 ]; then
  t0=$SECONDS
  say "== fuzzers: tests/fuzz/run.sh, ${CACHE_DIT_FUZZ_SECONDS:-20} s each"
  CACHE_DIT_PYTHON="${CACHE_DIT_PYTHON:-$PY}" ./tests/fuzz/run.sh --build-dir "$BUILD_DIR-fuzz" \
    --seconds "${CACHE_DIT_FUZZ_SECONDS:-20}"
  FUZZ_RC=$?
  say "fuzzers $(status_of "$FUZZ_RC") in $((SECONDS - t0)) s"
fi

# ---- summary ------------------------------------------------------------------
# Count testcases in both JUnit files; a step that failed without a failing
# testcase (build error, no tests, crash) counts as one failure.
COUNTS="$("$PY" tests/junit_summary.py "${JUNIT[@]}")" || COUNTS="0 1 0"
read -r N_PASS N_FAIL N_SKIP <<< "$COUNTS"

say "install $(status_of "$INSTALL_RC"), build $(status_of "$BUILD_RC"), ctest $(status_of "$CTEST_RC"), pytest $(status_of "$PYTEST_RC"), ASan+UBSan $(status_of "$SAN_RC"), TSan $(status_of "$TSAN_RC"), fuzzers $(status_of "$FUZZ_RC"); $((SECONDS - START)) s"
# The fuzzers write no JUnit file: a finding counts as one failure.
[ "$FUZZ_RC" -ne 0 ] && N_FAIL=$((N_FAIL + 1))
echo "$N_PASS passed, $N_FAIL failed, $N_SKIP skipped"
if [ "$BUILD_RC" -ne 0 ] || [ "$CTEST_RC" -ne 0 ] || [ "$PYTEST_RC" -ne 0 ] || [ "$SAN_RC" -ne 0 ] ||
  [ "$TSAN_RC" -ne 0 ] || [ "$FUZZ_RC" -ne 0 ] || [ "$N_FAIL" -ne 0 ]; then
  exit 1
fi
exit 0
