#!/usr/bin/env bash
# deploy/image/smoke.sh: runs the image built by build.sh with podman on a
# machine without a GPU and checks that it works as far as it can there:
#
#   deploy/image/smoke.sh [--tag NAME:VERSION] [--keep]
#
#   1. the image runs as uid/gid 10001 and its ENTRYPOINT is the launcher
#   2. the daemon starts in a container (`--socket /tmp/opd.sock`), logs
#      "health NOT_SERVING (<reason>)" and keeps running
#   3. the daemon process runs as uid 10001 (podman top, and the host's /proc)
#   4. `cache-dit-opdctl --address /tmp/opd.sock status --json` in the same
#      container exits 3 (answered, not serving) with "serving": false and a
#      non-empty not-serving reason
#   5. a client outside the container (the venv's grpcio) reaches the daemon
#      through the bind-mounted socket folder: GetVersion says serving=false,
#      a reason, daemon_uid 10001 (skipped when the venv has no grpcio)
#   6. `cache-dit-opd-launcher --help` exits 0, in the container and as the
#      image's ENTRYPOINT (`podman run IMAGE --help`)
#   7. SIGTERM (podman stop) drains the daemon: exit status 0
#
# A binary the image was built without (CACHE_DIT_IMAGE_ALLOW_MISSING=1 at
# build time, label cache-dit-opd.missing) fails its check unless
# CACHE_DIT_IMAGE_ALLOW_MISSING=1 here too, which marks it SKIPPED. (Without
# the CLI, check 2's log line is what shows the daemon is not serving.)
# --keep leaves the container and its socket folder for a look.
# Exit status: 0 when nothing failed, 1 otherwise (the failures are listed).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

t_start=$(date +%s%3N)
tag="$OPD_DEFAULT_TAG"
keep=0
while (($#)); do
  case "$1" in
    --tag) tag="${2:?--tag needs a name}"; shift 2 ;;
    --tag=*) tag="${1#*=}"; shift ;;
    --keep) keep=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) opd_die "unknown argument: $1 (see --help)" ;;
  esac
done
[[ "$(id -u)" == 0 ]] || opd_die "run as root: the scripts use rootful podman storage (podman/storage.conf)"
allow_missing="${CACHE_DIT_IMAGE_ALLOW_MISSING:-0}"
opd_podman image exists "$tag" || opd_die "no image $tag (deploy/image/build.sh builds it)"

results=()
failed=0
pass() { results+=("PASS  $1"); opd_log "PASS  $1"; }
fail() { results+=("FAIL  $1"); opd_log "FAIL  $1"; failed=1; }
skip() { results+=("SKIP  $1"); opd_log "SKIP  $1"; }
# A binary the image lacks: SKIP with CACHE_DIT_IMAGE_ALLOW_MISSING=1, else FAIL.
lacking() {
  if [[ "$allow_missing" == 1 ]]; then
    skip "$1: the image has no $2 (built with CACHE_DIT_IMAGE_ALLOW_MISSING=1; rebuild once admin/ builds it)"
  else
    fail "$1: the image has no $2 (set CACHE_DIT_IMAGE_ALLOW_MISSING=1 to skip)"
  fi
}
label() { opd_podman image inspect --format "{{index .Labels \"$1\"}}" "$tag" 2>/dev/null || true; }
has_bin() { [[ ",$(label cache-dit-opd.contents)," == *",$1,"* ]]; }

name="cache-dit-opd-smoke-$$"
sockdir="$(mktemp -d /tmp/cache-dit-opd-smoke.XXXXXX)"
chmod 1777 "$sockdir"   # the container's /tmp: the daemon (10001) writes its sockets here
cleanup() {
  if ((keep)); then
    opd_log "kept container $name and $sockdir (podman rm -f $name; rm -rf $sockdir)"
  else
    opd_podman rm -f -t 0 "$name" >/dev/null 2>&1 || true
    rm -rf "$sockdir"
  fi
}
trap cleanup EXIT

opd_log "image $tag ($(label org.opencontainers.image.revision), contents: $(label cache-dit-opd.contents)), runtime $OPD_RUNTIME"

# ---- 1. image configuration -----------------------------------------------------
user="$(opd_podman image inspect --format '{{.Config.User}}' "$tag")"
[[ "$user" == "$OPD_UID:$OPD_GID" || "$user" == "$OPD_UID" ]] &&
  pass "image USER is $user" || fail "image USER is '$user', not $OPD_UID:$OPD_GID"
entry="$(opd_podman image inspect --format '{{json .Config.Entrypoint}}' "$tag")"
[[ "$entry" == "[\"$OPD_PREFIX/bin/cache-dit-opd-launcher\"]" ]] &&
  pass "ENTRYPOINT is $entry" || fail "ENTRYPOINT is $entry, not the launcher"

