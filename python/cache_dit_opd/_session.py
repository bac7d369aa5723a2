"""Sessions with the operator daemon: one per (process, device).

Opening a session (lazily, on the first call that needs it):

1. find the daemon by the device's GPU UUID (``_discovery``),
2. ``GetVersion`` and ``OpenSession`` over gRPC (protocol version, pid, UUID,
   lanes); the returned op catalog is kept for the schema check,
3. bind on the session channel (AF_UNIX/SOCK_SEQPACKET): send the token,
   receive the session's memfd with ``socket.recv_fds``, ``mmap`` it, validate
   the header against ``_layout``, ``cuMemHostRegister`` it (device-mapped).

A call (``Session.call``) on the caller's current stream:

* its tensors become region refs (``_regions.RegionTable``),
* the stream gets a lane (one lane per stream; see ``_acquire_lane``),
* under the lane's lock: take ``seq = issued + 1``, enqueue
  ``inputs_ready := seq`` on the stream, send the call, and after the reply
  enqueue ``wait done >= seq`` on the stream. No host synchronization.

Transports: ``_GrpcTransport`` sends each call as a unary ``Call`` RPC.
``_RingTransport`` publishes it as a record in the session's shared-memory call
ring (``_ring``, proto/cache_dit_opd/v1/ring.h) when the daemon granted one
(``OpenSessionRequest.want_ring``; ``CACHE_DIT_OPD_RING=0`` turns it off); a
call the ring cannot carry (op missing from the catalog, record larger than a
slot) goes over gRPC after the ring's earlier records, so each lane's seq
order holds across both transports. Both share the lane protocol above.

With the native library (``_native``, ``client/python/``), a ring session
keeps its producer and lanes in C++ (``_NativeTransport``): the native CUDA
kernels of the ``.out`` proxy ops run whole calls there without entering
Python, and this module's own calls (first use of an allocation, retries,
everything the native kernels hand over) go through the same producer and
lanes. Lanes are then ``client/core/lanes.h``'s (streams share lanes behind fence
events) instead of ``_acquire_lane``'s.

Modes (ring only; over gRPC every call is synchronous): synchronous by
default, the call waits for its completion and a rejection raises at the call
site, exactly as over gRPC. Asynchronous (``set_async_calls(True)`` for the
process, ``with async_calls():`` for the calling thread), the call returns
once its record is published and its stream wait on ``done >= seq`` is
enqueued; a rejection is raised by the next call on the session (which then
does not run), by ``cache_dit_opd.synchronize()``, or by ``Session.close()``,
whichever comes first. Errors of a session that fails meanwhile go to the
process-wide deferred list (``_report_deferred``) that ``synchronize()`` raises.

Failure: when the session channel closes, the watcher thread waits until the
daemon process is gone (pidfd) or every lane has completed; if the daemon died
with calls unfinished, it writes every lane's ``done`` from the host so the
client's streams drain, fails the session, and reports the lost calls at
``synchronize()``. The next call opens a new session (reconnect). The same
watcher checks the daemon's heartbeat (``SessionMemoryHeader.daemon_heartbeat``,
~10 increments a second) while calls are outstanding: a daemon that stopped
advancing it for ``CACHE_DIT_OPD_HEARTBEAT_TIMEOUT_S`` fails the session the
same way. Ring waits (completion, room in the ring) check the session, the
daemon's pid and the heartbeat between sleeps, so none waits forever.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import mmap
import os
import re
import select
import socket
import struct
import threading
import time
import weakref
from typing import Any, Callable, Sequence

from . import _discovery, _layout, _native, _regions, _ring, _wire

log = logging.getLogger("cache_dit_opd")

CONNECT_TIMEOUT_S = float(os.environ.get("CACHE_DIT_OPD_CONNECT_TIMEOUT_S", "10"))
CALL_TIMEOUT_S = float(os.environ.get("CACHE_DIT_OPD_CALL_TIMEOUT_S", "600"))
DRAIN_TIMEOUT_S = float(os.environ.get("CACHE_DIT_OPD_DRAIN_TIMEOUT_S", "30"))
DEFAULT_LANES = int(os.environ.get("CACHE_DIT_OPD_LANES", "8"))
# A daemon whose heartbeat stops advancing this long while calls are outstanding is treated as hung (0: never).
HEARTBEAT_TIMEOUT_S = float(os.environ.get("CACHE_DIT_OPD_HEARTBEAT_TIMEOUT_S", "5"))
WATCH_INTERVAL_S = 0.25
NAMESPACE = "cache_dit_cuda_ops"

DTYPE_IDS = _wire.DTYPE_IDS  # torch dtype name -> wire DType (generated from wire.h)
_dtype_ids: dict = {}  # torch.dtype -> wire DType, filled on first use (the hot path skips the name lookup)


def _dtype_id(dtype) -> int | None:
    i = _dtype_ids.get(dtype)
    if i is None:
        i = DTYPE_IDS.get(str(dtype).rsplit(".", 1)[-1])
        if i is not None:
            _dtype_ids[dtype] = i
    return i


class DaemonUnavailableError(RuntimeError):
    """No operator daemon serves the device (not running, unreachable or not serving)."""


class SessionFailedError(RuntimeError):
    """The session with the daemon broke; the next call opens a new one."""


class CatalogSkewError(RuntimeError):
    """The daemon's op schemas differ from this client's."""


def _version() -> str:
    from . import __version__

    return __version__


# -- transports -----------------------------------------------------------------------


class _CallRejected(Exception):
    """The daemon answered the call with an error status; the lane stays usable."""

    def __init__(self, code: str, details: str):
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


class _TransportBroken(Exception):
    """The call's fate is unknown (connection lost, timeout, internal error)."""

    def __init__(self, code: str, details: str):
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


# Status codes with which the daemon rejects a call it decoded and completed
# in order on its lane (opd.proto: the daemon keeps serving).
_REJECT_CODES = frozenset({"INVALID_ARGUMENT", "OUT_OF_RANGE", "NOT_FOUND", "RESOURCE_EXHAUSTED", "PERMISSION_DENIED"})
# "session 7 not found" / "session 7 has ended": the daemon does not know the session (it
# restarted, or ended it); a region's NOT_FOUND names the region instead.
_UNKNOWN_SESSION = re.compile(r"\bsession \d+ (not found|has ended|is not bound)")


def _session_unknown(code: str, details: str) -> bool:
    """The daemon behind the socket does not know this session: our token is always right for it,
    so PERMISSION_DENIED means another daemon instance reuses the id."""
    return code == "PERMISSION_DENIED" or (code in ("NOT_FOUND", "FAILED_PRECONDITION")
                                           and bool(_UNKNOWN_SESSION.search(details)))


def _status_error(code: str, details: str) -> Exception:
    """The exception a call's error status maps to (both transports)."""
    if code in _REJECT_CODES:
        return _CallRejected(code, details)
    return _TransportBroken(code, details)


