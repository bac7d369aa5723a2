#!/usr/bin/env bash
# Downloads the pure-Python test dependencies that deploy/install.sh installs
# without their dependencies (PY_NODEPS_REQUIREMENTS, read from that script so
# the pin lives in one place) as wheels, for a GPU host with no package index:
#
#   deploy/offline/fetch-wheels.sh [DEST]      # default <repo>/.offline/wheels
#
# Also what `import cache_dit` needs and the H200 host's image lacks (it has
# transformers, huggingface-hub, safetensors, regex, pillow and requests):
# diffusers, at install.sh's pin, and importlib-metadata.
# tests/gpu/run.sh installs DEST/*.whl (--no-deps, --no-index) into
# <build dir>/pydeps and puts that folder on PYTHONPATH.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dest="${1:-$repo/.offline/wheels}"
line="$(grep -E '^PY_NODEPS_REQUIREMENTS=\(' "$repo/deploy/install.sh")"
eval "$line"
diffusers="$(grep -oE 'diffusers==[0-9.]+' "$repo/deploy/install.sh" | head -1)"
[ -n "$diffusers" ] || { echo "fetch-wheels.sh: no diffusers pin in deploy/install.sh" >&2; exit 1; }
PY_NODEPS_REQUIREMENTS+=("$diffusers" importlib-metadata)
mkdir -p "$dest"
"${PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: -d "$dest" "${PY_NODEPS_REQUIREMENTS[@]}"
ls -l "$dest"
