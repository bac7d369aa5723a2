# shellcheck shell=bash
# Unpack the offline .deb folder into a prefix and point CMake, the compiler,
# the linker and the loader at it. SOURCE it, on the air-gapped host:
#
#   source deploy/offline/use-prefix.sh [DEBS_DIR] [PREFIX]
#
# Defaults: DEBS_DIR=<repo>/.offline/debs (made by fetch-debs.sh),
#           PREFIX=<repo>/.offline/prefix.
# Every .deb is unpacked with `dpkg -x` (no root, nothing installed into the
# system); a stamp in PREFIX records the manifest's hash and the prefix path,
# so a second source is instant. Then it exports:
#   PATH              PREFIX/usr/bin first (protoc, grpc_cpp_plugin, pkg-config)
#   CMAKE_PREFIX_PATH PREFIX/usr (CMake finds lib/<multiarch>/cmake/{grpc,absl,
#                     spdlog,fmt,GTest} and FindProtobuf's protoc/lib/headers)
#   Protobuf_ROOT     PREFIX/usr (FindProtobuf; honoured under policy CMP0074)
#   CACHE_DIT_CMAKE_ARGS  -DProtobuf_* pinning FindProtobuf to the prefix;
#                     deploy/build.sh appends it to its cmake call
#   LIBRARY_PATH      PREFIX/usr/lib/<multiarch> (gRPC's config links re2 as
#                     a bare -lre2) and PREFIX/lib/<multiarch>
#   LD_LIBRARY_PATH   the same folders, for the loader
#   PKG_CONFIG_PATH   PREFIX's pkgconfig folders (gRPC finds re2 through
#                     pkg-config)
#   CACHE_DIT_OFFLINE_PREFIX  PREFIX
# CPATH is not set: headers reach the compiler through the CMake targets.
#
# Fix-ups after unpacking: absolute symlinks (zlib1g-dev's libz.so ->
# /lib/...) are made relative inside the prefix; .pc files, which hard-code
# prefix=/usr and libdir=/usr/lib/..., are rewritten to PREFIX. The CMake
# configs of gRPC, absl, spdlog, fmt and GTest compute their location from
# their own path (_IMPORT_PREFIX / PACKAGE_PREFIX_DIR); their only literal
# /usr lines are Debian's "/usr move" guard, which never matches a prefix
# elsewhere, and are left alone; any other literal /usr path in a .cmake file
# is rewritten too.

_cache_dit_prepend() { # VAR DIR: put DIR first in the colon list VAR, once
  local var="$1" dir="$2" cur
  cur="${!var-}"
  case ":$cur:" in
    *":$dir:"*) cur=":$cur:"; cur="${cur//:$dir:/:}"; cur="${cur#:}"; cur="${cur%:}" ;;
  esac
  if [ -n "$cur" ]; then export "$var=$dir:$cur"; else export "$var=$dir"; fi
}

