"""The CUDA driver entry points the Python control plane needs (exporting regions, mapping weight-store
blocks read-only), through ctypes.

Loaded lazily: importing this module (and the package) needs no driver, and
``libcuda.so.1`` is opened only when a region is first registered. Entry points
come from ``cuGetProcAddress`` at an explicit CUDA version (12000), never from
the unversioned symbols (the native engine's table, common/cuda/driver_api.cc,
says why). Stream operations and host registration are the native engine's.

Regions are exported with the driver's legacy IPC handle (64 raw bytes), not
with torch's private sharing format, whose version byte changes between torch
releases.
"""

from __future__ import annotations

import ctypes
import threading

# CUpointer_attribute
CU_POINTER_ATTRIBUTE_BUFFER_ID = 7
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11
CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12

CU_GET_PROC_ADDRESS_LEGACY_STREAM = 1 << 0

# Virtual memory management (a weight-store block's descriptor, session_memory.h StoreAttachReply)
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
CU_MEM_LOCATION_TYPE_DEVICE = 0x1
CU_MEM_ACCESS_FLAGS_PROT_READ = 0x1

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1

IPC_HANDLE_BYTES = 64
# The ABI version the entry points are requested at (CUDA 12.0).
_PROC_VERSION = 12000

_LIB_NAME = "libcuda.so.1"


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; ``code`` is the CUresult."""

    def __init__(self, func: str, code: int, name: str):
        super().__init__(f"{func} failed: {name} ({code})")
        self.func = func
        self.code = code


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemAccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _MemLocation), ("flags", ctypes.c_int)]


class Driver:
    """Typed wrappers over libcuda entry points. Create through ``get_driver()``."""

    def __init__(self, lib_name: str = _LIB_NAME):
        self._lib = ctypes.CDLL(lib_name)
        self._get_proc = self._resolve_get_proc_address()
        fn = self._proc
        self._cuInit = fn("cuInit", [ctypes.c_uint])
        self._cuGetErrorName = fn("cuGetErrorName", [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)])
        self._cuDriverGetVersion = fn("cuDriverGetVersion", [ctypes.POINTER(ctypes.c_int)])
        self._cuPointerGetAttributes = fn(
            "cuPointerGetAttributes",
            [ctypes.c_uint, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint64],
        )
        self._cuIpcGetMemHandle = fn("cuIpcGetMemHandle", [ctypes.c_char_p, ctypes.c_uint64])
        u64, size_t = ctypes.c_uint64, ctypes.c_size_t
        self._cuMemImportFromShareableHandle = fn("cuMemImportFromShareableHandle",
                                                  [ctypes.POINTER(u64), ctypes.c_void_p, ctypes.c_int])
        self._cuMemAddressReserve = fn("cuMemAddressReserve", [ctypes.POINTER(u64), size_t, size_t, u64, u64])
        self._cuMemAddressFree = fn("cuMemAddressFree", [u64, size_t])
        self._cuMemMap = fn("cuMemMap", [u64, size_t, size_t, u64, u64])
        self._cuMemUnmap = fn("cuMemUnmap", [u64, size_t])
        self._cuMemRelease = fn("cuMemRelease", [u64])
        self._cuMemSetAccess = fn("cuMemSetAccess", [u64, size_t, ctypes.POINTER(_MemAccessDesc), size_t])
        self._cuMemGetAddressRange = fn("cuMemGetAddressRange", [ctypes.POINTER(u64), ctypes.POINTER(size_t), u64])
        self._cuMemRetainAllocationHandle = fn("cuMemRetainAllocationHandle", [ctypes.POINTER(u64), ctypes.c_void_p])
        self._cuMemExportToShareableHandle = fn("cuMemExportToShareableHandle",
                                                [ctypes.POINTER(ctypes.c_int), u64, ctypes.c_int, u64])
        self._check("cuInit", self._cuInit(0))
        self._tls = threading.local()
        attrs = (ctypes.c_int * 3)(
            CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE, CU_POINTER_ATTRIBUTE_BUFFER_ID
        )
        self._range_attrs = attrs

    # -- loading ---------------------------------------------------------------
    def _resolve_get_proc_address(self):
        lib = self._lib
        try:  # CUDA >= 12.0 drivers: cuGetProcAddress_v2 reports why a symbol is missing.
            f = lib.cuGetProcAddress_v2
            f.restype = ctypes.c_int
            f.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                          ctypes.POINTER(ctypes.c_int)]

            def get(name: str) -> int:
                ptr, status = ctypes.c_void_p(), ctypes.c_int(0)
                rc = f(name.encode(), ctypes.byref(ptr), _PROC_VERSION, CU_GET_PROC_ADDRESS_LEGACY_STREAM,
                       ctypes.byref(status))
                if rc != CUDA_SUCCESS or not ptr.value:
                    raise CudaDriverError(f"cuGetProcAddress_v2({name!r}, {_PROC_VERSION})", rc,
                                          f"symbol status {status.value}")
                return ptr.value
        except AttributeError:  # CUDA 11.3 - 11.8 drivers
            f = lib.cuGetProcAddress
            f.restype = ctypes.c_int
            f.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64]

            def get(name: str) -> int:
                ptr = ctypes.c_void_p()
                rc = f(name.encode(), ctypes.byref(ptr), _PROC_VERSION, CU_GET_PROC_ADDRESS_LEGACY_STREAM)
                if rc != CUDA_SUCCESS or not ptr.value:
                    raise CudaDriverError(f"cuGetProcAddress({name!r}, {_PROC_VERSION})", rc, "symbol not found")
                return ptr.value
        return get

    def _proc(self, name: str, argtypes):
        proto = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)
        return proto(self._get_proc(name))

    def _error_name(self, code: int) -> str:
        s = ctypes.c_char_p()
        if self._cuGetErrorName(code, ctypes.byref(s)) == CUDA_SUCCESS and s.value:
            return s.value.decode()
        return "CUDA_ERROR_UNKNOWN"

    def _check(self, func: str, rc: int) -> None:
        if rc != CUDA_SUCCESS:
            raise CudaDriverError(func, rc, self._error_name(rc))

    # -- queries ---------------------------------------------------------------
    def driver_version(self) -> int:
        v = ctypes.c_int()
        self._check("cuDriverGetVersion", self._cuDriverGetVersion(ctypes.byref(v)))
        return v.value

    def pointer_range(self, ptr: int) -> tuple[int, int, int]:
        """(allocation base, allocation size, buffer id) of the allocation holding ``ptr``.

        One driver call (cuPointerGetAttributes). For an address that no live
        CUDA allocation covers the driver reports zeros, returned as is.
        """
        tls = self._tls
        view = getattr(tls, "view", None)
        if view is None:  # per thread: three u64 results, zeroed and read through a memoryview (no ctypes fields)
            buf = tls.buf = (ctypes.c_uint64 * 3)()
            base = ctypes.addressof(buf)
            tls.data = (ctypes.c_void_p * 3)(base, base + 8, base + 16)
            view = tls.view = memoryview(buf).cast("B").cast("Q")
        view[0] = view[1] = view[2] = 0
        rc = self._cuPointerGetAttributes(3, self._range_attrs, tls.data, ptr)
        if rc != CUDA_SUCCESS:
            raise CudaDriverError(f"cuPointerGetAttributes(0x{ptr:x})", rc, self._error_name(rc))
        return view[0], view[1], view[2]

    def legacy_ipc_capable(self, ptr: int) -> bool:
        """CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: False for VMM (cuMemCreate) memory."""
        attr = (ctypes.c_int * 1)(CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE)
        val = ctypes.c_int(0)
        data = (ctypes.c_void_p * 1)(ctypes.addressof(val))
        self._check(f"cuPointerGetAttributes(0x{ptr:x})", self._cuPointerGetAttributes(1, attr, data, ptr))
        return bool(val.value)

    def ipc_get_mem_handle(self, base: int) -> bytes:
        buf = ctypes.create_string_buffer(IPC_HANDLE_BYTES)
        self._check(f"cuIpcGetMemHandle(0x{base:x})", self._cuIpcGetMemHandle(buf, base))
        return buf.raw

    # -- virtual memory (PyTorch's expandable segments) ---------------------------------
    def chunk_range(self, ptr: int) -> tuple[int, int]:
        """(base, size) of the virtual-memory chunk (one cuMemMap'd physical allocation) holding ``ptr``:
        ``cuMemGetAddressRange``, which reports the chunk where the pointer attributes report the reservation."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._check(f"cuMemGetAddressRange(0x{ptr:x})",
                    self._cuMemGetAddressRange(ctypes.byref(base), ctypes.byref(size), ptr))
        return base.value, size.value

    def buffer_id(self, ptr: int) -> int:
        """CU_POINTER_ATTRIBUTE_BUFFER_ID: for virtual memory, the id of the chunk holding ``ptr``."""
        attr = (ctypes.c_int * 1)(CU_POINTER_ATTRIBUTE_BUFFER_ID)
        val = ctypes.c_uint64(0)
        data = (ctypes.c_void_p * 1)(ctypes.addressof(val))
        self._check(f"cuPointerGetAttributes(0x{ptr:x})", self._cuPointerGetAttributes(1, attr, data, ptr))
        return val.value

    def export_chunk_fd(self, ptr: int) -> int:
        """A POSIX descriptor of the chunk holding ``ptr`` (its allocation made with that handle type, as
        PyTorch's expandable segments are); the caller closes it."""
        handle = ctypes.c_uint64()
        self._check(f"cuMemRetainAllocationHandle(0x{ptr:x})",
                    self._cuMemRetainAllocationHandle(ctypes.byref(handle), ctypes.c_void_p(ptr)))
        try:
            fd = ctypes.c_int(-1)
            self._check("cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)",
                        self._cuMemExportToShareableHandle(ctypes.byref(fd), handle.value,
                                                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0))
        finally:
            self._cuMemRelease(handle.value)
        return fd.value

    def map_readonly(self, fd: int, size: int, device: int) -> int:
        """Maps ``size`` bytes of the virtual-memory allocation whose POSIX descriptor is ``fd`` (another
        process exported it) read-only for ``device`` (this process's ordinal, its context current); the
        base address. A kernel of this process that writes there faults in this process's context only.
        The caller keeps ``fd`` (closing it does not affect the mapping) and calls ``unmap``."""
        handle = ctypes.c_uint64()
        self._check("cuMemImportFromShareableHandle",
                    self._cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd),
                                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        ptr = ctypes.c_uint64()
        try:  # each step is undone when a later one fails; the mapping keeps the memory once made
            self._check(f"cuMemAddressReserve({size})", self._cuMemAddressReserve(ctypes.byref(ptr), size, 0, 0, 0))
            try:
                self._check("cuMemMap", self._cuMemMap(ptr.value, size, 0, handle.value, 0))
                try:
                    desc = _MemAccessDesc(_MemLocation(CU_MEM_LOCATION_TYPE_DEVICE, device),
                                          CU_MEM_ACCESS_FLAGS_PROT_READ)
                    self._check("cuMemSetAccess(PROT_READ)", self._cuMemSetAccess(ptr.value, size, ctypes.byref(desc), 1))
                except BaseException:
                    self._cuMemUnmap(ptr.value, size)
                    raise
            except BaseException:
                self._cuMemAddressFree(ptr.value, size)
                raise
        finally:
            self._cuMemRelease(handle.value)
        return ptr.value

    def unmap(self, base: int, size: int) -> None:
        """Undoes ``map_readonly`` (the caller has made sure no work of this process still reads it)."""
        self._check(f"cuMemUnmap(0x{base:x})", self._cuMemUnmap(base, size))
        self._check(f"cuMemAddressFree(0x{base:x})", self._cuMemAddressFree(base, size))


_driver: Driver | None = None
_driver_error: Exception | None = None
_driver_lock = threading.Lock()


def get_driver() -> Driver:
    """The process's Driver, created on first use; raises the load error otherwise."""
    global _driver, _driver_error
    if _driver is not None:
        return _driver
    with _driver_lock:
        if _driver is None:
            try:
                _driver = Driver()
                _driver_error = None
            except (OSError, AttributeError, CudaDriverError) as e:
                _driver_error = e
                raise RuntimeError(f"cache_dit_opd: cannot use the CUDA driver ({_LIB_NAME}): {e}") from e
    return _driver
