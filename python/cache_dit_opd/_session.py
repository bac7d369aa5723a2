"""Sessions with the operator daemon: the client's control plane, one session per (process, device).

Opening a session (lazily, on the first call that needs it):

1. find the daemon by the device's GPU UUID (``_discovery``),
2. ``GetVersion`` (protocol version, serving) and ``OpenSession`` over gRPC; the returned op catalog
   is kept for the schema check,
3. bind on the session channel (AF_UNIX/SOCK_SEQPACKET): send the token, receive the session's memfd,
4. with the native engine (``_native``): hand the memfd and the channel to it. From then on the
   engine runs every call (memory, lanes, ring, stream ordering, failure detection:
   ``client/core/session_engine.h``); this module registers regions, checks the catalog and turns
   what the engine hands back into exceptions or retries (:func:`run`).

Without the native engine a session is still usable, more slowly: every call is a host-ordered gRPC
``Call`` (the caller's stream is synchronized first, the daemon numbers the call on lane 0 and
answers once the kernel has finished), so no stream operation, lane or ring exists in Python. A
warning says so once per process.

Errors: every daemon error carries a reason; what to do about it is ``_errors.action`` (raise,
re-register and run again, reconnect and run again, fail), the same table the C++ client uses. No
decision reads a message.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import threading
import weakref
from typing import Any, Callable, Sequence

from . import _discovery, _errors, _layout, _native, _regions, _wire
from ._errors import CatalogSkewError, DaemonError, DaemonUnavailableError, SessionFailedError

log = logging.getLogger("cache_dit_opd")

CONNECT_TIMEOUT_S = float(os.environ.get("CACHE_DIT_OPD_CONNECT_TIMEOUT_S", "10"))
CALL_TIMEOUT_S = float(os.environ.get("CACHE_DIT_OPD_CALL_TIMEOUT_S", "600"))
DEFAULT_LANES = int(os.environ.get("CACHE_DIT_OPD_LANES", "8"))
# A daemon whose heartbeat stops advancing this long while calls are outstanding is taken for hung (0: never).
HEARTBEAT_TIMEOUT_S = float(os.environ.get("CACHE_DIT_OPD_HEARTBEAT_TIMEOUT_S", "5"))
SPIN_S = float(os.environ.get("CACHE_DIT_OPD_SPIN_US", "200")) * 1e-6
NAMESPACE = "cache_dit_cuda_ops"

__all__ = ["CatalogSkewError", "DaemonUnavailableError", "SessionFailedError"]


def _version() -> str:
    from . import __version__

    return __version__


def _ring_wanted() -> bool:
    return os.environ.get("CACHE_DIT_OPD_RING", "1").strip().lower() not in ("0", "false", "off", "no")


# -- call modes ----------------------------------------------------------------------------------

_async_process = False  # set_async_calls()
_async_local = threading.local()  # async_calls() scopes, per thread


def set_async_calls(enabled: bool = True) -> bool:
    """Makes ring calls of this process asynchronous (True) or synchronous (False); returns the previous setting.

    A thread inside an ``async_calls(...)`` scope follows its scope instead. Calls without the native
    engine are always synchronous.
    """
    global _async_process
    prev, _async_process = _async_process, bool(enabled)
    _native.set_async_process(_async_process)
    return prev


@contextlib.contextmanager
def async_calls(enabled: bool = True):
    """Scope in which this thread's ring calls are asynchronous (or, with ``enabled=False``, synchronous).

    Thread-local: other threads keep their own setting. Scopes nest; leaving one restores the setting
    that was in force when it was entered.
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


combine_errors = _errors.combine

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _check_int64(v: int) -> int:
    if not _INT64_MIN <= v <= _INT64_MAX:
        raise ValueError(f"cache_dit_opd: integer argument {v} does not fit in int64")
    return v


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


_slow_path_warned = False


def _warn_slow_path_once(why: str) -> None:
    global _slow_path_warned
    if _slow_path_warned:
        return
    _slow_path_warned = True
    log.warning(
        "cache_dit_opd: calls go over gRPC (%s), each waiting for the stream before it and for the daemon's "
        "kernel: the slow path, hundreds of microseconds per call. The native engine is installed by "
        "`pip install --no-build-isolation ./python` on a machine with torch, CMake and a CUDA toolkit.", why)


# -- the session ---------------------------------------------------------------------------------


