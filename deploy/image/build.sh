#!/usr/bin/env bash
# deploy/image/build.sh: a container image of cache-dit-opd, its CLI and its
# launcher, assembled from an existing build with no base image (nothing is
# pulled: the root filesystem is the binaries plus the shared-library closure
# ldd resolves for them) and loaded with `podman import`.
#
#   deploy/image/build.sh [--build-dir DIR] [--tag NAME:VERSION] [--keep-rootfs]
#
#   --build-dir DIR   the CMake build to package (default <repo>/build, or
#                     CACHE_DIT_BUILD_DIR). It must already be built: this
#                     script never runs cmake or ninja.
#   --tag TAG         image name (default cache-dit-opd:<project version>)
#   --keep-rootfs     keep the staged root filesystem (<build>/image-rootfs)
#
# Environment:
#   CACHE_DIT_IMAGE_ALLOW_MISSING=1   a missing cache-dit-opdctl or
#                                     cache-dit-opd-launcher is a warning, not
#                                     an error (the daemon is always required)
#   CACHE_DIT_VENV                    the virtual environment whose torch the
#                                     build linked (default <repo>/.venv)
#   CACHE_DIT_IMAGE_EXTRA_LIBS        sonames to add with their closures, for
#                                     libraries torch only dlopens (e.g.
#                                     "libcaffe2_nvrtc.so libnvrtc.so.13"); none
#                                     by default: the daemon's ops need none
#   (and lib.sh's: CACHE_DIT_IMAGE_RUNTIME, CACHE_DIT_IMAGE_STORAGE_DRIVER)
#
# The image:
#   /opt/cache-dit-opd/bin   cache-dit-opd, cache-dit-opdctl, cache-dit-opd-launcher
#   /opt/cache-dit-opd/lib   the kernel library, libtorch and the CUDA wheels'
#                            libraries (from the venv's torch/lib and nvidia/*/lib)
#   /usr/lib/x86_64-linux-gnu   this host's glibc, dynamic loader, libstdc++,
#                            gRPC, protobuf, abseil, spdlog, fmt, OpenSSL, ...
#   /etc/passwd, /etc/group  root and cache-dit-opd (10001:10001)
#   /tmp (1777), /run/cache-dit-opd (0750, 10001:10001)
#   ENTRYPOINT the launcher, USER 10001:10001
#
# NOT in the image: the CUDA driver (libcuda.so.1, libnvidia-ml.so.1,
# nvidia-smi) and /dev/nvidia*. They must match the node's kernel module, so
# on a GPU node the NVIDIA container runtime (or CDI: podman --device
# nvidia.com/gpu=all) injects them; NVIDIA_VISIBLE_DEVICES and
# NVIDIA_DRIVER_CAPABILITIES (compute,utility: utility brings nvidia-smi,
# which the launcher runs to list the GPUs) are set for it. The binaries
# never link libcuda (cudart dlopens it), so without it the daemon still
# starts and reports NOT_SERVING.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

t_start=$(date +%s%3N)
build_dir="${CACHE_DIT_BUILD_DIR:-$OPD_REPO/build}"
tag="$OPD_DEFAULT_TAG"
keep_rootfs=0
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", (b - a) / 1000 }'; }
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
while (($#)); do
  case "$1" in
    --build-dir) build_dir="${2:?--build-dir needs a folder}"; shift 2 ;;
    --build-dir=*) build_dir="${1#*=}"; shift ;;
    --tag) tag="${2:?--tag needs a name}"; shift 2 ;;
    --tag=*) tag="${1#*=}"; shift ;;
    --keep-rootfs) keep_rootfs=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) opd_die "unknown argument: $1 (see --help)" ;;
  esac
done
[[ -d "$build_dir" ]] || opd_die "no build folder $build_dir (build first: deploy/build.sh)"
build_dir="$(cd "$build_dir" && pwd)"
[[ "$(id -u)" == 0 ]] || opd_die "run as root: the scripts use rootful podman storage (podman/storage.conf)"
for tool in ldd readelf tar realpath; do
  command -v "$tool" >/dev/null || opd_die "$tool is not installed"
done

# ---- the binaries ------------------------------------------------------------
# build path -> required (1) or optional with CACHE_DIT_IMAGE_ALLOW_MISSING=1 (0)
bins=(server/cache-dit-opd admin/ctl/cache-dit-opdctl admin/launcher/cache-dit-opd-launcher)
allow_missing="${CACHE_DIT_IMAGE_ALLOW_MISSING:-0}"
present=()
missing=()
for b in "${bins[@]}"; do
  if [[ -x "$build_dir/$b" ]]; then
    present+=("$b")
  elif [[ "$b" == server/cache-dit-opd ]]; then
    opd_die "no daemon at $build_dir/$b (build first: deploy/build.sh)"
  elif [[ "$allow_missing" == 1 ]]; then
    opd_log "WARNING: $build_dir/$b is missing; left out of the image (CACHE_DIT_IMAGE_ALLOW_MISSING=1)"
    missing+=("$(basename "$b")")
  else
    opd_die "$build_dir/$b is missing (build it, or set CACHE_DIT_IMAGE_ALLOW_MISSING=1 to leave it out)"
  fi
