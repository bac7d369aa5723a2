"""Mirror of ``proto/cache_dit_opd/v1/session_memory.h`` (layout version 1).

The session channel messages and the session shared-memory layout are part of
the protocol, like ``opd.proto``. This module restates the header's constants,
sizes and field offsets for the Python client; ``tests/python/test_client_layout.py``
parses the header and checks that every value here agrees with it.
"""

from __future__ import annotations

import struct

PROTOCOL_VERSION = 1  # kProtocolVersion
LAYOUT_VERSION = 1  # kLayoutVersion
SESSION_MEMORY_MAGIC = 0x504F4443  # kSessionMemoryMagic, "CDOP" little-endian
BIND_REQUEST_MAGIC = 0x444E4942  # kBindRequestMagic, "BIND"
TOKEN_BYTES = 32  # kTokenBytes
LANES_OFFSET = 4096  # kLanesOffset

# struct BindRequest { u32 magic; u32 protocol_version; u64 session_id; u8 token[32]; }
BIND_REQUEST = struct.Struct("<IIQ32s")
BIND_REQUEST_SIZE = 48
# struct BindReply { i32 status_code; u32 layout_version; u64 shared_memory_bytes; char message[256]; }
BIND_REPLY = struct.Struct("<iIQ256s")
BIND_REPLY_SIZE = 272

# struct SessionMemoryHeader: field -> (byte offset, struct format)
HEADER_SIZE = 4096
HEADER_FIELDS = {
    "magic": (0, "<I"),
    "layout_version": (4, "<I"),
    "total_bytes": (8, "<Q"),
    "session_id": (16, "<Q"),
    "lane_count": (24, "<I"),
    "lane_stride": (28, "<I"),
    "lanes_offset": (32, "<Q"),
    "ring_offset": (40, "<Q"),
    "ring_bytes": (48, "<Q"),
    "daemon_pid": (56, "<Q"),
    "daemon_heartbeat": (64, "<Q"),
}
HEADER_RESERVED_OFFSET = 72

# struct alignas(64) LaneSemaphores { u64 inputs_ready; u8 pad0[56]; u64 done; u8 pad1[56]; }
LANE_STRIDE = 128
LANE_INPUTS_READY_OFFSET = 0
LANE_DONE_OFFSET = 64

PAGE_BYTES = 4096


def read_header(buf) -> dict:
    """Decodes the header fields from a buffer of at least HEADER_SIZE bytes."""
    return {name: struct.unpack_from(fmt, buf, off)[0] for name, (off, fmt) in HEADER_FIELDS.items()}
