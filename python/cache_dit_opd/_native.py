"""The client's native engine: ``libcache_dit_opd_native.so`` (``client/python/``), through ctypes.

The library is the client's data plane, the same engine the C++ client runs on
(``client/core/session_engine.h``): the session memory, lanes, call ring, region cache and failure
detection. With it, the ``.out`` proxy ops get a C++ CUDA kernel that encodes the call, publishes it
in the session's ring and orders the stream without entering Python; the Python implementation of
each op moves to the op's PrivateUse1 key, where the native kernel hands every call it cannot finish
itself, saying why (:func:`last_fallback`): no session yet, a new allocation, a rejection, a failed
session, CUDA graph capture, ... Python acts on that (the control plane: open, bind, register,
check the catalog, raise) and dispatches the op again. Without the library every call goes over gRPC
as a host-ordered call (``_session``).

Where the library is looked for, first found wins: ``$CACHE_DIT_OPD_NATIVE_LIB``, this package's
directory (where ``pip install --no-build-isolation ./python`` builds it), then ``$CACHE_DIT_OPD_BUILD_DIR/client/python``
and ``<repo>/build/client/python``. ``CACHE_DIT_OPD_NATIVE=0`` leaves it unused.

``c_api.cc`` is the contract: every prototype and struct here mirrors it, and
``opd_native_abi_version`` must match ``ABI_VERSION`` and ``opd_native_struct_bytes`` the ctypes structs.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import threading
from pathlib import Path

from . import _errors, _wire

log = logging.getLogger("cache_dit_opd")

ABI_VERSION = 4
LIB_NAME = "libcache_dit_opd_native.so"
_MAX_REJECTED = 64
# ProxyFallback in client/python/native_session.h, in order
FALLBACKS = ("no_session", "failed", "pending_errors", "capturing", "unknown_op", "argument", "region_miss",
             "rejected", "broken")


class OpdStatus(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int32), ("reason", ctypes.c_uint32), ("message", ctypes.c_char * 512)]

    def error(self) -> _errors.DaemonError:
        return _errors.DaemonError(self.code, self.reason, self.message.decode("utf-8", "replace"))


class OpdRejected(ctypes.Structure):
    _fields_ = [("ticket", ctypes.c_uint64), ("seq", ctypes.c_uint64), ("lane", ctypes.c_uint32),
                ("op_index", ctypes.c_uint32), ("code", ctypes.c_int32), ("reason", ctypes.c_uint32),
                ("nregions", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("regions", ctypes.c_uint64 * 32),
                ("message", ctypes.c_char * 256)]

    def error(self) -> _errors.DaemonError:
        return _errors.DaemonError(self.code, self.reason, self.message.decode("utf-8", "replace"))


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
    status = c.POINTER(OpdStatus)
    sig = {
        "opd_native_abi_version": (c.c_int, []),
        "opd_native_struct_bytes": (c.c_uint64, [c.c_int]),
        "opd_native_protocol_version": (c.c_int, []),
        "opd_native_register_kernel": (c.c_int, [c.c_char_p, c.c_char_p, c.c_size_t]),
        "opd_native_unregister_kernel": (c.c_int, [c.c_char_p]),
        "opd_native_open": (c.c_int64, [c.c_int, c.c_int, c.c_int, c.c_uint64, c.c_uint64, c.c_uint32, c.c_uint64,
                                        c.c_uint64, c.c_uint64, status]),
        "opd_native_close": (None, [c.c_int64]),
        "opd_native_activate": (c.c_int, [c.c_int64, c.c_int]),
        "opd_native_set_op": (c.c_int, [c.c_int64, c.c_char_p, c.c_uint32]),
        "opd_native_add_region": (c.c_int, [c.c_int64, c.c_uint64, c.c_uint64, c.c_uint64, c.c_uint64]),
        "opd_native_add_fixed_region": (c.c_int, [c.c_int64, c.c_uint64, c.c_uint64, c.c_uint64]),
        "opd_native_add_run_region": (c.c_int, [c.c_int64, c.POINTER(c.c_uint64), c.c_uint32, c.c_uint64]),
        "opd_native_forget_region": (c.c_int, [c.c_int64, c.c_uint64]),
        "opd_native_last_fallback": (c.c_int, [status]),
        "opd_native_take_rejected": (c.c_int, [c.c_int64, c.c_int, c.POINTER(OpdRejected), c.c_int]),
        "opd_native_fail": (None, [c.c_int64, c.c_int32, c.c_uint32, c.c_char_p]),
        "opd_native_failure": (c.c_int, [c.c_int64, status]),
        "opd_native_take_lost": (c.c_uint64, [c.c_int64]),
        "opd_native_state": (c.c_int, [c.c_int64, c.POINTER(c.c_uint64), c.c_int]),
        "opd_native_lane": (c.c_int, [c.c_int64, c.c_uint32, c.POINTER(c.c_uint64)]),
        "opd_native_set_async_process": (None, [c.c_int]),
        "opd_native_set_async_thread": (None, [c.c_int]),
    }
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype = res
        f.argtypes = args


def _torch_skew(path: Path) -> str | None:
    """Why an installed engine must not load under this torch (its C++ ABI), or None.

    ``pip install`` writes ``_native_build.json`` beside the engine it built (python/setup.py); an engine
    of a build folder has none and is the developer's to keep in step.
    """
    stamp = path.with_name("_native_build.json")
    if not stamp.is_file():
        return None
    import torch

    built = json.loads(stamp.read_text()).get("torch")
    if built != torch.__version__:
        return (f"{path} was built against torch {built}, this process runs torch {torch.__version__}: reinstall "
                f"the client (pip install --no-build-isolation ./python)")
    return None


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
        skew = _torch_skew(path)
        if skew is not None:
            _load_error = skew
            log.warning("cache_dit_opd: native library not used: %s", _load_error)
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
        if v != ABI_VERSION or lib.opd_native_protocol_version() != _wire.PROTOCOL_VERSION:
            _load_error = (f"{path}: ABI version {v} speaking protocol {lib.opd_native_protocol_version()}, this "
                           f"client needs ABI {ABI_VERSION} and protocol {_wire.PROTOCOL_VERSION} (rebuild it)")
            log.warning("cache_dit_opd: native library not used: %s", _load_error)
            return None
        sizes = [lib.opd_native_struct_bytes(i) for i in range(2)]
        if sizes != [ctypes.sizeof(OpdStatus), ctypes.sizeof(OpdRejected)]:
            _load_error = (f"{path}: its OpdStatus and OpdRejected have {sizes} bytes, this client's "
                           f"{[ctypes.sizeof(OpdStatus), ctypes.sizeof(OpdRejected)]} (c_api.cc and _native.py differ)")
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
    err = ctypes.create_string_buffer(512)
    if lib.opd_native_register_kernel(name_overload.encode(), err, len(err)) != 0:
        return err.value.decode(errors="replace")
    return None


def unregister_kernel(name: str) -> bool:
    """Takes the native kernel of the functional op ``name`` back out of the dispatcher (before its definition
    goes); whether it had one."""
    lib = library()
    return lib is not None and lib.opd_native_unregister_kernel(name.encode()) == 1


def set_async_process(enabled: bool) -> None:
    if _lib is not None:
        _lib.opd_native_set_async_process(1 if enabled else 0)


def set_async_thread(mode: bool | None) -> None:
    if _lib is not None:
        _lib.opd_native_set_async_thread(-1 if mode is None else int(bool(mode)))


def last_fallback() -> tuple[str, _errors.DaemonError | None]:
    """Why this thread's last native kernel handed its call to Python: a FALLBACKS name, and the daemon's
    rejection or the session's failure when there is one."""
    st = OpdStatus()
    why = _lib.opd_native_last_fallback(ctypes.byref(st))
    name = FALLBACKS[why] if 0 <= why < len(FALLBACKS) else "no_session"
    return name, (st.error() if st.code != 0 else None)