done

# ---- where libtorch's libraries come from --------------------------------------
venv="${CACHE_DIT_VENV:-$OPD_REPO/.venv}"
site=""
for d in "$venv"/lib/python3*/site-packages; do
  [[ -d "$d/torch/lib" ]] && site="$d"
done
[[ -n "$site" ]] || opd_die "no torch in $venv (deploy/install.sh makes it; CACHE_DIT_VENV selects another)"
site="$(realpath "$site")"
# torch/lib, then every nvidia-* wheel's lib folder: the same libraries torch
# itself finds through its RUNPATH ($ORIGIN/../../nvidia/*/lib). They come
# first so that e.g. libcudart.so.13 is the wheel's, not /usr/local/cuda's.
search=("$site/torch/lib")
for d in "$site"/nvidia/*/lib; do [[ -d "$d" ]] && search+=("$d"); done
search_path="$(IFS=:; echo "${search[*]}")"
# torch/version.py, read as text (importing torch would load libtorch).
torch_version="$(sed -n "s/^__version__ = '\([^']*\)'.*/\1/p" "$site/torch/version.py" 2>/dev/null | head -n1 || true)"

# ---- staging --------------------------------------------------------------------
rootfs="$build_dir/image-rootfs"
rm -rf "$rootfs"
mkdir -p "$rootfs"/{usr/lib/x86_64-linux-gnu,usr/lib64,usr/bin,etc/ld.so.conf.d,tmp,run/cache-dit-opd}
mkdir -p "$rootfs$OPD_PREFIX"/{bin,lib}
ln -s usr/lib "$rootfs/lib"
ln -s usr/lib64 "$rootfs/lib64"
ln -s usr/bin "$rootfs/bin"
chmod 1777 "$rootfs/tmp"
chown "$OPD_UID:$OPD_GID" "$rootfs/run/cache-dit-opd"
chmod 0750 "$rootfs/run/cache-dit-opd"

# place SRC DEST: copy a file into the root filesystem (contents, mode 0755
# for ELF files), refusing two different files for one path.
place() {
  local src="$1" dest="$rootfs$2"
  if [[ -e "$dest" ]]; then
    cmp -s "$src" "$dest" || opd_die "two different files for $2: $src and the one placed before"
    return 0
  fi
  mkdir -p "$(dirname "$dest")"
  cp -L "$src" "$dest"
  chmod 0755 "$dest"
}

# Where a resolved library goes: a host system library keeps its path (made
# /usr/... : Debian's /lib is a link to usr/lib); everything else (the build's
# kernel library, torch, the nvidia wheels, /usr/local/cuda) goes flat into
# /opt/cache-dit-opd/lib under the name the loader asks for.
dest_of() {
  local name="$1" real dir
  real="$(realpath "$2")"
  dir="$(dirname "$real")"
  case "$dir" in
    /usr/lib/x86_64-linux-gnu|/usr/lib64|/usr/lib|/lib/x86_64-linux-gnu|/lib64|/lib)
      printf '/usr%s/%s' "${dir#/usr}" "$name" ;;
    *) printf '%s/lib/%s' "$OPD_PREFIX" "$name" ;;
  esac
}

# The CUDA driver never goes in: the node's NVIDIA container runtime provides
# the one matching its kernel module.
is_driver_lib() { [[ "$1" =~ ^lib(cuda\.so|nvidia-|cudadebugger\.so|nvcuvid\.so|nvoptix\.so) ]]; }

