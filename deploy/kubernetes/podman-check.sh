#!/usr/bin/env bash
# deploy/kubernetes/podman-check.sh: runs the cache-dit-opd image the way
# daemonset.yaml and client-example.yaml run it, under podman on this host
# (no cluster, no GPU needed), and checks what the manifests rely on:
#
#   1. the daemon (uid 10001) cannot start on the root:root 0755 directory
#      kubelet creates for a new hostPath;
#   2. after the init container's step (chown + chmod 0750, CHOWN and FOWNER
#      only) it starts, with its sockets 0660 10001:10001;
#   3. the readiness command exits non-zero when the daemon is not serving
#      (no GPU here) and the liveness command exits 0;
#   4. a client container of primary gid 10001 with the directory mounted
#      read-only reaches the daemon; one of another gid does not;
#   5. SIGTERM: the daemon exits 0 well within the grace period.
#
#   sudo deploy/kubernetes/podman-check.sh [IMAGE]
#
# IMAGE defaults to localhost/cache-dit-opd:<newTag of kustomization.yaml>
# (what deploy/image/build.sh loads). Needs root, podman and busybox (for the
# init step, run on the host with only CHOWN and FOWNER). The daemon is run
# directly with --socket: the launcher lists GPUs with nvidia-smi, and there
# may be none. Exit status: 0 when every check passed.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../image/lib.sh"
[[ "$(id -u)" == 0 ]] || opd_die "run as root (rootful podman, and the init step's chown)"
command -v busybox >/dev/null || opd_die "busybox is not installed (apt-get install -y busybox-static)"

tag="$(awk '/- name: cache-dit-opd$/ {f=1; next} f && /newTag:/ {print $2; exit}' "$here/kustomization.yaml")"
image="${1:-localhost/cache-dit-opd:$tag}"
dir="$(mktemp -d /tmp/opd-k8s-check.XXXXXX)"
host="$dir/run-cache-dit-opd"
uuid=GPU-00000000-0000-0000-0000-00000000c8c8
name="opd-k8s-check-$$"
bin=/opt/cache-dit-opd/bin
failed=0
ok() { echo "ok:   $*"; }
bad() { echo "FAIL: $*"; failed=1; }
cleanup() { opd_podman rm -f "$name" >/dev/null 2>&1; rm -rf "$dir"; }
trap cleanup EXIT

# daemonset.yaml's pod: hostPID, hostIPC, uid/gid 10001, read-only root, /tmp
# emptyDir, no capabilities, no privilege escalation, the runtime dir hostPath.
pod=(--pid=host --ipc=host --user 10001:10001 --read-only --tmpfs /tmp --cap-drop ALL
     --security-opt no-new-privileges -v "$host:/run/cache-dit-opd"
     -e CACHE_DIT_OPD_RUNTIME_DIR=/run/cache-dit-opd -e HOME=/tmp "${OPD_RUN_ARGS[@]}")
flags=(--runtime-dir /run/cache-dit-opd --socket "/run/cache-dit-opd/$uuid.sock" --log-level info
       --max-sessions 64 --drain-deadline-ms 10000 --allowed-gid 10001)

mkdir -m 0755 "$host"  # what kubelet's DirectoryOrCreate makes: root:root 0755
timeout 120 podman "${OPD_PODMAN_GLOBAL[@]}" run --rm "${pod[@]}" --entrypoint "$bin/cache-dit-opd" "$image" "${flags[@]}" \
  >"$dir/first.log" 2>&1
rc=$?
if [[ $rc -ne 0 ]] && grep -q "Permission denied" "$dir/first.log"; then
  ok "1. on root:root 0755 the daemon exits $rc: $(grep -m1 'Permission denied' "$dir/first.log" | cut -c1-160)"
else
  bad "1. on root:root 0755 the daemon exited $rc; expected a Permission denied failure"
fi

setpriv --bounding-set=-all,+chown,+fowner --inh-caps=-all \
  busybox sh -c "chown 10001:10001 $host && chmod 0750 $host" || bad "2. the init step failed"
opd_podman run -d --name "$name" "${pod[@]}" --entrypoint "$bin/cache-dit-opd" "$image" "${flags[@]}" >/dev/null
for _ in $(seq 1 120); do [[ -S "$host/$uuid.session.sock" ]] && break; sleep 0.5; done
modes="$(stat -c '%A %u:%g' "$host" "$host/$uuid.sock" "$host/$uuid.session.sock" 2>&1 | tr '\n' ' ')"
if [[ "$modes" == "drwxr-x--- 10001:10001 srw-rw---- 10001:10001 srw-rw---- 10001:10001 " ]]; then
  ok "2. after the init step the daemon listens: $modes"
else
  bad "2. directory and sockets: $modes"; opd_podman logs "$name" 2>&1 | tail -5
fi

opd_podman exec "$name" "$bin/cache-dit-opdctl" --runtime-dir /run/cache-dit-opd status --all >"$dir/ready.txt" 2>&1
ready=$?
opd_podman exec "$name" "$bin/cache-dit-opdctl" --runtime-dir /run/cache-dit-opd status --all --live >"$dir/live.txt" 2>&1
live=$?
health="$(grep -m1 '^health' "$dir/ready.txt" | cut -c1-120)"
if [[ $ready -ne 0 && $live -eq 0 ]]; then
  ok "3. readiness exits $ready, liveness exits 0 ($health)"
elif [[ $ready -eq 0 && $live -eq 0 ]]; then
  ok "3. readiness and liveness exit 0: this daemon is serving ($health)"
else
  bad "3. readiness exits $ready, liveness exits $live ($health)"
fi

client() {  # client UID:GID -> the exit status of `status --all --live` from a client-like container
  opd_podman run --rm --user "$1" --read-only -v "$host:/run/cache-dit-opd:ro" "${OPD_RUN_ARGS[@]}" \
    --entrypoint "$bin/cache-dit-opdctl" "$image" --runtime-dir /run/cache-dit-opd status --all --live >/dev/null 2>&1
}
client 20001:10001; c1=$?
client 20001:20001; c2=$?
if [[ $c1 -eq 0 && $c2 -ne 0 ]]; then
  ok "4. a client of gid 10001 (read-only mount) reaches the daemon; one of gid 20001 does not (exit $c2)"
else
  bad "4. client gid 10001 exits $c1 (want 0), gid 20001 exits $c2 (want non-zero)"
fi

t0=$(date +%s%N)
opd_podman stop -t 30 "$name" >/dev/null
t1=$(date +%s%N)
code="$(opd_podman inspect "$name" --format '{{.State.ExitCode}}')"
ms=$(( (t1 - t0) / 1000000 ))
if [[ "$code" == 0 && $ms -lt 20000 ]]; then
  ok "5. SIGTERM: exit 0 after ${ms} ms (grace period 30 s, drain deadline 10 s)"
else
  bad "5. SIGTERM: exit $code after ${ms} ms"
fi
exit $failed
