#!/usr/bin/env bash
# Download every build dependency of the daemon as .deb files into one folder,
# for a GPU host that reaches no package registry.
#
#   deploy/offline/fetch-debs.sh [DEST]        (default: <repo>/.offline/debs)
#
# Run it on a networked Debian/Ubuntu machine (Debian 12 is what was validated:
# its packages, unpacked with deploy/offline/use-prefix.sh, build and run on the
# Ubuntu 24.04 GPU host). It needs apt-get and apt-cache, not root (root is fine).
# It writes DEST/*.deb and DEST/manifest.txt (one `package=version` per line),
# is idempotent (skips the download when the manifest already matches apt's
# candidates), and fails when the folder grows past CACHE_DIT_DEBS_LIMIT_MIB
# (default 40) because the folder is carried to the GPU host with the work tree.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="${1:-$ROOT/.offline/debs}"
LIMIT_MIB="${CACHE_DIT_DEBS_LIMIT_MIB:-40}"

# What the build needs. gRPC's bundled upb ships inside libgrpc-dev
# (libupb.a/.so); Debian's separate libupb-dev is an unrelated 2020 snapshot
# that gRPC 1.51 does not use, so it is not fetched.
ROOTS=(
  libgrpc++-dev libgrpc-dev libgrpc++1.51 libgrpc29 protobuf-compiler-grpc
  libabsl-dev libre2-dev libc-ares-dev
  libprotobuf-dev libprotobuf32 libprotoc-dev libprotoc32 protobuf-compiler
  libssl-dev libssl3 zlib1g-dev zlib1g
  libspdlog-dev libfmt-dev
  libgtest-dev libgmock-dev googletest
  pkgconf
  prometheus-cpp-dev libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 libcivetweb-dev libcivetweb1
  nlohmann-json3-dev
)

# Packages left out of the closure, and why. Every Debian 12 / Ubuntu 24.04
# machine that can build C++ at all already has them (the base system plus
# build-essential), and unpacking a second copy into the prefix would shadow
# the host's own (newer, on Ubuntu 24.04) toolchain and C library:
#   - C library and its headers: libc6 libc6-dev libc-dev-bin linux-libc-dev
#     libcrypt1 libcrypt-dev libnsl2 libnsl-dev libtirpc* rpcsvc-proto
#   - compiler runtime and toolchain: libgcc-s1 gcc-*-base libstdc++6
#     libstdc++-*-dev gcc* g++* cpp* binutils* libbinutils libctf* libgprofng*
#   - Kerberos/keyutils, pulled only through libtirpc3: libkrb5-3 libk5crypto3
#     libkrb5support0 libgssapi-krb5-2 libkeyutils1 libcom-err2
#   - base tools: perl* python3* debconf dpkg tzdata libsystemd0 libselinux1
#   - catch2: libspdlog-dev depends on it only for spdlog's own tests
# Kept on purpose although a base system may have them:
#   - zlib1g, libssl3: zlib1g-dev's and libssl-dev's libz.so/libssl.so
#     symlinks point at those exact files (Ubuntu 24.04 has other versions);
#   - pkgconf (pkg-config): gRPC's CMake config finds re2 only through
#     pkg-config (its Findre2.cmake does find_package(PkgConfig REQUIRED)).
EXCLUDE_RE='^(libc6|libc6-dev|libc-dev-bin|linux-libc-dev|libcrypt1|libcrypt-dev|libnsl2|libnsl-dev|libtirpc[0-9a-z-]*|rpcsvc-proto|libgcc-s1|gcc-[0-9]+-base|libstdc\+\+6|libstdc\+\+-[0-9]+-dev|gcc(-[0-9]+)?|g\+\+(-[0-9]+)?|cpp(-[0-9]+)?|binutils.*|libbinutils|libctf.*|libgprofng.*|libkrb5-3|libk5crypto3|libkrb5support0|libgssapi-krb5-2|libkeyutils1|libcom-err2|perl.*|libperl.*|python3.*|libpython3.*|debconf|dpkg|tzdata|libsystemd0|libselinux1|catch2)$'