class Session:
    """A bound session with the daemon serving one device of this process."""

    def __init__(self, device_index: int, *, target: str | None = None, uuid: str | None = None, driver=None,
                 lanes: int | None = None, native: bool | None = None, synchronize: Callable | None = None):
        """``native``: use the native engine (default: when its library is loaded); ``driver`` and
        ``synchronize`` (the caller's stream, before a host-ordered call) replace the CUDA ones in tests."""
        self.device_index = device_index
        self.pid = os.getpid()
        self.uuid = uuid
        self.target = target
        self._driver = driver
        self._lanes_wanted = lanes or DEFAULT_LANES
        self._native_off = native is False
        self._lib = _native.library() if not self._native_off else None
        if native and self._lib is None:
            raise DaemonUnavailableError(f"cache_dit_opd: the native engine is not available: {_native.load_error()}")
        self._synchronize = synchronize
        self._failure: DaemonError | None = None
        self._failure_lock = threading.Lock()
        self._ended = False  # fail() has released this side (once, whoever noticed the failure first)
        self._checked: dict[int, Exception | None] = {}
        self._channel = None
        self._chan_sock: socket.socket | None = None
        self.native: _native.NativeSession | None = None
        self.version = None
        self.reply = None
        self.catalog: dict[tuple[str, str], str] = {}
        self._op_index: dict[tuple[str, str], int] = {}
        self.regions: _regions.RegionTable | None = None
        _live_sessions.add(self)

    @property
    def transport(self) -> str:
        return "ring" if self.native is not None else "grpc"

    # -- open -----------------------------------------------------------------------------------
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
            try:
                self.version = self._stub.GetVersion(opd_pb2.VersionRequest(), timeout=CONNECT_TIMEOUT_S)
            except grpc.RpcError as e:
                raise DaemonUnavailableError(f"no answer from {self.target}: {_errors.from_grpc(e)}") from None
            v = self.version
            if v.protocol_version != _wire.PROTOCOL_VERSION:
                raise CatalogSkewError(
                    f"the daemon at {self.target} (cache-dit-opd {v.daemon_version}) speaks protocol version "
                    f"{v.protocol_version}, this client (cache_dit_opd {_version()}) speaks protocol version "
                    f"{_wire.PROTOCOL_VERSION}: install matching versions of the client and the daemon")
            if not v.serving:
                raise DaemonUnavailableError(f"daemon at {self.target} is not serving: "
                                             f"{v.not_serving_reason or 'no reason given'}")
            want_ring = self._lib is not None and _ring_wanted()
            try:
                self.reply = self._stub.OpenSession(
                    opd_pb2.OpenSessionRequest(protocol_version=_wire.PROTOCOL_VERSION, client_pid=self.pid,
                                               gpu_uuid=self.uuid or "", lanes=self._lanes_wanted if want_ring else 1,
                                               client_name=f"python cache_dit_opd {_version()}", want_ring=want_ring),
                    timeout=CONNECT_TIMEOUT_S)
            except grpc.RpcError as e:
                err = _errors.from_grpc(e)
                if err.reason == _wire.REASONS["VERSION_MISMATCH"][0]:
                    raise CatalogSkewError(f"OpenSession at {self.target}: {err.message}") from None
                raise DaemonUnavailableError(f"OpenSession at {self.target} failed: {err}") from None
            self._validate_reply(self.reply)
            r = self.reply
            self.catalog = {(o.name, o.overload): o.schema for o in r.catalog}
            self._op_index = {(o.name, o.overload): i for i, o in enumerate(r.catalog)}
            memfd, shm_bytes = self._bind(r)
            if want_ring and r.ring_enabled:
                # The engine owns the memfd and the channel from here, also when it refuses them.
                self.native = _native.NativeSession(
                    self._lib, device=self.device_index, memfd=memfd, channel_fd=self._chan_sock.detach(),
                    memory_bytes=shm_bytes, session_id=r.session_id, lanes=r.lanes, spin_s=SPIN_S,
                    call_timeout_s=CALL_TIMEOUT_S, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
            else:
                os.close(memfd)  # host-ordered calls need no shared memory
                _warn_slow_path_once(self._slow_path_reason())
        except _errors.DaemonError as e:
            self._abandon()
            raise SessionFailedError(f"cache_dit_opd: opening a session with {self.target}: {e}") from None
        except BaseException:
            self._abandon()
            raise
        n = self.native

        def on_add(reg: _regions.Region) -> None:
            if reg.fixed:
                n.add_fixed_region(reg.base, reg.size, reg.region_id)
            elif reg.chunks:
                n.add_run_region(reg.chunks, reg.region_id)
            else:
                n.add_region(reg.base, reg.size, reg.buffer_id, reg.region_id)

        self.regions = _regions.RegionTable(self._register_region, self._unregister_region, self._driver,
                                            self.device_index, on_add=n and on_add,
                                            on_forget=n and (lambda reg: n.forget_region(reg.base)),
                                            attach=self._attach_block, register_vmm=self._register_chunks)
        log.debug("cache_dit_opd: session %d with %s: %d lanes, transport %s", self.reply.session_id, self.target,
                  self.reply.lanes, self.transport)
        return self

    def _slow_path_reason(self) -> str:
        if self._lib is None:
            return "the native engine is turned off" if self._native_off else \
                f"the native engine is not available: {_native.load_error()}"
        return "CACHE_DIT_OPD_RING=0" if not _ring_wanted() else f"the daemon at {self.target} offers no call ring"

    def _validate_reply(self, r) -> None:
        if r.session_id == 0 or len(r.token) != _wire.TOKEN_BYTES:
            raise SessionFailedError(f"OpenSession reply is malformed (session id {r.session_id}, "
                                     f"token of {len(r.token)} bytes)")
        if r.layout_version != _wire.LAYOUT_VERSION:
            raise CatalogSkewError(
                f"the daemon at {self.target} (cache-dit-opd {self.version.daemon_version}) uses session memory "
                f"layout {r.layout_version}, this client (cache_dit_opd {_version()}) uses layout "
                f"{_wire.LAYOUT_VERSION}: install matching versions of the client and the daemon")
        if self.uuid and r.gpu_uuid and r.gpu_uuid != self.uuid:
            raise SessionFailedError(f"daemon at {self.target} serves {r.gpu_uuid}, not {self.uuid} "
                                     f"(cuda:{self.device_index})")
        if r.lanes < 1:
            raise SessionFailedError(f"daemon at {self.target} granted {r.lanes} lanes")

    def _bind(self, r) -> tuple[int, int]:
        """Binds the session on its channel: (the session memfd, its size in bytes); the socket stays open."""
        path = r.session_channel_path
        timeout = (r.bind_timeout_ms / 1000.0) if r.bind_timeout_ms else CONNECT_TIMEOUT_S
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._chan_sock = sock
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            try:
                sock.sendall(_layout.BIND_REQUEST.pack(_wire.BIND_REQUEST_MAGIC, _wire.PROTOCOL_VERSION,
                                                       r.session_id, bytes(r.token)))
            except (BrokenPipeError, ConnectionResetError):
                pass  # the daemon refused the connection at accept and closed it: its reply is queued
            msg, fds, flags, _ = socket.recv_fds(sock, _wire.BIND_REPLY_SIZE, 4)
        except OSError as e:
            raise SessionFailedError(f"binding session {r.session_id} on {path} failed: {e}") from None
        fd = fds[0] if fds else None
        for extra in fds[1:]:
            os.close(extra)
        try:
            if len(msg) != _wire.BIND_REPLY_SIZE or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise SessionFailedError(f"bind reply on {path} has {len(msg)} bytes (flags 0x{flags:x}), "
                                         f"expected {_wire.BIND_REPLY_SIZE}")
            status, layout_version, shm_bytes, reason, message = _layout.BIND_REPLY.unpack(msg)
            if status != 0:
                raise DaemonError(status, reason, message.split(b"\0", 1)[0].decode(errors="replace"))
            if layout_version != _wire.LAYOUT_VERSION:
                raise CatalogSkewError(f"the bind reply has layout version {layout_version}, this client uses "
                                       f"{_wire.LAYOUT_VERSION}")
            if fd is None:
                raise SessionFailedError(f"bind reply on {path} carries no memfd")
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        sock.settimeout(None)
        return fd, shm_bytes

    # -- the session channel's own requests (session_memory.h) --------------------------------------------------
    def _channel_request(self, what: str, request: bytes, fds: list[int], reply_size: int) -> tuple[bytes, list[int]]:
        """Sends one request (with ``fds``) on a connection of its own to the session channel; the reply's bytes and
        descriptors. A BindReply-sized answer (refused before the request was read) raises its DaemonError, as does
        a reply of another size (SessionFailedError) or a refusal left to the caller to decode."""
        path = self.reply.session_channel_path
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(CONNECT_TIMEOUT_S)
            try:
                sock.connect(path)
                try:
                    if fds:
                        socket.send_fds(sock, [request], fds)
                    else:
                        sock.sendall(request)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # refused at accept: its reply is queued
                msg, got, flags, _ = socket.recv_fds(sock, max(reply_size, _layout.BIND_REPLY_SIZE) + 1, 2)
            except OSError as e:
                raise SessionFailedError(f"{what} on {path} failed: {e}") from None
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(msg) not in (reply_size, _layout.BIND_REPLY_SIZE):
                raise SessionFailedError(f"{what}: the reply on {path} has {len(msg)} bytes (flags 0x{flags:x}), "
                                         f"expected {reply_size}")
            if len(msg) == _layout.BIND_REPLY_SIZE and reply_size != _layout.BIND_REPLY_SIZE:
                status, _, _, reason, message = _layout.BIND_REPLY.unpack(msg)
                raise DaemonError(status or 2, reason, message.split(b"\0", 1)[0].decode(errors="replace"))
        except BaseException:
            for fd in got:
                os.close(fd)
            raise
        return msg, got

    def _register_chunks(self, chunks, fds: list[int]) -> int:
        """Registers a run of virtual-memory chunks ((base, size, buffer id), with their descriptors) as one
        region (session_memory.h VmmRegionRequest)."""
        r = self.reply
        what = f"registering {len(chunks)} chunks at 0x{chunks[0][0]:x}"
        try:
            msg, got = self._channel_request(what, _layout.pack_vmm_request(r.session_id, bytes(r.token), chunks), fds,
                                             _layout.VMM_REGION_REPLY_SIZE)
            for fd in got:
                os.close(fd)
            status, reason, region_id, _, message = _layout.VMM_REGION_REPLY.unpack(msg)
            if status != 0:
                raise DaemonError(status, reason, message.split(b"\0", 1)[0].decode(errors="replace"))
        except DaemonError as err:
            if err.reason == _wire.REASONS["RESOURCE_EXHAUSTED"][0]:
                raise _regions.RegionsExhausted(err.message) from None
            if err.action in (_errors.RECONNECT, _errors.FAIL):
                self.fail(err)
            _errors.raise_for(what, err)
        return region_id

    # -- the weight store: attaching an entry (session_memory.h StoreAttachRequest) ---------------------------
    def attach_store(self, name: str) -> tuple[dict, int | None]:
        """Attaches the store entry ``name`` on this session: (the reply's fields, the descriptor of its set's
        block, or None for an empty tensor). The caller owns the descriptor. Raises DaemonError with the
        daemon's refusal (STORE_UNKNOWN, STORE_DENIED, ...)."""
        r = self.reply
        data = name.encode()
        if not 0 < len(data) <= _wire.MAX_STORE_NAME_BYTES:
            raise ValueError(f"cache_dit_opd.store: name {name!r} has {len(data)} bytes (1 to "
                             f"{_wire.MAX_STORE_NAME_BYTES})")
        req = _layout.STORE_ATTACH_REQUEST.pack(_layout.STORE_ATTACH_MAGIC, _wire.PROTOCOL_VERSION, r.session_id,
                                                bytes(r.token), len(data), 0, data)
        msg, fds = self._channel_request(f"attaching '{name}'", req, [], _layout.STORE_ATTACH_REPLY_SIZE)
        fd = fds[0] if fds else None
        try:
            for extra in fds[1:]:
                os.close(extra)
            reply = _layout.read_attach_reply(msg)
            if reply["status_code"] != 0:
                raise DaemonError(reply["status_code"], reply["reason"], reply["message"])
            has_memory = reply["region_id"] != _wire.NO_REGION
            if has_memory != (fd is not None) or (has_memory and reply["offset"] + reply["bytes"] > reply["block_bytes"]):
                raise SessionFailedError(f"store attach reply of '{name}' is malformed: region {reply['region_id']}, "
                                         f"{len(fds)} descriptors, bytes [{reply['offset']}, +{reply['bytes']}) of a "
                                         f"{reply['block_bytes']}-byte block")
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        return reply, fd

    def _attach_block(self, block: _regions.StoreBlock) -> int:
        """Registers a store block this process mapped (through another session) in this one: its entry
        attached again, which must still be the same publication in the same daemon."""
        try:
            reply, fd = self.attach_store(block.name)
        except DaemonError as e:
            raise _regions.RegionExportError(
                f"cache_dit_opd: the weight-store tensor at 0x{block.base:x} was attached from '{block.name}', "
                f"which the daemon at {self.target} cannot lend this session: {e}") from None
        if fd is not None:
            os.close(fd)  # this process's mapping of the block stays the one in use
        if (reply["daemon_instance"], reply["block_id"]) != (block.daemon_instance, block.block_id):
            raise _regions.RegionExportError(
                f"cache_dit_opd: the weight-store tensor at 0x{block.base:x} was attached from '{block.name}' of "
                f"another daemon or an earlier publication (the daemon restarted, or the entry was deleted and "
                f"published again): attach '{block.name}' again")
        return reply["region_id"]

    def _abandon(self) -> None:
        if self._chan_sock is not None:
            self._chan_sock.close()
        if self._channel is not None:
            self._channel.close()

    # -- catalog ----------------------------------------------------------------------------------
    def check_ops(self, schemas: dict) -> None:
        """Checks ``{"name[.overload]": "(args) -> rets"}`` against the daemon's catalog (cached)."""
        key = id(schemas)  # each domain passes its module-level table
        if key not in self._checked:
            self._checked[key] = err = self._compare(schemas)
            if err is None and self.native is not None:
                # The native kernels may now run these ops on this session.
                for full in schemas:
                    name, _, overload = full.partition(".")
                    idx = self._op_index.get((name, overload))
                    if idx is not None:
                        self.native.set_op(full, idx)
                self.native.activate()
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
                "\nInstall matching versions of the client and the daemon.")
        if missing:
            return DaemonUnavailableError(
                f"the daemon at {self.target} ({daemon}) does not serve {', '.join(missing)}: its kernel library "
                f"was built without that op family")
        return None

    # -- failure ----------------------------------------------------------------------------------
    @property
    def failed(self) -> DaemonError | None:
        """Why the session failed, or None while it lives (the native engine may fail it at any time)."""
        if self._failure is None and self.native is not None:
            err = self.native.failure()
            if err is not None:
                self._set_failure(err)
        return self._failure

    def _set_failure(self, err: DaemonError) -> bool:
        with self._failure_lock:
            if self._failure is not None:
                return False
            self._failure = err
        return True

    def fail(self, err: DaemonError) -> None:
        """Ends the session after an error whose action gives it up (or on close), once: reading ``failed``
        records the engine's failure, and this still releases everything. What the engine holds for the user
        (calls lost with a dead daemon, rejected asynchronous calls) is kept for take_deferred_errors() and the
        device's next call, not dropped with the engine."""
        self._set_failure(err)
        with self._failure_lock:
            if self._ended:
                return
            self._ended = True
        log.debug("cache_dit_opd: session with %s failed: %s", self.target, self._failure)
        if self.native is not None:
            errs, _ = self._engine_errors(wait=False)
            if errs:
                with _ended_errors_lock:
                    _ended_errors.extend((self.pid, self.device_index, e) for e in errs)
            self.native.fail(self._failure)
            self.native.activate(False)
        self._close_remote()
        if self.regions is not None:
            self.regions.close()
        self._close_channels()

    def raise_if_failed(self) -> None:
        err = self.failed
        if err is not None:
            self.fail(err)  # the engine failed it: release this side too
            e = SessionFailedError(f"cache_dit_opd: the session with the daemon at {self.target} failed: {err}")
            e.retryable = err.action == _errors.RECONNECT
            raise e

    # -- regions --------------------------------------------------------------------------------
    def _register_region(self, handle: bytes, base: int, size: int, buffer_id: int) -> int:
        import grpc

        pb = self._pb
        try:
            rep = self._stub.RegisterRegion(
                pb.RegisterRegionRequest(session_id=self.reply.session_id, token=self.reply.token, ipc_handle=handle,
                                         client_base_address=base, size=size, buffer_id=buffer_id),
                timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as e:
            err = _errors.from_grpc(e)
            if err.reason == _wire.REASONS["RESOURCE_EXHAUSTED"][0]:
                raise _regions.RegionsExhausted(err.message) from None
            if err.action in (_errors.RECONNECT, _errors.FAIL):
                self.fail(err)
            _errors.raise_for(f"registering the allocation at 0x{base:x} ({size} bytes)", err)
        return rep.region_id

    def _unregister_region(self, region_id: int) -> None:
        pb = self._pb
        self._stub.UnregisterRegion(
            pb.UnregisterRegionRequest(session_id=self.reply.session_id, token=self.reply.token, region_id=region_id),
            timeout=CONNECT_TIMEOUT_S)

    def _tensor_ref(self, t, pinned: set) -> tuple:
        """(region_id, byte_offset, sizes, strides, dtype) of a CUDA tensor of this session's device.

        An empty tensor names no memory (its data pointer is usually 0, inside no allocation): region
        ``_wire.NO_REGION`` at offset 0, nothing registered or pinned (wire.h kNoRegion)."""
        dtype = _wire.DTYPE_IDS.get(str(t.dtype).rsplit(".", 1)[-1])
        if dtype is None:
            raise ValueError(f"cache_dit_opd: dtype {t.dtype} cannot be sent to the daemon")
        sizes, strides = tuple(t.shape), tuple(t.stride())
        if t.numel() == 0:
            return _wire.NO_REGION, 0, sizes, strides, dtype
        # the span from the first to the last element the view covers
        nbytes = (sum((s - 1) * st for s, st in zip(sizes, strides)) + 1) * t.element_size()
        region_id, offset = self.regions.ref(t.data_ptr(), nbytes, pinned)
        return region_id, offset, sizes, strides, dtype

    def _is_tensor(self, a) -> bool:
        return hasattr(a, "data_ptr") and hasattr(a, "stride")

    def _check_device(self, a) -> None:
        if not a.is_cuda or a.get_device() != self.device_index:
            raise ValueError(f"cache_dit_opd: tensor on {a.device} passed to the session of cuda:{self.device_index}")

    def register(self, args: Sequence[Any]) -> set:
        """Registers every tensor argument's allocation (the native kernels found one missing); the region ids."""
        pinned: set = set()
        for a in args:
            if self._is_tensor(a):
                self._check_device(a)
                self._tensor_ref(a, pinned)
        self.regions.maybe_sweep()
        return pinned

    # -- host-ordered calls (no native engine) ---------------------------------------------------------
    def _encode(self, args: Sequence[Any], pinned: set) -> list:
        """Every argument as a protobuf ``Argument``, validated here, before anything is sent."""
        pb = self._pb
        out = []
        for a in args:
            if self._is_tensor(a):
                self._check_device(a)
                rid, off, sizes, strides, dtype = self._tensor_ref(a, pinned)
                out.append(pb.Argument(tensor=pb.TensorRef(region_id=rid, byte_offset=off, sizes=sizes,
                                                           strides=strides, dtype=dtype)))
            elif a is None:
                out.append(pb.Argument(none=pb.NoneValue()))
            elif isinstance(a, bool):
                out.append(pb.Argument(bool_value=a))
            elif isinstance(a, int):
                out.append(pb.Argument(int_value=_check_int64(a)))
            elif isinstance(a, float):
                out.append(pb.Argument(float_value=a))
            elif isinstance(a, (list, tuple)) and all(isinstance(x, bool) for x in a):
                out.append(pb.Argument(bool_list=pb.BoolList(values=a)))
            elif isinstance(a, (list, tuple)) and all(isinstance(x, int) for x in a):
                out.append(pb.Argument(int_list=pb.IntList(values=[_check_int64(x) for x in a])))
            elif isinstance(a, (list, tuple)) and all(isinstance(x, (int, float)) for x in a):
                out.append(pb.Argument(float_list=pb.FloatList(values=[float(x) for x in a])))
            else:
                raise ValueError(f"cache_dit_opd: argument of type {type(a).__name__} cannot be sent to the daemon")
        return out

    def call_host_ordered(self, op: str, args: Sequence[Any], overload: str = "out") -> set:
        """Runs ``op.overload(*args)`` as a host-ordered call: returns once the kernel has finished.

        The caller's current stream is synchronized first (its work produces the inputs). Raises
        DaemonError with the daemon's answer; returns the call's region ids.
        """
        import grpc

        self.raise_if_failed()
        pinned: set = set()
        req = self._pb.CallRequest(session_id=self.reply.session_id, token=self.reply.token, op=op,
                                   overload=overload, args=self._encode(args, pinned), lane=0, host_ordered=True)
        self.regions.maybe_sweep()
        self._sync_stream()
        try:
            self._stub.Call(req, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as e:
            err = _errors.from_grpc(e)
            err.regions = pinned
            raise err from None
        return pinned

    def _sync_stream(self) -> None:
        if self._synchronize is not None:
            self._synchronize()
            return
        import torch

        torch.cuda.current_stream(self.device_index).synchronize()

    # -- asynchronous errors ------------------------------------------------------------------------
    def async_errors(self, wait: bool = False) -> list[Exception]:
        """What earlier asynchronous calls were rejected with, as the exceptions the calls would have raised;
        ``wait``: first wait for every call in flight. Calls lost with a dead daemon are reported here too."""
        if self.native is None or self._ended:
            return []
        errs, reconnect = self._engine_errors(wait)
        if reconnect is not None:
            self.fail(reconnect)
        return errs

    def _engine_errors(self, wait: bool) -> tuple[list[Exception], DaemonError | None]:
        """The engine's rejected and lost calls as exceptions, and the first rejection that gives the session up."""
        ops = {i: f"{NAMESPACE}::{n}" + (f".{o}" if o else "") for (n, o), i in self._op_index.items()}
        errs = []
        reconnect = None
        for r in self.native.take_rejected(wait=wait):
            e = r.error()
            where = (f" (asynchronous call on lane {r.lane}, seq {r.seq}, ticket {r.ticket}; its outputs were not "
                     f"written)")
            label = ops.get(r.op_index, f"op #{r.op_index}")
            if e.action == _errors.REREGISTER and self.regions is not None:
                self.regions.forget(r.regions[:r.nregions])  # evicted by the daemon: the next call registers again
            if e.action in (_errors.RECONNECT, _errors.FAIL):
                reconnect = reconnect or e
            try:
                _errors.raise_for(label, e, where)
            except Exception as exc:  # noqa: BLE001  (collected, raised together by the caller)
                errs.append(exc)
        lost = self.native.take_lost()
        if lost:
            errs.append(SessionFailedError(
                f"cache_dit_opd: the daemon at {self.target} (cuda:{self.device_index}) died with {lost} call(s) "
                f"unfinished; their outputs are undefined. The waits of this process's streams were released; "
                f"the next call opens a new session."))
        return errs, reconnect

    # -- close --------------------------------------------------------------------------------------
    def _close_remote(self) -> None:
        try:
            self._stub.CloseSession(
                self._pb.CloseSessionRequest(session_id=self.reply.session_id, token=self.reply.token), timeout=2.0)
        except Exception:
            pass

    def _close_channels(self) -> None:
        if self.native is not None:
            self.native.close()  # half-closes the session channel; the engine frees the memory later
        if self._chan_sock is not None:
            self._chan_sock.close()
        if self._channel is not None:
            try:
                self._channel.close()
            except Exception:
                pass

    def close(self) -> None:
        """Ends the session: waits for every call in flight, closes it (the daemon completes every lane, then
        unmaps the regions), then raises what asynchronous calls were rejected with. A failed session is only
        released (its errors wait for take_deferred_errors())."""
        if self.failed is not None:
            self.fail(self.failed)
            return
        errs = self.async_errors(wait=True)
        self.fail(DaemonError(1, _wire.REASONS["CLOSED"][0], "closed by the client"))
        if errs:
            raise combine_errors(errs)

    def stats(self):
        return self._stub.GetStats(
            self._pb.StatsRequest(session_id=self.reply.session_id, token=self.reply.token), timeout=CONNECT_TIMEOUT_S)


# -- running one call -------------------------------------------------------------------------------

_depth = threading.local()
MAX_FALLBACKS = 4  # a call the native kernels hand back more often than this fails, saying why


class _RetryBudget:
    """What one call may spend on its errors' actions: one re-registration and one reconnect."""

    __slots__ = ("_reregistered", "_reconnected")

    def __init__(self):
        self._reregistered = self._reconnected = False

    def reregister(self) -> bool:
        """Spends the re-registration; False when it is spent already."""
        spent, self._reregistered = self._reregistered, True
        return not spent

    def reconnect(self) -> bool:
        """Spends the reconnect; False when it is spent already."""
        spent, self._reconnected = self._reconnected, True
        return not spent


def run(get_required: Callable[[int], Session], device_index: int, op: str, args: Sequence[Any],
        again: Callable[[], Any] | None = None) -> None:
    """Runs ``op.out(*args)`` for a proxy op's Python implementation.

    Every call goes to the daemon, empty tensors included (they travel without memory, region
    ``_wire.NO_REGION``): whether a call has anything to write is the daemon's one rule (a call none of
    whose outputs has an element is checked and launches nothing; server/dispatch/torch_call_runner.h),
    the same for this path, the native kernels and the C++ client.

    With the native engine (``again`` re-dispatches the op to its native kernel): acts on why the native
    kernel handed the call here (opens a session, registers allocations, raises the daemon's rejection,
    reconnects) and dispatches again. Without it: a host-ordered gRPC call. Either way what an error does
    is its reason's action (``_errors.action``), at most one re-registration and one reconnect per call.
    """
    label = f"{NAMESPACE}::{op}.out"
    if again is None:
        return _run_host_ordered(get_required, device_index, op, label, args)
    depth = getattr(_depth, "n", 0)
    if depth == 0:  # the outermost fallback of this call: its budget, for every fallback of the call
        _depth.budget = _RetryBudget()
    budget = _depth.budget
    if depth >= MAX_FALLBACKS:
        why, err = _native.last_fallback()
        raise RuntimeError(f"{label}: the native engine handed the call back {depth} times (last: {why}"
                           + (f": {err}" if err else "") + ")")
    why, err = _native.last_fallback()
    if why in ("rejected", "broken", "failed") and err is not None and err.action in (_errors.RECONNECT,
                                                                                      _errors.FAIL):
        old = _sessions.get(device_index)
        if old is not None:
            old.fail(err)  # the session that handed the call back; the next one is opened below
        ended = take_ended_errors(device_index)
        if ended:  # earlier calls whose outputs were lost or never written: said before anything runs again
            raise combine_errors(ended)
        if err.action == _errors.FAIL or not budget.reconnect():
            _errors.raise_for(label, err)
    try:
        s = get_required(device_index)  # opens or reopens the session, checks the catalog (activating it)
        if s.native is None:  # a session without the engine (no ring: CACHE_DIT_OPD_RING=0, --no-ring)
            return _run_host_ordered(get_required, device_index, op, label, args)
        _act_on_fallback(s, why, err, op, label, device_index, args, budget)
    except SessionFailedError as e:  # registering found the session gone: dispatching again reconnects
        if not e.retryable or not budget.reconnect():
            raise
    _depth.n = depth + 1
    try:
        again()
    finally:
        _depth.n = depth


def _act_on_fallback(s: Session, why: str, err, op: str, label: str, device_index: int, args,
                     budget: _RetryBudget) -> None:
    """Does what the native kernel's reason for handing a call back asks of the (re)opened session ``s``, so
    that the call can be dispatched again; raises when it cannot run."""
    if why == "pending_errors":
        errs = s.async_errors()
        if errs:
            raise combine_errors(errs)
    elif why == "capturing":
        from ._proxy import check_not_capturing

        check_not_capturing(op, device_index)
    elif why == "argument":
        raise ValueError(f"{label}: an argument cannot be sent to the daemon (a tensor of another device, an "
                         f"unsupported dtype, or an argument type the protocol does not carry)")
    elif why == "region_miss":
        s.register(args)
    elif why == "rejected" and err is not None:
        if err.action == _errors.REREGISTER and budget.reregister():
            s.regions.forget(s.register(args))  # the daemon no longer knows one: drop the call's, register again
            s.register(args)
        elif err.action not in (_errors.RECONNECT, _errors.FAIL):
            _errors.raise_for(label, err)


def _run_host_ordered(get_required, device_index: int, op: str, label: str, args: Sequence[Any]) -> None:
    budget = _RetryBudget()
    while True:
        s = get_required(device_index)
        try:
            s.call_host_ordered(op, args)
            return
        except DaemonError as e:
            if e.action == _errors.REREGISTER and budget.reregister():
                s.regions.forget(getattr(e, "regions", ()))
                continue
            if e.action in (_errors.RECONNECT, _errors.FAIL):
                s.fail(e)
                if e.action == _errors.RECONNECT and budget.reconnect():
                    continue
            _errors.raise_for(label, e)
        except SessionFailedError as e:  # registering an allocation found the session gone
            if not e.retryable or not budget.reconnect():
                raise


# -- process-wide session table ----------------------------------------------------------------------

_sessions: dict[int, Session] = {}
_sessions_lock = threading.Lock()
_live_sessions: "weakref.WeakSet[Session]" = weakref.WeakSet()  # every session opened by this process
_atexit_registered = False


# What sessions that ended (failed, replaced, closed after a failure) still owed the user: calls lost with a
# dead daemon, rejected asynchronous calls, as (pid, device index, exception). Raised by take_deferred_errors()
# and by the device's next call that finds its session failed; a fork's child does not inherit its parent's.
_ended_errors: list[tuple[int, int, Exception]] = []
_ended_errors_lock = threading.Lock()


def take_ended_errors(device_index: int | None = None) -> list[Exception]:
    """Takes this process's errors of ended sessions (of one device, or all)."""
    pid = os.getpid()
    mine, others = [], []
    with _ended_errors_lock:
        for e in _ended_errors:
            (mine if e[0] == pid and device_index in (None, e[1]) else others).append(e)
        _ended_errors[:] = others
    return [e[2] for e in mine]


def take_deferred_errors() -> list[Exception]:
    """Every error not raised at its call site yet: calls lost with a dead daemon, rejected asynchronous calls,
    of open sessions and of sessions that ended since.

    Waits for the calls in flight of every open session of this process first.
    """
    errs = []
    pid = os.getpid()
    for s in list(_live_sessions):
        if s.pid != pid:
            continue
        if s.failed is None:
            errs.extend(s.async_errors(wait=True))
        else:
            s.fail(s.failed)  # an engine failure nobody acted on yet: release it, keep its errors
    return errs + take_ended_errors()


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
        if s is not None and s.pid == os.getpid():
            s.fail(s.failed)  # the engine failed it: release this side before replacing it
        _sessions.pop(idx, None)  # failed, or inherited across fork (the parent's, never used here)
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
    errors += take_ended_errors()  # of sessions that failed before: never dropped unsaid
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
            f"`{_discovery.DAEMON_BINARY} --device 0` (built at {_discovery.BUILD_PATH_HINT}).")
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


def load_error(family: str, schemas: dict, device=None) -> Exception | None:
    """Why ``require`` fails for ``device`` (the error it raises), or None. Opens the session if needed."""
    try:
        require(family, schemas, device)
    except (RuntimeError, ValueError) as e:
        return e
    return None


def current_stream_is_capturing(device_index: int) -> bool:
    import torch

    if torch.cuda.current_device() == device_index:
        return torch._C._cuda_isCurrentStreamCapturing()
    with torch.cuda.device(device_index):
        return torch.cuda.is_current_stream_capturing()
