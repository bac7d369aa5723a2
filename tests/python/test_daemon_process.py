"""The real `cache-dit-opd` binary as a process, on a machine without a GPU.

Starts the built daemon with --socket in a temporary directory and talks to
it with grpcio: GetVersion answers (protocol 1, not serving, the reason names
the missing GPU/driver), grpc.health.v1 reports NOT_SERVING, OpenSession
fails UNAVAILABLE with the reason, the sockets are mode 0660, and SIGTERM
makes it exit 0 within the drain deadline and remove its sockets.

Stubs for opd.proto and health.proto are generated at test time with
grpc_tools.protoc (no dependency on any shipped stubs).

Build directory: $CACHE_DIT_OPD_BUILD_DIR (default /work/main/build); the
binary is <build>/server/cache-dit-opd. Skipped when it is not built.
"""

import datetime
import importlib
import os
import pathlib
import signal
import stat
import subprocess
import sys
import time

import pytest

grpc = pytest.importorskip("grpc")

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))
from cache_dit_opd import _wire  # noqa: E402  (the contract's numbers)

BUILD_DIR = pathlib.Path(os.environ.get("CACHE_DIT_OPD_BUILD_DIR", str(REPO / "build")))
DAEMON = BUILD_DIR / "server" / "cache-dit-opd"
DRAIN_DEADLINE_MS = 2000

HEALTH_PROTO = """
syntax = "proto3";
package grpc.health.v1;
message HealthCheckRequest { string service = 1; }
message HealthCheckResponse {
  enum ServingStatus { UNKNOWN = 0; SERVING = 1; NOT_SERVING = 2; SERVICE_UNKNOWN = 3; }
  ServingStatus status = 1;
}
service Health {
  rpc Check(HealthCheckRequest) returns (HealthCheckResponse);
}
"""

pytestmark = pytest.mark.skipif(
    not DAEMON.exists(),
    reason=f"daemon not built: {DAEMON} is missing (build the server, or set CACHE_DIT_OPD_BUILD_DIR)",
)

SERVICE = "cache_dit_opd.v1.OperatorDaemon"


def _has_gpu() -> bool:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20)
        return out.returncode == 0 and b"GPU" in out.stdout
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    """Stubs for opd.proto and health.proto.

    opd.proto: the client package's committed stubs (test_client_proto.py keeps
    them in step with proto/); a second copy generated here would collide with
    them in protobuf's default descriptor pool when both suites share a process.
    health.proto: generated here with grpcio-tools.
    """
    from cache_dit_opd._proto import opd_grpc, opd_pb2

    grpc_tools = pytest.importorskip("grpc_tools")
    from grpc_tools import protoc
    out = tmp_path_factory.mktemp("stubs")
    # health.proto goes under its own top-level folder: the service name comes
    # from its `package grpc.health.v1`, and a generated "grpc" package would
    # shadow grpcio.
    (out / "opd_health").mkdir()
    (out / "opd_health" / "health.proto").write_text(HEALTH_PROTO)
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main([
        "grpc_tools.protoc",
        f"-I{out}",
        f"-I{include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        "opd_health/health.proto",
    ])
    assert rc == 0, "protoc failed for health.proto"
    (out / "opd_health" / "__init__.py").touch()
    sys.path.insert(0, str(out))
    try:
        health_pb2 = importlib.import_module("opd_health.health_pb2")
        health_grpc = importlib.import_module("opd_health.health_pb2_grpc")
    finally:
        sys.path.remove(str(out))
    return opd_pb2, opd_grpc, health_pb2, health_grpc


