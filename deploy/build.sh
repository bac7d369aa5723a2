#!/usr/bin/env bash
# Configure and build cache-dit-opd with CMake (+ Ninja when available).
#
#   deploy/build.sh [--arch LIST] [--build-dir DIR] [--no-install] [-- CMAKE_ARGS...]
#
# Build folder : --build-dir, else ${CACHE_DIT_BUILD_DIR:-<repo>/build}
# Python       : -DCACHE_DIT_PYTHON= $CACHE_DIT_PYTHON, else <venv>/bin/python
#                (${CACHE_DIT_VENV:-<repo>/.venv}) when it exists, else python3
#                on PATH; the kernels build against that interpreter's torch.
# CUDA targets : -DCACHE_DIT_CUDA_ARCH_LIST= --arch, else $CACHE_DIT_CUDA_ARCH_LIST
#                when set; otherwise the project's default list applies.
# Extra args   : $CACHE_DIT_CMAKE_ARGS (set by deploy/offline/use-prefix.sh;
#                split on spaces), then everything after `--`.
# Always -DCMAKE_BUILD_TYPE=Release, builds with -j $(nproc). It never installs
# packages (--no-install is accepted and changes nothing); run
# deploy/install.sh first on a fresh machine.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${CACHE_DIT_BUILD_DIR:-$ROOT/build}"
VENV="${CACHE_DIT_VENV:-$ROOT/.venv}"
ARCH="${CACHE_DIT_CUDA_ARCH_LIST-}"
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) [ $# -ge 2 ] || { echo "build.sh: --arch needs a value" >&2; exit 2; }; ARCH="$2"; shift 2 ;;
    --arch=*) ARCH="${1#--arch=}"; shift ;;
    --build-dir) [ $# -ge 2 ] || { echo "build.sh: --build-dir needs a value" >&2; exit 2; }; BUILD_DIR="$2"; shift 2 ;;
    --build-dir=*) BUILD_DIR="${1#--build-dir=}"; shift ;;
    --no-install) shift ;;
    -h | --help) sed -n '2,18p' "$0"; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "build.sh: unknown argument '$1' (see --help; pass CMake arguments after --)" >&2; exit 2 ;;
  esac
done
case "$BUILD_DIR" in /*) ;; *) BUILD_DIR="$PWD/$BUILD_DIR" ;; esac

if [ -n "${CACHE_DIT_PYTHON-}" ]; then
  PY="$CACHE_DIT_PYTHON"
elif [ -x "$VENV/bin/python" ]; then
  PY="$VENV/bin/python"
else
  PY="python3"
fi
case "$PY" in */*) ;; *) PY="$(command -v "$PY" || true)" ;; esac
if [ -z "$PY" ] || [ ! -x "$PY" ]; then echo "build.sh: no Python interpreter (set CACHE_DIT_PYTHON)" >&2; exit 1; fi

# nvcc is often installed but not on PATH (/usr/local/cuda/bin).
if ! command -v nvcc > /dev/null && [ -z "${CUDACXX-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi

ARGS=(-S "$ROOT" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release "-DCACHE_DIT_PYTHON=$PY")
# Keep the generator of an existing build folder; pick Ninja for a new one.
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ] && command -v ninja > /dev/null; then
  ARGS+=(-G Ninja)
fi
[ -n "$ARCH" ] && ARGS+=("-DCACHE_DIT_CUDA_ARCH_LIST=$ARCH")
if [ -n "${CACHE_DIT_CMAKE_ARGS-}" ]; then
  read -r -a ENV_ARGS <<< "$CACHE_DIT_CMAKE_ARGS"
  ARGS+=("${ENV_ARGS[@]}")
fi
ARGS+=("${EXTRA[@]}")

echo "build.sh: cmake ${ARGS[*]}"
cmake "${ARGS[@]}"
echo "build.sh: cmake --build $BUILD_DIR -j $(nproc)"
cmake --build "$BUILD_DIR" -j "$(nproc)"
echo "build.sh: built in $BUILD_DIR"
