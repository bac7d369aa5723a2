"""The benchmark's own daemon: started from the build directory on a private socket, probed over gRPC.

The orchestrator talks to it without importing the Python client (whose
package import defines the op namespace): the generated protobuf module is
loaded by file path and RPCs are called by method name.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import time
from pathlib import Path

from bench.common import PYTHON_DIR

SERVICE = "/cache_dit_opd.v1.OperatorDaemon/"


class DaemonError(RuntimeError):
    """The daemon could not be started or does not serve; the message says why and what to do."""


_pb = None


def _protocol():
    """(grpc, opd_pb2), loaded once; DaemonError when grpcio/protobuf are missing."""
    global _pb
    try:
        import grpc
    except ImportError as e:
        raise DaemonError(f"grpcio is not importable ({e}); the Python client needs it too") from None
    if _pb is None:
        path = PYTHON_DIR / "cache_dit_opd" / "_proto" / "opd_pb2.py"
        try:
            spec = importlib.util.spec_from_file_location("_bench_opd_pb2", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        except Exception as e:  # noqa: BLE001  (protobuf version skew, missing file: say which)
            raise DaemonError(f"cannot load the protocol module {path}: {e}") from None
        _pb = mod
    return grpc, _pb


def message_to_dict(msg) -> dict:
    """Every field, defaults included, as plain values (the client's cache_dit_opd/_proto/plain.py)."""
    global _plain
    if _plain is None:
        path = PYTHON_DIR / "cache_dit_opd" / "_proto" / "plain.py"
        spec = importlib.util.spec_from_file_location("_bench_opd_plain", path)
        _plain = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_plain)
    return _plain.message_to_dict(msg)


_plain = None


class Daemon:
    """``<build>/server/cache-dit-opd`` on ``<workdir>/opd.sock``, logging to ``<workdir>/daemon.log``."""

    def __init__(self, binary: Path, workdir: Path, device: int = 0, extra_flags: list[str] | None = None,
                 env: dict | None = None, socket: Path | None = None):
        """``env``: variables set for the daemon on top of this process's (the fake-device daemon's knobs);
        ``socket``: another path than ``<workdir>/opd.sock`` (``<dir>/<GPU UUID>.sock`` is found by discovery)."""
        self.binary = Path(binary)
        self.env = env
        self.workdir = Path(workdir)
        self.socket = Path(socket) if socket else self.workdir / "opd.sock"
        self.address = f"unix:{self.socket}"
        self.log_path = self.workdir / "daemon.log"
        self.device = device
        self.extra_flags = list(extra_flags or [])
        self.flags = ["--device", str(device), "--socket", str(self.socket), "--runtime-dir", str(self.workdir),
                      *self.extra_flags]
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self._log_start = 0  # where this start's lines begin in the (appended) log

    @property
    def command(self) -> list[str]:
        return [str(self.binary), *self.flags]

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 60.0, serving: bool = True) -> "Daemon":
        """Starts it and waits until GetVersion answers; ``serving``: and says it serves (DaemonError if not)."""
        if not (self.binary.is_file() and os.access(self.binary, os.X_OK)):
            raise DaemonError(f"the daemon binary {self.binary} is not built (build it, or pass --build DIR)")
        _protocol()
        self.workdir.mkdir(parents=True, exist_ok=True)
        for p in (self.socket, self.socket.with_name("opd.session.sock")):
            p.unlink(missing_ok=True)  # a stale socket of an earlier start in this directory
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            env = {**os.environ, **self.env} if self.env else None
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        self.starts += 1
        try:
            self._wait_serving(timeout, serving)
        except DaemonError:
            self.stop()
            raise
        return self

    def _wait_serving(self, timeout: float, serving: bool = True) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            if self.proc.poll() is not None:
                raise DaemonError(f"the daemon exited with status {self.proc.returncode} while starting "
                                  f"({' '.join(self.command)}); its log:\n{self.log_tail()}")
            try:
                v = self.version(timeout=1.0)
            except Exception as e:  # noqa: BLE001  (not listening yet)
                last = str(e).splitlines()[0] if str(e) else type(e).__name__
            else:
                if v.serving or not serving:
                    return
                raise DaemonError(f"the daemon started but does not serve: {v.not_serving_reason or '?'} "
                                  f"(a CUDA device is needed); its log:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise DaemonError(f"the daemon did not answer GetVersion within {timeout:.0f} s ({last}); "
                                  f"its log:\n{self.log_tail()}")
            time.sleep(0.1)

    def _rpc(self, method: str, request, reply_type, timeout: float):
        grpc, _ = _protocol()
        with grpc.insecure_channel(self.address) as ch:
            fn = ch.unary_unary(SERVICE + method, request_serializer=request.SerializeToString,
                                response_deserializer=reply_type.FromString)
            return fn(request, timeout=timeout)

    def version(self, timeout: float = 5.0):
        _, pb = _protocol()
        return self._rpc("GetVersion", pb.VersionRequest(), pb.VersionReply, timeout)

    def stats(self, timeout: float = 5.0):
        """Daemon-wide GetStats (session_id 0: every session)."""
        _, pb = _protocol()
        return self._rpc("GetStats", pb.StatsRequest(session_id=0), pb.StatsReply, timeout)

    def executor_busy_ns(self) -> list[int] | None:
        """GetStats' executor_busy_ns: each executor thread's time in passes that did work, since start (None when
        the daemon cannot be asked)."""
        try:
            return list(self.stats().executor_busy_ns)
        except Exception:  # noqa: BLE001 - a figure the report shows as missing, not a failed run
            return None

    def stage_p50_us(self) -> dict[str, float] | None:
        """GetStats' stages: each stage's p50 over its last 8192 calls ("accept", "inputs_wait", "run"), in
        microseconds (None when the daemon cannot be asked)."""
        try:
            return {s.name: s.p50_us for s in self.stats().stages}
        except Exception:  # noqa: BLE001 - a figure the report shows as missing, not a failed run
            return None

    def cpu_seconds(self) -> float | None:
        """utime + stime of the daemon (all its threads) from /proc, in seconds; None if unreadable."""
        try:
            text = Path(f"/proc/{self.pid}/stat").read_text()
        except (OSError, TypeError):
            return None
        fields = text.rsplit(")", 1)[1].split()  # after "pid (comm)": field 3 is fields[0]
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the log of the latest start (earlier starts' lines are left out)."""
        try:
            with open(self.log_path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(self._log_start, size - chars))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: the daemon dies at once, as after a crash."""
        if self.alive():
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (the daemon drains), then SIGKILL of this pid if it does not exit."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return self.proc.returncode
