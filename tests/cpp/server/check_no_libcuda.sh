#!/bin/sh
# Fails when any binary given depends on libcuda.so (directly or through a
# dependency): the daemon, its tests and the kernel library must load on
# machines without a GPU driver (docs/DESIGN.md section 5). `readelf -d` catches a
# direct NEEDED entry even where ldd cannot resolve it.
status=0
for bin in "$@"; do
  if [ ! -e "$bin" ]; then
    echo "missing: $bin"
    status=1
    continue
  fi
  if readelf -d "$bin" | grep -E 'NEEDED.*\[libcuda\.so' >/dev/null; then
    echo "FAIL: $bin has a direct NEEDED entry for libcuda.so"
    status=1
  elif ldd "$bin" 2>/dev/null | grep -E '(^|[[:space:]/])libcuda\.so' >/dev/null; then
    echo "FAIL: $bin depends on libcuda.so:"
    ldd "$bin" | grep -E 'libcuda\.so'
    status=1
  else
    echo "ok: $bin does not link libcuda.so"
  fi
done
exit $status