def _pb_args(pb, args: list) -> list:
    """Arguments in the neutral form of ``Session._encode`` (or already ``pb.Argument``) as protobuf."""
    out = []
    for a in args:
        if not isinstance(a, tuple):
            out.append(a)  # a pb.Argument
            continue
        kind, v = a
        if kind == _ring.ARG_TENSOR:
            rid, off, sizes, strides, dtype = v
            out.append(pb.Argument(tensor=pb.TensorRef(region_id=rid, byte_offset=off, sizes=sizes, strides=strides,
                                                       dtype=dtype)))
        elif kind == _ring.ARG_NONE:
            out.append(pb.Argument(none=pb.NoneValue()))
        elif kind == _ring.ARG_BOOL:
            out.append(pb.Argument(bool_value=v))
        elif kind == _ring.ARG_INT:
            out.append(pb.Argument(int_value=v))
        elif kind == _ring.ARG_FLOAT:
            out.append(pb.Argument(float_value=v))
        elif kind == _ring.ARG_BOOL_LIST:
            out.append(pb.Argument(bool_list=pb.BoolList(values=v)))
        elif kind == _ring.ARG_INT_LIST:
            out.append(pb.Argument(int_list=pb.IntList(values=v)))
        elif kind == _ring.ARG_FLOAT_LIST:
            out.append(pb.Argument(float_list=pb.FloatList(values=v)))
        else:
            raise ValueError(f"cache_dit_opd: unknown argument kind {kind}")
    return out