declare -A placed=()     # soname -> image path
declare -A why=()        # soname -> first binary that needs it
interp=""
closure() {  # closure FILE LABEL: ldd FILE, place every library
  local file="$1" label="$2" out line name path
  out="$(LD_LIBRARY_PATH="$search_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$file" 2>&1)" ||
    opd_die "ldd $file failed: $out"
  local notfound=()
  while IFS= read -r line; do
    line="${line#"${line%%[![:space:]]*}"}"
    case "$line" in
      linux-vdso.so*|linux-gate.so*) continue ;;
      *" => not found"*)
        name="${line%% *}"
        if is_driver_lib "$name"; then
          opd_log "  $name: not found (CUDA driver; injected on the GPU node)"
        else
          notfound+=("$name")
        fi ;;
      *" => "*)
        name="${line%% => *}"; path="${line#* => }"; path="${path%% (0x*}"
        if is_driver_lib "$name"; then
          opd_log "  $name: CUDA driver library, left out (the NVIDIA container runtime injects it)"
          continue
        fi
        if [[ -z "${placed[$name]:-}" ]]; then
          placed[$name]="$(dest_of "$name" "$path")"
          why[$name]="$label"
          place "$path" "${placed[$name]}"
        fi ;;
      /*" (0x"*)   # the dynamic loader, by absolute path
        path="${line%% (0x*}"
        [[ -n "$interp" ]] || interp="$path" ;;
      *) opd_die "ldd $file: cannot read line: $line" ;;
    esac
  done <<<"$out"
  ((${#notfound[@]} == 0)) || opd_die "$label needs libraries ldd cannot find: ${notfound[*]} (searched $search_path and the system folders)"
}

for b in "${present[@]}"; do
  name="$(basename "$b")"
  place "$build_dir/$b" "$OPD_PREFIX/bin/$name"
  closure "$build_dir/$b" "$name"
  want="$(readelf -l "$build_dir/$b" | sed -n 's/.*Requesting program interpreter: \(.*\)]/\1/p')"
  [[ -z "$interp" || -z "$want" || "$want" == "$interp" ]] || opd_die "$name asks for loader $want, another binary for $interp"
  [[ -n "$want" ]] && interp="$want"
done
for soname in ${CACHE_DIT_IMAGE_EXTRA_LIBS:-}; do
  found=""
  for d in "${search[@]}" /usr/lib/x86_64-linux-gnu /lib/x86_64-linux-gnu; do
    [[ -e "$d/$soname" ]] && { found="$d/$soname"; break; }
  done
  [[ -n "$found" ]] || opd_die "CACHE_DIT_IMAGE_EXTRA_LIBS: no $soname in $search_path or the system folders"
  if [[ -z "${placed[$soname]:-}" ]]; then
    placed[$soname]="$(dest_of "$soname" "$found")"; why[$soname]="CACHE_DIT_IMAGE_EXTRA_LIBS"
    place "$found" "${placed[$soname]}"
  fi
  closure "$found" "$soname"
done

# The dynamic loader: the real file next to libc, and the path the binaries
# ask for (PT_INTERP, /lib64/ld-linux-x86-64.so.2 on x86_64) as a link to it.
[[ -n "$interp" ]] || opd_die "no dynamic loader found for the binaries"
ld_real="$(realpath "$interp")"
ld_dest="/usr/lib/x86_64-linux-gnu/$(basename "$ld_real")"
place "$ld_real" "$ld_dest"
interp_in_usr="$interp"
[[ "$interp_in_usr" == /usr/* ]] || interp_in_usr="/usr$interp"   # /lib64 -> usr/lib64 in the image
if [[ "$interp_in_usr" != "$ld_dest" ]]; then
  mkdir -p "$rootfs$(dirname "$interp_in_usr")"
  ln -sf "$(realpath -m --relative-to="$(dirname "$interp_in_usr")" "$ld_dest")" "$rootfs$interp_in_usr"
fi

# The daemon links the kernel library (DT_NEEDED, --no-as-needed in
# server/CMakeLists.txt), so the closure carries it; say so, or say why not.
if [[ -n "${placed[libcache_dit_cuda_ops.so]:-}" ]]; then
  opd_log "kernel library: libcache_dit_cuda_ops.so -> ${placed[libcache_dit_cuda_ops.so]} (the daemon links it)"
elif [[ -e "$build_dir/kernels/libcache_dit_cuda_ops.so" ]]; then
  opd_log "WARNING: the daemon does not link kernels/libcache_dit_cuda_ops.so: left out (the daemon serves no built-in ops; --load-library would need it)"
fi

# ---- /etc -------------------------------------------------------------------
cat >"$rootfs/etc/passwd" <<EOF
root:x:0:0:root:/root:/sbin/nologin
cache-dit-opd:x:$OPD_UID:$OPD_GID:cache-dit-opd daemon:/tmp:/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin
EOF
cat >"$rootfs/etc/group" <<EOF
root:x:0:
cache-dit-opd:x:$OPD_GID:
nogroup:x:65534:
EOF
printf 'passwd: files\ngroup: files\nhosts: files\n' >"$rootfs/etc/nsswitch.conf"
# ld.so.conf: the NVIDIA container runtime's hook runs ldconfig in the
# container after injecting the driver into /usr/lib/x86_64-linux-gnu; with
# this it also indexes /opt/cache-dit-opd/lib (LD_LIBRARY_PATH covers it too).
printf 'include /etc/ld.so.conf.d/*.conf\n' >"$rootfs/etc/ld.so.conf"
printf '%s/lib\n' "$OPD_PREFIX" >"$rootfs/etc/ld.so.conf.d/cache-dit-opd.conf"
if command -v ldconfig >/dev/null || [[ -x /sbin/ldconfig ]]; then
  "$(command -v ldconfig || echo /sbin/ldconfig)" -X -r "$rootfs" 2>/dev/null ||
    opd_log "WARNING: ldconfig -r could not write the image's /etc/ld.so.cache (LD_LIBRARY_PATH still finds everything)"
fi

# ---- metadata -------------------------------------------------------------------
version="$(opd_project_version)"
commit="$(git -C "$OPD_REPO" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"
dirty=false
[[ -n "$(git -C "$OPD_REPO" status --porcelain --untracked-files=no 2>/dev/null)" ]] && dirty=true
contents="$(for b in "${present[@]}"; do basename "$b"; done | paste -sd, -)"
created="$(date -u +%Y-%m-%dT%H:%M:%SZ)"

staged_bytes="$(du -sb "$rootfs" | cut -f1)"
nlibs="${#placed[@]}"
t_staged=$(date +%s%3N)
opd_log "staged $rootfs: ${#present[@]} binaries, $nlibs libraries, $((staged_bytes / 1048576)) MiB ($(secs "$t_start" "$t_staged") s)"
opd_log "largest files:"
find "$rootfs" -type f -printf '%s %P\n' | sort -rn | head -n 8 | while read -r sz p; do
  opd_log "  $((sz / 1048576)) MiB  /$p  (${why[$(basename "$p")]:-})"
done

changes=(
  --change "ENTRYPOINT [\"$OPD_PREFIX/bin/cache-dit-opd-launcher\"]"
  --change "USER $OPD_UID:$OPD_GID"
  --change "WORKDIR /tmp"
  --change "ENV PATH=$OPD_PREFIX/bin:/usr/local/bin:/usr/bin:/bin"
  --change "ENV LD_LIBRARY_PATH=$OPD_PREFIX/lib"
  --change "ENV NVIDIA_VISIBLE_DEVICES=all"
  --change "ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility"
  --change "STOPSIGNAL SIGTERM"
  --change "LABEL org.opencontainers.image.title=cache-dit-opd"
  --change "LABEL org.opencontainers.image.version=$version"
  --change "LABEL org.opencontainers.image.revision=$commit"
  --change "LABEL org.opencontainers.image.created=$created"
  --change "LABEL cache-dit-opd.git-dirty=$dirty"
  --change "LABEL cache-dit-opd.torch=${torch_version:-unknown}"
  --change "LABEL cache-dit-opd.contents=$contents"
)
((${#missing[@]} == 0)) || changes+=(--change "LABEL cache-dit-opd.missing=$(IFS=,; echo "${missing[*]}")")

old_id="$(opd_podman image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)"
opd_log "podman import -> $tag (runtime $OPD_RUNTIME, CONTAINERS_STORAGE_CONF=$CONTAINERS_STORAGE_CONF)"
# --numeric-owner: the image has its own /etc/passwd; ownership is root's
# except /run/cache-dit-opd (10001). Sorted for a stable layer.
new_id="$(tar -C "$rootfs" --numeric-owner --sort=name -cf - . |
  opd_podman import --quiet "${changes[@]}" --message "cache-dit-opd $version ($commit)" - "$tag")" ||
  opd_die "podman import failed"
new_id="${new_id##*sha256:}"
t_imported=$(date +%s%3N)
opd_log "tar | podman import took $(secs "$t_staged" "$t_imported") s"
if [[ -n "$old_id" && "$old_id" != "$new_id"* ]]; then
  # The previous build under this tag is now untagged: drop it (a few GB)
  # unless a container still uses it.
  opd_podman rmi "$old_id" >/dev/null 2>&1 && opd_log "removed the previous image ${old_id:0:12}" || true
fi
((keep_rootfs)) || rm -rf "$rootfs"

size_bytes="$(opd_podman image inspect --format '{{.Size}}' "$tag")"
t_end=$(date +%s%3N)
elapsed="$(secs "$t_start" "$t_end")"
opd_log "built $tag (${new_id:0:12}): $((size_bytes / 1048576)) MiB, commit $commit$([[ $dirty == true ]] && echo ' (dirty tree)'), torch ${torch_version:-unknown}"
opd_log "contents: $contents${missing:+; missing: ${missing[*]}}"
opd_log "build took ${elapsed} s"
