# shellcheck shell=bash disable=SC2034  # sourced: its variables are for build.sh and smoke.sh
# deploy/image/lib.sh: sourced by build.sh and smoke.sh. Makes podman work
# on a fresh Debian 12 host (and in sandboxes) without touching /etc:
#
#   opd_podman ARGS...      podman with this folder's containers.conf and
#                           storage.conf and the host's OCI runtime
#   OPD_RUN_ARGS            extra `podman run` arguments (ulimits, below)
#   opd_log / opd_die       messages on stderr
#
# Inputs (environment):
#   CONTAINERS_CONF, CONTAINERS_STORAGE_CONF   kept when already set
#   CACHE_DIT_IMAGE_RUNTIME          OCI runtime (crun|runc|path); default: crun,
#                                    or runc on a cgroup v1/hybrid host
#   CACHE_DIT_IMAGE_STORAGE_DRIVER   e.g. vfs where overlayfs cannot mount

OPD_IMAGE_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OPD_REPO="$(cd "$OPD_IMAGE_DIR/../.." && pwd)"

opd_log() { printf '[image] %s\n' "$*" >&2; }
opd_die() { printf '[image] ERROR: %s\n' "$*" >&2; exit 1; }

export CONTAINERS_CONF="${CONTAINERS_CONF:-$OPD_IMAGE_DIR/podman/containers.conf}"
export CONTAINERS_STORAGE_CONF="${CONTAINERS_STORAGE_CONF:-$OPD_IMAGE_DIR/podman/storage.conf}"

command -v podman >/dev/null 2>&1 ||
  opd_die "podman is not installed (Debian/Ubuntu: apt-get install -y podman; a cgroup v1 host also needs runc)"

# The OCI runtime. crun 1.8 (Debian 12's) aborts every container on a hybrid
# cgroup host whose cgroup2 mount has controllers ("cgroups in hybrid mode not
# supported, drop all controllers from cgroupv2"), and runc refuses
# --cgroups=disabled, so on cgroup v1/hybrid hosts runc with cgroupfs it is.
opd_pick_runtime() {
  if [[ -n "${CACHE_DIT_IMAGE_RUNTIME:-}" ]]; then
    printf '%s' "$CACHE_DIT_IMAGE_RUNTIME"
    return
  fi
  if [[ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" == cgroup2fs ]]; then
    printf 'crun'   # pure cgroup v2: podman's default works
    return
  fi
  command -v runc >/dev/null 2>&1 ||
    opd_die "this host has cgroup v1/hybrid mounts, where crun cannot run containers; install runc (apt-get install -y runc) or set CACHE_DIT_IMAGE_RUNTIME"
  printf 'runc'
}
OPD_RUNTIME="$(opd_pick_runtime)"

OPD_PODMAN_GLOBAL=(--runtime "$OPD_RUNTIME")
if [[ -n "${CACHE_DIT_IMAGE_STORAGE_DRIVER:-}" ]]; then
  OPD_PODMAN_GLOBAL+=(--storage-driver "$CACHE_DIT_IMAGE_STORAGE_DRIVER")
fi

opd_podman() { podman "${OPD_PODMAN_GLOBAL[@]}" "$@"; }

# Resource limits. Rootful podman gives a container RLIMIT_NOFILE 1048576 and
# RLIMIT_NPROC at its own (raised) limit; raising a limit needs
# CAP_SYS_RESOURCE, which sandboxes often drop even for root ("setrlimit
# RLIMIT_NOFILE: Operation not permitted"). Without that capability the
# container gets the host's hard limits instead, RLIMIT_NPROC capped at
# kernel.pid_max (podman itself runs under that cap; more fails in runc).
OPD_RUN_ARGS=()
opd_has_cap_sys_resource() {
  local eff
  eff="$(awk '/^CapEff:/ {print $2}' /proc/self/status 2>/dev/null)"
  [[ -n "$eff" ]] || return 0
  (( (16#$eff >> 24) & 1 ))
}
if ! opd_has_cap_sys_resource; then
  _nofile="$(ulimit -Hn)"
  _nproc="$(ulimit -Hu)"
  _pidmax="$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo 32768)"
  [[ "$_nproc" == unlimited ]] && _nproc="$_pidmax"
  (( _nproc > _pidmax )) && _nproc="$_pidmax"
  [[ "$_nofile" == unlimited ]] && _nofile=1048576
  OPD_RUN_ARGS+=(--ulimit "nofile=$_nofile:$_nofile" --ulimit "nproc=$_nproc:$_nproc")
  unset _nofile _nproc _pidmax
fi

# The version the image is tagged with by default: the project's.
opd_project_version() {
  sed -n 's/^project(cache_dit_opd VERSION \([0-9.]*\).*/\1/p' "$OPD_REPO/CMakeLists.txt" | head -n1
}
OPD_DEFAULT_TAG="cache-dit-opd:$(opd_project_version)"

# Where the image puts things (build.sh writes them, smoke.sh relies on them).
OPD_PREFIX=/opt/cache-dit-opd
OPD_UID=10001
OPD_GID=10001
