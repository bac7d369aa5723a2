"""`cache-dit-opd-launcher` (admin/launcher/): one daemon per GPU, restarts, stop, exit codes.

The launcher runs the fake daemon (tests/fake_daemon/: the real daemon on fake device operations, whose GPU
UUID is $CUDA_VISIBLE_DEVICES when that is a GPU UUID, which is what the launcher sets) for two made-up GPUs
in a private runtime dir, and talks to each over gRPC. Other tests run a small Python stand-in daemon that
records what it was started with (arguments, CUDA_VISIBLE_DEVICES, signal mask, parent-death signal) and
drains or fails on SIGTERM as told, or /bin/false.

Everything is observed from the launcher's log lines on stderr (one per event, naming the GPU UUID) and from
the processes themselves; waits poll with deadlines, and the one negative check (a drained daemon is not
restarted) watches for many times the restart delay.

Binaries: the launcher is $CACHE_DIT_OPD_LAUNCHER, else <build>/admin/launcher/cache-dit-opd-launcher; the fake
daemon <build>/tests/fake_daemon/opd_fake_daemon (``CACHE_DIT_OPD_BUILD_DIR``, default <repo>/build). A test
whose binary is missing is skipped (failed under CACHE_DIT_OPD_REQUIRE_BUILD=1).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time

import pytest

from _client_fixtures import build_dir, built, fake_daemon_binary_path, short_tmpdir

grpc = pytest.importorskip("grpc")

UUIDS = ("GPU-1a2b3c4d-0000-4000-8000-00000000000a", "GPU-1a2b3c4d-0000-4000-8000-00000000000b")
PREFIX = "cache-dit-opd-launcher: "
STARTED = re.compile(r"^cache-dit-opd-launcher: (GPU-[0-9A-Fa-f-]+): started pid (\d+)", re.M)
RESTARTING = re.compile(r"^cache-dit-opd-launcher: (GPU-[0-9A-Fa-f-]+): restarting in (\d+) ms", re.M)
DEADLINE_S = 20.0  # for anything that should take well under a second


def launcher_binary() -> str:
    return built(os.environ.get("CACHE_DIT_OPD_LAUNCHER")
                 or os.path.join(build_dir(), "admin", "launcher", "cache-dit-opd-launcher"))


def wait_until(predicate, what: str, timeout: float = DEADLINE_S, log=None):
    """Polls ``predicate`` until it returns something truthy (returned); fails naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            tail = f"\n--- log ---\n{log()}" if log else ""
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}{tail}")
        time.sleep(0.02)


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, which has exited and waits for its parent, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def child_pids(pid: int) -> set[int]:
    """The running children of ``pid`` (all its threads')."""
    out: set[int] = set()
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.update(int(p) for p in f.read().split())
    except FileNotFoundError:
        pass
    return {p for p in out if process_alive(p)}


