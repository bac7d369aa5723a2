"""Operating the daemon (CPU, fake device ops, the real daemon process): Prometheus metrics, the admin CLI
(`cache-dit-opdctl`) and clients in another PID namespace.

* metrics: a daemon serving /metrics on a loopback port (--metrics-address); after a known number of calls,
  rejections by reason and a calls to an op the catalog does not hold, a scrape parsed with
  prometheus_client's parser shows exactly those counts under the right labels, the histograms are
  cumulative with +Inf equal to _count, and the session gauges follow the session; bad and busy addresses.
* opdctl: every command against a real daemon, `--json` parsed (status of one and of every daemon of a
  runtime dir, with the exit codes the Kubernetes probes rely on; sessions; stats; drain) and drain refused
  to another uid (a child that drops to uid 65534) while the daemon keeps serving.
* PID namespaces: a client in its own PID namespace (`unshare --pid --fork`) binds a session with its inner
  pid (the daemon checks it against /proc/<pid>/status NSpid), opdctl shows the outer pid, and killing the
  client ends the session as a local client's death does.
"""
from __future__ import annotations

import json
import re
import struct
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import _client_fixtures as fx
from test_client_reasons import FP8, TIMEOUT_S, Peer, rejected
from cache_dit_opd import _errors
from cache_dit_opd._proto import opd_pb2 as pb

QUANT = ("fp8_comm_per_token_quant", "out")


