"""Shared by the orchestrator (bench/__main__.py) and its child processes (bench/worker.py).

Nothing here imports torch: the orchestrator stays light, and a child decides
for itself whether it loads the kernel library or the Python client (a
process cannot hold both: they define the same op namespace).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON_DIR = REPO / "python"
D = 128
ULYSSES = 4

# name -> (model, S, H, per rank); B = 1, D = 128. Per rank is Ulysses-4's share of the heads.
SHAPES = {
    "flux": ("FLUX.1 1024²", 4608, 24, False),
    "flux_rank": ("FLUX.1 1024²", 4608, 6, True),
    "wan": ("Wan-14B 480p", 32760, 40, False),
    "wan_rank": ("Wan-14B 480p", 32760, 10, True),
}

MERGE = "fused_merge_attn_states"
QUANT = "fp8_comm_per_token_quant"
DEQUANT = "fp8_comm_per_token_dequant"
QKV_QUANT = "fp8_comm_qkv_permute_quant"
QKV_DEQUANT = "fp8_comm_qkv_permute_dequant"
OPS = (MERGE, QUANT, DEQUANT, QKV_QUANT, QKV_DEQUANT)
SHORT = {MERGE: "merge", QUANT: "quant", DEQUANT: "dequant", QKV_QUANT: "qkv_quant", QKV_DEQUANT: "qkv_dequant"}

# Client modes of a child: how its calls reach the kernels.
INPROC = "inproc"  # kernel library loaded with torch.ops.load_library, no daemon
RING_SYNC, RING_ASYNC, GRPC = "sync", "async", "grpc"
CLIENT = "client"  # ring; the child switches sync/async itself (scaling)
CLIENT_MODES = (RING_SYNC, RING_ASYNC, GRPC, CLIENT)


def shape_label(name: str) -> str:
    model, s, h, per_rank = SHAPES[name]
    return f"{model} S={s} H={h}" + (" per rank" if per_rank else "")


# -- progress ------------------------------------------------------------------------------

_T0 = time.monotonic()


def log(msg: str) -> None:
    """One timestamped progress line on stderr (stdout is kept for the final table)."""
    print(f"[bench {time.strftime('%H:%M:%S')} +{time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# -- statistics ----------------------------------------------------------------------------


def summarize_ns(samples_ns: list[int]) -> dict:
    """p50/p99/mean/min/max in microseconds of host-time samples in nanoseconds."""
    t = sorted(samples_ns)
    n = len(t)
    if n == 0:
        return {"n": 0}
    return {
        "n": n,
        "p50_us": t[n // 2] / 1e3,
        "p99_us": t[min(n - 1, int(n * 0.99))] / 1e3,
        "mean_us": sum(t) / n / 1e3,
        "min_us": t[0] / 1e3,
        "max_us": t[-1] / 1e3,
    }


def error_text(e: BaseException, limit: int = 2000) -> str:
    """The exception and the end of its traceback: enough to tell a bug from a refusal."""
    import traceback

    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    return text if len(text) <= limit else "..." + text[-limit:]


# -- files ---------------------------------------------------------------------------------


def write_json(path: Path, data) -> None:
    """Atomic write: a reader (or a killed run) never sees half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def tail(path: Path, chars: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - chars))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


# -- child processes -----------------------------------------------------------------------


def child_env(client: bool, address: str | None, ring: bool = True, extra: dict | None = None) -> dict:
    """The caller's environment (LD_LIBRARY_PATH of the offline prefix included) for a child.

    The repository root is on PYTHONPATH (for ``bench``); python/ (the client)
    only for client children. In-process children must never import the client,
    so python/ is also removed from an inherited PYTHONPATH there.
    """
    env = dict(os.environ)
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    python_dir = str(PYTHON_DIR)
    inherited = [p for p in inherited if os.path.abspath(p) != python_dir]
    paths = ([python_dir] if client else []) + [str(REPO)] + inherited
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if address:
        env["CACHE_DIT_OPD_ADDRESS"] = address
    env.pop("CACHE_DIT_OPD_RING", None)
    if client and not ring:
        env["CACHE_DIT_OPD_RING"] = "0"
    # Legacy CUDA IPC cannot export expandable segments: the client would refuse them.
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.update(extra or {})
    return env


def spawn(cmd: list[str], env: dict, stdout_path: Path, stderr_path: Path | None = None) -> subprocess.Popen:
    """Starts cmd in its own process group (so a timeout can end it and whatever it started)."""
    out = open(stdout_path, "ab")
    err = open(stderr_path, "ab") if stderr_path else subprocess.STDOUT
    try:
        return subprocess.Popen([str(c) for c in cmd], env=env, cwd=str(REPO), stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        out.close()
        if stderr_path:
            err.close()


def kill_group(p: subprocess.Popen) -> None:
    """SIGKILL to the process group this benchmark created for p (its id is p's pid)."""
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        p.kill()
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        pass


def wait_or_kill(p: subprocess.Popen, timeout: float) -> tuple[int | None, bool]:
    """(exit status, timed out). A child past its time is killed, never waited on forever."""
    try:
        return p.wait(max(0.1, timeout)), False
    except subprocess.TimeoutExpired:
        kill_group(p)
        return p.returncode, True
    except BaseException:  # interrupted: the child (in its own session) would outlive us
        kill_group(p)
        raise


def run_child(cmd: list[str], env: dict, timeout: float, stdout_path: Path,
              stderr_path: Path | None = None) -> dict:
    """Runs cmd to completion or timeout: {rc, timed_out, wall_s}."""
    t0 = time.monotonic()
    try:
        p = spawn(cmd, env, stdout_path, stderr_path)
    except OSError as e:
        return {"rc": None, "timed_out": False, "wall_s": 0.0, "spawn_error": str(e)}
    rc, timed_out = wait_or_kill(p, timeout)
    return {"rc": rc, "timed_out": timed_out, "wall_s": round(time.monotonic() - t0, 2)}
