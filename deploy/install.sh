#!/usr/bin/env bash
# Install what building and testing cache-dit-opd needs on a fresh Debian/Ubuntu
# machine. Idempotent: a second run checks and returns in seconds.
#
#   deploy/install.sh [--no-apt] [--no-python]
#
#   apt     build tools, gRPC C++ + protoc plugin, protobuf, spdlog, fmt,
#           GoogleTest/GoogleMock, python3-venv, clang with its sanitizer and
#           libFuzzer runtimes (tests/fuzz/; the distribution's default clang
#           and its libclang-rt, on Debian 12 clang-14 and
#           libclang-rt-14-dev, which holds libclang_rt.fuzzer). `apt-get update` and
#           `apt-get install` run only when dpkg-query reports a package
#           missing. Needs root (or sudo).
#   python  a virtual environment at ${CACHE_DIT_VENV:-<repo>/.venv}, made
#           with the `python3` on PATH, holding torch 2.11 (PyPI's Linux
#           x86_64 wheel of 2.11 is the CUDA 13.0 build, same as the GPU
#           host's 2.11.0+cu130), grpcio, grpcio-tools, protobuf, pytest,
#           numpy, matplotlib, psutil, safetensors, diffusers and transformers
#           (pinned: what `import cache_dit` needs), and cache-dit 1.5.3 without its
#           dependencies (a test input). A stamp file in the venv records the
#           requirement set; pip runs only when it differs.
#   client  the Python client into the venv, `pip install --no-build-isolation
#           ./python`: with its native engine built against the venv's torch
#           when CMake, a compiler and the CUDA toolkit are here, else the
#           pure-Python client (python/setup.py says which). A stamp of the
#           sources it is built from skips it when nothing changed.
# No GPU is needed. Override the torch requirement with CACHE_DIT_TORCH_SPEC.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CACHE_DIT_VENV:-$ROOT/.venv}"
DO_APT=1
DO_PY=1
for arg in "$@"; do
  case "$arg" in
    --no-apt) DO_APT=0 ;;
    --no-python) DO_PY=0 ;;
    -h | --help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown argument '$arg' (use --no-apt, --no-python)" >&2; exit 2 ;;
  esac
done

APT_PACKAGES=(
  build-essential cmake ninja-build pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libspdlog-dev libfmt-dev libgtest-dev libgmock-dev
  python3-venv
  clang libclang-rt-dev
  prometheus-cpp-dev
  nlohmann-json3-dev
)
PY_REQUIREMENTS=(
  "${CACHE_DIT_TORCH_SPEC:-torch==2.11.*}"
  grpcio grpcio-tools protobuf pytest numpy matplotlib psutil
  prometheus-client kubernetes-validate==1.37.0 pyyaml
  # What `import cache_dit` needs, pinned (cache-dit asks for >= only); with
  # them the integration tests run against the real package
  # (tests/python/test_integration_cache_dit.py).
  diffusers==0.42.1 transformers==5.24.0
  # cache_dit_opd.nn.load_safetensors; the H200 host's image has 0.8.0.
  safetensors==0.8.0
)
# Installed without its dependencies: cache-dit's own requirements are the
# pinned pair above plus torch, which it must not replace.
PY_NODEPS_REQUIREMENTS=(cache-dit==1.5.3)

log() { echo "install.sh: $*"; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo > /dev/null; then sudo "$@"
  else echo "install.sh: need root (or sudo) for: $*" >&2; return 1
  fi
}

install_apt() {
  local missing=() p status
  for p in "${APT_PACKAGES[@]}"; do
    status="$(dpkg-query -W -f='${db:Status-Status}' "$p" 2> /dev/null || true)"
    [ "$status" = "installed" ] || missing+=("$p")
  done
  if [ "${#missing[@]}" -eq 0 ]; then
    log "apt: all ${#APT_PACKAGES[@]} packages already installed; skipped"
    return
  fi
  log "apt: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  log "apt: installed ${#missing[@]} package(s)"
}

install_python() {
  local py stamp want
  py="$(command -v python3 || true)"
  [ -n "$py" ] || { echo "install.sh: python3 not found on PATH" >&2; exit 1; }
  stamp="$VENV/.cache-dit-requirements"
  # The stamp holds the interpreter version and the requirement set.
  want="$("$py" -c 'import sys; print("python %d.%d" % sys.version_info[:2])')"$'\n'"$(printf '%s\n' "${PY_REQUIREMENTS[@]}" "${PY_NODEPS_REQUIREMENTS[@]}")"

  if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    log "python: $VENV already has: ${PY_REQUIREMENTS[*]}; skipped"
    return
  fi
  if [ ! -x "$VENV/bin/python" ]; then
    log "python: creating venv $VENV with $py ($("$py" --version 2>&1))"
    "$py" -m venv "$VENV"
  else
    log "python: reusing venv $VENV"
  fi
  log "python: pip install ${PY_REQUIREMENTS[*]}"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${PY_REQUIREMENTS[@]}"
  log "python: pip install --no-deps ${PY_NODEPS_REQUIREMENTS[*]}"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "${PY_NODEPS_REQUIREMENTS[@]}"
  "$VENV/bin/python" - << 'EOF'
import importlib
parts = []
for mod, name in (("torch", "torch"), ("grpc", "grpcio"), ("google.protobuf", "protobuf"), ("numpy", "numpy")):
    try:
        m = importlib.import_module(mod)
        v = m.__version__
        if mod == "torch":
            v += " (CUDA %s)" % m.version.cuda
    except Exception as e:  # report only; pip already failed on a missing requirement
        v = "not importable: %s" % e
    parts.append("%s %s" % (name, v))
print("install.sh: python: " + ", ".join(parts))
EOF
  printf '%s\n' "$want" > "$stamp"
}

install_client() {
  local stamp want
  stamp="$VENV/.cache-dit-client"
  want="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
  if git -C "$ROOT" rev-parse --git-dir > /dev/null 2>&1; then
    want+=" $( (git -C "$ROOT" ls-files -s python client common proto cmake CMakeLists.txt;
                git -C "$ROOT" diff HEAD -- python client common proto cmake CMakeLists.txt) | sha1sum | cut -c1-16)"
  else
    want+=" $(date +%s)"  # not a checkout: always reinstall
  fi
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    log "client: $VENV has the client of these sources; skipped"
    return
  fi
  log "client: pip install --no-build-isolation ./python (builds the native engine, ~30 s)"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps \
    --force-reinstall "$ROOT/python"
  (cd / && env -u PYTHONPATH -u CACHE_DIT_OPD_BUILD_DIR "$VENV/bin/python" -c '
from cache_dit_opd import _native as n
lib = n.library()
print("install.sh: client: native engine " + (lib.path if lib else "NOT available (%s): calls go over gRPC" % n.load_error()))')
  printf '%s\n' "$want" > "$stamp"
}

START=$SECONDS
if [ "$DO_APT" -eq 1 ]; then install_apt; else log "apt: skipped (--no-apt)"; fi
if [ "$DO_PY" -eq 1 ]; then install_python; install_client; else log "python: skipped (--no-python)"; fi
log "done in $((SECONDS - START)) s (venv: $VENV)"
