#!/usr/bin/env bash
# The daemon's and the C++ client's concurrency suites under ThreadSanitizer.
#
#   tests/sanitizers/tsan.sh [--build-dir DIR] [--junit FILE] [--build-only] [-- CTEST_ARGS...]
#
# Build folder : --build-dir, else ${CACHE_DIT_BUILD_DIR:-<repo>/build}-tsan
# JUnit file   : --junit, else $CACHE_DIT_TSAN_JUNIT, else
#                <build folder>/test-results/ctest-tsan.xml (ctest --output-junit)
# Extra args   : $CACHE_DIT_CMAKE_ARGS (as deploy/build.sh takes it: split on
#                spaces; tests/run.sh puts -DCACHE_DIT_WERROR=ON there), and
#                everything after `--` goes to ctest (e.g. -R '^server\.Ring').
#
# What is built: -DCACHE_DIT_SANITIZE=thread (cmake/OpdTargets.cmake), Release
# (-O3 -g), and only three test executables and their dependencies:
#   opd_server_tests  ctest server.*  executors (ExecutorTest, LaunchAheadTest,
#                     ExecutorPoolTest),
#                     ring (Ring*Test), session manager, region registry, peer
#                     policy, the gRPC service in-process (DaemonServiceTest),
#                     and the small single-threaded ones in the same binary
#                     (options, proto, Status mapping, runtime dir)
#   opd_client_test   ctest client.*  lanes (LanesTest, Semaphores), session
#                     channel, session memory (SessionMapping, TensorRef),
#                     regions (RegionCacheTest), discovery
#   opd_store_tests   ctest server.*  the weight store (WeightStoreTest: sets
#                     published concurrently) and its safetensors reader
# The kernel library, torch and the Python client's native engine are off
# (-DCACHE_DIT_BUILD_KERNELS=OFF -DCACHE_DIT_BUILD_NATIVE_CLIENT=OFF): none of
# these suites needs them. Not run: the "gpu" label, server.daemon_process
# (pytest: an instrumented library cannot load into an uninstrumented Python),
# server.no_libcuda (an ldd check of binaries this build does not make), and
# client.EngineTest (needs the fake daemon, hence the kernel library and torch).
#
# Also left out: server.MemoryTrimmerTest.FreedMemoryHeldInAThreadsArena...,
# which measures glibc malloc's per-thread arenas (TSan brings its own
# allocator: there is no arena to trim).
#
# Every TSan report fails its test: halt_on_error=1 and exitcode=66, with
# tests/sanitizers/tsan.supp naming the frames that are not the project's
# (uninstrumented gRPC and abseil, gRPC's header code, spdlog's registry).
# Extra TSAN_OPTIONS from the environment are appended (later ones win), e.g.
# TSAN_OPTIONS=halt_on_error=0:print_suppressions=1 to see every report and
# how often each suppression matched.
# Exit status: 1 when configuring or building failed (no JUnit file then),
# else ctest's (non-zero when a test failed or no test ran).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD_DIR="${CACHE_DIT_BUILD_DIR:-$ROOT/build}-tsan"
JUNIT="${CACHE_DIT_TSAN_JUNIT-}"
BUILD_ONLY=0
CTEST_EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) [ $# -ge 2 ] || { echo "tsan.sh: --build-dir needs a value" >&2; exit 2; }; BUILD_DIR="$2"; shift 2 ;;
    --build-dir=*) BUILD_DIR="${1#--build-dir=}"; shift ;;
    --junit) [ $# -ge 2 ] || { echo "tsan.sh: --junit needs a value" >&2; exit 2; }; JUNIT="$2"; shift 2 ;;
    --junit=*) JUNIT="${1#--junit=}"; shift ;;
    --build-only) BUILD_ONLY=1; shift ;;
    -h | --help) sed -n '2,41p' "$0"; exit 0 ;;
    --) shift; CTEST_EXTRA=("$@"); break ;;
    *) echo "tsan.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$BUILD_DIR" in /*) ;; *) BUILD_DIR="$PWD/$BUILD_DIR" ;; esac
[ -n "$JUNIT" ] || JUNIT="$BUILD_DIR/test-results/ctest-tsan.xml"
case "$JUNIT" in /*) ;; *) JUNIT="$PWD/$JUNIT" ;; esac
SUPP="$ROOT/tests/sanitizers/tsan.supp"
TARGETS=(opd_server_tests opd_client_test opd_store_tests)

# nvcc is often installed but not on PATH; CMake's CUDAToolkit wants it.
if ! command -v nvcc > /dev/null && [ -z "${CUDACXX-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi

ARGS=(-S "$ROOT" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DCACHE_DIT_SANITIZE=thread
      -DCACHE_DIT_BUILD_KERNELS=OFF -DCACHE_DIT_BUILD_NATIVE_CLIENT=OFF -DCACHE_DIT_PYTHON=)
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ] && command -v ninja > /dev/null; then
  ARGS+=(-G Ninja)
fi
if [ -n "${CACHE_DIT_CMAKE_ARGS-}" ]; then
  read -r -a ENV_ARGS <<< "$CACHE_DIT_CMAKE_ARGS"
  ARGS+=("${ENV_ARGS[@]}")
fi

t0=$SECONDS
echo "tsan.sh: cmake ${ARGS[*]}"
cmake "${ARGS[@]}" || exit 1
echo "tsan.sh: cmake --build $BUILD_DIR --target ${TARGETS[*]} -j $(nproc)"
cmake --build "$BUILD_DIR" --target "${TARGETS[@]}" -j "$(nproc)" || exit 1
echo "tsan.sh: built in $((SECONDS - t0)) s"
[ "$BUILD_ONLY" = "1" ] && exit 0

# halt_on_error=1: the first report ends the process; exitcode=66 makes it a
# failure even where a report comes from a thread gtest does not see.
# second_deadlock_stack=1: both stacks of a lock-order inversion.
# history_size=4: a longer per-thread history, so that the earlier access of
# a report still has its stack ("failed to restore the stack" otherwise).
export TSAN_OPTIONS="suppressions=$SUPP:halt_on_error=1:exitcode=66:second_deadlock_stack=1:history_size=4${TSAN_OPTIONS:+:$TSAN_OPTIONS}"
mkdir -p "$(dirname "$JUNIT")"
rm -f "$JUNIT"
t1=$SECONDS
echo "tsan.sh: ctest under TSan (TSAN_OPTIONS=$TSAN_OPTIONS)"
# Only the executables above were built: select their tests by prefix
# (server.gpu.* and client_gpu.* carry the gpu label). Left out: see above.
EXCLUDE='^(server\.(daemon_process|no_libcuda)$|client\.EngineTest\.|server\.MemoryTrimmerTest\.FreedMemoryHeld)'
ctest --test-dir "$BUILD_DIR" --output-on-failure --no-tests=error -j "$(nproc)" \
  -LE gpu -R '^(server|client)\.' -E "$EXCLUDE" --output-junit "$JUNIT" "${CTEST_EXTRA[@]}"
RC=$?
echo "tsan.sh: ctest $([ "$RC" -eq 0 ] && echo ok || echo "FAILED (exit $RC)") in $((SECONDS - t1)) s; JUnit: $JUNIT"
exit "$RC"