@pytest.fixture()
def daemon(tmp_path):
    if _has_gpu():
        pytest.skip("this test covers the no-GPU behaviour; a GPU is present")
    sock = tmp_path / "opd.sock"
    log = open(tmp_path / "daemon.log", "w+")
    proc = subprocess.Popen(
        [str(DAEMON), "--socket", str(sock), "--drain-deadline-ms", str(DRAIN_DEADLINE_MS), "--log-level", "debug"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 30
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            log.seek(0)
            proc.kill()
            pytest.fail(f"daemon did not create {sock} (rc={proc.poll()}):\n{log.read()}")
        time.sleep(0.05)
    yield proc, sock, tmp_path / "opd.session.sock", log
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.close()


def _channel(sock):
    channel = grpc.insecure_channel(f"unix:{sock}")
    grpc.channel_ready_future(channel).result(timeout=10)
    return channel


def _reason(err) -> str:
    """The reason name an error's trailing metadata carries (opd.proto Reason)."""
    value = dict(err.trailing_metadata() or ()).get(_wire.REASON_METADATA_KEY)
    names = {v[0]: k for k, v in _wire.REASONS.items()}
    return names.get(int(value), value) if value is not None else "UNSPECIFIED"


def _log_time(text: str, message: str) -> datetime.datetime:
    """When the daemon logged the first line that contains ``message`` (its lines begin with an ISO time)."""
    for line in text.splitlines():
        if message in line:
            return datetime.datetime.fromisoformat(line.split(" ", 1)[0])
    raise AssertionError(f"no log line with {message!r}:\n{text}")


def test_version_health_open_session_and_sigterm(stubs, daemon):
    opd_pb2, opd_grpc, health_pb2, health_grpc = stubs
    proc, sock, session_sock, log = daemon

    # Sockets: both present, mode 0660.
    assert stat.S_ISSOCK(os.stat(sock).st_mode)
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o660
    assert stat.S_IMODE(os.stat(session_sock).st_mode) == 0o660

    with _channel(sock) as channel:
        stub = opd_grpc.OperatorDaemonStub(channel)
        version = stub.GetVersion(opd_pb2.VersionRequest(), timeout=10)
        assert version.protocol_version == _wire.PROTOCOL_VERSION
        assert version.layout_version == _wire.LAYOUT_VERSION
        assert version.daemon_version
        assert version.serving is False
        reason = version.not_serving_reason
        assert "gpu" in reason.lower() or "driver" in reason.lower(), reason
        assert version.device_index == -1
        assert version.gpu_uuid == ""

        health = health_grpc.HealthStub(channel)
        NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == NOT_SERVING
        assert (
            health.Check(health_pb2.HealthCheckRequest(service="cache_dit_opd.v1.OperatorDaemon"), timeout=10).status
            == NOT_SERVING
        )

        with pytest.raises(grpc.RpcError) as err:
            stub.OpenSession(
                opd_pb2.OpenSessionRequest(protocol_version=_wire.PROTOCOL_VERSION, client_pid=os.getpid(), lanes=1),
                timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert reason in err.value.details()
        assert _reason(err.value) == "NOT_SERVING"

        # Session-scoped calls are refused cleanly and the daemon keeps serving.
        with pytest.raises(grpc.RpcError) as err:
            stub.Call(opd_pb2.CallRequest(session_id=1, token=b"x" * 32, op="noop", lane=0, seq=1), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as err:
            stub.RegisterRegion(opd_pb2.RegisterRegionRequest(session_id=1, token=b"x", ipc_handle=b"h"), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # token is 1 byte
        assert _reason(err.value) == "BAD_ARGUMENT"
        stats = stub.GetStats(opd_pb2.StatsRequest(), timeout=10)
        assert stats.sessions == 0
        assert stub.GetVersion(opd_pb2.VersionRequest(), timeout=10).protocol_version == _wire.PROTOCOL_VERSION

    proc.send_signal(signal.SIGTERM)
    # The wait bounds the whole exit, which under ASan includes its leak check
    # and teardown (seconds on a 2-core machine); the drain itself is timed by
    # the daemon's own log, from the signal to its last line.
    rc = proc.wait(timeout=DRAIN_DEADLINE_MS / 1000 + 30)
    log.seek(0)
    text = log.read()
    assert rc == 0, text
    drain = _log_time(text, "exiting with status 0") - _log_time(text, "shutdown requested: SIGTERM")
    assert 0 <= drain.total_seconds() < DRAIN_DEADLINE_MS / 1000 + 1, f"drain took {drain}\n{text}"
    assert not sock.exists()
    assert not session_sock.exists()
    assert "not serving" in text


def test_second_daemon_refuses_a_live_socket(daemon):
    proc, sock, _, _ = daemon
    out = subprocess.run([str(DAEMON), "--socket", str(sock)], capture_output=True, text=True, timeout=30)
    assert out.returncode != 0
    assert "another daemon" in out.stderr
    assert sock.exists()
    assert proc.poll() is None


def test_stale_socket_is_replaced(tmp_path):
    if _has_gpu():
        pytest.skip("no-GPU behaviour")
    import socket as pysocket

    sock = tmp_path / "stale.sock"
    s = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    s.bind(str(sock))
    s.close()  # leaves the file behind, like a crashed daemon
    proc = subprocess.Popen([str(DAEMON), "--socket", str(sock)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
            try:
                probe.connect(str(sock))
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode()
                assert time.monotonic() < deadline, "daemon never accepted on the replaced socket"
                time.sleep(0.05)
            finally:
                probe.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


def test_help_documents_every_flag():
    out = subprocess.run([str(DAEMON), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0
    for flag in (
        "--device", "--socket", "--runtime-dir", "--log-level", "--max-sessions", "--max-lanes",
        "--max-regions", "--max-mapped-bytes", "--max-message-bytes", "--drain-deadline-ms",
        "--bind-timeout-ms", "--allowed-gid", "--load-library", "--executor-threads",
    ):
        assert flag in out.stdout, flag
    bad = subprocess.run([str(DAEMON), "--max-lanes", "zero"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2
    assert "--max-lanes" in bad.stderr


def _raw_unary(channel, method, request=b""):
    """A unary call with raw bytes both ways (no generated stubs needed)."""
    return channel.unary_unary(method, request_serializer=None, response_deserializer=None)(request, timeout=10)


def test_gpu_daemon_serves(tmp_path):
    """On a GPU host: the socket is named after the GPU UUID and health is SERVING."""
    if not _has_gpu():
        pytest.skip("needs a GPU")
    log = open(tmp_path / "daemon.log", "w+")
    proc = subprocess.Popen(
        [str(DAEMON), "--runtime-dir", str(tmp_path), "--drain-deadline-ms", "2000"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        socks = []
        while not socks:
            socks = [p for p in tmp_path.glob("GPU-*.sock") if not p.name.endswith(".session.sock")]
            log.seek(0)
            assert proc.poll() is None, log.read()
            assert time.monotonic() < deadline, log.read()
            time.sleep(0.05)
        sock = socks[0]
        assert len(sock.name) == len("GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.sock")
        assert (tmp_path / (sock.name[: -len(".sock")] + ".session.sock")).exists()
        with _channel(sock) as channel:
            assert _raw_unary(channel, "/grpc.health.v1.Health/Check") == b"\x08\x01"  # SERVING
            version = _raw_unary(channel, f"/{SERVICE}/GetVersion")
            assert sock.name[: -len(".sock")].encode() in version  # gpu_uuid
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=10)
        log.seek(0)
        text = log.read()
        log.close()
    assert rc == 0, text
    assert "health SERVING" in text, text
    assert not list(tmp_path.glob("*.sock"))