_cache_dit_use_prefix() {
  local root debs prefix ma hash stamp d f link target n_debs
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  debs="${1:-$root/.offline/debs}"
  prefix="${2:-$root/.offline/prefix}"

  if ! compgen -G "$debs/*.deb" > /dev/null; then
    echo "use-prefix: no .deb files in $debs (make them with deploy/offline/fetch-debs.sh on a networked Debian/Ubuntu machine)" >&2
    return 1
  fi
  command -v dpkg > /dev/null || { echo "use-prefix: dpkg not found (needed for dpkg -x)" >&2; return 1; }
  debs="$(cd "$debs" && pwd)"
  mkdir -p "$prefix" && prefix="$(cd "$prefix" && pwd)" || return 1
  ma="$(dpkg-architecture -qDEB_HOST_MULTIARCH 2> /dev/null || gcc -print-multiarch 2> /dev/null || true)"
  [ -n "$ma" ] || ma="$(uname -m)-linux-gnu"

  # What the prefix must hold: the manifest (or the .deb names and sizes when
  # there is none), where the prefix lives, and this fix-up scheme's version.
  n_debs="$(find "$debs" -maxdepth 1 -name '*.deb' | wc -l)"
  hash="$({
    if [ -f "$debs/manifest.txt" ]; then cat "$debs/manifest.txt"; else (cd "$debs" && ls -l -- *.deb); fi
    echo "prefix=$prefix multiarch=$ma fixups=1"
  } | sha256sum | cut -d' ' -f1)"
  stamp="$prefix/.cache-dit-prefix-stamp"

  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$hash" ]; then
    echo "use-prefix: $prefix already holds the $n_debs packages of $debs"
  else
    # Only ever wipe a folder this script made (stamp present) or an empty one.
    if [ -n "$(ls -A "$prefix")" ] && [ ! -f "$stamp" ]; then
      echo "use-prefix: $prefix is not empty and has no stamp of this script; refusing to overwrite it" >&2
      return 1
    fi
    echo "use-prefix: unpacking $n_debs packages from $debs into $prefix"
    find "$prefix" -mindepth 1 -delete || return 1
    for d in "$debs"/*.deb; do
      dpkg -x "$d" "$prefix" || { echo "use-prefix: dpkg -x $d failed" >&2; return 1; }
    done

    # Absolute symlinks point into the host's /usr or /lib; retarget them
    # inside the prefix (relative, so the prefix stays movable).
    while IFS= read -r -d '' link; do
      target="$(readlink "$link")"
      if [ -e "$prefix$target" ] || [ -L "$prefix$target" ]; then
        ln -sfn "$(realpath -m --relative-to="$(dirname "$link")" "$prefix$target")" "$link"
      fi
    done < <(find "$prefix" -type l -lname '/*' -print0)

    # pkg-config files: prefix=/usr, libdir=/usr/lib/..., -I/usr/..., -L/usr/...
    while IFS= read -r -d '' f; do
      sed -i -E \
        -e "s#^([A-Za-z_][A-Za-z0-9_]*)=/usr(/|\$)#\\1=$prefix/usr\\2#" \
        -e "s#(^|[ =])-([IL])/usr/#\\1-\\2$prefix/usr/#g" "$f"
    done < <(find "$prefix" -name '*.pc' -print0)

    # CMake files: rewrite literal /usr/{include,lib,bin,share} paths except
    # Debian's "/usr move" guard lines and comments.
    while IFS= read -r -d '' f; do
      if grep -vE '_realOrig|PACKAGE_PREFIX_DIR "/usr"|set\(_IMPORT_PREFIX "/usr|^[[:space:]]*#' "$f" |
           grep -qE '(^|[" ;])/usr/(include|lib|bin|share)'; then
        sed -i -E '/_realOrig|PACKAGE_PREFIX_DIR "\/usr"|set\(_IMPORT_PREFIX "\/usr|^[[:space:]]*#/!'"s#(^|[\" ;])/usr/(include|lib|bin|share)#\\1$prefix/usr/\\2#g" "$f"
        echo "use-prefix: rewrote /usr paths in ${f#"$prefix"/}"
      fi
    done < <(find "$prefix" -name '*.cmake' -print0)

    echo "$hash" > "$stamp"
  fi

  _cache_dit_prepend PATH "$prefix/usr/bin"
  _cache_dit_prepend CMAKE_PREFIX_PATH "$prefix/usr"
  export Protobuf_ROOT="$prefix/usr"
  for d in "$prefix/lib/$ma" "$prefix/usr/lib/$ma"; do
    [ -d "$d" ] || continue
    _cache_dit_prepend LIBRARY_PATH "$d"
    _cache_dit_prepend LD_LIBRARY_PATH "$d"
  done
  for d in "$prefix/usr/share/pkgconfig" "$prefix/usr/lib/$ma/pkgconfig"; do
    [ -d "$d" ] && _cache_dit_prepend PKG_CONFIG_PATH "$d"
  done

  # Pin FindProtobuf to the prefix even where the host has its own protobuf
  # (Debian's protobuf ships no CMake config). Earlier -DProtobuf_* words are
  # dropped so that sourcing twice does not pile them up.
  local args="" w
  for w in ${CACHE_DIT_CMAKE_ARGS-}; do
    case "$w" in -DProtobuf_*) ;; *) args="${args:+$args }$w" ;; esac
  done
  local lib="$prefix/usr/lib/$ma"
  args="${args:+$args }-DProtobuf_PROTOC_EXECUTABLE=$prefix/usr/bin/protoc"
  args+=" -DProtobuf_INCLUDE_DIR=$prefix/usr/include"
  args+=" -DProtobuf_LIBRARY_RELEASE=$lib/libprotobuf.so"
  args+=" -DProtobuf_LITE_LIBRARY_RELEASE=$lib/libprotobuf-lite.so"
  args+=" -DProtobuf_PROTOC_LIBRARY_RELEASE=$lib/libprotoc.so"
  export CACHE_DIT_CMAKE_ARGS="$args"
  export CACHE_DIT_OFFLINE_PREFIX="$prefix"

  echo "use-prefix: using $prefix (protoc $("$prefix/usr/bin/protoc" --version 2> /dev/null | cut -d' ' -f2),"\
       "gRPC $(sed -n 's/.*PACKAGE_VERSION "\([0-9.]*\)".*/\1/p' "$prefix/usr/lib/$ma/cmake/grpc/gRPCConfigVersion.cmake" 2> /dev/null | head -1));"\
       "exported PATH CMAKE_PREFIX_PATH Protobuf_ROOT LIBRARY_PATH LD_LIBRARY_PATH PKG_CONFIG_PATH CACHE_DIT_CMAKE_ARGS"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  echo "use-prefix: source this file (source $0 [DEBS_DIR] [PREFIX]); running it cannot change your shell" >&2
  _cache_dit_use_prefix "$@"
  exit $?
fi
if _cache_dit_use_prefix "$@"; then
  unset -f _cache_dit_use_prefix _cache_dit_prepend
  return 0
else
  unset -f _cache_dit_use_prefix _cache_dit_prepend
  return 1
fi