# ---- 2. the daemon, no GPU -------------------------------------------------------
opd_podman run -d --name "$name" "${OPD_RUN_ARGS[@]}" -v "$sockdir:/tmp" \
  --entrypoint "$OPD_PREFIX/bin/cache-dit-opd" "$tag" --socket /tmp/opd.sock >/dev/null ||
  opd_die "podman run failed (see above); nothing else can be checked"
logs=""
listening=""
for _ in $(seq 1 120); do   # up to 60 s (loading libtorch from a cold cache takes a few)
  logs="$(opd_podman logs "$name" 2>&1 || true)"
  listening="$(grep -m1 ' listening: ' <<<"$logs" || true)"
  [[ -n "$listening" ]] && break
  [[ "$(opd_podman inspect --format '{{.State.Running}}' "$name" 2>/dev/null)" == true ]] || break
  sleep 0.5
done
if [[ -z "$listening" ]]; then
  printf '%s\n' "$logs" | tail -n 30 >&2
  fail "the daemon did not start listening (state: $(opd_podman inspect --format '{{.State.Status}} exit {{.State.ExitCode}}' "$name" 2>/dev/null)); its log is above"
  daemon_up=0
else
  daemon_up=1
  reason="$(sed -n 's/.*health NOT_SERVING (\(.*\))$/\1/p' <<<"$listening")"
  if [[ -n "$reason" ]]; then
    pass "daemon listening on /tmp/opd.sock, log says health NOT_SERVING ($reason)"
  else
    fail "daemon log has no 'health NOT_SERVING (<reason>)': $listening"
  fi
fi

if ((daemon_up)); then
  # ---- 3. the daemon's uid ------------------------------------------------------
  # user/group are names from the image's /etc/passwd, huser/hgroup the host's
  # ids (rootful podman: no user namespace, so the same numbers).
  top="$(opd_podman top "$name" user group huser hgroup 2>&1 | awk 'NR > 1 {print $1 ":" $2 "=" $3 ":" $4}' | sort -u | paste -sd' ' - || true)"
  [[ "$top" == "cache-dit-opd:cache-dit-opd=$OPD_UID:$OPD_GID" ]] && pass "container processes run as $top (podman top: user:group=host uid:gid)" ||
    fail "container processes run as '$top' (podman top), not cache-dit-opd:cache-dit-opd=$OPD_UID:$OPD_GID"
  pid="$(opd_podman inspect --format '{{.State.Pid}}' "$name")"
  uids="$(awk '/^Uid:/ {print $2, $3, $4, $5}' "/proc/$pid/status" 2>/dev/null || true)"
  [[ "$uids" == "$OPD_UID $OPD_UID $OPD_UID $OPD_UID" ]] && pass "daemon (host pid $pid) has uid $OPD_UID (real, effective, saved, fs)" ||
    fail "daemon (host pid $pid) has uids '$uids', not $OPD_UID"

  # ---- 4. the CLI, in the same container ----------------------------------------
  if has_bin cache-dit-opdctl; then
    rc=0
    out="$(timeout 60 podman "${OPD_PODMAN_GLOBAL[@]}" exec "$name" cache-dit-opdctl --address /tmp/opd.sock status --json 2>"$sockdir/ctl.err")" || rc=$?
    if [[ "$rc" != 3 ]]; then
      fail "cache-dit-opdctl status --json exited $rc, not 3 (answered, not serving); stderr: $(head -c 600 "$sockdir/ctl.err")"
    elif verdict="$(python3 - "$out" "$OPD_UID" <<'EOF'
import json, sys
try:
    doc = json.loads(sys.argv[1])
except ValueError as e:
    sys.exit(f"not JSON ({e}): {sys.argv[1][:300]!r}")
def find(o, keys):
    # the first value under any of `keys`, at any depth
    if isinstance(o, dict):
        for k in keys:
            if k in o:
                return o[k]
        for v in o.values():
            r = find(v, keys)
            if r is not None:
                return r
    elif isinstance(o, list):
        for v in o:
            r = find(v, keys)
            if r is not None:
                return r
    return None
serving = find(doc, ["serving"])
reason = find(doc, ["not_serving_reason", "notServingReason", "reason"])
if serving is not False:
    sys.exit(f'"serving" is {serving!r}, not false')
if not isinstance(reason, str) or not reason.strip():
    sys.exit(f"no non-empty not-serving reason (got {reason!r})")
uid = find(doc, ["daemon_uid"])
if uid is not None and uid != int(sys.argv[2]):
    sys.exit(f"daemon_uid is {uid!r}, not {sys.argv[2]}")
