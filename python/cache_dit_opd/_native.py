"""The native half of the client: ``libcache_dit_opd_native.so`` (``client/python/``), through ctypes.

When the library is found, the ``.out`` proxy ops get a C++ CUDA kernel that
encodes the call, publishes it in the session's ring and orders the stream,
all without entering Python; the Python implementation of each op moves to
the op's PrivateUse1 key, where the native kernel hands every call it cannot
finish itself (first call on a new allocation, pending asynchronous errors,
a failed session, CUDA graph capture, rejected calls, ...). A session that
uses the ring then keeps its producer and lanes in C++ (``NativeSession``),
shared by both paths, so one ring has exactly one producer.

Where the library is looked for, first found wins:
``$CACHE_DIT_OPD_NATIVE_LIB``, this package's directory, then
``$CACHE_DIT_OPD_BUILD_DIR/client/python`` and ``<repo>/build/client/python``.
``CACHE_DIT_OPD_NATIVE=0`` keeps the client pure Python (same behaviour,
more host time per call). Without the library the client is pure Python.

``c_api.cc`` is the contract: every prototype and struct here mirrors it,
and ``opd_native_abi_version`` must match ``ABI_VERSION``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger("cache_dit_opd")

ABI_VERSION = 1
LIB_NAME = "libcache_dit_opd_native.so"
_MESSAGE_BYTES = 512
_MAX_REJECTED = 64
# ProxyFallback in client/python/native_session.h, in order
FALLBACK_REASONS = ("failed", "pending_errors", "capturing", "unknown_op", "argument", "region_miss", "rejected",
                    "broken")


class OpdRejected(ctypes.Structure):
    _fields_ = [("ticket", ctypes.c_uint64), ("seq", ctypes.c_uint64), ("lane", ctypes.c_uint32),
                ("op_index", ctypes.c_uint32), ("code", ctypes.c_int32), ("nregions", ctypes.c_uint32),
                ("regions", ctypes.c_uint64 * 32), ("message", ctypes.c_char * 256)]


_lib = None
_load_error: str | None = None
_lock = threading.Lock()


def enabled_by_env() -> bool:
    return os.environ.get("CACHE_DIT_OPD_NATIVE", "1").strip().lower() not in ("0", "false", "off", "no")


def candidates() -> list[Path]:
    here = Path(__file__).resolve().parent
    out = []
    if os.environ.get("CACHE_DIT_OPD_NATIVE_LIB"):
        out.append(Path(os.environ["CACHE_DIT_OPD_NATIVE_LIB"]))
    out.append(here / LIB_NAME)
    if os.environ.get("CACHE_DIT_OPD_BUILD_DIR"):
        out.append(Path(os.environ["CACHE_DIT_OPD_BUILD_DIR"]) / "client" / "python" / LIB_NAME)
    out.append(here.parent.parent / "build" / "client" / "python" / LIB_NAME)
    return out


def _prototype(lib) -> None:
    c = ctypes
    sig = {
        "opd_native_abi_version": (c.c_int, []),
        "opd_native_register_kernel": (c.c_int, [c.c_char_p, c.c_char_p, c.c_size_t]),
        "opd_native_open": (c.c_int64, [c.c_int, c.c_void_p, c.c_uint64, c.c_uint64, c.c_uint64, c.c_uint32, c.c_int,
                                        c.c_uint64, c.c_uint64, c.c_uint64, c.c_char_p, c.c_size_t]),
        "opd_native_activate": (c.c_int, [c.c_int64, c.c_int]),
        "opd_native_set_op": (c.c_int, [c.c_int64, c.c_char_p, c.c_uint32]),
        "opd_native_add_region": (c.c_int, [c.c_int64, c.c_uint64, c.c_uint64, c.c_uint64, c.c_uint64]),
        "opd_native_forget_region": (c.c_int, [c.c_int64, c.c_uint64]),
        "opd_native_call": (c.c_int, [c.c_int64, c.c_void_p, c.c_uint32, c.c_char_p, c.c_uint32, c.c_uint32, c.c_int,
                                      c.POINTER(c.c_uint64), c.c_uint32, c.POINTER(c.c_int32), c.c_char_p,
                                      c.c_size_t]),
        "opd_native_take_rejected": (c.c_int, [c.c_int64, c.c_int, c.POINTER(OpdRejected), c.c_int]),
        "opd_native_fail": (None, [c.c_int64, c.c_char_p]),
        "opd_native_release_from_host": (c.c_uint64, [c.c_int64, c.c_char_p]),
        "opd_native_state": (c.c_int, [c.c_int64, c.POINTER(c.c_uint64), c.c_int]),
        "opd_native_lane": (c.c_int, [c.c_int64, c.c_uint32, c.POINTER(c.c_uint64)]),
        "opd_native_set_async_process": (None, [c.c_int]),
        "opd_native_set_async_thread": (None, [c.c_int]),
    }
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype = res
        f.argtypes = args


def library():
    """The loaded native library, or None (``load_error()`` says why)."""
    global _lib, _load_error
    if _lib is not None or _load_error is not None:
        return _lib
    with _lock:
        if _lib is not None or _load_error is not None:
            return _lib
        if not enabled_by_env():
            _load_error = "disabled by CACHE_DIT_OPD_NATIVE=0"
            return None
        path = next((p for p in candidates() if p.is_file()), None)
        if path is None:
            _load_error = f"{LIB_NAME} not found (looked in {', '.join(str(p.parent) for p in candidates())})"
            return None
        try:
            import torch  # noqa: F401  (the library links torch's shared objects: load them first)

            lib = ctypes.CDLL(str(path))
            _prototype(lib)
            v = lib.opd_native_abi_version()
        except (OSError, AttributeError) as e:
            _load_error = f"{path}: {e}"
            log.warning("cache_dit_opd: native library not used: %s", _load_error)
            return None
        if v != ABI_VERSION:
            _load_error = f"{path}: ABI version {v}, this client needs {ABI_VERSION} (rebuild it)"
            log.warning("cache_dit_opd: native library not used: %s", _load_error)
            return None
        _lib = lib
        _lib.path = str(path)
        log.debug("cache_dit_opd: native library %s", path)
        return _lib


def load_error() -> str | None:
    library()
    return _load_error


def register_kernel(name_overload: str) -> str | None:
    """Gives ``cache_dit_cuda_ops::<name_overload>`` the native CUDA kernel; None on success, else why not."""
    lib = library()
    if lib is None:
        return _load_error
    err = ctypes.create_string_buffer(_MESSAGE_BYTES)
    if lib.opd_native_register_kernel(name_overload.encode(), err, len(err)) != 0:
        return err.value.decode(errors="replace")
    return None


def set_async_process(enabled: bool) -> None:
    if _lib is not None:
        _lib.opd_native_set_async_process(1 if enabled else 0)


def set_async_thread(mode: bool | None) -> None:
    if _lib is not None:
        _lib.opd_native_set_async_thread(-1 if mode is None else int(bool(mode)))


class NativeError(Exception):
    """A transport failure the native side reported: google.rpc.Code value and message."""

    def __init__(self, code: int, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class NativeSession:
    """One session's producer, lanes and region copy in C++ (``client/python/native_session.h``)."""

    def __init__(self, lib, *, device: int, memory: int, memory_bytes: int, device_base: int, session_id: int,
                 lanes: int, daemon_pidfd: int | None, spin_s: float, call_timeout_s: float,
                 heartbeat_timeout_s: float):
        self._lib = lib
        err = ctypes.create_string_buffer(_MESSAGE_BYTES)
        h = lib.opd_native_open(device, memory, memory_bytes, device_base, session_id, lanes,
                                -1 if daemon_pidfd is None else daemon_pidfd, int(spin_s * 1e9),
                                int(call_timeout_s * 1e9), int(max(0.0, heartbeat_timeout_s) * 1e9), err, len(err))
        if h == 0:
            raise RuntimeError(f"cache_dit_opd: native session: {err.value.decode(errors='replace')}")
        self.handle = h

    def activate(self, active: bool = True) -> None:
        self._lib.opd_native_activate(self.handle, 1 if active else 0)

    def set_op(self, name_overload: str, op_index: int) -> None:
        self._lib.opd_native_set_op(self.handle, name_overload.encode(), op_index)

    def add_region(self, base: int, size: int, buffer_id: int, region_id: int) -> None:
        self._lib.opd_native_add_region(self.handle, base, size, buffer_id, region_id)

    def forget_region(self, base: int) -> None:
        self._lib.opd_native_forget_region(self.handle, base)

    def call(self, stream: int, op_index: int, body: bytes, nargs: int, asynchronous: bool, regions) -> tuple[int, str]:
        """(daemon code, message) of one call encoded by ``_ring.encode_args``; NativeError when the ring failed."""
        regs = list(regions or ())
        arr = (ctypes.c_uint64 * max(1, len(regs)))(*regs)
        # Thread-safe buffers: each thread may call concurrently.
        code, msg = ctypes.c_int32(), ctypes.create_string_buffer(_MESSAGE_BYTES)
        rc = self._lib.opd_native_call(self.handle, stream, op_index, body, len(body), nargs, 1 if asynchronous else 0,
                                       arr, len(regs), ctypes.byref(code), msg, len(msg))
        text = msg.value.decode("utf-8", "replace")
        if rc != 0:
            raise NativeError(rc, text)
        return code.value, text

    def take_rejected(self, wait: bool = False) -> list[OpdRejected]:
        """Rejected asynchronous calls (copies); ``wait``: first wait for every record in flight."""
        out: list = []
        buf = (OpdRejected * _MAX_REJECTED)()
        while True:
            n = self._lib.opd_native_take_rejected(self.handle, 1 if wait and not out else 0, buf, _MAX_REJECTED)
            if n < 0:
                raise NativeError(-n, "waiting for the records in flight failed")
            out.extend(OpdRejected.from_buffer_copy(buf[i]) for i in range(n))
            if n < _MAX_REJECTED:
                return out

    def fail(self, reason: str) -> None:
        self._lib.opd_native_fail(self.handle, reason.encode(errors="replace"))

    def release_from_host(self, reason: str) -> int:
        return self._lib.opd_native_release_from_host(self.handle, reason.encode(errors="replace"))

    def state(self) -> dict:
        n = 9 + len(FALLBACK_REASONS)
        v = (ctypes.c_uint64 * n)()
        self._lib.opd_native_state(self.handle, v, n)
        return {"in_flight": v[0], "unanswered_async": v[1], "lanes_behind": bool(v[2]), "native_calls": v[3],
                "ring_wakes": v[4], "ring_full_waits": v[5], "lanes": v[6], "published": v[7],
                "ring_capacity": v[8], "fallbacks": {r: v[9 + i] for i, r in enumerate(FALLBACK_REASONS)}}

    def lane(self, index: int) -> dict:
        v = (ctypes.c_uint64 * 3)()
        if self._lib.opd_native_lane(self.handle, index, v) != 0:
            raise IndexError(f"lane {index}")
        return {"issued": v[0], "inputs_ready": v[1], "done": v[2]}