class NativeSession:
    """One bound session's engine (``client/python/native_session.h``); the control plane stays in Python."""

    def __init__(self, lib, *, device: int, memfd: int, channel_fd: int, memory_bytes: int, session_id: int,
                 lanes: int, spin_s: float, call_timeout_s: float, heartbeat_timeout_s: float):
        """Takes ownership of ``memfd`` and ``channel_fd`` (closed by the engine, also on failure)."""
        self._lib = lib
        st = OpdStatus()
        h = lib.opd_native_open(device, memfd, channel_fd, memory_bytes, session_id, lanes, int(spin_s * 1e9),
                                int(call_timeout_s * 1e9), int(max(0.0, heartbeat_timeout_s) * 1e9), ctypes.byref(st))
        if h == 0:
            raise st.error()
        self.handle = h

    def close(self) -> None:
        """Ends the session on this side; the engine frees the memory once no stream can wait on it."""
        if self.handle:
            self._lib.opd_native_close(self.handle)
            self.handle = 0

    def activate(self, active: bool = True) -> None:
        self._lib.opd_native_activate(self.handle, 1 if active else 0)

    def set_op(self, name_overload: str, op_index: int) -> None:
        self._lib.opd_native_set_op(self.handle, name_overload.encode(), op_index)

    def add_region(self, base: int, size: int, buffer_id: int, region_id: int) -> None:
        self._lib.opd_native_add_region(self.handle, base, size, buffer_id, region_id)

    def add_fixed_region(self, base: int, size: int, region_id: int) -> None:
        """A range this process mapped itself (an attached store block): the engine trusts it without the driver."""
        self._lib.opd_native_add_fixed_region(self.handle, base, size, region_id)

    def add_run_region(self, chunks, region_id: int) -> None:
        """A run of virtual-memory chunks ((base, size, buffer id), in address order) registered as one region."""
        flat = (ctypes.c_uint64 * (3 * len(chunks)))(*(v for c in chunks for v in c))
        self._lib.opd_native_add_run_region(self.handle, flat, len(chunks), region_id)

    def forget_region(self, base: int) -> None:
        self._lib.opd_native_forget_region(self.handle, base)

    def take_rejected(self, wait: bool = False) -> list[OpdRejected]:
        """Rejected asynchronous calls (copies); ``wait``: first wait for every record in flight."""
        out: list = []
        buf = (OpdRejected * _MAX_REJECTED)()
        while True:
            n = self._lib.opd_native_take_rejected(self.handle, 1 if wait and not out else 0, buf, _MAX_REJECTED)
            if n < 0:  # the wait failed: the session failed meanwhile (its failure reports the rest)
                return out
            out.extend(OpdRejected.from_buffer_copy(buf[i]) for i in range(n))
            if n < _MAX_REJECTED:
                return out

    def fail(self, e: _errors.DaemonError) -> None:
        self._lib.opd_native_fail(self.handle, e.code, e.reason, e.message.encode(errors="replace"))

    def failure(self) -> _errors.DaemonError | None:
        st = OpdStatus()
        rc = self._lib.opd_native_failure(self.handle, ctypes.byref(st)) if self.handle else -1
        if rc == 0:
            return None
        return st.error() if rc == 1 else _errors.DaemonError(9, 6, "the native session is closed")

    def take_lost(self) -> int:
        return self._lib.opd_native_take_lost(self.handle) if self.handle else 0

    def state(self) -> dict:
        n = 9 + len(FALLBACKS)
        v = (ctypes.c_uint64 * n)()
        self._lib.opd_native_state(self.handle, v, n)
        return {"in_flight": v[0], "unanswered_async": v[1], "lanes_behind": bool(v[2]), "native_calls": v[3],
                "ring_wakes": v[4], "ring_full_waits": v[5], "lanes": v[6], "published": v[7],
                "ring_capacity": v[8], "fallbacks": {r: v[9 + i] for i, r in enumerate(FALLBACKS)}}

    def lane(self, index: int) -> dict:
        v = (ctypes.c_uint64 * 3)()
        if self._lib.opd_native_lane(self.handle, index, v) != 0:
            raise IndexError(f"lane {index}")
        return {"issued": v[0], "inputs_ready": v[1], "done": v[2]}