print(reason + (f" (daemon_uid {uid})" if uid is not None else ""))
EOF
)"; then
      pass "cache-dit-opdctl status --json: exit 3, serving false, reason: $verdict"
    else
      fail "cache-dit-opdctl status --json: exit 3 but ${verdict:-its JSON is not as expected}"
    fi
  else
    lacking "cache-dit-opdctl status --json" cache-dit-opdctl
    [[ "$allow_missing" == 1 ]] && opd_log "      (the daemon's NOT_SERVING state was checked from its log line instead)"
  fi

  # ---- 5. a client outside the container, through the bind-mounted socket -----
  venv="${CACHE_DIT_VENV:-$OPD_REPO/.venv}"
  py="$venv/bin/python"
  [[ -x "$py" ]] || py=python3
  if "$py" -c 'import grpc, google.protobuf' 2>/dev/null; then
    # The messages from the working tree's .proto (what the daemon was built
    # from), else the Python client's checked-in copy.
    pb2="$OPD_REPO/python/cache_dit_opd/_proto/opd_pb2.py"
    mkdir -p "$sockdir/pb"
    if "$py" -m grpc_tools.protoc -I "$OPD_REPO/proto" --python_out="$sockdir/pb" \
         "$OPD_REPO/proto/cache_dit_opd/v1/opd.proto" 2>/dev/null; then
      pb2="$sockdir/pb/cache_dit_opd/v1/opd_pb2.py"
    fi
    if verdict="$("$py" - "$pb2" "$sockdir/opd.sock" "$OPD_UID" <<'EOF' 2>&1
import importlib.util, sys
import grpc
spec = importlib.util.spec_from_file_location("opd_pb2", sys.argv[1])
pb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pb)
channel = grpc.insecure_channel("unix:" + sys.argv[2])
get_version = channel.unary_unary("/cache_dit_opd.v1.OperatorDaemon/GetVersion",
                                  request_serializer=pb.VersionRequest.SerializeToString,
                                  response_deserializer=pb.VersionReply.FromString)
for _ in range(2):  # twice: it keeps answering
    v = get_version(pb.VersionRequest(), timeout=20)
if v.serving:
    sys.exit("GetVersion says serving=true without a GPU")
if not v.not_serving_reason:
    sys.exit("GetVersion gives no not_serving_reason")
# daemon_uid (newer daemons): 0 is also what an older daemon leaves unset;
# the uid itself was checked from /proc above.
uid = getattr(v, "daemon_uid", 0)
if uid not in (0, int(sys.argv[3])):
    sys.exit(f"GetVersion says daemon_uid {uid}, not {sys.argv[3]}")
print(f"daemon {v.daemon_version} ({v.git_commit}), torch {v.torch_version}, "
      f"uid {uid if uid else 'not reported'}, serving=false: {v.not_serving_reason}")
EOF
)"; then
      pass "host client via the bind-mounted socket: GetVersion x2: $verdict"
    else
      fail "host client via the bind-mounted socket: $(tail -n 3 <<<"$verdict")"
    fi
  else
    skip "host client via the bind-mounted socket: no grpcio in $py"
  fi
fi

# ---- 6. the launcher --------------------------------------------------------------
if has_bin cache-dit-opd-launcher; then
  if ((daemon_up)); then
    rc=0
    out="$(timeout 60 podman "${OPD_PODMAN_GLOBAL[@]}" exec "$name" cache-dit-opd-launcher --help 2>&1)" || rc=$?
    [[ "$rc" == 0 && -n "$out" ]] && pass "cache-dit-opd-launcher --help in the container: exit 0" ||
      fail "cache-dit-opd-launcher --help in the container exited $rc: $(head -c 600 <<<"$out")"
  fi
  rc=0
  out="$(timeout 120 podman "${OPD_PODMAN_GLOBAL[@]}" run --rm "${OPD_RUN_ARGS[@]}" "$tag" --help 2>&1)" || rc=$?
  [[ "$rc" == 0 && -n "$out" ]] && pass "podman run IMAGE --help (ENTRYPOINT, the launcher): exit 0" ||
    fail "podman run IMAGE --help (ENTRYPOINT, the launcher) exited $rc: $(head -c 600 <<<"$out")"
else
  lacking "cache-dit-opd-launcher --help" cache-dit-opd-launcher
fi

# ---- 7. drain on SIGTERM ----------------------------------------------------------
if ((daemon_up)); then
  if [[ "$(opd_podman inspect --format '{{.State.Running}}' "$name")" != true ]]; then
    fail "the daemon stopped during the checks: $(opd_podman logs "$name" 2>&1 | tail -n 5)"
  else
    opd_podman stop -t 20 "$name" >/dev/null 2>&1 || true
    code="$(opd_podman inspect --format '{{.State.ExitCode}}' "$name")"
    [[ "$code" == 0 ]] && pass "still running after the checks; podman stop (SIGTERM): daemon exited 0" ||
      fail "podman stop (SIGTERM): daemon exited $code; log tail: $(opd_podman logs "$name" 2>&1 | tail -n 3)"
  fi
fi

t_end=$(date +%s%3N)
opd_log "---- smoke of $tag: $(awk -v a="$t_start" -v b="$t_end" 'BEGIN { printf "%.1f", (b - a) / 1000 }') s"
for r in "${results[@]}"; do opd_log "  $r"; done
if ((failed)); then
  opd_log "smoke FAILED"
  exit 1
fi
opd_log "smoke passed ($(grep -c '^SKIP' < <(printf '%s\n' "${results[@]}") || true) skipped)"
