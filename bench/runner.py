"""The orchestrator's side of a run: paths, the time budget, the daemon, and child processes.

Every child has a timeout (bounded by what is left of the run's budget), runs
in its own process group, and logs to a file in the run's temporary
directory; a child that dies or times out becomes an error entry carrying the
end of its log.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import GRPC, INPROC, child_env, kill_group, log, run_child, spawn, tail
from bench.daemon import Daemon, DaemonError


@dataclass
class Settings:
    """What the cases read: sizes depend on --quick."""

    quick: bool
    device: int
    build: Path
    lib: Path
    scaling_window_s: float | None = None  # None: the suite's default


class Runner:
    def __init__(self, settings: Settings, daemon: Daemon, tmp: Path, deadline: float):
        self.s = settings
        self.daemon = daemon
        self.tmp = tmp
        self.deadline = deadline  # time.monotonic() by which the run must be over
        self.live: set[subprocess.Popen] = set()
        self.restarts: list[dict] = []
        self._seq = itertools.count(1)

    # -- budget -----------------------------------------------------------------------------
    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def clamp(self, timeout: float) -> float:
        """A child's timeout: its own, or less when the run's budget is nearly spent."""
        return max(1.0, min(timeout, self.remaining()))

    # -- daemon -----------------------------------------------------------------------------
    def ensure_daemon(self) -> None:
        """Restarts the daemon if an earlier case killed it (recorded with its log); DaemonError if it won't."""
        if self.daemon.alive():
            return
        rc = self.daemon.proc.returncode if self.daemon.proc else None
        entry = {"at": time.strftime("%H:%M:%S"), "exit_status": rc, "log_tail": self.daemon.log_tail()}
        self.restarts.append(entry)
        log(f"the daemon is down (exit status {rc}): restarting it")
        self.daemon.start()

    # -- children ---------------------------------------------------------------------------
    def _worker_cmd(self, case: str, mode: str, params: dict, result: Path, timeout: float = 0) -> list[str]:
        # -X faulthandler: a crash leaves its Python stack in the log; --dump-after: so does a hang, just
        # before the timeout kills the child.
        return [sys.executable, "-X", "faulthandler", "-m", "bench.worker", "--case", case, "--mode", mode,
                "--lib", str(self.s.lib), "--device", str(self.s.device), "--params", json.dumps(params),
                "--result", str(result), "--dump-after", f"{max(0.0, timeout - 3):.0f}"]

    def _env(self, mode: str) -> dict:
        # The client finds the native library (client/python/) of the build under test.
        return child_env(client=mode != INPROC, address=self.daemon.address, ring=mode != GRPC,
                         extra={"CACHE_DIT_OPD_BUILD_DIR": str(self.s.build)})

    def _paths(self, name: str) -> tuple[Path, Path]:
        n = next(self._seq)
        return self.tmp / f"{n:03d}-{name}.result.json", self.tmp / f"{n:03d}-{name}.log"

    def child(self, case: str, mode: str, params: dict, timeout: float) -> dict:
        """Runs one worker to completion: its result dict, or an error entry (never raises)."""
        result, logf = self._paths(f"{case}-{mode}")
        t = self.clamp(timeout)
        log(f"{case}: {mode} child (timeout {t:.0f} s)")
        r = run_child(self._worker_cmd(case, mode, params, result, t), self._env(mode), t, logf)
        return self.collect(result, logf, r)

    def spawn_child(self, case: str, mode: str, params: dict, name: str) -> tuple[subprocess.Popen, Path, Path]:
        """Starts one worker and returns at once (for the many-process case); tracked for clean-up."""
        result, logf = self._paths(name)
        p = spawn(self._worker_cmd(case, mode, params, result), self._env(mode), logf)
        self.live.add(p)
        return p, result, logf

    def collect(self, result: Path, logf: Path, r: dict) -> dict:
        try:
            data = json.loads(result.read_text())
        except (OSError, ValueError):
            why = ("timed out" if r.get("timed_out") else
                   r.get("spawn_error") or f"exited with status {r.get('rc')} without a result")
            return {"status": "error", "error": f"child {why}", "log_tail": tail(logf)}
        data["wall_s"] = r.get("wall_s")
        if data.get("status") != "ok":
            data["log_tail"] = tail(logf)
        return data

    def command(self, cmd: list[str], timeout: float, name: str, extra_env: dict | None = None) -> dict:
        """Runs a non-Python tool (the C++ benchmark): {rc, timed_out, wall_s, stdout, stderr_tail}."""
        n = next(self._seq)
        out, err = self.tmp / f"{n:03d}-{name}.stdout", self.tmp / f"{n:03d}-{name}.stderr"
        t = self.clamp(timeout)
        log(f"{name}: {Path(cmd[0]).name} (timeout {t:.0f} s)")
        r = run_child(cmd, child_env(client=False, address=self.daemon.address, extra=extra_env), t, out, err)
        r["stdout"] = tail(out, 20000)
        r["stderr_tail"] = tail(err)
        return r

    def kill_all(self) -> None:
        for p in list(self.live):
            kill_group(p)
        self.live.clear()


def start_daemon(daemon: Daemon) -> dict:
    """Starts it and returns what the JSON records about it; DaemonError with the reason otherwise."""
    log(f"starting the daemon: {' '.join(daemon.command)}")
    daemon.start()
    from bench.daemon import message_to_dict

    try:
        version = message_to_dict(daemon.version())
    except Exception as e:  # noqa: BLE001
        raise DaemonError(f"GetVersion failed right after start-up: {e}") from None
    log(f"daemon pid {daemon.pid} serving {version.get('gpu_name')} (ring offered: {version.get('ring_available')})")
    return {"binary": str(daemon.binary), "flags": daemon.flags, "command": daemon.command, "pid": daemon.pid,
            "version": version}
