"""Probe: what PyTorch's expandable segments look like to the CUDA driver, for exporting them to the daemon.

Run with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` on a CUDA host; prints one JSON object. For
tensors of several sizes: the driver's range of the pointer (``cuPointerGetAttributes`` RANGE_START_ADDR /
RANGE_SIZE, BUFFER_ID, IS_LEGACY_CUDA_IPC_CAPABLE), ``cuMemGetAddressRange``, the physical allocation behind
it (``cuMemRetainAllocationHandle``: its requested handle types, ``cuMemGetAllocationPropertiesFromHandle``),
and whether ``cuMemExportToShareableHandle`` gives a POSIX file descriptor for it.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 bench/probes/expandable_segments.py
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import torch  # noqa: E402

from cache_dit_opd import _cuda_driver as cd  # noqa: E402


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class AllocProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", AllocFlags)]


def main() -> None:
    torch.cuda.init()
    d = cd.get_driver()
    u64 = ctypes.c_uint64
    retain = d._proc("cuMemRetainAllocationHandle", [ctypes.POINTER(u64), ctypes.c_void_p])
    props = d._proc("cuMemGetAllocationPropertiesFromHandle", [ctypes.POINTER(AllocProp), u64])
    export = d._proc("cuMemExportToShareableHandle", [ctypes.c_void_p, u64, ctypes.c_int, u64])
    release = d._proc("cuMemRelease", [u64])
    addr_range = d._proc("cuMemGetAddressRange", [ctypes.POINTER(u64), ctypes.POINTER(ctypes.c_size_t), u64])
    out = {"torch": torch.__version__, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "tensors": []}
    keep = []
    for nbytes in (1 << 20, 30 << 20, 300 << 20):
        t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        keep.append(t)
        p = t.data_ptr()
        rec = {"bytes": nbytes, "ptr": hex(p)}
        try:
            base, size, bid = d.pointer_range(p)
            rec.update(range_start=hex(base), range_size=size, buffer_id=bid, offset_in_range=p - base,
                       legacy_ipc=d.legacy_ipc_capable(p))
            end_base, end_size, end_bid = d.pointer_range(p + nbytes - 1)
            rec.update(last_byte_range_start=hex(end_base), last_byte_buffer_id=end_bid)
        except Exception as e:  # noqa: BLE001
            rec["pointer_attributes_error"] = str(e)
        b, s = u64(), ctypes.c_size_t()
        rc = addr_range(ctypes.byref(b), ctypes.byref(s), p)
        rec["cuMemGetAddressRange"] = [rc, hex(b.value), s.value]
        h = u64()
        rc = retain(ctypes.byref(h), ctypes.c_void_p(p))
        rec["cuMemRetainAllocationHandle"] = rc
        if rc == 0:
            prop = AllocProp()
            rec["cuMemGetAllocationPropertiesFromHandle"] = props(ctypes.byref(prop), h.value)
            rec["requested_handle_types"] = prop.requestedHandleTypes
            rec["location"] = [prop.location.type, prop.location.id]
            fd = ctypes.c_int(-1)
            rec["export_posix_fd"] = export(ctypes.byref(fd), h.value, cd.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
            if fd.value >= 0:
                rec["exported_fd_size"] = os.fstat(fd.value).st_size
                os.close(fd.value)
            release(h.value)
        out["tensors"].append(rec)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