have_candidate() { local out; out="$(apt-cache policy "$1" 2>/dev/null)"; [[ "$out" == *"Candidate: "[!\(]* ]]; }

if ! have_candidate libgrpc++-dev; then
  echo "fetch-debs: apt lists lack libgrpc++-dev; running apt-get update"
  if [ "$(id -u)" -eq 0 ]; then apt-get update -qq; else sudo apt-get update -qq; fi
fi

# Closure of the roots' hard dependencies (Depends/Pre-Depends), minus the
# exclusion list. Lines at column 0 of `apt-cache depends --recurse` are real
# package names; "<virtual>" ones are skipped (their providers are listed).
mapfile -t CLOSURE < <(
  apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts \
      --no-breaks --no-replaces --no-enhances "${ROOTS[@]}" 2>/dev/null |
    grep -E '^[a-z0-9]' | sed 's/:.*$//' | sort -u |
    grep -Ev "$EXCLUDE_RE" || true)
[ "${#CLOSURE[@]}" -gt 0 ] || { echo "fetch-debs: empty dependency closure" >&2; exit 1; }
for r in "${ROOTS[@]}"; do
  printf '%s\n' "${CLOSURE[@]}" | grep -qx -- "$r" || { echo "fetch-debs: $r missing from closure" >&2; exit 1; }
done

# package=candidate-version, the manifest this run should produce.
WANT="$(apt-cache policy "${CLOSURE[@]}" |
  awk '/^[^ ]/ {sub(/:$/, ""); p = $0} /^  Candidate:/ {print p "=" $2}' | LC_ALL=C sort)"$'\n'
if [ "$(printf '%s' "$WANT" | grep -c .)" -ne "${#CLOSURE[@]}" ] || printf '%s' "$WANT" | grep -q '=(none)$'; then
  echo "fetch-debs: some packages have no candidate:" >&2
  printf '%s' "$WANT" | grep '=(none)$' >&2 || true
  exit 1
fi

mkdir -p "$DEST"
if [ -f "$DEST/manifest.txt" ] && [ "$(cat "$DEST/manifest.txt")"$'\n' = "$WANT" ] &&
   [ "$(find "$DEST" -maxdepth 1 -name '*.deb' | wc -l)" -eq "${#CLOSURE[@]}" ]; then
  echo "fetch-debs: $DEST already holds the ${#CLOSURE[@]} packages of manifest.txt; nothing to download"
else
  TMP="$(mktemp -d "${DEST%/}.tmp.XXXXXX")"
  trap 'rm -rf "$TMP"' EXIT
  echo "fetch-debs: downloading ${#CLOSURE[@]} packages into $DEST"
  mapfile -t SPECS < <(printf '%s' "$WANT")
  # -o APT::Sandbox::User=root: as root, apt would otherwise warn that the
  # _apt user cannot write the current folder.
  (cd "$TMP" && apt-get download -q -o APT::Sandbox::User="$(id -un)" "${SPECS[@]}")
  : > "$TMP/manifest.txt"
  for f in "$TMP"/*.deb; do
    printf '%s=%s\n' "$(dpkg-deb -f "$f" Package)" "$(dpkg-deb -f "$f" Version)" >> "$TMP/manifest.txt"
  done
  LC_ALL=C sort -o "$TMP/manifest.txt" "$TMP/manifest.txt"
  find "$DEST" -maxdepth 1 \( -name '*.deb' -o -name manifest.txt \) -delete
  mv "$TMP"/*.deb "$TMP/manifest.txt" "$DEST/"
fi

BYTES="$(du -cb "$DEST"/*.deb | tail -1 | cut -f1)"
MIB="$(awk -v b="$BYTES" 'BEGIN {printf "%.1f", b / 1048576}')"
echo "fetch-debs: $(wc -l < "$DEST/manifest.txt") packages, $MIB MiB in $DEST (manifest: $DEST/manifest.txt)"
if [ "$BYTES" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "fetch-debs: $MIB MiB exceeds the ${LIMIT_MIB} MiB limit (CACHE_DIT_DEBS_LIMIT_MIB)" >&2
  exit 1
fi
if [ -d "$(dirname "$DEST")/prefix" ]; then
  echo "fetch-debs: note: $(dirname "$DEST")/prefix (an unpacked test prefix) exists; do not carry it to the GPU host, carry $DEST"
fi
