"""The session channel messages and the session shared-memory layout, as the Python client uses them.

Every number comes from ``_wire`` (generated from ``proto/cache_dit_opd/v1/session_memory.h``);
this module only shapes them into ``struct.Struct`` objects and offsets.
"""

from __future__ import annotations

import struct

from . import _wire

PAGE_BYTES = 4096  # mmap granularity of the session memory (its offsets are multiples of it)


def struct_of(fields: dict, size: int) -> struct.Struct:
    """A little-endian ``struct.Struct`` of ``size`` bytes with ``fields`` at their offsets, padding between."""
    fmt, at = "<", 0
    for off, f in sorted(fields.values()):
        code = f[1:]
        if off > at:
            fmt += f"{off - at}x"
        fmt += code
        at = off + struct.calcsize("<" + code)
    if size > at:
        fmt += f"{size - at}x"
    s = struct.Struct(fmt)
    assert s.size == size, (fields, size)
    return s


PROTOCOL_VERSION = _wire.PROTOCOL_VERSION
LAYOUT_VERSION = _wire.LAYOUT_VERSION
SESSION_MEMORY_MAGIC = _wire.SESSION_MEMORY_MAGIC
BIND_REQUEST_MAGIC = _wire.BIND_REQUEST_MAGIC
TOKEN_BYTES = _wire.TOKEN_BYTES
LANES_OFFSET = _wire.LANES_OFFSET

BIND_REQUEST = struct_of(_wire.BIND_REQUEST_FIELDS, _wire.BIND_REQUEST_SIZE)
BIND_REQUEST_SIZE = _wire.BIND_REQUEST_SIZE
BIND_REPLY = struct_of(_wire.BIND_REPLY_FIELDS, _wire.BIND_REPLY_SIZE)
BIND_REPLY_SIZE = _wire.BIND_REPLY_SIZE

STORE_ATTACH_MAGIC = _wire.STORE_ATTACH_MAGIC
STORE_ATTACH_REQUEST = struct_of(_wire.STORE_ATTACH_REQUEST_FIELDS, _wire.STORE_ATTACH_REQUEST_SIZE)
STORE_ATTACH_REQUEST_SIZE = _wire.STORE_ATTACH_REQUEST_SIZE
STORE_ATTACH_REPLY_SIZE = _wire.STORE_ATTACH_REPLY_SIZE

VMM_REGION_MAGIC = _wire.VMM_REGION_MAGIC
MAX_VMM_CHUNKS = _wire.MAX_VMM_CHUNKS
VMM_REGION_REQUEST = struct_of(_wire.VMM_REGION_REQUEST_FIELDS, _wire.VMM_REGION_REQUEST_SIZE)
VMM_REGION_REPLY = struct_of(_wire.VMM_REGION_REPLY_FIELDS, _wire.VMM_REGION_REPLY_SIZE)
VMM_REGION_REPLY_SIZE = _wire.VMM_REGION_REPLY_SIZE


def pack_vmm_request(session_id: int, token: bytes, chunks) -> bytes:
    """A VmmRegionRequest for ``chunks`` ((base, size, buffer id) in address order)."""
    pad = [0] * (MAX_VMM_CHUNKS - len(chunks))
    return VMM_REGION_REQUEST.pack(VMM_REGION_MAGIC, _wire.PROTOCOL_VERSION, session_id, token, chunks[0][0],
                                   len(chunks), 0, *(c[1] for c in chunks), *pad, *(c[2] for c in chunks), *pad)

HEADER_SIZE = _wire.SESSION_HEADER_SIZE
HEADER_FIELDS = _wire.SESSION_HEADER_FIELDS

LANE_STRIDE = _wire.LANE_SIZE
LANE_INPUTS_READY_OFFSET = _wire.LANE_FIELDS["inputs_ready"][0]
LANE_DONE_OFFSET = _wire.LANE_FIELDS["done"][0]


def read_fields(fields: dict, buf) -> dict:
    """Decodes ``fields`` ({name: (offset, format)}) from ``buf``: a number, bytes, or a tuple for an array."""
    out = {}
    for name, (off, fmt) in fields.items():
        v = struct.unpack_from(fmt, buf, off)
        out[name] = v[0] if len(v) == 1 else v
    return out


def read_header(buf) -> dict:
    """Decodes the header fields from a buffer of at least HEADER_SIZE bytes."""
    return read_fields(HEADER_FIELDS, buf)


def read_attach_reply(buf) -> dict:
    """Decodes a StoreAttachReply of STORE_ATTACH_REPLY_SIZE bytes (``shape`` cut to ``ndim``)."""
    r = read_fields(_wire.STORE_ATTACH_REPLY_FIELDS, buf)
    r["shape"] = tuple(r["shape"][:min(r["ndim"], _wire.MAX_TENSOR_DIMS)])
    r["message"] = r["message"].split(b"\0", 1)[0].decode(errors="replace")
    return r