class _GrpcTransport:
    """Unary ``Call`` per op call; the portable path. Always synchronous."""

    name = "grpc"

    def __init__(self, stub, pb, session_id: int, token: bytes):
        self._stub = stub
        self._pb = pb
        self._session_id = session_id
        self._token = token

    def call(self, op: str, overload: str, args: list, lane: int, seq: int, asynchronous: bool = False,
             regions=None) -> None:
        import grpc

        req = self._pb.CallRequest(session_id=self._session_id, token=self._token, op=op, overload=overload,
                                   args=_pb_args(self._pb, args), lane=lane, seq=seq)
        try:
            self._stub.Call(req, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as e:
            code = e.code().name if e.code() is not None else "UNKNOWN"
            raise _status_error(code, e.details() or "") from None

    def ready_errors(self) -> list:
        return []

    def deferred_errors(self) -> list:
        return []  # synchronous: every error is raised at its call site

    def in_flight(self) -> int:
        return 0


class _RingTransport:
    """Records in the session's shared-memory call ring (``_ring.RingProducer``); gRPC for what it cannot carry.

    ``call`` publishes the record; in synchronous mode it then waits for the
    completion and raises like ``_GrpcTransport`` (``_CallRejected`` /
    ``_TransportBroken``). In asynchronous mode it returns at once; rejections
    come back from ``ready_errors()`` (completions that have arrived, no
    waiting: the next call) and ``deferred_errors()`` (waits for every record
    in flight: synchronize and close) as the exceptions the call would have
    raised, naming the op, lane and seq.
    """

    name = "ring"

    def __init__(self, producer: "_ring.RingProducer", grpc_transport: _GrpcTransport, catalog, session: "Session"):
        self.producer = producer
        self.capacity = producer.capacity
        self._grpc = grpc_transport
        self._op_index = {(o.name, o.overload): i for i, o in enumerate(catalog)}
        self._session = weakref.proxy(session)
        self.grpc_calls = 0  # calls the ring could not carry

    def call(self, op: str, overload: str, args: list, lane: int, seq: int, asynchronous: bool = False,
             regions=None) -> None:
        p = self.producer
        idx = self._op_index.get((op, overload))
        body = None
        if idx is not None:
            try:
                body = _ring.encode_args(args)
            except _ring.RecordDoesNotFit:
                body = None
        try:
            if body is None:
                # The daemon must see this lane's earlier records before this seq: wait for their completions.
                self.grpc_calls += 1
                log.debug("cache_dit_opd: %s.%s goes over gRPC (%s)", op, overload,
                          "not in the catalog" if idx is None else "does not fit a ring record")
                p.wait_consumed(timeout_s=CALL_TIMEOUT_S)
                return self._grpc.call(op, overload, args, lane, seq)
            e = p.publish(lane, seq, idx, body, len(args), op=op, overload=overload, asynchronous=asynchronous,
                          context=regions, timeout_s=CALL_TIMEOUT_S)
            if asynchronous:
                return
            code, message = p.wait(e, CALL_TIMEOUT_S)
        except _ring.RingBroken as b:
            raise _TransportBroken(b.code, b.details) from None
        if code:
            raise _status_error(_ring.status_name(code), message)

    def ready_errors(self) -> list:
        entries = self.producer.poll()
        return self._session._async_errors(entries) if entries else []

    def deferred_errors(self) -> list:
        try:
            self.producer.wait_consumed(timeout_s=CALL_TIMEOUT_S)
        except _ring.RingBroken:
            pass  # the session failed: what never completes is reported by the failure handling
        entries = self.producer.take_rejected()
        return self._session._async_errors(entries) if entries else []

    def in_flight(self) -> int:
        return self.producer.in_flight()

    def unanswered_async(self) -> int:
        """Asynchronous records still without a completion (after the session ended)."""
        p = self.producer
        with p._lock:
            p._harvest_locked()
            return sum(1 for e in p._entries if e is not None and e.code is None and e.asynchronous)


class _NativeTransport:
    """The ring through the native session (``_native.NativeSession``): one C++ producer and lane table shared
    with the native proxy kernels. Raises like ``_RingTransport``; there is no gRPC fallback (every catalog op
    fits a record, and a record that does not fit would not pass the daemon's limits over gRPC either)."""

    name = "ring"

    def __init__(self, native: "_native.NativeSession", catalog, session: "Session"):
        self.native = native
        self._ops = [(o.name, o.overload) for o in catalog]
        self._op_index = {k: i for i, k in enumerate(self._ops)}
        self._session = weakref.proxy(session)
        self.capacity = native.state()["ring_capacity"]

    def op_index(self, op: str, overload: str) -> int | None:
        return self._op_index.get((op, overload))

    def call_on_stream(self, op: str, overload: str, args: list, stream: int, asynchronous: bool,
                       regions=None) -> None:
        idx = self._op_index.get((op, overload))
        if idx is None:
            raise _CallRejected("NOT_FOUND", f"{op}.{overload} is not in the daemon's catalog")
        try:
            body = _ring.encode_args(args)
        except _ring.RecordDoesNotFit as e:
            raise ValueError(f"{NAMESPACE}::{op}.{overload}: the arguments do not fit a call record: {e}") from None
        try:
            code, message = self.native.call(stream, idx, body, len(args), asynchronous, regions)
        except _native.NativeError as e:
            raise _TransportBroken(_ring.status_name(e.code), e.message) from None
        if code:
            raise _status_error(_ring.status_name(code), message)

    def _entries(self, rejected) -> list:
        out = []
        for r in rejected:
            op, overload = self._ops[r.op_index] if r.op_index < len(self._ops) else (f"op#{r.op_index}", "")
            e = _ring.Entry(r.ticket, r.lane, r.seq, op, overload, True, tuple(r.regions[:r.nregions]))
            e.code = r.code
            e.message = r.message.decode("utf-8", "replace")
            out.append(e)
        return out

    def ready_errors(self) -> list:
        rejected = self.native.take_rejected()
        return self._session._async_errors(self._entries(rejected)) if rejected else []

    def deferred_errors(self) -> list:
        try:
            rejected = self.native.take_rejected(wait=True)
        except _native.NativeError:  # the session failed: the failure handling reports what never completes
            rejected = self.native.take_rejected()
        return self._session._async_errors(self._entries(rejected)) if rejected else []

    def in_flight(self) -> int:
        return self.native.state()["in_flight"]

    def unanswered_async(self) -> int:
        return self.native.state()["unanswered_async"]


def _ring_wanted(pref: bool | None) -> bool:
    """Whether to ask for the ring: ``pref`` if given, else CACHE_DIT_OPD_RING (default on); never off x86-64."""
    if pref is None:
        pref = os.environ.get("CACHE_DIT_OPD_RING", "1").strip().lower() not in ("0", "false", "off", "no")
    if pref and not _ring.architecture_supported():
        global _arch_warned
        if not _arch_warned:
            _arch_warned = True
            log.warning("cache_dit_opd: the shared-memory call ring needs x86-64 (total store order); this machine "
                        "is %s: calls use gRPC", __import__("platform").machine())
        return False
    return pref


_arch_warned = False


# -- call modes --------------------------------------------------------------------------------

_async_process = False  # set_async_calls()
_async_local = threading.local()  # async_calls() scopes, per thread


def set_async_calls(enabled: bool = True) -> bool:
    """Makes ring calls of this process asynchronous (True) or synchronous (False); returns the previous setting.

    A thread inside an ``async_calls(...)`` scope follows its scope instead.
    """
    global _async_process
    prev, _async_process = _async_process, bool(enabled)
    _native.set_async_process(_async_process)
    return prev


@contextlib.contextmanager
def async_calls(enabled: bool = True):
    """Scope in which this thread's ring calls are asynchronous (or, with ``enabled=False``, synchronous).

    Thread-local: other threads keep their own setting. Scopes nest; leaving
    one restores the setting that was in force when it was entered.
    """
    prev = getattr(_async_local, "enabled", None)
    _async_local.enabled = bool(enabled)
    _native.set_async_thread(_async_local.enabled)
    try:
        yield
    finally:
        _async_local.enabled = prev
        _native.set_async_thread(prev)


def async_calls_enabled() -> bool:
    """Whether a call made now by this thread would be asynchronous (when the session uses the ring)."""
    v = getattr(_async_local, "enabled", None)
    return _async_process if v is None else v


def combine_errors(errors: list) -> Exception:
    """One exception for several deferred errors (the first one's type)."""
    if len(errors) == 1:
        return errors[0]
    return type(errors[0])(f"{errors[0]}\n(and {len(errors) - 1} more: " + "; ".join(str(e) for e in errors[1:])
                           + ")")


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _check_int64(v: int) -> int:
    if not _INT64_MIN <= v <= _INT64_MAX:
        raise ValueError(f"cache_dit_opd: integer argument {v} does not fit in int64")
    return v


# -- lanes ------------------------------------------------------------------------------


class _Lane:
    __slots__ = ("index", "lock", "issued", "waited", "stream", "last_use", "inputs_addr", "done_addr",
                 "inputs_dptr", "done_dptr")

    def __init__(self, index: int, host_base: int, dev_base: int):
        self.index = index
        self.lock = threading.Lock()
        self.issued = 0  # last sequence number handed out (its inputs_ready write is enqueued)
        self.waited = 0  # last sequence number a stream waits for (the call was accepted)
        self.stream: int | None = None  # the CUDA stream that owns the lane
        self.last_use = 0
        self.inputs_addr = host_base + _layout.LANE_INPUTS_READY_OFFSET
        self.done_addr = host_base + _layout.LANE_DONE_OFFSET
        self.inputs_dptr = dev_base + _layout.LANE_INPUTS_READY_OFFSET
        self.done_dptr = dev_base + _layout.LANE_DONE_OFFSET

    def done(self) -> int:
        return ctypes.c_uint64.from_address(self.done_addr).value

    def inputs_ready(self) -> int:
        return ctypes.c_uint64.from_address(self.inputs_addr).value


# -- schemas ----------------------------------------------------------------------------


def _normalize_schema(name: str, overload: str, schema: str) -> str:
    """A catalog or client schema as torch prints it: ``ns::name.overload(args) -> rets``."""
    qual = f"{NAMESPACE}::{name}" + (f".{overload}" if overload else "")
    s = schema.strip()
    if s.startswith("("):
        s = qual + s
    elif "::" not in s.split("(", 1)[0]:
        s = f"{NAMESPACE}::{s}"
    try:
        import torch

        return str(torch._C.parse_schema(s))
    except Exception:
        return " ".join(s.split())


# -- the session --------------------------------------------------------------------------


class Session:
    """A bound session with the daemon serving one device of this process."""

    def __init__(self, device_index: int, *, target: str | None = None, uuid: str | None = None, driver=None,
                 lanes: int | None = None, torch_streams: bool = True, ring: bool | None = None):
        self.device_index = device_index
        self.pid = os.getpid()
        self.uuid = uuid
        self.target = target
        self.failed: str | None = None
        self.retryable = False  # the failure lost the connection before the call ran; running it again is safe
        self._driver = driver
        self._real_driver = driver is None  # tests pass a fake driver: no native session then
        self._lanes_wanted = lanes or DEFAULT_LANES
        self._ring_pref = ring  # None: CACHE_DIT_OPD_RING decides
        self._host = 0
        self._hb = None  # the header's daemon_heartbeat word
        self._hb_value = 0
        self._hb_seen = 0.0
        self._hb_armed = False
        self._torch_streams = torch_streams
        self._state_lock = threading.Lock()
        self._lanes_lock = threading.Lock()
        self._lane_of_stream: dict[int, _Lane] = {}
        self._lanes: list[_Lane] = []
        self._checked: dict[int, Exception | None] = {}
        self._closing = False
        self._clock = 0
        self._channel = None
        self._chan_sock: socket.socket | None = None
        self._pidfd: int | None = None
        self._mm: mmap.mmap | None = None
        self.version = None
        self.reply = None
        self.catalog: dict[tuple[str, str], str] = {}
        self.transport = None
        self.regions: _regions.RegionTable | None = None
        self._native: _native.NativeSession | None = None  # with _NativeTransport
        self._dev_base = 0

    # -- open ---------------------------------------------------------------------------
    @property
    def driver(self):
        if self._driver is None:
            from . import _cuda_driver

            self._driver = _cuda_driver.get_driver()
        return self._driver

    def open(self) -> "Session":
        import grpc

        from ._proto import opd_grpc, opd_pb2

        self._pb = opd_pb2
        if self.target is None:
            target, looked = _discovery.find_daemon(self.uuid)
            if target is None:
                raise DaemonUnavailableError(f"no daemon socket {self.uuid}.sock found (looked in {', '.join(looked)})")
            self.target = target
        self._channel = grpc.insecure_channel(self.target)
        self._stub = opd_grpc.OperatorDaemonStub(self._channel)
        try:
            self.version = self._stub.GetVersion(opd_pb2.VersionRequest(), timeout=CONNECT_TIMEOUT_S)
        except grpc.RpcError as e:
            self._channel.close()
            raise DaemonUnavailableError(f"no answer from {self.target}: {e.code().name}: {e.details()}") from None
        v = self.version
        if v.protocol_version != _layout.PROTOCOL_VERSION:
            self._channel.close()
            raise CatalogSkewError(
                f"daemon at {self.target} (cache-dit-opd {v.daemon_version}) speaks protocol {v.protocol_version}; "
                f"this client (cache_dit_opd {_version()}) speaks protocol {_layout.PROTOCOL_VERSION}"
            )
        if not v.serving:
            self._channel.close()
            raise DaemonUnavailableError(f"daemon at {self.target} is not serving: {v.not_serving_reason or 'no reason given'}")
        want_ring = _ring_wanted(self._ring_pref)
        try:
            self.reply = self._stub.OpenSession(
                opd_pb2.OpenSessionRequest(
                    protocol_version=_layout.PROTOCOL_VERSION,
                    client_pid=self.pid,
                    gpu_uuid=self.uuid or "",
                    lanes=self._lanes_wanted,
                    client_name=f"python cache_dit_opd {_version()}",
                    want_ring=want_ring,
                ),
                timeout=CONNECT_TIMEOUT_S,
            )
        except grpc.RpcError as e:
            self._channel.close()
            raise DaemonUnavailableError(f"OpenSession at {self.target} failed: {e.code().name}: {e.details()}") from None
        r = self.reply
        try:
            self._validate_reply(r)
            self.catalog = {(o.name, o.overload): o.schema for o in r.catalog}
            self._bind(r)
            grpc_transport = _GrpcTransport(self._stub, opd_pb2, r.session_id, bytes(r.token))
            self.transport = self._ring_transport(r, grpc_transport) if r.ring_enabled and want_ring else grpc_transport
        except BaseException:
            self._abandon()
            raise
        n = self._native
        self.regions = _regions.RegionTable(self._register_region, self._unregister_region, self._driver,
                                            self.device_index,
                                            on_add=n and (lambda r: n.add_region(r.base, r.size, r.buffer_id,
                                                                                 r.region_id)),
                                            on_forget=n and (lambda r: n.forget_region(r.base)))
        self._watcher = threading.Thread(target=self._watch, name=f"cache_dit_opd-watch-{r.session_id}", daemon=True)
        self._watcher.start()
        _live_sessions.add(self)
        log.debug("cache_dit_opd: session %d with %s: %d lanes, transport %s", r.session_id, self.target, r.lanes,
                  self.transport.name)
        return self

    def _ring_transport(self, r, grpc_transport: _GrpcTransport):
        h = _layout.read_header(self._mm)
        if not h["ring_offset"] or not h["ring_bytes"]:
            raise SessionFailedError(f"OpenSession granted the call ring but the session memory holds none "
                                     f"(ring_offset {h['ring_offset']}, ring_bytes {h['ring_bytes']})")
        lib = _native.library() if self._real_driver and self._torch_streams else None
        if lib is not None:
            try:
                self._native = _native.NativeSession(
                    lib, device=self.device_index, memory=self._host, memory_bytes=len(self._mm),
                    device_base=self._dev_base, session_id=r.session_id, lanes=r.lanes,
                    daemon_pidfd=os.dup(self._pidfd) if self._pidfd is not None else None,
                    spin_s=_ring.SPIN_S, call_timeout_s=CALL_TIMEOUT_S, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
            except RuntimeError as e:  # the same calls, through the pure-Python producer
                log.warning("%s; this session uses the pure-Python client", e)
            else:
                return _NativeTransport(self._native, r.catalog, self)
        try:
            producer = _ring.RingProducer(self._host + h["ring_offset"], h["ring_bytes"], liveness=self._liveness)
        except ValueError as e:
            raise SessionFailedError(f"daemon at {self.target}: {e}") from None
        return _RingTransport(producer, grpc_transport, r.catalog, self)

    def _validate_reply(self, r) -> None:
        if r.session_id == 0 or len(r.token) != _layout.TOKEN_BYTES:
            raise SessionFailedError(f"OpenSession reply is malformed (session id {r.session_id}, "
                                     f"token of {len(r.token)} bytes)")
        if r.layout_version != _layout.LAYOUT_VERSION:
            raise CatalogSkewError(
                f"daemon at {self.target} (cache-dit-opd {self.version.daemon_version}) uses shared-memory layout "
                f"{r.layout_version}; this client (cache_dit_opd {_version()}) uses layout {_layout.LAYOUT_VERSION}"
            )
        if self.uuid and r.gpu_uuid and r.gpu_uuid != self.uuid:
            raise SessionFailedError(f"daemon at {self.target} serves {r.gpu_uuid}, not {self.uuid} (cuda:{self.device_index})")
        if r.lanes < 1:
            raise SessionFailedError(f"daemon at {self.target} granted {r.lanes} lanes")

    def _bind(self, r) -> None:
        path = r.session_channel_path
        if not path:
            if not self.target.startswith("unix:") or not self.target.endswith(".sock"):
                raise SessionFailedError("OpenSession reply has no session_channel_path")
            path = self.target[len("unix:"):-len(".sock")] + ".session.sock"
        timeout = (r.bind_timeout_ms / 1000.0) if r.bind_timeout_ms else CONNECT_TIMEOUT_S
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._chan_sock = sock
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            sock.sendall(_layout.BIND_REQUEST.pack(_layout.BIND_REQUEST_MAGIC, _layout.PROTOCOL_VERSION, r.session_id,
                                                   bytes(r.token)))
            msg, fds, flags, _ = socket.recv_fds(sock, _layout.BIND_REPLY_SIZE, 4)
        except OSError as e:
            raise SessionFailedError(f"binding session {r.session_id} on {path} failed: {e}") from None
        fd = fds[0] if fds else None
        for extra in fds[1:]:
            os.close(extra)
        try:
            if len(msg) != _layout.BIND_REPLY_SIZE or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise SessionFailedError(f"bind reply on {path} has {len(msg)} bytes (flags 0x{flags:x}), "
                                         f"expected {_layout.BIND_REPLY_SIZE}")
            status, layout_version, shm_bytes, message = _layout.BIND_REPLY.unpack(msg)
            if status != 0:
                text = message.split(b"\0", 1)[0].decode(errors="replace")
                raise SessionFailedError(f"daemon refused to bind session {r.session_id} on {path}: "
                                         f"status {status}: {text}")
            if layout_version != _layout.LAYOUT_VERSION:
                raise CatalogSkewError(f"bind reply has layout version {layout_version}, this client uses "
                                       f"{_layout.LAYOUT_VERSION}")
            if fd is None:
                raise SessionFailedError(f"bind reply on {path} carries no memfd")
            size = os.fstat(fd).st_size
            if shm_bytes < _layout.HEADER_SIZE or size < shm_bytes or (r.shared_memory_bytes
                                                                        and shm_bytes != r.shared_memory_bytes):
                raise SessionFailedError(f"session memory size mismatch: bind reply {shm_bytes}, OpenSession "
                                         f"{r.shared_memory_bytes}, memfd {size}")
            self._mm = mmap.mmap(fd, shm_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            if fd is not None:
                os.close(fd)
        sock.settimeout(None)
        try:  # the daemon's pid as this namespace sees it; a pidfd tells when it has exited
            pid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
            self.daemon_pid = pid
            self._pidfd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") and pid > 0 else None
        except OSError:
            self._pidfd = None
        self._setup_memory(r)

    def _setup_memory(self, r) -> None:
        mm = self._mm
        h = _layout.read_header(mm)
        size = len(mm)
        problems = []
        if h["magic"] != _layout.SESSION_MEMORY_MAGIC:
            problems.append(f"magic 0x{h['magic']:08x} (expected 0x{_layout.SESSION_MEMORY_MAGIC:08x})")
        if h["layout_version"] != _layout.LAYOUT_VERSION:
            problems.append(f"layout_version {h['layout_version']} (expected {_layout.LAYOUT_VERSION})")
        if h["total_bytes"] != size:
            problems.append(f"total_bytes {h['total_bytes']} (memfd has {size})")
        if h["session_id"] != r.session_id:
            problems.append(f"session_id {h['session_id']} (expected {r.session_id})")
        if h["lane_count"] != r.lanes:
            problems.append(f"lane_count {h['lane_count']} (OpenSession granted {r.lanes})")
        if h["lane_stride"] != _layout.LANE_STRIDE:
            problems.append(f"lane_stride {h['lane_stride']} (expected {_layout.LANE_STRIDE})")
        lo = h["lanes_offset"]
        if lo < _layout.HEADER_SIZE or lo % _layout.PAGE_BYTES or lo + h["lane_count"] * _layout.LANE_STRIDE > size:
            problems.append(f"lanes_offset {lo} with {h['lane_count']} lanes does not fit {size} bytes")
        if h["ring_offset"] and (h["ring_offset"] + h["ring_bytes"] > size or h["ring_offset"] % 64):
            problems.append(f"ring [{h['ring_offset']}, +{h['ring_bytes']}) does not fit {size} bytes "
                            f"(or is not 64-byte aligned)")
        if problems:
            raise SessionFailedError("session shared memory header is invalid: " + "; ".join(problems))
        host = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        drv = self.driver
        from . import _cuda_driver as cd

        self._ensure_context()
        drv.mem_host_register(host, size, cd.CU_MEMHOSTREGISTER_PORTABLE | cd.CU_MEMHOSTREGISTER_DEVICEMAP)
        self._host_registered = host
        self._host = host
        self._hb = ctypes.c_uint64.from_address(host + _layout.HEADER_FIELDS["daemon_heartbeat"][0])
        self._hb_value = self._hb.value
        self._hb_seen = time.monotonic()
        dev = drv.mem_host_get_device_pointer(host)
        self._dev_base = dev
        self._lanes = [
            _Lane(i, host + lo + i * _layout.LANE_STRIDE, dev + lo + i * _layout.LANE_STRIDE)
            for i in range(h["lane_count"])
        ]
        for lane in self._lanes:  # a fresh session starts at 0; resume from what the daemon wrote otherwise
            lane.issued = lane.waited = max(lane.done(), lane.inputs_ready())

    def _ensure_context(self) -> None:
        if not self._torch_streams:
            return
        import torch

        with torch.cuda.device(self.device_index):
            torch.cuda.current_stream().query()  # makes the device's primary context current

    def _abandon(self) -> None:
        if self._chan_sock is not None:
            self._chan_sock.close()
        if self._channel is not None:
            self._channel.close()

    # -- catalog --------------------------------------------------------------------------
    def check_ops(self, schemas: dict) -> None:
        """Checks ``{"name[.overload]": "(args) -> rets"}`` against the daemon's catalog (cached)."""
        key = id(schemas)  # each domain passes its module-level table
        if key not in self._checked:
            self._checked[key] = err = self._compare(schemas)
            if err is None and self._native is not None:
                # The native kernels may now run these ops on this session.
                for full in schemas:
                    name, _, overload = full.partition(".")
                    idx = self.transport.op_index(name, overload)
                    if idx is not None:
                        self._native.set_op(full, idx)
                self._native.activate()
        err = self._checked[key]
        if err is not None:
            raise err

    def _compare(self, schemas: dict) -> Exception | None:
        v = self.version
        daemon = f"cache-dit-opd {v.daemon_version}" + (f" ({v.git_commit})" if v.git_commit else "")
        client = f"cache_dit_opd {_version()}"
        missing, skew = [], []
        for full, sig in schemas.items():
            name, _, overload = full.partition(".")
            theirs = self.catalog.get((name, overload))
            if theirs is None:
                if overload == "out":
                    missing.append(f"{NAMESPACE}::{full}")
                continue
            a, b = _normalize_schema(name, overload, sig), _normalize_schema(name, overload, theirs)
            if a != b:
                skew.append(f"  {NAMESPACE}::{full}\n    client ({client}): {a}\n    daemon ({daemon}): {b}")
        if skew:
            return CatalogSkewError(
                f"op catalog skew between this client ({client}) and the daemon at {self.target} ({daemon}, "
                f"protocol {v.protocol_version}):\n" + "\n".join(skew) +
                "\nInstall matching versions of the client and the daemon."
            )
        if missing:
            return DaemonUnavailableError(
                f"the daemon at {self.target} ({daemon}) does not serve {', '.join(missing)}: its kernel library "
                f"was built without that op family"
            )
        return None

    # -- regions --------------------------------------------------------------------------
    def _register_region(self, handle: bytes, base: int, size: int, buffer_id: int) -> int:
        import grpc

        pb = self._pb
        try:
            rep = self._stub.RegisterRegion(
                pb.RegisterRegionRequest(session_id=self.reply.session_id, token=self.reply.token, ipc_handle=handle,
                                         client_base_address=base, size=size, buffer_id=buffer_id),
                timeout=CALL_TIMEOUT_S,
            )
        except grpc.RpcError as e:
            code = e.code().name if e.code() is not None else "UNKNOWN"
            details = e.details() or ""
            if code == "RESOURCE_EXHAUSTED":
                raise _regions.RegionsExhausted(details) from None
            if _session_unknown(code, details) or code not in _REJECT_CODES:
                raise _TransportBroken(code, details) from None
            raise RuntimeError(f"cache_dit_opd: the daemon refused to map the allocation at 0x{base:x} "
                               f"({size} bytes): {code}: {details}") from None
        return rep.region_id

    def _unregister_region(self, region_id: int) -> None:
        pb = self._pb
        self._stub.UnregisterRegion(
            pb.UnregisterRegionRequest(session_id=self.reply.session_id, token=self.reply.token, region_id=region_id),
            timeout=CONNECT_TIMEOUT_S,
        )

    def _tensor_ref(self, t, pinned: set) -> tuple:
        """(region_id, byte_offset, sizes, strides, dtype) of a CUDA tensor of this session's device."""
        dtype = _dtype_id(t.dtype)
        if dtype is None:
            raise ValueError(f"cache_dit_opd: dtype {t.dtype} cannot be sent to the daemon")
        sizes, strides = t.shape, t.stride()
        if t.is_contiguous():
            nbytes = t.nbytes
        elif t.numel() == 0:
            nbytes = 0
        else:  # the span from the first to the last element the view covers
            nbytes = (sum((s - 1) * st for s, st in zip(sizes, strides)) + 1) * t.element_size()
        region_id, offset = self.regions.ref(t.data_ptr(), nbytes, pinned)
        return region_id, offset, tuple(sizes), strides, dtype

    def _encode(self, args: Sequence[Any], pinned: set) -> list:
        """Every argument as a transport-neutral ``(kind, value)`` pair (``_ring.ARG_*``), fully validated here,
        before a sequence number is taken: nothing after this point can fail on an argument's value."""
        import torch

        out = []
        tensor = torch.Tensor
        for a in args:
            if isinstance(a, tensor):
                if not a.is_cuda or a.get_device() != self.device_index:
                    raise ValueError(f"cache_dit_opd: tensor on {a.device} passed to the session of "
                                     f"cuda:{self.device_index}")
                out.append((_ring.ARG_TENSOR, self._tensor_ref(a, pinned)))
            elif a is None:
                out.append((_ring.ARG_NONE, None))
            elif isinstance(a, bool):
                out.append((_ring.ARG_BOOL, a))
            elif isinstance(a, int):
                out.append((_ring.ARG_INT, _check_int64(a)))
            elif isinstance(a, float):
                out.append((_ring.ARG_FLOAT, a))
            elif isinstance(a, (list, tuple)) and all(isinstance(x, bool) for x in a):
                out.append((_ring.ARG_BOOL_LIST, tuple(a)))
            elif isinstance(a, (list, tuple)) and all(isinstance(x, int) for x in a):
                out.append((_ring.ARG_INT_LIST, tuple(_check_int64(x) for x in a)))
            elif isinstance(a, (list, tuple)) and all(isinstance(x, (int, float)) for x in a):
                out.append((_ring.ARG_FLOAT_LIST, tuple(float(x) for x in a)))
            else:
                raise ValueError(f"cache_dit_opd: argument of type {type(a).__name__} cannot be sent to the daemon")
        return out

    # -- lanes ----------------------------------------------------------------------------
    def _acquire_lane(self, stream: int) -> _Lane:
        """The lane of ``stream``, locked. One stream per lane at a time.

        A lane's semaphore only grows if one stream at a time writes it. When
        every lane is taken, the least recently used one moves to ``stream``:
        ``stream`` first waits (on the GPU) for the lane's ``done`` to reach
        its last call, which implies the old stream's ``inputs_ready`` writes
        have all landed.
        """
        lane = self._lane_of_stream.get(stream)
        if lane is not None:
            lane.lock.acquire()
            if lane.stream == stream:
                return lane
            lane.lock.release()
        with self._lanes_lock:
            lane = self._lane_of_stream.get(stream)
            if lane is None:
                free = [l for l in self._lanes if l.stream is None]
                if free:
                    lane = free[0]
                    lane.lock.acquire()
                else:
                    lane = min(self._lanes, key=lambda l: l.last_use)
                    lane.lock.acquire()
                    self._lane_of_stream.pop(lane.stream, None)
                    if lane.issued:
                        self.driver.stream_wait_value64(stream, lane.done_dptr, lane.issued)
                lane.stream = stream
                self._lane_of_stream[stream] = lane
                return lane
        lane.lock.acquire()
        return lane

    # -- call -----------------------------------------------------------------------------
    def call(self, op: str, args: Sequence[Any], overload: str = "out") -> None:
        """Runs ``cache_dit_cuda_ops::op.overload(*args)`` on the current stream of the session's device.

        ``args`` are every schema argument in order (outputs included). Raises
        ValueError when the daemon rejects the arguments, SessionFailedError
        when the session broke.
        """
        import torch

        asynchronous = async_calls_enabled()
        for attempt in range(2):
            self._raise_if_failed()
            self._raise_async_errors()
            pinned: set = set()
            try:
                call_args = self._encode(args, pinned)
                self.regions.maybe_sweep()
            except _TransportBroken as e:
                self._fail(f"RegisterRegion failed: {e}", retryable=self._retryable(e.code, e.details))
                continue  # raises SessionFailedError above
            # The raw cudaStream_t, without building a torch.cuda.Stream per call.
            stream = torch._C._cuda_getCurrentRawStream(self.device_index) if self._torch_streams else 0
            try:
                self._call_on_lane(op, overload, call_args, stream, asynchronous, pinned)
                return
            except _CallRejected as e:
                if _session_unknown(e.code, e.details):
                    self._fail(f"the daemon no longer knows the session: {e}", retryable=True)
                    continue  # raises a retryable SessionFailedError above
                if e.code == "NOT_FOUND" and attempt == 0:
                    # the daemon evicted one of these regions: register them again and retry once
                    self.regions.forget(pinned)
                    continue
                if "expected seq" in e.details:  # lanes out of step: no "done" comes for this seq
                    self._fail(f"lane sequence mismatch: {e}", retryable=True)
                    continue
                if e.code in ("INVALID_ARGUMENT", "OUT_OF_RANGE"):
                    raise ValueError(f"{NAMESPACE}::{op}.{overload} rejected by the daemon: {e.details}") from None
                raise RuntimeError(f"{NAMESPACE}::{op}.{overload} failed in the daemon: {e}") from None
            except _TransportBroken as e:
                # UNAVAILABLE / FAILED_PRECONDITION: the daemon went away or no longer knows the
                # session; the op did not run, or ran on a daemon that is gone. The ops are pure
                # functions of their inputs, so the caller may run the call again on a new session.
                retryable = self._retryable(e.code, e.details)
                self._fail(f"call {NAMESPACE}::{op}.{overload} failed: {e}", retryable=retryable)
                err = SessionFailedError(
                    f"cache_dit_opd: the session with the daemon at {self.target} failed during "
                    f"{NAMESPACE}::{op}.{overload}: {e}"
                )
                err.retryable = retryable
                raise err from None
        self._raise_if_failed()
        raise RuntimeError(f"{NAMESPACE}::{op}.{overload}: daemon does not know this session's regions")

    @staticmethod
    def _retryable(code: str, details: str) -> bool:
        """The call did not run on a live daemon that still knows the session: safe to run again."""
        return code in ("UNAVAILABLE", "FAILED_PRECONDITION") or _session_unknown(code, details)

    def _call_on_lane(self, op: str, overload: str, args: list, stream: int, asynchronous: bool = False,
                      regions=None) -> None:
        """Under the lane's lock: take seq, enqueue ``inputs_ready := seq``, send or publish the call, and enqueue
        ``wait done >= seq`` (after the acceptance in synchronous mode, after the publish in asynchronous mode)."""
        if self._native is not None:
            return self.transport.call_on_stream(op, overload, args, stream, asynchronous, regions)
        drv = self.driver
        lane = self._acquire_lane(stream)
        try:
            self._clock += 1
            lane.last_use = self._clock
            seq = lane.issued + 1
            drv.stream_write_value64(stream, lane.inputs_dptr, seq)
            lane.issued = seq
            self.transport.call(op, overload, args, lane.index, seq, asynchronous, regions)
            lane.waited = seq
            drv.stream_wait_value64(stream, lane.done_dptr, seq)
        finally:
            lane.lock.release()

    # -- asynchronous errors ------------------------------------------------------------------
    def _raise_async_errors(self) -> None:
        """Raises what earlier asynchronous calls of this session were rejected with (completions arrived)."""
        errs = self.transport.ready_errors()
        if errs:
            raise combine_errors(errs)

    def _async_errors(self, entries: list) -> list:
        """The exceptions for rejected asynchronous ring records: what the call would have raised synchronously."""
        errs, fail = [], None
        for e in entries:
            code, details = _ring.status_name(e.code), e.message
            label = f"{NAMESPACE}::{e.op}.{e.overload}"
            where = (f" (asynchronous call on lane {e.lane}, seq {e.seq}, ticket {e.ticket}; its outputs were not "
                     f"written)")
            if _session_unknown(code, details) or "expected seq" in details or code not in _REJECT_CODES:
                fail = fail or f"{label} failed: {code}: {details}"
                err = SessionFailedError(f"cache_dit_opd: the session with the daemon at {self.target} failed during "
                                         f"{label}{where}: {code}: {details}")
            elif code in ("INVALID_ARGUMENT", "OUT_OF_RANGE"):
                err = ValueError(f"{label} rejected by the daemon: {details}{where}")
            else:
                if code == "NOT_FOUND" and e.context and self.regions is not None:
                    self.regions.forget(e.context)  # evicted by the daemon: the next call registers them again
                err = RuntimeError(f"{label} failed in the daemon: {code}: {details}{where}")
            errs.append(err)
        if fail is not None:
            self._fail(fail, retryable=True)
        return errs

    # -- liveness -----------------------------------------------------------------------------
    def _heartbeat_lost(self) -> str | None:
        """A reason when the daemon's heartbeat stopped advancing (armed once it has been seen advancing)."""
        hb = self._hb
        if hb is None or HEARTBEAT_TIMEOUT_S <= 0:
            return None
        v, now = hb.value, time.monotonic()
        if v != self._hb_value:
            self._hb_value, self._hb_seen, self._hb_armed = v, now, True
            return None
        if self._hb_armed and now - self._hb_seen > HEARTBEAT_TIMEOUT_S:
            return (f"the daemon's heartbeat has not advanced for {now - self._hb_seen:.1f} s "
                    f"(daemon pid {getattr(self, 'daemon_pid', '?')} hung or stopped)")
        return None

    def _liveness(self) -> str | None:
        """None while the session can still complete calls; else why not (ring waits poll this)."""
        if self.failed is not None:
            return self.failed
        pidfd = self._pidfd
        if pidfd is not None:
            try:
                if select.select([pidfd], [], [], 0)[0]:
                    return "the daemon process exited"
            except (OSError, ValueError):
                pass
        return self._heartbeat_lost()

    def _lanes_behind(self) -> bool:
        """Some stream of ours still waits for a ``done`` the daemon has not written."""
        if self._native is not None:
            return self._native.state()["lanes_behind"]
        return any(l.done() < l.waited for l in self._lanes)

    def _work_outstanding(self) -> bool:
        return self._lanes_behind() or (self.transport is not None and self.transport.in_flight() > 0)

    # -- failure --------------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self.failed is not None:
            err = SessionFailedError(self.failed)
            err.retryable = self.retryable
            raise err

    def _fail(self, reason: str, daemon_dead: bool = False, retryable: bool = False) -> None:
        with self._state_lock:
            if self.failed is not None:
                return
            self.failed = f"cache_dit_opd: session with the daemon at {self.target} failed: {reason}"
            self.retryable = retryable or daemon_dead
        if not self._closing:
            log.warning("%s", self.failed)
        if self._native is not None:
            self._native.fail(self.failed)
            self._native.activate(False)
        self._flush_async_errors()
        if daemon_dead:
            self._release_waits()
        elif not self._closing:
            self._close_remote()
        if self.regions is not None:
            self.regions.close()
        self._close_channel()

    def _release_waits(self) -> int:
        """Writes every lane's ``done`` up to its last issued call from the host; returns calls lost."""
        lost = 0
        if self._native is not None:  # the native lanes issued every call of this session
            lost = self._native.release_from_host(f"the daemon at {self.target} is gone")
        else:
            for lane in self._lanes:
                done = lane.done()
                lost += max(0, lane.waited - done)  # accepted calls whose outputs were handed out
                if done < lane.issued:
                    ctypes.c_uint64.from_address(lane.done_addr).value = lane.issued
        if lost:
            _report_deferred(SessionFailedError(
                f"cache_dit_opd: the daemon at {self.target} (cuda:{self.device_index}) died with {lost} call(s) "
                f"unfinished; their outputs are undefined. The waits of this process's streams were released; "
                f"the next call opens a new session."
            ))
        return lost

    def _flush_async_errors(self, final: bool = False, lost_reported: bool = False) -> None:
        """Moves the session's asynchronous errors to the process-wide list ``synchronize()`` raises.

        ``final`` (the session has ended): asynchronous records that never got
        a completion are reported too, unless the lost-calls report covers them.
        """
        t = self.transport
        if not isinstance(t, (_RingTransport, _NativeTransport)):
            return
        try:
            for err in t.ready_errors():
                _report_deferred(err)
        except Exception:  # pragma: no cover - reporting must never raise here
            log.exception("cache_dit_opd: collecting asynchronous errors")
        if final and not lost_reported:
            n = t.unanswered_async()
            if n:
                _report_deferred(SessionFailedError(
                    f"cache_dit_opd: {n} asynchronous call(s) on the session with the daemon at {self.target} were "
                    f"never answered before the session ended ({self.failed}); their outputs are undefined."))

    def _watch(self) -> None:
        """Runs until the session channel closes, then makes sure no stream of ours waits forever.

        While the channel is open it also watches the daemon's heartbeat: with
        calls outstanding (a stream waits on a lane's "done", or ring records
        have no completion yet) and no heartbeat for HEARTBEAT_TIMEOUT_S, the
        daemon is hung; the session fails, which closes the channel.
        """
        sock = self._chan_sock
        while True:
            try:
                readable = select.select([sock], [], [], WATCH_INTERVAL_S)[0]
            except (OSError, ValueError):
                break
            if readable:
                try:
                    data = sock.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    break
                continue
            reason = self._heartbeat_lost()  # called every interval: it also arms the check
            if reason and self.failed is None and self._work_outstanding():
                self._fail(reason)  # shuts the channel down: the loop ends on the next select
        # The channel closed: the daemon exited, ended the session, or we closed it (after a
        # CloseSession, or on a broken connection). While the daemon process lives it completes
        # the lanes itself (never the host while its calls may still run); once it is gone, or
        # after DRAIN_TIMEOUT_S, the host writes every pending "done".
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        dead = False
        while self._lanes_behind():
            if self._daemon_exited(0.01) or time.monotonic() > deadline:
                dead = True
                break
        lost = self._release_waits() if dead else 0
        self._fail("the daemon closed the session channel" + (" (the daemon exited)" if dead else ""),
                   daemon_dead=dead)
        self._flush_async_errors(final=True, lost_reported=lost > 0)
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _daemon_exited(self, timeout: float) -> bool:
        if self._pidfd is not None:
            r, _, _ = select.select([self._pidfd], [], [], timeout)
            return bool(r)
        time.sleep(timeout)
        pid = getattr(self, "daemon_pid", 0)
        if pid <= 0:
            return False
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except OSError:
            return True

    def _close_remote(self) -> None:
        try:
            self._stub.CloseSession(
                self._pb.CloseSessionRequest(session_id=self.reply.session_id, token=self.reply.token), timeout=2.0
            )
        except Exception:
            pass

    def _close_channel(self) -> None:
        if self._chan_sock is not None:
            try:
                self._chan_sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._channel is not None:
            try:
                self._channel.close()
            except Exception:
                pass
        # The shared memory stays mapped and registered: streams may still wait on it.
        _retired.append(self)

    def close(self) -> None:
        """Ends the session (CloseSession: the daemon completes every lane, then unmaps the regions).

        With the ring, first waits for every record in flight; then raises what
        asynchronous calls were rejected with (after the session is closed).
        """
        if self.failed is not None:
            return
        errs = self.transport.deferred_errors() if self.transport is not None else []
        self._closing = True
        self._close_remote()
        self._fail("closed by the client")
        if errs:
            raise combine_errors(errs)

    def stats(self):
        return self._stub.GetStats(
            self._pb.StatsRequest(session_id=self.reply.session_id, token=self.reply.token), timeout=CONNECT_TIMEOUT_S
        )

    def lanes_state(self) -> list[dict]:
        if self._native is not None:
            return [dict(self._native.lane(i), lane=i, waited=None, stream=None)
                    for i in range(self._native.state()["lanes"])]
        return [{"lane": l.index, "issued": l.issued, "waited": l.waited, "inputs_ready": l.inputs_ready(),
                 "done": l.done(),
                 "stream": l.stream} for l in self._lanes]


# -- process-wide session table ----------------------------------------------------------------

_sessions: dict[int, Session] = {}
_sessions_lock = threading.Lock()
_retired: list[Session] = []  # failed or closed sessions whose shared memory stays mapped
_live_sessions: "weakref.WeakSet[Session]" = weakref.WeakSet()  # every session opened by this process
_deferred: list[Exception] = []
_deferred_lock = threading.Lock()
_atexit_registered = False


def _report_deferred(err: Exception) -> None:
    with _deferred_lock:
        _deferred.append(err)


def take_deferred_errors() -> list[Exception]:
    """Every error not raised at its call site yet: lost calls of dead daemons, rejected asynchronous calls.

    Waits for the ring records in flight of every open session of this process first.
    """
    errs = []
    pid = os.getpid()
    for s in list(_live_sessions):
        if s.pid == pid and s.failed is None and s.transport is not None:
            errs.extend(s.transport.deferred_errors())
    with _deferred_lock:
        errs = list(_deferred) + errs
        _deferred.clear()
    return errs


def _device_index(device) -> int:
    import torch

    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    d = torch.device(device) if not isinstance(device, torch.device) else device
    if d.type != "cuda":
        raise ValueError(f"cache_dit_opd: the daemon serves CUDA devices, got {d}")
    return d.index if d.index is not None else torch.cuda.current_device()


def unavailable_message(family: str, device_index: int, uuid: str | None, reason: str) -> str:
    if uuid is None:
        cmd = f"{_discovery.DAEMON_BINARY} --device {device_index}"
    else:
        cmd = _discovery.start_command(device_index, uuid)
    return (
        f"cache_dit_opd: no operator daemon serves the {family} ops for cuda:{device_index}"
        + (f" ({uuid})" if uuid else "")
        + f": {reason}.\nStart one with:\n    {cmd}\n"
        f"(the binary is built at {_discovery.BUILD_PATH_HINT}), or point the client at a running daemon with "
        f"{_discovery.ADDRESS_ENV}=unix:/path/to/<GPU-UUID>.sock."
    )


def get_session(device=None) -> Session:
    """This process's live session for ``device``, opened (or reopened) on demand."""
    import torch

    idx = _device_index(device)
    s = _sessions.get(idx)
    if s is not None and s.failed is None and s.pid == os.getpid():
        return s
    with _sessions_lock:
        s = _sessions.get(idx)
        if s is not None and s.failed is None and s.pid == os.getpid():
            return s
        if s is not None and s.pid != os.getpid():
            _sessions.pop(idx, None)  # inherited across fork: the parent's, never used here
        if not torch.cuda.is_available():
            raise DaemonUnavailableError("CUDA is not available in this process")
        uuid = _discovery.gpu_uuid(idx)
        s = Session(idx, uuid=uuid).open()
        _sessions[idx] = s
        _regions.install_free_hooks()
        global _atexit_registered
        if not _atexit_registered:
            atexit.register(close_all)
            _atexit_registered = True
        return s


def close_all(raise_errors: bool = False) -> None:
    """Closes this process's sessions; errors of asynchronous calls are raised (``raise_errors``) or logged."""
    with _sessions_lock:
        sessions = [s for s in _sessions.values() if s.pid == os.getpid()]
        _sessions.clear()
    errors = []
    for s in sessions:
        try:
            s.close()
        except Exception as e:
            errors.append(e)
    if errors:
        if raise_errors:
            raise combine_errors(errors)
        for e in errors:
            log.warning("cache_dit_opd: closing the sessions: %s", e)


def require(family: str, schemas: dict, device=None) -> Session:
    """The session for ``device`` with the ``schemas`` checked; RuntimeError naming the start command otherwise."""
    if type(device) is int:  # the per-call path: a live session of this process whose catalog was checked
        s = _sessions.get(device)
        if s is not None and s.failed is None and s.pid == os.getpid() and s._checked.get(id(schemas), 0) is None:
            return s
    import torch

    if not torch.cuda.is_available():
        raise DaemonUnavailableError(
            f"cache_dit_opd: the {family} ops run on a CUDA device through the operator daemon, and CUDA is not "
            f"available in this process (torch {torch.__version__}, CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}). On a GPU host start a daemon with "
            f"`{_discovery.DAEMON_BINARY} --device 0` (built at {_discovery.BUILD_PATH_HINT})."
        )
    idx = None
    uuid = None
    try:
        idx = _device_index(device)
        s = get_session(idx)
    except (DaemonUnavailableError, SessionFailedError) as e:
        try:
            uuid = _discovery.gpu_uuid(idx) if idx is not None else None
        except Exception:
            uuid = None
        raise DaemonUnavailableError(unavailable_message(family, idx if idx is not None else 0, uuid, str(e))) from e
    s.check_ops(schemas)
    return s


def run(get_required: Callable[[int], Session], device_index: int, op: str, args: Sequence[Any]) -> None:
    """Runs ``op.out(*args)`` through the session ``get_required(device_index)`` returns.

    When the session breaks in a way that means the call never ran on a live
    daemon (daemon restarted, connection lost), the call runs once more on a
    new session: the ops are pure functions of their inputs.
    """
    for attempt in range(2):
        s = get_required(device_index)
        try:
            s.call(op, args)
            return
        except SessionFailedError as e:
            if attempt == 0 and getattr(e, "retryable", False):
                continue
            raise


def current_stream_is_capturing(device_index: int) -> bool:
    import torch

    if torch.cuda.current_device() == device_index:
        return torch._C._cuda_isCurrentStreamCapturing()
    with torch.cuda.device(device_index):
        return torch.cuda.is_current_stream_capturing()