class Launcher:
    """A started launcher; its stdout and stderr (and its daemons', which inherit them) go to one file, never
    a pipe, so nothing blocks on a reader. Its environment carries a marker unique to the test, which its
    daemons inherit: close() ends only processes that carry it (pids are reused, fast: threads take them too)."""

    def __init__(self, tmp: str, args: list[str], env: dict | None = None):
        self.log_path = os.path.join(tmp, "launcher.log")
        self.marker = f"CACHE_DIT_OPD_LAUNCHER_TEST={tmp}".encode()
        self._log_file = open(self.log_path, "w")
        full_env = dict(os.environ)
        full_env.pop("CACHE_DIT_OPD_FAKE_GPU_UUID", None)  # would override CUDA_VISIBLE_DEVICES in the fake
        full_env.update(env or {})
        full_env["CACHE_DIT_OPD_LAUNCHER_TEST"] = tmp
        self.proc = subprocess.Popen([launcher_binary(), *args], stdout=self._log_file, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=full_env)
        self.seen_pids: set[int] = set()

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def report(self) -> str:
        """The log, for a failure message, with who the test is (the launcher logs who signalled it)."""
        return f"{self.log()}[test pid {os.getpid()}, launcher pid {self.proc.pid}]"

    def started(self, uuid: str | None = None) -> list[int]:
        """The daemon pids the launcher logged as started, in order (for ``uuid``, or all)."""
        pids = [int(p) for u, p in STARTED.findall(self.log()) if uuid is None or u == uuid]
        self.seen_pids.update(pids)
        return pids

    def wait_started(self, uuid: str, count: int = 1) -> int:
        pids = wait_until(lambda: len(self.started(uuid)) >= count and self.started(uuid),
                          f"{uuid} started {count} time(s)", log=self.report)
        return pids[count - 1]

    def wait_log(self, pattern: str, what: str | None = None) -> re.Match:
        rx = re.compile(pattern, re.M)
        return wait_until(lambda: rx.search(self.log()), what or repr(pattern), log=self.report)

    def wait_exit(self, timeout: float = DEADLINE_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"launcher still running {timeout:.0f}s later\n--- log ---\n{self.report()}")

    def ours(self, pid: int) -> bool:
        """Whether ``pid`` runs and is one of this launcher's daemons (carries the marker)."""
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                marked = self.marker in f.read().split(b"\0")
        except OSError:
            return False
        return marked and process_alive(pid)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()  # its daemons get SIGTERM (PR_SET_PDEATHSIG) and drain
            self.proc.wait()
        self.started()
        deadline = time.monotonic() + 10
        while any(self.ours(p) for p in self.seen_pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in self.seen_pids:
            if self.ours(pid):
                os.kill(pid, signal.SIGKILL)
        self._log_file.close()


@pytest.fixture()
def tmp():
    d = short_tmpdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture()
def launch(tmp):
    started: list[Launcher] = []

    def start(*args: str, env: dict | None = None) -> Launcher:
        launcher = Launcher(tmp, list(args), env)
        started.append(launcher)
        return launcher

    yield start
    for launcher in started:
        launcher.close()


# -- the fake daemon over gRPC ------------------------------------------------------------------------


def fake_daemon() -> str:
    return built(fake_daemon_binary_path())


def fake_daemon_has_metrics() -> bool:
    """Whether this build's daemon knows --metrics-address (being added): the launcher passes it by default."""
    out = subprocess.run([fake_daemon(), "--help"], capture_output=True, text=True, timeout=60)
    return "--metrics-address" in out.stdout + out.stderr


def fake_args(runtime_dir: str, *extra: str, metrics_port_base: int = 0) -> list[str]:
    return ["--daemon", fake_daemon(), "--gpus", ",".join(UUIDS), "--metrics-port-base", str(metrics_port_base),
            "--backoff-initial-ms", "100", *extra,
            "--", "--runtime-dir", runtime_dir, "--log-level", "info", "--drain-deadline-ms", "2000"]


def version(sock: str):
    """GetVersion over ``sock``; None while it does not answer (not there yet, or restarting)."""
    from cache_dit_opd._proto import opd_grpc, opd_pb2

    if not os.path.exists(sock):
        return None
    channel = grpc.insecure_channel(f"unix:{sock}")
    try:
        grpc.channel_ready_future(channel).result(timeout=2)
        return opd_grpc.OperatorDaemonStub(channel).GetVersion(opd_pb2.VersionRequest(), timeout=5)
    except (grpc.RpcError, grpc.FutureTimeoutError):
        return None
    finally:
        channel.close()


def socket_owner(sock: str) -> int | None:
    """The pid of the process listening on the Unix socket ``sock`` (SO_PEERCRED); None when none listens."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(sock)
        except OSError:
            return None
        pid, _, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return pid


def wait_serving(launcher: Launcher, runtime_dir: str, uuid: str, pid: int):
    """Waits until <uuid>.sock is daemon ``pid``'s and answers GetVersion, serving, for ``uuid``; returns the
    reply."""
    sock = os.path.join(runtime_dir, f"{uuid}.sock")

    def answered():
        if socket_owner(sock) != pid:
            return None
        return version(sock)

    v = wait_until(answered, f"{sock} answering from pid {pid}", log=launcher.report)
    assert v.gpu_uuid == uuid
    assert v.serving, v.not_serving_reason
    if "daemon_pid" in v.DESCRIPTOR.fields_by_name:
        assert v.daemon_pid == pid
    assert os.path.exists(os.path.join(runtime_dir, f"{uuid}.session.sock"))
    return v


def metrics_answer(port: int, host: str = "127.0.0.1") -> bool:
    """Whether http://<host>:<port>/metrics answers 200 (``host`` as a URL writes it: [::1] for IPv6)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A base port such that base and base+1 are free on ``host`` now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(50):
        with socket.socket(family) as a:
            a.bind((host, 0))
            base = a.getsockname()[1]
            if base >= 65535:
                continue
            with socket.socket(family) as b:
                try:
                    b.bind((host, base + 1))
                except OSError:
                    continue
        return base
    pytest.skip(f"no two adjacent free ports on {host}")


def ipv6_loopback() -> bool:
    """Whether ::1 can be bound here (a container may run without IPv6)."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_two_gpus_each_served_on_its_socket(launch, tmp):
    # The launcher's default passes --metrics-address 127.0.0.1:<base+i>; with a daemon that knows the flag,
    # check it arrived, else turn it off (0: no flag).
    base = free_port_pair() if fake_daemon_has_metrics() else 0
    launcher = launch(*fake_args(tmp, metrics_port_base=base))
    for i, uuid in enumerate(UUIDS):
        pid = launcher.wait_started(uuid)
        v = wait_serving(launcher, tmp, uuid, pid)
        assert v.device_index == 0  # CUDA_VISIBLE_DEVICES=<uuid> --device 0
        if base:
            if "metrics_address" in v.DESCRIPTOR.fields_by_name:
                assert v.metrics_address == f"127.0.0.1:{base + i}"
            wait_until(lambda: metrics_answer(base + i), f"/metrics on 127.0.0.1:{base + i}", log=launcher.report)
    assert len(set(launcher.started())) == 2
    assert child_pids(launcher.proc.pid) == set(launcher.started())
    assert launcher.proc.poll() is None


def test_metrics_host_ipv6_is_bracketed_and_served(launch, tmp):
    # --metrics-host takes an IPv6 address bare (as the downward API's status.podIP gives it) and hands each
    # daemon [::1]:<base+i>: the real daemon accepts that address and serves on it.
    if not fake_daemon_has_metrics():
        pytest.skip("this build's daemon has no --metrics-address")
    if not ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    base = free_port_pair("::1")
    launcher = launch(*fake_args(tmp, "--metrics-host", "::1", metrics_port_base=base))
    for i, uuid in enumerate(UUIDS):
        pid = launcher.wait_started(uuid)
        assert re.search(rf"^{PREFIX}{uuid}: started pid {pid}: .* --metrics-address \[::1\]:{base + i} ",
                         launcher.log(), re.M), launcher.log()
        v = wait_serving(launcher, tmp, uuid, pid)
        if "metrics_address" in v.DESCRIPTOR.fields_by_name:
            assert v.metrics_address == f"[::1]:{base + i}"
        wait_until(lambda: metrics_answer(base + i, "[::1]"), f"/metrics on [::1]:{base + i}", log=launcher.report)
        assert not metrics_answer(base + i), f"daemon {i} also answers on 127.0.0.1:{base + i}"


def test_killed_daemon_is_restarted_and_the_other_untouched(launch, tmp):
    launcher = launch(*fake_args(tmp))
    a, b = UUIDS
    pid_a = launcher.wait_started(a)
    pid_b = launcher.wait_started(b)
    wait_serving(launcher, tmp, a, pid_a)
    wait_serving(launcher, tmp, b, pid_b)

    os.kill(pid_a, signal.SIGKILL)
    launcher.wait_log(rf"^{PREFIX}{a}: pid {pid_a} killed by signal 9 \(SIGKILL\) after \d+ ms$")
    launcher.wait_log(rf"^{PREFIX}{a}: restarting in 100 ms \(failure 1 in a row\)$")
    new_a = launcher.wait_started(a, count=2)
    assert new_a != pid_a
    v = wait_serving(launcher, tmp, a, new_a)
    assert v.gpu_uuid == a

    assert launcher.started(b) == [pid_b]
    wait_serving(launcher, tmp, b, pid_b)
    assert child_pids(launcher.proc.pid) == {new_a, pid_b}


def test_sigterm_drains_every_daemon_and_exits_0(launch, tmp):
    launcher = launch(*fake_args(tmp))
    pids = {uuid: launcher.wait_started(uuid) for uuid in UUIDS}
    for uuid, pid in pids.items():
        wait_serving(launcher, tmp, uuid, pid)

    launcher.proc.send_signal(signal.SIGTERM)
    # Bounded by the wait, not timed: the daemons drain in parallel within their
    # 2 s deadline, but under ASan each one's exit adds its leak check (seconds).
    rc = launcher.wait_exit(timeout=15)
    log = launcher.log()
    assert rc == 0, log
    for uuid, pid in pids.items():
        assert f"{uuid}: SIGTERM to pid {pid}" in log
        assert re.search(rf"^{PREFIX}{uuid}: pid {pid} exited with status 0 after \d+ ms", log, re.M), log
        assert not launcher.ours(pid)
        assert not os.path.exists(os.path.join(tmp, f"{uuid}.sock"))  # the daemon drained and cleaned up
    assert f"{PREFIX}all daemons exited: exit 0" in log
    assert len(launcher.started()) == 2


def test_daemon_that_exits_0_is_not_restarted(launch, tmp):
    launcher = launch(*fake_args(tmp))
    a, b = UUIDS
    pid_a = launcher.wait_started(a)
    pid_b = launcher.wait_started(b)
    wait_serving(launcher, tmp, a, pid_a)
    wait_serving(launcher, tmp, b, pid_b)

    os.kill(pid_a, signal.SIGTERM)  # the daemon drains and exits 0: an operator stopped this one
    launcher.wait_log(rf"^{PREFIX}{a}: pid {pid_a} exited with status 0 after \d+ ms: drained, not restarted$")
    # A restart would come after 100 ms (--backoff-initial-ms): watch for 15 times that.
    watch_until = time.monotonic() + 1.5
    while time.monotonic() < watch_until:
        assert launcher.started(a) == [pid_a], launcher.log()
        assert launcher.proc.poll() is None, launcher.log()
        time.sleep(0.05)
    assert not RESTARTING.search(launcher.log())
    assert not launcher.ours(pid_a)
    wait_serving(launcher, tmp, b, pid_b)
    assert child_pids(launcher.proc.pid) == {pid_b}

    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.wait_exit() == 0
    assert launcher.started(b) == [pid_b]


# -- usage ------------------------------------------------------------------------------------------------


def run_launcher(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([launcher_binary(), *args], capture_output=True, text=True, timeout=30,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("args, named", [
    (["--gpus", "GPU-nothex"], "GPU-nothex"),
    (["--gpus", f"{UUIDS[0]},MIG-1a2b3c4d-0000-4000-8000-00000000000a"], "MIG-1a2b3c4d-0000-4000-8000-00000000000a"),
    (["--gpus", f"{UUIDS[0]},{UUIDS[0]}"], UUIDS[0]),
    (["--gpus=", "--daemon", "/bin/true"], "--gpus"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--metrics-port-base", "65536"], "--metrics-port-base"),
    (["--backoff-initial-ms", "0"], "--backoff-initial-ms"),
    (["--backoff-initial-ms", "500", "--backoff-max-ms", "100"], "--backoff-max-ms"),
    (["--stable-ms", "-1"], "--stable-ms"),
    (["--stable-ms"], "--stable-ms"),
    (["stray"], "stray"),
    (["--gpus", UUIDS[0], "--", "--socket", "/tmp/x.sock"], "--socket"),
    (["--gpus", UUIDS[0], "--", "--device=1"], "--device=1"),
    (["--gpus", UUIDS[0], "--", "--metrics-address", "127.0.0.1:1"], "--metrics-address"),
    (["--daemon", "/no/such/cache-dit-opd", "--gpus", UUIDS[0]], "/no/such/cache-dit-opd"),
])
def test_usage_errors_exit_2_naming_the_value(args, named):
    out = run_launcher(*args)
    assert out.returncode == 2, out
    assert named in out.stderr, out.stderr
    assert "started pid" not in out.stderr


def test_help_exits_0():
    out = run_launcher("--help")
    assert out.returncode == 0, out
    assert "--metrics-port-base" in out.stdout and "--backoff-max-ms" in out.stdout
    assert "--metrics-host HOST" in out.stdout and "without brackets" in out.stdout.replace("WITHOUT", "without")


@pytest.mark.parametrize("value, why", [
    ("", "empty host"),
    ("pod ip", "space"),
    ("10.0.0.1\t", "space"),
    ("[::1]", "without brackets"),
    ("[fd00::5", "without brackets"),
    ("10.0.0.1:9464", "only in an IPv6 address"),
    ("metrics.local:80", "only in an IPv6 address"),
    ("fd00::5::1", "only in an IPv6 address"),
    ("a/b", "not a host name"),
    ("-x", "not a host name"),
], ids=["empty", "space", "tab", "bracketed", "half-bracketed", "ipv4-with-port", "name-with-port",
        "bad-ipv6", "slash", "leading-dash"])
@pytest.mark.parametrize("form", ["separate", "inline"])
def test_bad_metrics_host_exits_2_naming_the_value(value, why, form):
    flag = ["--metrics-host", value] if form == "separate" else [f"--metrics-host={value}"]
    out = run_launcher(*flag, "--gpus", UUIDS[0], "--daemon", "/bin/true")
    assert out.returncode == 2, out
    assert f"--metrics-host '{value}'" in out.stderr, out.stderr
    assert why in out.stderr, out.stderr
    assert "usage:" in out.stderr and "started pid" not in out.stderr, out.stderr


@pytest.mark.parametrize("args", [
    ["--metrics-host", "10.0.0.7", "--metrics-port-base", "0"],
    ["--metrics-port-base=0", "--metrics-host=fd00::5"],
    ["--metrics-host", "127.0.0.1", "--metrics-port-base", "0"],  # the default, named: still nothing to apply
], ids=["host-first", "base-first-ipv6", "default-host"])
def test_metrics_host_with_port_base_0_exits_2(args):
    out = run_launcher(*args, "--gpus", UUIDS[0], "--daemon", "/bin/true")
    assert out.returncode == 2, out
    host = args[1] if args[0] == "--metrics-host" else args[1].split("=", 1)[1]
    assert f"--metrics-host '{host}' with --metrics-port-base 0" in out.stderr, out.stderr
    assert "started pid" not in out.stderr, out.stderr


def test_daemon_metrics_address_conflict_names_the_metrics_host():
    out = run_launcher("--metrics-host", "fd00::5", "--gpus", UUIDS[0], "--daemon", "/bin/true",
                       "--", "--metrics-address=[::1]:1")
    assert out.returncode == 2, out
    assert "daemon flag '--metrics-address=[::1]:1'" in out.stderr and "[fd00::5]:<base+i>" in out.stderr, out.stderr


def test_no_gpu_list_and_no_nvidia_smi_exits_2(tmp):
    empty = os.path.join(tmp, "empty-path")
    os.mkdir(empty)
    out = run_launcher("--daemon", "/bin/true", env={"PATH": empty})
    assert out.returncode == 2, out
    assert "nvidia-smi" in out.stderr and "--gpus" in out.stderr, out.stderr


def test_nvidia_smi_listing_no_gpu_exits_2(tmp):
    bindir = os.path.join(tmp, "bin")
    os.mkdir(bindir)
    script = os.path.join(bindir, "nvidia-smi")
    with open(script, "w") as f:
        f.write("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    os.chmod(script, 0o755)
    out = run_launcher("--daemon", "/bin/true", env={"PATH": f"{bindir}:/usr/bin:/bin"})
    assert out.returncode == 2, out
    assert "No devices were found" in out.stderr and "--gpus" in out.stderr, out.stderr


# -- a stand-in daemon: what each child is started with -----------------------------------------------------

STAND_IN = textwrap.dedent("""\
    #!{python}
    # A stand-in daemon: records how it was started, then waits; on SIGTERM it drains for
    # $STAND_IN_DRAIN_S seconds and exits $STAND_IN_TERM_RC.
    import ctypes, json, os, signal, sys, time
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    # Taken with sigwait, blocked before the record exists: the tests signal only once they have read it.
    signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGTERM}})
    pdeathsig = ctypes.c_int(0)
    ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(pdeathsig), 0, 0, 0)  # PR_GET_PDEATHSIG
    record = dict(pid=os.getpid(), ppid=os.getppid(), argv=sys.argv[1:],
                  visible=os.environ.get("CUDA_VISIBLE_DEVICES"), sigblk=int(status["SigBlk"].strip(), 16),
                  pdeathsig=pdeathsig.value)
    path = os.path.join(os.environ["STAND_IN_OUT"], f"{{os.getpid()}}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.rename(path + ".tmp", path)
    signal.sigwait({{signal.SIGTERM}})
    time.sleep(float(os.environ.get("STAND_IN_DRAIN_S", "0")))
    with open(path + ".term", "w") as f:
        f.write("drained")
    os._exit(int(os.environ.get("STAND_IN_TERM_RC", "0")))
""")


def stand_in(tmp: str) -> tuple[str, str]:
    """(path of the stand-in daemon script, folder where it writes one <pid>.json per start)."""
    out = os.path.join(tmp, "records")
    os.mkdir(out)
    path = os.path.join(tmp, "stand-in-daemon")
    with open(path, "w") as f:
        f.write(STAND_IN.format(python=sys.executable))
    os.chmod(path, 0o755)
    return path, out


def record(out: str, pid: int, launcher: Launcher) -> dict:
    path = os.path.join(out, f"{pid}.json")
    wait_until(lambda: os.path.exists(path), f"{path}", log=launcher.report)
    with open(path) as f:
        return json.load(f)


def test_each_daemon_gets_its_gpu_arguments_and_a_clean_signal_state(launch, tmp):
    daemon, out = stand_in(tmp)
    launcher = launch("--daemon", daemon, "--gpus", ",".join(UUIDS), "--metrics-port-base", "19000",
                      "--", "--runtime-dir", "/run/x", "--log-level", "debug", env={"STAND_IN_OUT": out,
                                                                                     "CUDA_VISIBLE_DEVICES": "3"})
    for i, uuid in enumerate(UUIDS):
        rec = record(out, launcher.wait_started(uuid), launcher)
        assert rec["visible"] == uuid  # replaces the launcher's own CUDA_VISIBLE_DEVICES
        assert rec["argv"] == ["--device", "0", "--metrics-address", f"127.0.0.1:{19000 + i}",
                               "--runtime-dir", "/run/x", "--log-level", "debug"]
        assert rec["ppid"] == launcher.proc.pid
        assert rec["sigblk"] == 0, f"the daemon inherited a blocked signal mask {rec['sigblk']:#x}"
        assert rec["pdeathsig"] == signal.SIGTERM
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.wait_exit() == 0


@pytest.mark.parametrize("host, address_host", [
    ("10.1.2.3", "10.1.2.3"),
    ("0.0.0.0", "0.0.0.0"),
    ("cache-dit-opd-0.metrics_svc.example", "cache-dit-opd-0.metrics_svc.example"),
    ("::1", "[::1]"),
    ("fd00:10:244::5", "[fd00:10:244::5]"),
], ids=["ipv4", "any", "name", "ipv6-loopback", "ipv6-pod-ip"])
def test_metrics_host_reaches_every_daemon(launch, tmp, host, address_host):
    daemon, out = stand_in(tmp)
    launcher = launch("--daemon", daemon, "--gpus", ",".join(UUIDS), f"--metrics-host={host}",
                      "--metrics-port-base", "19000", "--", "--log-level", "debug", env={"STAND_IN_OUT": out})
    for i, uuid in enumerate(UUIDS):
        rec = record(out, launcher.wait_started(uuid), launcher)
        assert rec["visible"] == uuid
        assert rec["argv"] == ["--device", "0", "--metrics-address", f"{address_host}:{19000 + i}",
                               "--log-level", "debug"]
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.wait_exit() == 0


def test_gpus_default_to_what_nvidia_smi_lists(launch, tmp):
    daemon, out = stand_in(tmp)
    bindir = os.path.join(tmp, "bin")
    os.mkdir(bindir)
    with open(os.path.join(bindir, "nvidia-smi"), "w") as f:
        f.write('#!/bin/sh\n[ "$*" = "--query-gpu=uuid --format=csv,noheader" ] || exit 3\n'
                f"printf '{UUIDS[0]}\\n{UUIDS[1]}\\n'\n")
    os.chmod(os.path.join(bindir, "nvidia-smi"), 0o755)
    launcher = launch("--daemon", daemon, "--metrics-port-base", "0",
                      env={"STAND_IN_OUT": out, "PATH": f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}"})
    for uuid in UUIDS:
        rec = record(out, launcher.wait_started(uuid), launcher)
        assert rec["visible"] == uuid
        assert rec["argv"] == ["--device", "0"]  # --metrics-port-base 0: no --metrics-address
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.wait_exit() == 0


def test_second_signal_while_draining_is_ignored(launch, tmp):
    daemon, out = stand_in(tmp)
    launcher = launch("--daemon", daemon, "--gpus", UUIDS[0], "--metrics-port-base", "0",
                      env={"STAND_IN_OUT": out, "STAND_IN_DRAIN_S": "1.0"})
    pid = launcher.wait_started(UUIDS[0])
    record(out, pid, launcher)
    launcher.proc.send_signal(signal.SIGTERM)
    launcher.wait_log(rf"^{PREFIX}received SIGTERM from pid \d+: stopping 1 daemon\(s\)$")
    launcher.proc.send_signal(signal.SIGINT)
    launcher.wait_log(rf"^{PREFIX}received SIGINT from pid \d+ while stopping: ignored")
    assert launcher.ours(pid)  # still draining: a second signal does not kill it
    assert launcher.wait_exit() == 0
    assert os.path.exists(os.path.join(out, f"{pid}.json.term"))  # it drained to the end
    assert f"{UUIDS[0]}: pid {pid} exited with status 0" in launcher.log()


def test_daemon_failing_its_drain_makes_exit_1(launch, tmp):
    daemon, out = stand_in(tmp)
    launcher = launch("--daemon", daemon, "--gpus", UUIDS[0], "--metrics-port-base", "0",
                      env={"STAND_IN_OUT": out, "STAND_IN_TERM_RC": "3"})
    pid = launcher.wait_started(UUIDS[0])
    record(out, pid, launcher)
    launcher.proc.send_signal(signal.SIGHUP)
    assert launcher.wait_exit() == 1
    log = launcher.log()
    assert f"{UUIDS[0]}: pid {pid} exited with status 3" in log and "while stopping" in log, log
    assert f"{PREFIX}all daemons exited: exit 1" in log


def test_killed_launcher_leaves_no_daemon_behind(launch, tmp):
    daemon, out = stand_in(tmp)
    launcher = launch("--daemon", daemon, "--gpus", ",".join(UUIDS), "--metrics-port-base", "0",
                      env={"STAND_IN_OUT": out})
    pids = [launcher.wait_started(uuid) for uuid in UUIDS]
    for pid in pids:
        record(out, pid, launcher)
    launcher.proc.kill()
    launcher.proc.wait()
    for pid in pids:
        # PR_SET_PDEATHSIG: each got SIGTERM and drained (exit 0).
        wait_until(lambda: os.path.exists(os.path.join(out, f"{pid}.json.term")), f"pid {pid} drained")
        wait_until(lambda: not launcher.ours(pid), f"pid {pid} gone")


# -- restart backoff --------------------------------------------------------------------------------------


def test_failing_daemon_is_restarted_with_growing_delays(launch, tmp):
    launcher = launch("--daemon", "/bin/false", "--gpus", UUIDS[0], "--metrics-port-base", "0",
                      "--backoff-initial-ms", "50", "--backoff-max-ms", "200", "--stable-ms", "60000")
    uuid = UUIDS[0]
    launcher.wait_started(uuid)
    t_first = time.monotonic()
    launcher.wait_started(uuid, count=7)
    t_seventh = time.monotonic()
    delays = [int(d) for u, d in RESTARTING.findall(launcher.log()) if u == uuid]
    assert delays[:6] == [50, 100, 200, 200, 200, 200], launcher.log()
    # Six restarts cannot come sooner than their delays add up to.
    # (0.2 s of slack: t_first is read when the test sees the first start, up to a poll late.)
    assert t_seventh - t_first >= sum(delays[:6]) / 1000 - 0.2, (t_seventh - t_first, delays)
    log = launcher.log()
    assert re.search(rf"^{PREFIX}{uuid}: pid \d+ exited with status 1 after \d+ ms$", log, re.M), log
    assert f"{uuid}: restarting in 200 ms (failure 6 in a row)" in log

    # Stop while it waits for a restart (after a "restarting in" line, before the next start): the stop
    # cancels the restart. Nothing was running, so nothing failed during the stop: exit 0 (each failure was
    # logged when it happened). Had the signal met a /bin/false still running, that one would have exited 1
    # during the stop, logged "while stopping", and the launcher would exit 1: the log says which it was.
    def waiting():
        text = launcher.log()
        return len(RESTARTING.findall(text)) == len(STARTED.findall(text))

    wait_until(waiting, "a restart pending", log=launcher.report)
    launcher.proc.send_signal(signal.SIGTERM)
    rc = launcher.wait_exit()
    log = launcher.log()
    if "while stopping" in log:
        assert rc == 1, log
    else:
        assert rc == 0, log
        assert f"{uuid}: restart cancelled" in log, log
    assert re.search(rf"^{PREFIX}all daemons exited: exit {rc}$", log, re.M), log


def test_launcher_exits_0_once_every_daemon_exited_0(launch, tmp):
    launcher = launch("--daemon", "/bin/true", "--gpus", ",".join(UUIDS), "--metrics-port-base", "0")
    assert launcher.wait_exit() == 0, launcher.log()
    log = launcher.log()
    for uuid in UUIDS:
        assert re.search(rf"^{PREFIX}{uuid}: pid \d+ exited with status 0 after \d+ ms: drained, not restarted$",
                         log, re.M), log
    assert len(launcher.started()) == 2 and not RESTARTING.search(log), log
    assert f"{PREFIX}every daemon exited 0: nothing left to supervise" in log