def opdctl_path() -> str:
    return fx.built(os.path.join(fx.build_dir(), "admin", "ctl", "cache-dit-opdctl"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def opdctl(*args, user: int | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    """``user``: run it as that uid (and gid), set by subprocess in the child without running Python there."""
    return subprocess.run([opdctl_path(), *args], capture_output=True, text=True, timeout=timeout,
                          user=user, group=user)


def opdctl_json(*args, expect_rc: int = 0):
    r = opdctl(*args, "--json")
    assert r.returncode == expect_rc, (r.returncode, r.stdout, r.stderr)
    return json.loads(r.stdout)


def scrape(port: int) -> dict:
    """{(name, frozenset(labels)): value} of every sample, plus the family types under ("#type", name)."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT_S).read().decode()
    out = {}
    for fam in text_string_to_metric_families(body):
        out[("#type", fam.name)] = fam.type
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def sample(m: dict, name: str, **labels):
    return m.get((name, frozenset(labels.items())))


@pytest.fixture
def metrics_daemon():
    port = free_port()
    d = fx.daemon(None, "--metrics-address", f"127.0.0.1:{port}")
    try:
        yield d, port
    finally:
        d.stop()


def test_metrics_count_known_calls_and_rejections_by_op_reason_and_transport(metrics_daemon):
    d, port = metrics_daemon
    p = Peer(d)
    try:
        r = p.bound(lanes=2)
        args = p.quant_args(r)
        for _ in range(3):
            p.call(r, args=args)
        bad = [args[0], p.tensor(r, 4, 65, dtype=FP8)]  # scales column missing
        for _ in range(2):
            rejected(lambda: p.call(r, args=bad))
        rejected(lambda: p.call(r, op="no_such_op", args=args))
        too_many = rejected(lambda: p.call(r, args=[args[0]] * 33))  # no call: the request does not convert
        assert _errors.reason_name(too_many.reason) == "BAD_ARGUMENT", too_many
        m = scrape(port)
        assert m[("#type", "cache_dit_opd_calls")] == "counter"
        grpc_quant = dict(op=QUANT[0], overload=QUANT[1], transport="grpc")
        assert sample(m, "cache_dit_opd_calls_total", **grpc_quant) == 3
        assert sample(m, "cache_dit_opd_call_rejections_total", **grpc_quant, reason="BAD_ARGUMENT") == 2
        # A name the catalog does not hold is counted under op="": a client cannot add label values.
        assert sample(m, "cache_dit_opd_call_rejections_total", op="", overload="", transport="grpc",
                      reason="OP_UNKNOWN") == 1
        assert not [k for k in m if k[0] != "#type" and ("op", "no_such_op") in k[1]]
        # ...as is a request that does not convert to a call, under its own transport.
        assert sample(m, "cache_dit_opd_call_rejections_total", op="", overload="", transport="grpc",
                      reason="BAD_ARGUMENT") == 1
        assert not [k for k in m if k[0] == "cache_dit_opd_call_rejections_total" and ("transport", "ring") in k[1]]
        # Histograms: every call of the row reached completion; cumulative buckets, +Inf == _count.
        n = sample(m, "cache_dit_opd_call_duration_seconds_count", **grpc_quant)
        assert n == 5, n  # 3 run + 2 rejected at acceptance, each completed in order
        buckets = sorted((float(dict(k[1])["le"]), v) for k, v in m.items()
                         if k[0] == "cache_dit_opd_call_duration_seconds_bucket" and ("op", QUANT[0]) in k[1])
        assert buckets[-1] == (float("inf"), n)
        assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), buckets
        for stage in ("accept", "inputs_wait", "run"):
            c = sample(m, "cache_dit_opd_call_stage_seconds_count", **grpc_quant, stage=stage)
            assert c is not None and c >= 3, (stage, c)
        # Session gauges follow the session.
        assert sample(m, "cache_dit_opd_sessions") == 1
        assert sample(m, "cache_dit_opd_lanes") == 2
        assert sample(m, "cache_dit_opd_regions") == 3
        assert sample(m, "cache_dit_opd_mapped_bytes") == 4 * 64 * 2 + 4 * 66 + 4 * 65
        assert sample(m, "cache_dit_opd_health", state="serving") == 1
        assert sample(m, "cache_dit_opd_health", state="device_lost") == 0
        info = [dict(k[1]) for k in m if k[0] == "cache_dit_opd_info"]
        assert len(info) == 1 and info[0]["gpu_uuid"] == d.version().gpu_uuid and info[0]["protocol_version"] == "2"
        assert sample(m, "process_resident_memory_bytes") > 0
        assert sample(m, "process_cpu_seconds_total") > 0
        # GetStats' per-op rows are the same table.
        ops = {(o.name, o.overload, o.transport): o for o in d.stats().ops}
        assert ops[(*QUANT, "grpc")].calls == 3 and ops[(*QUANT, "grpc")].rejections == 2
        assert ops[("", "", "grpc")].rejections == 2 and ("", "", "ring") not in ops
        p.stub.CloseSession(pb.CloseSessionRequest(session_id=r.session_id, token=r.token), timeout=TIMEOUT_S)
        deadline = time.monotonic() + TIMEOUT_S
        while sample(m := scrape(port), "cache_dit_opd_sessions") != 0:
            assert time.monotonic() < deadline, "the session gauge did not return to 0"
            time.sleep(0.05)
        assert sample(m, "cache_dit_opd_sessions_closed_total") == 1
        assert sample(m, "cache_dit_opd_regions") == 0
    finally:
        p.close()


def test_metrics_endpoint_answers_only_get_metrics_and_survives_garbage(metrics_daemon):
    d, port = metrics_daemon
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=TIMEOUT_S)
    assert e.value.code == 404
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/metrics", data=b"x"),
                               timeout=TIMEOUT_S)
    assert e.value.code == 405 and e.value.headers["Allow"] == "GET, HEAD"
    # HEAD: GET's head (its length included), no body.
    get = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT_S)
    head = urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/metrics", method="HEAD"),
                                  timeout=TIMEOUT_S)
    assert head.status == 200 and head.headers["Content-Type"] == get.headers["Content-Type"]
    assert int(head.headers["Content-Length"]) > 0 and head.read() == b""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"HEAD /metrics HTTP/1.1\r\n\r\n")
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
        assert raw.startswith(b"HTTP/1.1 200") and raw.endswith(b"\r\n\r\n")  # nothing after the head
    # Garbage, an oversized head, and silent connections beyond the cap: the next scrape still works.
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"\x00\xff garbage\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.1 400")
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 10000)
        assert s.recv(64).startswith(b"HTTP/1.1 431")
    # More silent peers than the 8 that may stay silent for a second: the others are dropped after 100 ms, and a
    # scrape is answered at once (not after their 5 s deadline, as it once was).
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(12)]
    try:
        assert sample(scrape(port), "cache_dit_opd_sessions") == 0
    finally:
        for s in idle:
            s.close()
    assert sample(scrape(port), "cache_dit_opd_sessions") == 0
    assert d.alive()


def test_a_request_with_bytes_past_its_head_still_gets_its_whole_response(metrics_daemon):
    """A client that sends more than the head (a body the endpoint never reads, or a second request) gets the
    whole response and an orderly end: closing a socket with unread input sends a reset, which can cut the
    response short or turn the client's read into ECONNRESET. The client here reads only after sending all."""
    d, port = metrics_daemon
    for extra in (b"x" * 200_000, b"GET /metrics HTTP/1.1\r\n\r\n" * 2000):
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as s:
            try:
                s.sendall(b"GET /metrics HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(extra) + extra)
            except (BrokenPipeError, ConnectionResetError) as e:
                pytest.fail(f"the endpoint reset the connection while the request was being sent: {e!r}")
            raw = b""
            try:
                while chunk := s.recv(65536):
                    raw += chunk
            except ConnectionResetError as e:
                pytest.fail(f"the endpoint reset the connection after {len(raw)} bytes of its response: {e!r}")
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head[:64]
        length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")).split(b":")[1])
        assert len(body) == length > 0 and b"cache_dit_opd_sessions" in body
    assert sample(scrape(port), "cache_dit_opd_sessions") == 0 and d.alive()


def test_silent_peers_that_reconnect_at_once_cannot_keep_a_scraper_out(metrics_daemon):
    """More silent peers than the backlog holds, each reconnecting as soon as it is dropped: the endpoint
    drains its backlog as connections come (a full one would drop the scraper's connect) and drops silent
    peers before a scraper, which sends its request at once. Every scrape is answered within its timeout."""
    d, port = metrics_daemon
    stop = threading.Event()

    def silent():
        while not stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                    s.settimeout(10)
                    while not stop.is_set() and s.recv(64):
                        pass
            except OSError:
                pass

    peers = [threading.Thread(target=silent, daemon=True) for _ in range(64)]
    for t in peers:
        t.start()
    try:
        time.sleep(0.5)
        for _ in range(3):
            assert sample(scrape(port), "cache_dit_opd_sessions") == 0
    finally:
        stop.set()
        for t in peers:
            t.join(timeout=15)
    assert d.alive()


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_out_of_descriptors_the_endpoint_waits_instead_of_spinning(metrics_daemon):
    """With the daemon's descriptors used up, a connection waiting to be accepted keeps the listening socket
    readable: the endpoint pauses accepting (it used to poll it in a loop, a core at 100%) and answers once
    descriptors are free again."""
    import resource

    if os.environ.get("CACHE_DIT_OPD_SANITIZED") == "1":
        # As SessionManagerTest.AcceptOutOfDescriptorsNeitherSpinsNorStopsServing: a sanitizer's runtime needs
        # descriptors of its own (UBSan's vptr check reads through a pipe). Against the ASan+UBSan daemon this
        # connection was closed unanswered (CI, 2026-12-07; not investigated further). The plain build runs it.
        pytest.skip("a sanitized daemon needs file descriptors of its own, which this test exhausts")
    d, port = metrics_daemon
    limits = resource.prlimit(d.pid, resource.RLIMIT_NOFILE)
    used = {int(n) for n in os.listdir(f"/proc/{d.pid}/fd")}
    lowest_free = next(n for n in range(len(used) + 1) if n not in used)
    resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (lowest_free, limits[1]))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
            before = _cpu_seconds(d.pid)
            time.sleep(1.0)
            spent = _cpu_seconds(d.pid) - before
            resource.prlimit(d.pid, resource.RLIMIT_NOFILE, limits)
            assert spent < 0.3, f"the daemon used {spent:.2f} s of CPU in 1 s with a connection it could not accept"
            s.settimeout(TIMEOUT_S)
            assert s.recv(64).startswith(b"HTTP/1.1 200")
    finally:
        resource.prlimit(d.pid, resource.RLIMIT_NOFILE, limits)
    assert d.alive()


def test_metrics_address_errors_name_the_value():
    for bad in ("nohost", "127.0.0.1:", "127.0.0.1:99999", "::1:9464", "127.0.0.1:0"):
        r = subprocess.run([fx.built(fx.fake_daemon_binary_path()), "--socket", "/tmp/unused.sock",
                            "--metrics-address", bad], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and f"--metrics-address '{bad}'" in r.stderr, (bad, r.stderr)
    # An address given explicitly that cannot be bound is fatal (exit 2, saying so) ...
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(fx.DaemonError) as e:
            fx.daemon(None, "--metrics-address", f"127.0.0.1:{port}")
        assert f"cannot listen on 127.0.0.1:{port}" in str(e.value)
    # ... and "" turns metrics off: GetVersion says so.
    d = fx.daemon(None, "--metrics-address", "")
    try:
        assert d.version().metrics_address == ""
    finally:
        d.stop()


# -- cache-dit-opdctl -------------------------------------------------------------------------------------


def test_opdctl_status_human_and_json(metrics_daemon):
    d, port = metrics_daemon
    r = opdctl("--address", str(d.socket), "status")
    assert r.returncode == 0, r.stderr
    assert "SERVING" in r.stdout and d.version().gpu_uuid in r.stdout and f"127.0.0.1:{port}" in r.stdout
    j = opdctl_json("--address", str(d.socket), "status")
    assert j["reachable"] and j["serving"] and j["health"] == "SERVING"
    assert j["version"]["daemon_pid"] == d.pid and j["version"]["metrics_address"] == f"127.0.0.1:{port}"
    assert j["version"]["session_channel_path"].endswith(".session.sock")
    assert j["stats"]["sessions"] == 0 and isinstance(j["stats"]["calls"], (int, float))


def test_opdctl_status_all_of_a_runtime_dir_and_the_probe_exit_codes():
    rt = fx.short_tmpdir()
    uuids = ["GPU-11111111-0000-4000-8000-000000000001", "GPU-11111111-0000-4000-8000-000000000002"]
    ds = [fx.daemon(None, "--runtime-dir", rt, "--metrics-address", "", env={"CACHE_DIT_OPD_FAKE_GPU_UUID": u},
                    socket=os.path.join(rt, f"{u}.sock")) for u in uuids]
    try:
        j = opdctl_json("--runtime-dir", rt, "status", "--all")
        assert sorted(e["version"]["gpu_uuid"] for e in j) == uuids and all(e["serving"] for e in j)
        # One daemon by UUID, found as clients find it.
        one = opdctl_json("--runtime-dir", rt, "--gpu", uuids[1], "status")
        assert one["version"]["gpu_uuid"] == uuids[1]
        # Two daemons and no --gpu: a usage error listing them.
        r = opdctl("--runtime-dir", rt, "status")
        assert r.returncode == 2 and uuids[0] in r.stderr and uuids[1] in r.stderr
        # A daemon without a usable GPU answers: not ready (3), alive (0 with --live).
        u3 = "GPU-11111111-0000-4000-8000-000000000003"
        ds.append(fx.daemon(None, "--runtime-dir", rt, "--metrics-address", "", serving=False,
                            env={"CACHE_DIT_OPD_FAKE_GPU_UUID": u3, "CACHE_DIT_OPD_FAKE_NOT_SERVING": "no GPU here"},
                            socket=os.path.join(rt, f"{u3}.sock")))
        j = opdctl_json("--runtime-dir", rt, "status", "--all", expect_rc=3)
        down = [e for e in j if not e["serving"]]
        assert len(down) == 1 and down[0]["health_reason"] == "REASON_NOT_SERVING"
        assert "no GPU here" in down[0]["not_serving_reason"]
        assert opdctl("--runtime-dir", rt, "status", "--all", "--live").returncode == 0
        # A daemon that is gone: unreachable (1), for --live as well.
        ds[0].kill()
        assert opdctl("--runtime-dir", rt, "status", "--all", "--live").returncode == 1
        # Nothing in an empty dir: 1, saying where it looked.
        empty = fx.short_tmpdir()
        r = opdctl("--runtime-dir", empty, "status", "--all")
        assert r.returncode == 1 and empty in r.stderr
    finally:
        for d in ds:
            d.stop()


def test_opdctl_sessions_and_stats_json(metrics_daemon):
    d, _ = metrics_daemon
    p = Peer(d)
    try:
        r = p.bound(lanes=3, client_name="opdctl-test")
        args = p.quant_args(r)
        for _ in range(4):
            p.call(r, args=args)
        rejected(lambda: p.call(r, op="no_such_op", args=args))
        j = opdctl_json("--address", str(d.socket), "sessions")
        (s,) = j["sessions"]
        assert s["session_id"] == r.session_id and s["client_pid"] == os.getpid() and s["client_uid"] == os.getuid()
        assert s["bound"] and s["lanes"] == 3 and s["calls"] == 4 and s["errors"] == 1 and s["regions"] == 2
        assert s["client_name"] == "opdctl-test" and "python" in s["command"]
        assert s["mapped_bytes"] == 4 * 64 * 2 + 4 * 66 and s["idle_ms"] <= s["age_ms"]
        human = opdctl("--address", str(d.socket), "sessions")
        assert human.returncode == 0 and str(os.getpid()) in human.stdout and "python" in human.stdout
        st = opdctl_json("--address", str(d.socket), "stats")["stats"]
        assert st["calls"] == 4 and st["errors"] == 1
        rows = {(o["name"], o["transport"]): o for o in st["ops"]}
        assert rows[(QUANT[0], "grpc")]["calls"] == 4 and rows[("", "grpc")]["rejections"] == 1
        assert {x["name"] for x in st["stages"]} == {"accept", "inputs_wait", "run"}
        human = opdctl("--address", str(d.socket), "stats")
        assert human.returncode == 0 and QUANT[0] in human.stdout and "(not in the catalog)" in human.stdout
    finally:
        p.close()


def test_which_executor_serves_each_session_is_shown_by_opdctl_and_the_metrics():
    """--executor-threads 2, three sessions that call and one that does not: opdctl and /metrics show the
    threads, the executor of each session that called (spread: 0, 1, 0) and none for the one that did not,
    and how long each thread has been busy (both served calls: both busy a while, and /metrics says the same
    as GetStats)."""
    port = free_port()
    d = fx.daemon(None, "--executor-threads", "2", "--metrics-address", f"127.0.0.1:{port}")
    p = Peer(d)
    try:
        callers = [p.bound(client_name=f"exec-{i}") for i in range(3)]
        for r in callers:  # one after another: each first call picks the executor with the fewest sessions
            p.call(r, args=p.quant_args(r))
        idle = p.bound(client_name="exec-idle")
        j = opdctl_json("--address", str(d.socket), "sessions")
        executor = {s["session_id"]: s["executor"] for s in j["sessions"]}
        assert [executor[r.session_id] for r in callers] == [0, 1, 0], j
        assert executor[idle.session_id] == -1
        st = opdctl_json("--address", str(d.socket), "stats")["stats"]
        assert st["executor_threads"] == 2
        busy = st["executor_busy_ns"]
        assert len(busy) == 2 and all(b > 0 for b in busy), busy
        human = opdctl("--address", str(d.socket), "status")
        assert human.returncode == 0 and "2 thread(s)" in human.stdout, human.stdout
        assert re.search(r"busy since start: \d+\.\d%, \d+\.\d%", human.stdout), human.stdout
        m = scrape(port)
        assert sample(m, "cache_dit_opd_executor_threads") == 2
        assert sample(m, "cache_dit_opd_executor_sessions", executor="0") == 2
        assert sample(m, "cache_dit_opd_executor_sessions", executor="1") == 1
        # The same counter, scraped later: at least where GetStats saw it (it never goes back).
        for e in (0, 1):
            assert sample(m, "cache_dit_opd_executor_busy_seconds_total", executor=str(e)) >= busy[e] * 1e-9 * 0.999
    finally:
        p.close()
        d.stop()


def _open_to_everyone(d) -> None:
    """Lets another uid reach the sockets, so that only the daemon's own check can refuse it."""
    os.chmod(d.workdir, 0o755)
    for path in (d.socket, d.socket.with_name(d.socket.name.replace(".sock", ".session.sock"))):
        os.chmod(path, 0o666)


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")
def test_opdctl_drain_refused_for_another_uid_then_drains_for_the_daemons_uid():
    d = fx.daemon(None, "--metrics-address", "", "--drain-deadline-ms", "2000")
    try:
        _open_to_everyone(d)
        nobody = 65534
        r = opdctl("--address", str(d.socket), "status", user=nobody)
        assert r.returncode == 0, r.stderr  # it may read
        r = opdctl("--address", str(d.socket), "drain", user=nobody)
        assert r.returncode == 1 and "only root and the daemon's uid" in r.stderr, r.stderr
        assert f"uid {nobody}" in r.stderr
        assert d.alive() and d.version().serving
        # A client session open while draining: its calls are refused DRAINING, then the daemon exits 0.
        j = opdctl_json("--address", str(d.socket), "drain")
        assert j["draining"] is True
        assert d.proc.wait(timeout=30) == 0, d.log_tail()
        assert "drain requested by pid" in d.log_tail(20000)
    finally:
        d.stop()


# -- PID namespaces ---------------------------------------------------------------------------------------

PIDNS_CLIENT = textwrap.dedent("""
    import os, sys, time
    sys.path[:0] = [{tests!r}]
    import _client_fixtures as fx
    from test_client_reasons import Peer
    class D:
        address = {address!r}
    p = Peer(D())
    r = p.bound(client_name="pidns")
    print(os.getpid(), r.session_id, flush=True)
    time.sleep(600)
""")


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_a_client_in_its_own_pid_namespace_binds_and_its_death_is_cleaned_up():
    d = fx.daemon(None, "--metrics-address", "")
    client = None
    try:
        code = PIDNS_CLIENT.format(tests=fx.HERE, address=d.address)
        client = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", code],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=fx.subprocess_env())
        line = client.stdout.readline()
        if not line:
            err = client.stderr.read()
            if "Operation not permitted" in err:
                pytest.skip("unshare --pid is not permitted here: " + err.strip())
            raise AssertionError(err)
        inner_pid, session_id = map(int, line.split())
        assert inner_pid == 1  # the first process of its namespace
        (s,) = opdctl_json("--address", str(d.socket), "sessions")["sessions"]
        assert s["session_id"] == session_id and s["bound"] and s["client_name"] == "pidns"
        outer = s["client_pid"]
        assert outer not in (0, 1) and "python" in s["command"]
        # The outer pid is a process of our namespace whose innermost pid is 1.
        with open(f"/proc/{outer}/status") as f:
            nspid = next(line for line in f if line.startswith("NSpid:")).split()[1:]
        assert nspid[-1] == "1" and int(nspid[0]) == outer
        # Its death ends the session as a local client's does (the session channel closes).
        client.send_signal(signal.SIGKILL)
        client.wait(timeout=10)
        deadline = time.monotonic() + TIMEOUT_S
        while d.stats().sessions:
            assert time.monotonic() < deadline, d.log_tail()
            time.sleep(0.05)
        assert d.stats().sessions_closed == 1 and d.alive()
    finally:
        if client and client.poll() is None:
            client.kill()
        d.stop()


ADMIN_MAGIC = 0x4E4D4441  # session_memory.h kAdminRequestMagic, "ADMN"


def test_malformed_admin_requests_are_refused_by_reason_and_the_daemon_keeps_serving():
    d = fx.daemon(None, "--metrics-address", "")
    try:
        channel = d.version().session_channel_path
        cases = {
            "MALFORMED": (0x12345678, 2, 1, 0),      # 16 bytes that are not an admin request
            "VERSION_MISMATCH": (ADMIN_MAGIC, 1, 1, 0),
            "BAD_ARGUMENT": (ADMIN_MAGIC, 2, 7, 0),  # no command 7
        }

        for want, fields in cases.items():
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                s.settimeout(TIMEOUT_S)
                s.connect(channel)
                s.sendall(struct.pack("<IIII", *fields))
                code, reason = Peer.bind_reply(s)
                assert code != 0 and _errors.reason_name(reason) == want, (want, code, reason)
                assert s.recv(16) == b""  # answered, then closed
        assert d.alive() and d.version().serving
        well = Peer(d)
        try:
            well.bound()  # binding still works
        finally:
            well.close()
    finally:
        d.stop()


@pytest.mark.gpu
def test_metrics_count_every_call_a_real_client_makes():
    """On the GPU: a client process makes a known number of calls (.out through the ring, sync and async;
    functional forms; host-ordered gRPC calls with the native engine off; one rejection); the daemon's
    /metrics deltas equal them per op, overload and transport, and opdctl's per-op stats agree."""
    port = free_port()
    d = fx.daemon(None, "--metrics-address", f"127.0.0.1:{port}", fake=False)
    try:
        before = scrape(port)
        code = textwrap.dedent("""
            import os, torch, cache_dit_opd
            from cache_dit_opd import kernels as k
            x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(64, 130, device="cuda", dtype=torch.float8_e4m3fn)
            for _ in range(7):
                torch.ops.cache_dit_cuda_ops.fp8_comm_per_token_quant.out(x, out=out)
            with cache_dit_opd.async_calls():
                for _ in range(11):
                    torch.ops.cache_dit_cuda_ops.fp8_comm_per_token_quant.out(x, out=out)
            cache_dit_opd.synchronize()
            for _ in range(5):
                k.fp8_comm_per_token_dequant(k.fp8_comm_per_token_quant(x))
            try:
                k.fp8_comm_per_token_quant(x.float())
            except ValueError:
                pass
            torch.cuda.synchronize()
            print("native", cache_dit_opd.daemon_info()["native"])
        """)
        env = dict(CACHE_DIT_OPD_ADDRESS=d.address)
        r = fx.run_python(code, timeout=120, **env)
        assert r.returncode == 0, r.stdout + r.stderr
        r2 = fx.run_python(code.replace("import os,", "import os; os.environ['CACHE_DIT_OPD_NATIVE'] = '0'; import"),
                           timeout=120, **env)
        assert r2.returncode == 0 and "native False" in r2.stdout, r2.stdout + r2.stderr
        after = scrape(port)

        def delta(**labels):
            return (sample(after, "cache_dit_opd_calls_total", **labels) or 0) - (
                sample(before, "cache_dit_opd_calls_total", **labels) or 0)

        # Each run: 7 + 11 .out calls of the quantizer and 5 functional ones (each one .out call), 5 dequants;
        # the rejected call is refused in the client (its Meta check), so the daemon never sees it. Run 1
        # goes through the ring where the engine is built, run 2 over host-ordered gRPC.
        quant = [delta(op="fp8_comm_per_token_quant", overload="out", transport=t) for t in ("ring", "grpc")]
        dequant = [delta(op="fp8_comm_per_token_dequant", overload="out", transport=t) for t in ("ring", "grpc")]
        assert sum(quant) == 2 * 23 and sum(dequant) == 2 * 5, (quant, dequant)
        if "native True" in r.stdout:
            assert quant == [23, 23] and dequant == [5, 5], (quant, dequant)
        st = opdctl_json("--address", str(d.socket), "stats")["stats"]
        for o in st["ops"]:
            labels = dict(op=o["name"], overload=o.get("overload", ""), transport=o["transport"])
            assert sample(after, "cache_dit_opd_calls_total", **labels) == o["calls"], (labels, o)
    finally:
        d.stop()
