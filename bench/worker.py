"""One measurement in a child process: ``python -m bench.worker --case C --mode M --params JSON --result PATH``.

The orchestrator starts one child per (case, mode) so that a crash, a hang or a
sticky CUDA error costs one case, and so that the in-process baseline (kernel
library loaded) and the client (proxy ops) never share a process. The child
writes ``{"status": "ok", ...}`` or ``{"status": "error", "error": ...}`` to
PATH; no file means it died (the orchestrator then reports its log).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import CLIENT_MODES, INPROC, RING_ASYNC, error_text, write_json  # noqa: E402


class Context:
    """How this child reaches the ops: opened on first use (the kernels case never opens it)."""

    def __init__(self, mode: str, lib: str, device: int):
        self.mode, self.lib, self.device = mode, lib, device
        self._ops = None
        self._sync = None
        self.info: dict = {"mode": mode, "pid": os.getpid()}

    def ops(self):
        if self._ops is None:
            self._open()
        return self._ops

    def sync(self) -> None:
        """Waits for this process's GPU work (and, for the client, every call in flight and its errors)."""
        self.ops()
        self._sync()

    def set_async(self, on: bool) -> None:
        if self.mode in CLIENT_MODES:
            import cache_dit_opd

            cache_dit_opd.set_async_calls(on)

    def _open(self) -> None:
        import torch

        torch.cuda.set_device(self.device)
        if self.mode == INPROC:
            torch.ops.load_library(self.lib)
            self._sync = torch.cuda.synchronize
            self.info["transport"] = "in-process"
        else:
            import cache_dit_opd

            cache_dit_opd.set_async_calls(self.mode == RING_ASYNC)
            d = cache_dit_opd.daemon_info()  # opens the session now, not inside the first timed call
            self.info.update(transport=d["transport"], native=d.get("native", False), async_calls=d["async_calls"],
                             ring_capacity=d["ring_capacity"], lanes=d["lanes"], session_id=d["session_id"],
                             daemon_version=d["daemon_version"])
            self._sync = cache_dit_opd.synchronize
        self._ops = torch.ops.cache_dit_cuda_ops


def _case_function(case: str):
    from bench import kernel_case, latency, regions, scaling, svdq_case, throughput

    return {"latency": latency.child, "pipelined": throughput.child, "scaling": scaling.child,
            "regions": regions.child, "kernels": kernel_case.child, "svdq": svdq_case.child}[case]


def _cuda_or_exit() -> None:
    try:
        import torch
    except ImportError as e:
        print(f"bench worker: PyTorch is not importable ({e})", file=sys.stderr)
        sys.exit(2)
    if not torch.cuda.is_available():
        print("bench worker: no CUDA device is visible; the benchmark runs on a GPU host", file=sys.stderr)
        sys.exit(2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", required=True, choices=("latency", "pipelined", "scaling", "regions", "kernels", "svdq"))
    ap.add_argument("--mode", required=True, choices=(INPROC, *CLIENT_MODES))
    ap.add_argument("--lib", default="", help="kernel library (in-process mode)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--params", default="{}", help="JSON object of the case's parameters")
    ap.add_argument("--result", required=True)
    ap.add_argument("--dump-after", type=float, default=0, help="print every thread's stack after this many s")
    args = ap.parse_args(argv)
    if args.dump_after > 0:
        import faulthandler

        faulthandler.dump_traceback_later(args.dump_after)
    _cuda_or_exit()
    ctx = Context(args.mode, args.lib, args.device)
    t0 = time.monotonic()
    try:
        data = _case_function(args.case)(ctx, json.loads(args.params))
        out = {"status": "ok", **data}
    except Exception as e:  # noqa: BLE001  (recorded; the orchestrator goes on with the next case)
        out = {"status": "error", "error": error_text(e)}
    out["info"] = ctx.info
    out["child_wall_s"] = round(time.monotonic() - t0, 2)
    write_json(Path(args.result), out)
    _bound_exit(EXIT_GRACE_S)
    return 0


EXIT_GRACE_S = 20.0


def _bound_exit(grace_s: float) -> None:
    """The result is written: if closing the session or CUDA at exit hangs, leave after grace_s anyway
    (the daemon treats it as a client that died), instead of holding the run until the child's timeout."""
    import threading

    t = threading.Timer(grace_s, os._exit, args=(0,))
    t.daemon = True
    t.start()


if __name__ == "__main__":
    sys.exit(main())
