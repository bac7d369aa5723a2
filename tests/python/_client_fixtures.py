"""Helpers for the Python client's tests (tests/python/test_client_*.py).

* ``PYTHON_DIR`` is put first on sys.path, so the tests run against the
  source tree whether or not ``pip install ./python`` was done;
  ``subprocess_env()`` does the same for child interpreters.
* ``FakeDaemon``: a small stand-in for the C++ daemon that speaks the real
  protocol (gRPC OperatorDaemon over a Unix socket, the SOCK_SEQPACKET session
  channel with a memfd, the shared-memory header and lane semaphores). It runs
  as a separate process (``python _client_fixtures.py fake-daemon ...``) so
  that killing it is real. It completes a call by writing the lane's ``done``
  from the host, as the daemon's lane stream would. With ``--ring`` it offers
  the shared-memory call ring and consumes it with ``RingConsumer``; it
  increments the header's ``daemon_heartbeat`` every 100 ms.
* ``RingConsumer``: a stand-in for the daemon's side of the call ring
  (proto/cache_dit_opd/v1/ring.h) over any mapping: copies each record once,
  answers it through a handler, writes the completion (``done_ticket`` last),
  and sleeps on the doorbell futex when idle.
* ``FakeDriver``: the client's ``_cuda_driver.Driver`` interface without a
  GPU: stream memory operations act on host memory at once; allocations are
  simulated for the region table.
* Paths of the built kernel library and daemon (``CACHE_DIT_OPD_BUILD_DIR``,
  default ``<repo>/build``).
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PYTHON_DIR = os.path.join(REPO, "python")
PACKAGE_DIR = os.path.join(PYTHON_DIR, "cache_dit_opd")

if PYTHON_DIR not in sys.path:
    sys.path.insert(0, PYTHON_DIR)


def build_dir() -> str:
    return os.environ.get("CACHE_DIT_OPD_BUILD_DIR", os.path.join(REPO, "build"))


def kernel_library_path() -> str:
    return os.path.join(build_dir(), "kernels", "libcache_dit_cuda_ops.so")


def daemon_binary_path() -> str:
    return os.path.join(build_dir(), "server", "cache-dit-opd")


def short_tmpdir() -> str:
    """A fresh directory with a short path: AF_UNIX socket paths are limited to 107 bytes."""
    import tempfile

    return tempfile.mkdtemp(prefix="cdo-", dir="/tmp")


def subprocess_env(**extra) -> dict:
    """os.environ with the source tree first on PYTHONPATH (an extra PYTHONPATH goes after it)."""
    env = dict(os.environ)
    paths = [PYTHON_DIR, HERE]
    if extra.get("PYTHONPATH"):
        paths.append(extra.pop("PYTHONPATH"))
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update({k: v for k, v in extra.items() if v is not None})
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
    return env


def run_python(code: str, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter with the source tree on its path."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env=subprocess_env(**env), cwd=REPO)


# -- the real daemon (GPU tests) -------------------------------------------------------------------


class RealDaemon:
    """The built daemon on ``<dir>/opd.sock`` (``--socket``), for the GPU tests.

    Extra daemon flags can be given with CACHE_DIT_OPD_DAEMON_ARGS (split on spaces).
    """

    def __init__(self, directory: str, device: int = 0, *args: str):
        self.dir = directory
        self.socket = os.path.join(directory, "opd.sock")
        self.address = "unix:" + self.socket
        self.log_path = os.path.join(directory, "daemon.log")
        self.args = ["--device", str(device), "--socket", self.socket, *args,
                     *os.environ.get("CACHE_DIT_OPD_DAEMON_ARGS", "").split()]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> "RealDaemon":
        binary = daemon_binary_path()
        if os.path.exists(self.socket):
            os.unlink(self.socket)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([binary, *self.args], stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            try:
                v = self.version(timeout=1.0)
                if v.serving:
                    return self
                raise RuntimeError(f"daemon is not serving: {v.not_serving_reason}\n{self.log()}")
            except RuntimeError:
                raise
            except Exception:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"daemon did not answer within {timeout} s:\n{self.log()}")
                time.sleep(0.1)

    def log(self) -> str:
        try:
            return open(self.log_path, errors="replace").read()[-4000:]
        except OSError:
            return ""

    def _stub(self):
        import grpc

        from cache_dit_opd._proto import opd_grpc

        ch = grpc.insecure_channel(self.address)
        return ch, opd_grpc.OperatorDaemonStub(ch)

    def version(self, timeout: float = 5.0):
        from cache_dit_opd._proto import opd_pb2 as pb

        ch, stub = self._stub()
        try:
            return stub.GetVersion(pb.VersionRequest(), timeout=timeout)
        finally:
            ch.close()

    def stats(self):
        """Daemon-wide GetStats (session_id 0: every session)."""
        from cache_dit_opd._proto import opd_pb2 as pb

        ch, stub = self._stub()
        try:
            return stub.GetStats(pb.StatsRequest(session_id=0), timeout=5.0)
        finally:
            ch.close()

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


# -- reference math (docs/DESIGN.md section 3), for tolerance checks -----------------------------------------


def ref_merge(prev_out, prev_lse, suff_out, suff_lse):
    import torch

    p, s = prev_lse.float(), suff_lse.float()
    p = torch.where(p == float("inf"), torch.full_like(p, -float("inf")), p)
    s = torch.where(s == float("inf"), torch.full_like(s, -float("inf")), s)
    m = torch.maximum(p, s)
    empty = m == -float("inf")
    mm = torch.where(empty, torch.zeros_like(m), m)
    wp, ws = torch.exp(p - mm), torch.exp(s - mm)
    out = (wp * prev_out.float() + ws * suff_out.float()) / (wp + ws)
    lse = mm + torch.log(wp + ws)
    out = torch.where(empty, prev_out.float(), out)
    lse = torch.where(empty, torch.full_like(lse, -float("inf")), lse)
    return out.to(suff_out.dtype), lse.to(suff_lse.dtype)


def ref_per_token_quant(x):
    import torch

    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448.0
    q = (xf * (1.0 / scale)).clamp(-448, 448).to(torch.float8_e4m3fn)
    sb = scale.to(torch.bfloat16).view(torch.uint8)
    return torch.cat([q.view(torch.uint8), sb], -1).view(torch.float8_e4m3fn)


def ref_per_token_dequant(x):
    import torch

    d = x.shape[-1] - 2
    q = x[..., :d].float()
    scale = x[..., d:].view(torch.uint8).contiguous().view(torch.bfloat16).float()
    return (q * scale).to(torch.bfloat16)


def ref_qkv_permute_quant(x):
    import torch

    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / 448.0).clamp_min(1e-6)
    q = (xf / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    rec = torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8)], -1)  # [B, S, P, N, D+4]
    return rec.permute(2, 1, 0, 3, 4).contiguous().view(torch.float8_e4m3fn)


def ref_qkv_permute_dequant(quant_x):
    import torch

    d = quant_x.shape[-1] - 4
    q = quant_x[..., :d].float()
    scale = quant_x[..., d:].view(torch.uint8).contiguous().view(torch.float32)
    return (q * scale).to(torch.bfloat16).permute(1, 0, 2, 3).contiguous()


# -- fake driver ----------------------------------------------------------------------------


class FakeDriver:
    """The Driver interface on host memory. Allocations: ``alloc(size) -> base``; ``free(base)``."""

    def __init__(self):
        self.allocs: dict[int, tuple[int, int, bool]] = {}  # base -> (size, buffer id, legacy ipc capable)
        self.next_base = 0x7F0000000000
        self.next_buffer_id = 1
        self.writes: list[tuple[int, int, int]] = []
        self.waits: list[tuple[int, int, int]] = []
        self.registered: list[tuple[int, int]] = []
        self.pointer_queries = 0

    def alloc(self, size: int, at: int | None = None, vmm: bool = False) -> int:
        base = at if at is not None else self.next_base
        self.next_base = max(self.next_base, base + ((size + 0xFFFFF) & ~0xFFFFF) + 0x100000)
        self.allocs[base] = (size, self.next_buffer_id, not vmm)
        self.next_buffer_id += 1
        return base

    def free(self, base: int) -> None:
        del self.allocs[base]

    def pointer_range(self, ptr: int):
        self.pointer_queries += 1
        for base, (size, bid, _) in self.allocs.items():
            if base <= ptr < base + size:
                return base, size, bid
        return 0, 0, 0

    def legacy_ipc_capable(self, ptr: int) -> bool:
        for base, (size, _, ok) in self.allocs.items():
            if base <= ptr < base + size:
                return ok
        return False

    def ipc_get_mem_handle(self, base: int) -> bytes:
        size, bid, _ = self.allocs[base]
        return struct.pack("<QQQ", base, size, bid).ljust(64, b"\0")

    def mem_host_register(self, addr, size, flags):
        self.registered.append((addr, size))

    def mem_host_unregister(self, addr):
        pass

    def mem_host_get_device_pointer(self, addr):
        return addr

    def stream_write_value64(self, stream, addr, value):
        self.writes.append((stream, addr, value))
        ctypes.c_uint64.from_address(addr).value = value

    def stream_wait_value64(self, stream, addr, value):
        self.waits.append((stream, addr, value))

    def waits_satisfied(self) -> bool:
        return all(ctypes.c_uint64.from_address(a).value >= v for _, a, v in self.waits)


# -- fake daemon (runs in its own process) ---------------------------------------------------------


class FakeDaemon:
    """A fake daemon process on ``<dir>/<uuid>.sock`` (+ ``.session.sock``)."""

    def __init__(self, directory: str, uuid: str = "GPU-00000000-0000-0000-0000-000000000000", *args: str,
                 catalog: list | None = None):
        import json

        self.dir = directory
        self.uuid = uuid
        self.socket = os.path.join(directory, f"{uuid}.sock")
        self.address = "unix:" + self.socket
        self.catalog_file = os.path.join(directory, f"{uuid}.catalog.json")
        with open(self.catalog_file, "w") as f:
            json.dump(catalog if catalog is not None else client_catalog(), f)
        self.args = list(args) + ["--catalog", self.catalog_file]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30) -> "FakeDaemon":
        for p in (self.socket, self.socket[:-5] + ".session.sock"):
            if os.path.exists(p):
                os.unlink(p)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "fake-daemon", "--socket", self.socket, "--uuid", self.uuid,
             *self.args],
            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        deadline = time.monotonic() + timeout
        line = self.proc.stdout.readline()
        if "ready" not in line:
            self.proc.kill()
            rest = self.proc.stdout.read()
            raise RuntimeError(f"fake daemon did not start: {line}{rest}")
        while not os.path.exists(self.socket) and time.monotonic() < deadline:
            time.sleep(0.01)
        threading.Thread(target=self._drain, daemon=True).start()
        return self

    def _drain(self):
        for line in self.proc.stdout:
            sys.stderr.write("[fake-daemon] " + line)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def client_catalog(skew: bool = False, families=("attn", "comm")) -> list:
    """[(name, overload, schema)] of the client's ops, as the daemon's OpenSession would list them."""
    import torch

    import cache_dit_opd  # noqa: F401  (defines the ops)

    out = []
    names = {q.split("::", 1)[1].split(".", 1)[0] for q in torch._C._dispatch_get_all_op_names()
             if q.startswith("cache_dit_cuda_ops::")}
    for name in sorted(names):
        family = "attn" if "merge_attn" in name else "comm"
        if family not in families:
            continue
        packet = getattr(torch.ops.cache_dit_cuda_ops, name)
        for ov in packet.overloads():
            schema = str(getattr(packet, ov)._schema)
            if skew and name == "fused_merge_attn_states" and ov == "out":
                schema = schema.replace("Tensor suff_lse,", "Tensor suff_lse, float scale,")
            out.append((name, "" if ov == "default" else ov, schema))
    return sorted(out)


def _import_protocol_modules():
    """cache_dit_opd._layout and ._proto without running the package __init__ (no torch import)."""
    import importlib
    import types

    if "cache_dit_opd" not in sys.modules:
        pkg = types.ModuleType("cache_dit_opd")
        pkg.__path__ = [PACKAGE_DIR]
        sys.modules["cache_dit_opd"] = pkg
    return (importlib.import_module("cache_dit_opd._layout"), importlib.import_module("cache_dit_opd._proto.opd_grpc"),
            importlib.import_module("cache_dit_opd._proto.opd_pb2"))


def _ring_module():
    _import_protocol_modules()
    import importlib

    return importlib.import_module("cache_dit_opd._ring")


class RingConsumer:
    """The daemon's side of one call ring, in a thread (ring.h protocol).

    ``handler(ticket, record_bytes) -> (status_code, message, lane, seq)`` answers
    each record (its private copy); a ``status_code`` of None writes no completion
    (a daemon that never answers). ``pause()`` (optional) stops consuming while it
    returns True (ring-full tests). ``on_violation(reason)`` is called when the
    tail is behind the head or more than ``capacity`` ahead; the consumer stops.
    Idle: spins ``spin_s``, then stores kDoorbellSleeping, re-checks the tail, and
    FUTEX_WAITs with ``futex_timeout_s``.
    """

    def __init__(self, addr: int, capacity: int, handler, *, spin_s: float = 200e-6, futex_timeout_s: float = 0.1,
                 pause=None, on_violation=None, init: bool = True):
        r = self.ring = _ring_module()
        self.addr, self.capacity, self.mask = addr, capacity, capacity - 1
        self.handler = handler
        self.spin_s, self.futex_timeout_s = spin_s, futex_timeout_s
        self.pause = pause
        self.on_violation = on_violation
        if init:
            self.init_control(addr, capacity)
        f = r.CONTROL_FIELDS
        self.tail = ctypes.c_uint64.from_address(addr + f["sq_tail"][0])
        self.head_word = ctypes.c_uint64.from_address(addr + f["sq_head"][0])
        self.doorbell_addr = addr + f["doorbell"][0]
        self.doorbell = ctypes.c_uint32.from_address(self.doorbell_addr)
        self.slots = addr + r.RING_CONTROL_BYTES
        self.comps = self.slots + capacity * r.SLOT_BYTES
        self.head = self.tail.value
        self.records = 0
        self.sleeps = 0  # FUTEX_WAITs entered
        self.woken = 0  # FUTEX_WAITs ended by a producer's FUTEX_WAKE (doorbell found awake before the timeout)
        self.violation: str | None = None
        self._stop = False
        self.thread: threading.Thread | None = None

    @staticmethod
    def init_control(addr: int, capacity: int) -> None:
        r = _ring_module()
        for name, value in (("version", r.RING_VERSION), ("capacity", capacity), ("slot_bytes", r.SLOT_BYTES),
                            ("completion_bytes", r.COMPLETION_BYTES)):
            ctypes.c_uint32.from_address(addr + r.CONTROL_FIELDS[name][0]).value = value

    def start(self) -> "RingConsumer":
        self.thread = threading.Thread(target=self.run, name="ring-consumer", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop = True
        self.doorbell.value = self.ring.DOORBELL_AWAKE
        self.ring.futex_wake(self.doorbell_addr, 1)
        if self.thread is not None:
            self.thread.join(10)

    def complete(self, t: int, lane: int, seq: int, code: int, message: str) -> None:
        r = self.ring
        a = self.comps + (t & self.mask) * r.COMPLETION_BYTES
        rec = r.COMPLETION.pack(0, t, seq, lane, code, message.encode()[: r.COMPLETION_MESSAGE_BYTES - 1])
        ctypes.memmove(a + 8, rec[8:], len(rec) - 8)  # the fields first,
        ctypes.c_uint64.from_address(a).value = t + 1  # done_ticket last (x86-64: stores stay in order)

    def run(self) -> None:
        r = self.ring
        idle_since = time.monotonic()
        while not self._stop:
            if self.pause is not None and self.pause():
                time.sleep(0.001)
                continue
            tail = self.tail.value
            if tail == self.head:
                if time.monotonic() - idle_since < self.spin_s:
                    continue
                self.doorbell.value = r.DOORBELL_SLEEPING
                r.store_load_fence()  # the doorbell store before the tail re-check (Dekker with the producer)
                if self.tail.value != self.head or self._stop:
                    self.doorbell.value = r.DOORBELL_AWAKE
                    continue
                self.sleeps += 1
                t0 = time.monotonic()
                r.futex_wait(self.doorbell_addr, r.DOORBELL_SLEEPING, self.futex_timeout_s)
                if time.monotonic() - t0 < self.futex_timeout_s * 0.9 and self.doorbell.value == r.DOORBELL_AWAKE:
                    self.woken += 1
                self.doorbell.value = r.DOORBELL_AWAKE
                continue
            if tail < self.head or tail - self.head > self.capacity:
                self.violation = f"sq_tail {tail} with head {self.head} and capacity {self.capacity}"
                if self.on_violation is not None:
                    self.on_violation(self.violation)
                return
            for t in range(self.head, tail):
                slot = self.slots + (t & self.mask) * r.SLOT_BYTES
                copy = ctypes.string_at(slot, r.SLOT_BYTES)  # copied once; only the copy is read
                self.head = t + 1
                self.head_word.value = self.head
                code, message, lane, seq = self.handler(t, copy)
                self.records += 1
                if code is not None:
                    self.complete(t, lane, seq, code, message)
            idle_since = time.monotonic()


def _serve(argv: list[str]) -> None:  # noqa: C901  (one fake, one function)
    import argparse
    import mmap
    from concurrent import futures

    import grpc

    _layout, opd_grpc, pb = _import_protocol_modules()
    _ring = _ring_module()

    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--uuid", required=True)
    ap.add_argument("--hold", action="store_true", help="never complete calls (kernels 'still running')")
    ap.add_argument("--bad-magic", action="store_true")
    ap.add_argument("--refuse-bind", action="store_true")
    ap.add_argument("--catalog", required=True, help="JSON file: [[name, overload, schema], ...]")
    ap.add_argument("--max-lanes", type=int, default=4)
    ap.add_argument("--not-serving", default="")
    ap.add_argument("--region-limit", type=int, default=1 << 30)
    ap.add_argument("--ring", action="store_true", help="offer the shared-memory call ring")
    ap.add_argument("--ring-capacity", type=int, default=_ring.DEFAULT_RING_CAPACITY)
    ap.add_argument("--ring-spin-us", type=float, default=200)
    ap.add_argument("--ring-pause-file", default="", help="the ring consumer pauses while this file exists")
    ap.add_argument("--ring-no-completions", action="store_true", help="consume records, never complete them")
    ap.add_argument("--record-log", default="", help="append one JSON line per call received (ring and gRPC)")
    ap.add_argument("--no-heartbeat", action="store_true")
    opts = ap.parse_args(argv)

    import json

    with open(opts.catalog) as f:
        catalog = [tuple(e) for e in json.load(f)]
    chan_path = opts.socket[: -len(".sock")] + ".session.sock"
    lock = threading.Lock()
    sessions: dict[int, dict] = {}
    stats = {"calls": 0, "errors": 0, "closed": 0}

    def get(ctx, sid, token, bound=True):
        s = sessions.get(sid)
        if s is None or s["closed"]:
            ctx.abort(grpc.StatusCode.NOT_FOUND, f"session {sid} not found")
        if bytes(token) != s["token"]:
            ctx.abort(grpc.StatusCode.PERMISSION_DENIED, "bad token")
        if bound and s["mm"] is None:
            ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, f"session {sid} is not bound")
        return s

    def lane_addr(s, lane, off):
        return s["addr"] + _layout.LANES_OFFSET + lane * _layout.LANE_STRIDE + off

    def complete_all(s):
        for i, last in enumerate(s["seq"]):
            ctypes.c_uint64.from_address(lane_addr(s, i, _layout.LANE_DONE_OFFSET)).value = last

    def GetVersion(req, ctx):
        return pb.VersionReply(daemon_version="0.0.0-fake", protocol_version=_layout.PROTOCOL_VERSION,
                               gpu_uuid=opts.uuid, gpu_name="fake", serving=not opts.not_serving,
                               not_serving_reason=opts.not_serving, layout_version=_layout.LAYOUT_VERSION,
                               ring_available=opts.ring)

    def OpenSession(req, ctx):
        if req.protocol_version != _layout.PROTOCOL_VERSION:
            ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, f"protocol {req.protocol_version}")
        if req.gpu_uuid and req.gpu_uuid != opts.uuid:
            ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this daemon serves {opts.uuid}, not {req.gpu_uuid}")
        log_call({"event": "open", "want_ring": req.want_ring, "lanes": req.lanes})
        lanes = max(1, min(req.lanes or 1, opts.max_lanes))
        ring_offset = (_layout.LANES_OFFSET + lanes * _layout.LANE_STRIDE + 4095) // 4096 * 4096
        ring = opts.ring and req.want_ring
        ring_bytes = (_ring.ring_bytes(opts.ring_capacity) + 4095) // 4096 * 4096 if ring else 0
        size = ring_offset + ring_bytes
        with lock:
            sid = len(sessions) + 1
            sessions[sid] = {"token": os.urandom(32), "lanes": lanes, "size": size, "mm": None, "addr": 0,
                             "seq": [0] * lanes, "closed": False, "regions": {}, "calls": 0, "errors": 0,
                             "pid": req.client_pid, "conn": None, "ring_offset": ring_offset if ring else 0,
                             "ring_bytes": ring_bytes, "consumer": None, "lock": threading.Lock(),
                             "want_ring": req.want_ring}
        return pb.OpenSessionReply(
            session_id=sid, token=sessions[sid]["token"], session_channel_path=chan_path, lanes=lanes,
            layout_version=_layout.LAYOUT_VERSION, shared_memory_bytes=size, gpu_uuid=opts.uuid,
            catalog=[pb.OpSchema(name=n, overload=o, schema=s) for n, o, s in catalog], bind_timeout_ms=5000,
            ring_enabled=ring)

    def CloseSession(req, ctx):
        s = get(ctx, req.session_id, req.token, bound=False)
        if s["mm"] is not None:
            complete_all(s)
        s["closed"] = True
        stats["closed"] += 1
        if s["consumer"] is not None:
            s["consumer"].stop()
        return pb.CloseSessionReply()

    def RegisterRegion(req, ctx):
        s = get(ctx, req.session_id, req.token)
        if len(req.ipc_handle) != 64:
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"ipc_handle has {len(req.ipc_handle)} bytes")
        if len(s["regions"]) >= opts.region_limit:
            ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "mapping cache full")
        s["next_region"] = rid = s.get("next_region", 0) + 1
        s["regions"][rid] = (req.client_base_address, req.size)
        return pb.RegisterRegionReply(region_id=rid, mapped_size=req.size)

    def UnregisterRegion(req, ctx):
        s = get(ctx, req.session_id, req.token)
        if s["regions"].pop(req.region_id, None) is None:
            ctx.abort(grpc.StatusCode.NOT_FOUND, f"region {req.region_id} not found")
        return pb.UnregisterRegionReply()

    def log_call(entry):
        if opts.record_log:
            with lock, open(opts.record_log, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def execute(s, op, lane, seq, region_ids):
        """One call, whichever transport brought it: (grpc status code name or None, message)."""
        if lane >= s["lanes"]:
            return "INVALID_ARGUMENT", f"lane {lane} >= {s['lanes']}"
        with s["lock"]:
            if seq != s["seq"][lane] + 1:
                return "INVALID_ARGUMENT", f"seq {seq}, expected {s['seq'][lane] + 1}"
            ready_addr = lane_addr(s, lane, _layout.LANE_INPUTS_READY_OFFSET)
            deadline = time.monotonic() + 10  # a GPU stream writes inputs_ready: wait for it on the host
            while ctypes.c_uint64.from_address(ready_addr).value < seq and time.monotonic() < deadline:
                time.sleep(0.0002)
            ready = ctypes.c_uint64.from_address(ready_addr).value
            s["seq"][lane] = seq
            stats["calls"] += 1
            s["calls"] += 1
            done = ctypes.c_uint64.from_address(lane_addr(s, lane, _layout.LANE_DONE_OFFSET))
            if ready < seq:  # the client must have enqueued inputs_ready >= seq before calling
                s["errors"] += 1
                done.value = seq
                return "INVALID_ARGUMENT", f"inputs_ready {ready} < seq {seq}"
            for rid in region_ids:
                if rid not in s["regions"]:
                    s["errors"] += 1
                    done.value = seq
                    return "NOT_FOUND", f"region {rid} not found"
            if op == "reject_me":
                s["errors"] += 1
                done.value = seq
                return "INVALID_ARGUMENT", "rejected: op reject_me, value 42"
            if not opts.hold:
                done.value = seq
            return None, ""

    def Call(req, ctx):
        s = get(ctx, req.session_id, req.token)
        log_call({"transport": "grpc", "op": req.op, "overload": req.overload, "lane": req.lane, "seq": req.seq,
                  "nargs": len(req.args)})
        code, message = execute(s, req.op, req.lane, req.seq,
                                [a.tensor.region_id for a in req.args if a.HasField("tensor")])
        if code is not None:
            ctx.abort(getattr(grpc.StatusCode, code), message)
        return pb.CallReply()

    codes = {name: i for i, name in enumerate(_ring.STATUS_NAMES)}

    def ring_handler(s):
        def handle(t, copy):
            try:
                rec = _ring.decode_record(copy)
            except _ring.RecordError as e:
                return codes["INVALID_ARGUMENT"], f"malformed record: {e}", 0, 0
            if rec["op_index"] >= len(catalog):
                return codes["INVALID_ARGUMENT"], f"op_index {rec['op_index']}", rec["lane"], rec["seq"]
            name, overload, _ = catalog[rec["op_index"]]
            log_call({"transport": "ring", "ticket": t, "op": name, "overload": overload, "lane": rec["lane"],
                      "seq": rec["seq"], "flags": rec["flags"], "args": rec["args"]})
            code, message = execute(s, name, rec["lane"], rec["seq"],
                                    [a["region_id"] for a in rec["args"] if a["kind"] == "tensor"])
            if opts.ring_no_completions:
                return None, "", 0, 0
            return (codes[code] if code else 0), message, rec["lane"], rec["seq"]

        return handle

    def GetStats(req, ctx):
        rep = pb.StatsReply(sessions=sum(not s["closed"] for s in sessions.values()), calls=stats["calls"],
                            sessions_closed=stats["closed"])
        for sid, s in sessions.items():
            if req.session_id in (0, sid):
                rep.session.append(pb.SessionStats(session_id=sid, client_pid=s["pid"], calls=s["calls"],
                                                   errors=s["errors"], regions=len(s["regions"])))
        return rep

    handlers = {}
    for name, (req_t, rep_t) in opd_grpc.METHODS.items():
        handlers[name] = grpc.unary_unary_rpc_method_handler(
            locals()[name], request_deserializer=req_t.FromString, response_serializer=rep_t.SerializeToString)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(opd_grpc.SERVICE, handlers),))

    def channel_conn(conn):
        try:
            msg = conn.recv(4096)
            magic, proto, sid, token = _layout.BIND_REQUEST.unpack(msg[: _layout.BIND_REQUEST_SIZE])
            s = sessions.get(sid)

            def refuse(code, text):
                conn.send(_layout.BIND_REPLY.pack(code, _layout.LAYOUT_VERSION, 0, text.encode()))

            if opts.refuse_bind:
                return refuse(7, "refused by --refuse-bind")
            if magic != _layout.BIND_REQUEST_MAGIC or s is None or token != s["token"]:
                return refuse(16, "bad bind request")
            fd = os.memfd_create(f"cache-dit-opd-fake-{sid}")
            os.ftruncate(fd, s["size"])
            mm = mmap.mmap(fd, s["size"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            s["addr"] = ctypes.addressof(ctypes.c_char.from_buffer(mm))
            for name, (off, fmt) in _layout.HEADER_FIELDS.items():
                value = {"magic": 0xDEADBEEF if opts.bad_magic else _layout.SESSION_MEMORY_MAGIC,
                         "layout_version": _layout.LAYOUT_VERSION, "total_bytes": s["size"], "session_id": sid,
                         "lane_count": s["lanes"], "lane_stride": _layout.LANE_STRIDE,
                         "lanes_offset": _layout.LANES_OFFSET, "ring_offset": s["ring_offset"],
                         "ring_bytes": s["ring_bytes"], "daemon_pid": os.getpid(), "daemon_heartbeat": 1}[name]
                struct.pack_into(fmt, mm, off, value)
            if s["ring_offset"]:
                pause = (lambda: os.path.exists(opts.ring_pause_file)) if opts.ring_pause_file else None

                def violation(reason, conn=conn):
                    print(f"session {sid}: ring protocol violation: {reason}", flush=True)
                    conn.shutdown(socket.SHUT_RDWR)

                s["consumer"] = RingConsumer(s["addr"] + s["ring_offset"], opts.ring_capacity, ring_handler(s),
                                             spin_s=opts.ring_spin_us * 1e-6, pause=pause,
                                             on_violation=violation).start()
            s["mm"] = mm
            s["conn"] = conn
            socket.send_fds(conn, [_layout.BIND_REPLY.pack(0, _layout.LAYOUT_VERSION, s["size"], b"")], [fd])
            os.close(fd)
            while conn.recv(4096):
                pass
            s["closed"] = True  # the client closed its channel: the session ends
            if s["consumer"] is not None:
                s["consumer"].stop()
        except OSError:
            pass

    def heartbeat_loop():
        off = _layout.HEADER_FIELDS["daemon_heartbeat"][0]
        while True:
            time.sleep(0.1)
            for s in list(sessions.values()):
                if s["mm"] is not None and not s["closed"]:
                    ctypes.c_uint64.from_address(s["addr"] + off).value += 1

    def channel_loop():
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        lsock.bind(chan_path)
        lsock.listen(64)
        while True:
            conn, _ = lsock.accept()
            threading.Thread(target=channel_conn, args=(conn,), daemon=True).start()

    threading.Thread(target=channel_loop, daemon=True).start()
    if not opts.no_heartbeat:
        threading.Thread(target=heartbeat_loop, daemon=True).start()
    while not os.path.exists(chan_path):
        time.sleep(0.005)
    server.add_insecure_port("unix:" + opts.socket)
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "fake-daemon":
        _serve(sys.argv[2:])
    else:
        print(f"usage: {sys.argv[0]} fake-daemon --socket PATH --uuid GPU-... [options]", file=sys.stderr)
        sys.exit(2)
