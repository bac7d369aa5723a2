#!/usr/bin/env bash
# The figures a GPU session records beside the suites, on a CUDA host, after
# tests/gpu/run.sh has built ${CACHE_DIT_GPU_BUILD_DIR:-build-gpu}:
#
#   tests/gpu/records.sh [example] [bench]      # default: both
#
# example  examples/cache_dit_svdquant.py against a daemon started here
#          (cache-dit's SVDQuant PTQ of a small FLUX transformer, through the
#          daemon vs BF16) -> $OUT/cache-dit-svdquant.md
# bench    bench/run.sh --quick, while `cache-dit-opdctl status` and `sessions`
#          of the benchmark's daemon are read every 2 s ($OUT/opdctl.txt);
#          its /metrics and GetStats are read at the end of the run, and the
#          per-op call counts of the two are compared ($OUT/metrics-vs-stats.txt)
# The dependencies are set up as tests/gpu/run.sh does (offline prefix, test
# wheels in <build dir>/pydeps). Results go to ${OUT:-<build dir>/records}.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 1
BUILD_DIR="${CACHE_DIT_GPU_BUILD_DIR:-$ROOT/build-gpu}"
OUT="${OUT:-$BUILD_DIR/records}"
mkdir -p "$OUT"
STEPS=("$@")
[ ${#STEPS[@]} -gt 0 ] || STEPS=(example bench)
say() { echo "gpu/records.sh: $*"; }

[ -x "$BUILD_DIR/server/cache-dit-opd" ] || { say "not built: $BUILD_DIR (run tests/gpu/run.sh first)"; exit 1; }
if [ -d "$ROOT/.offline/debs" ]; then
  # shellcheck source=deploy/offline/use-prefix.sh
  source "$ROOT/deploy/offline/use-prefix.sh" "$ROOT/.offline/debs" > /dev/null
fi
PY="${CACHE_DIT_PYTHON:-python3}"
export PYTHONPATH="$ROOT/python:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
[ -d "$BUILD_DIR/pydeps" ] && export PYTHONPATH="$BUILD_DIR/pydeps:$PYTHONPATH"
export CACHE_DIT_OPD_BUILD_DIR="$BUILD_DIR"
OPDCTL="$BUILD_DIR/admin/ctl/cache-dit-opdctl"
RC=0

for step in "${STEPS[@]}"; do
  case "$step" in
    example)
      sock_dir="$(mktemp -d /tmp/cdo-rec-XXXX)"
      "$BUILD_DIR/server/cache-dit-opd" --device 0 --socket "$sock_dir/d.sock" --metrics-address "" \
        > "$OUT/example-daemon.log" 2>&1 &
      dpid=$!
      for _ in $(seq 100); do [ -S "$sock_dir/d.sock" ] && break; sleep 0.1; done
      say "example: examples/cache_dit_svdquant.py"
      CACHE_DIT_OPD_ADDRESS="unix:$sock_dir/d.sock" "$PY" examples/cache_dit_svdquant.py \
        --out "$OUT/cache-dit-svdquant.md" > "$OUT/example.log" 2>&1 || { RC=1; say "example failed"; }
      tail -n 20 "$OUT/example.log"
      kill -TERM "$dpid" 2> /dev/null; wait "$dpid" 2> /dev/null
      rm -rf "$sock_dir"
      ;;
    bench)
      say "bench: bench/run.sh --quick with opdctl every 2 s"
      bench/run.sh --quick --build "$BUILD_DIR" --out "$OUT" --no-readme --daemon-args "--metrics-address 127.0.0.1:9464" \
        > "$OUT/bench.log" 2>&1 &
      bpid=$!
      : > "$OUT/opdctl.txt"
      last=""
      while kill -0 "$bpid" 2> /dev/null; do
        sock="$(find /tmp -maxdepth 2 -path '/tmp/cdo-bench-*' -name opd.sock 2> /dev/null | head -n 1)"
        if [ -n "$sock" ]; then
          # The benchmark's sessions live a few seconds each: sample every 2 s, keep a sample
          # that shows an open session, and one in five of the others.
          sample="$({ echo "== $(date -u +%T) status"; "$OPDCTL" --address "$sock" status
                      echo "== $(date -u +%T) sessions"; "$OPDCTL" --address "$sock" sessions; } 2>&1)"
          n=$((${n:-0} + 1))
          if ! grep -q "(no session)" <<< "$sample" || [ $((n % 5)) -eq 1 ]; then echo "$sample" >> "$OUT/opdctl.txt"; fi
          # What both counters say near the end: the last reading before the daemon stops.
          "$PY" tests/gpu/metrics_vs_stats.py "$sock" 127.0.0.1:9464 > "$OUT/metrics-vs-stats.tmp" 2>&1 &&
            mv "$OUT/metrics-vs-stats.tmp" "$OUT/metrics-vs-stats.txt" && last="$sock"
        fi
        sleep 2
      done
      wait "$bpid" || { RC=1; say "bench failed"; }
      tail -n 30 "$OUT/bench.log"
      [ -n "$last" ] || { RC=1; say "never reached the benchmark's daemon"; }
      [ -f "$OUT/metrics-vs-stats.txt" ] && cat "$OUT/metrics-vs-stats.txt"
      grep -q "^equal" "$OUT/metrics-vs-stats.txt" 2> /dev/null || RC=1
      ;;
    *) say "unknown step '$step' (example, bench)"; exit 2 ;;
  esac
done
exit "$RC"
