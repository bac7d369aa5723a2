"""``bench/run.sh --mps``: the whole run (daemon, every child, this process) as clients of a private MPS
server, started before any of them makes a CUDA context and stopped at the end.

Under MPS the daemon's and the clients' work share one hardware context, so a call's hand-off between
their streams costs no context switch (docs/DESIGN.md section 7; deploy/README.md says how to run a daemon
that way). The control daemon gets its own pipe and log directories under the run's temporary directory,
so it neither needs nor disturbs a system-wide MPS.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
ENV_KEYS = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")


class MpsError(RuntimeError):
    pass


@contextlib.contextmanager
def private_mps(tmp: Path):
    """Starts ``nvidia-cuda-mps-control -d`` with pipe and log directories under ``tmp``, exports them to this
    process (and so to everything it starts) while the block runs, then asks the control daemon to quit and
    restores the environment. Yields what the results record.

    ``quit`` returns only once every client has gone, and this process stays one until it exits (its CUDA
    context cannot be torn down before): the request is sent without waiting for its answer (measured on an
    H100: waiting timed out), and the server and control daemon stop when this process exits. ``tmp`` must
    outlive the block (the control daemon still uses it)."""
    control = shutil.which(CONTROL)
    if control is None:
        raise MpsError(f"--mps: {CONTROL} is not on PATH (it ships with the NVIDIA driver)")
    dirs = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp / "mps-pipe"), "CUDA_MPS_LOG_DIRECTORY": str(tmp / "mps-log")}
    for d in dirs.values():
        Path(d).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **dirs)
    started = subprocess.run([control, "-d"], env=env, capture_output=True, text=True, timeout=30)
    if started.returncode != 0:
        raise MpsError(f"--mps: {CONTROL} -d exited with {started.returncode}: "
                       f"{(started.stderr or started.stdout).strip()[:300]}")
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    os.environ.update(dirs)
    try:
        yield {"control": control, **{k.lower(): v for k, v in dirs.items()}}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        quit_ = subprocess.Popen([control], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, env=env, text=True, start_new_session=True)
        quit_.stdin.write("quit\n")
        quit_.stdin.close()
