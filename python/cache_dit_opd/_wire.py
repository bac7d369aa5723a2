"""The contract's numbers for the Python client: GENERATED, do not edit.

Written by proto/tools/wire_py.cc from proto/cache_dit_opd/v1/{wire,session_memory,ring}.h
(build/proto/opd_wire_py > python/cache_dit_opd/_wire.py); tests/python/test_client_wire.py
checks that this file is what the headers say. Offsets and sizes are the compiler's.
"""

# ---- wire.h
# torch dtype name -> wire DType value (opd.proto DTYPE_<NAME>)
DTYPE_IDS = {
    "float32": 1,
    "float16": 2,
    "bfloat16": 3,
    "float8_e4m3fn": 4,
    "uint8": 5,
    "int8": 6,
    "int32": 7,
    "int64": 8,
    "float64": 9,
    "bool": 10,
    "float8_e5m2": 11,
}
# wire DType value -> bytes per element
DTYPE_SIZES = {
    1: 4,
    2: 2,
    3: 2,
    4: 1,
    5: 1,
    6: 1,
    7: 4,
    8: 8,
    9: 8,
    10: 1,
    11: 1,
}
DTYPE_COUNT = 12  # kDTypeCount: valid values are 1 .. DTYPE_COUNT - 1
MAX_TENSOR_DIMS = 8  # kMaxTensorDims
MAX_ARGS = 32  # kMaxArgs
MAX_LIST_LENGTH = 64  # kMaxListLength
MAX_STORE_NAME_BYTES = 512  # kMaxStoreNameBytes
NO_REGION = 0  # kNoRegion: the region id of an empty view (no memory)
# ClientAction: what a client does about an error (wire.h)
ACTIONS = {
    "raise_value": 1,
    "raise": 2,
    "reregister": 3,
    "reconnect": 4,
    "fail": 5,
}
# Reason: name -> (value, google.rpc.Code, action)
REASONS = {
    "BAD_ARGUMENT": (1, 3, 1),
    "UNSUPPORTED": (2, 12, 2),
    "OP_UNKNOWN": (3, 5, 2),
    "REGION_UNKNOWN": (4, 5, 3),
    "SESSION_UNKNOWN": (5, 5, 4),
    "SESSION_ENDED": (6, 9, 4),
    "SESSION_UNBOUND": (7, 9, 4),
    "BAD_TOKEN": (8, 7, 4),
    "LANE_SEQUENCE": (9, 3, 4),
    "LANE_RANGE": (10, 3, 5),
    "MALFORMED": (11, 3, 5),
    "RESOURCE_EXHAUSTED": (12, 8, 2),
    "PEER_REFUSED": (13, 7, 5),
    "VERSION_MISMATCH": (14, 9, 5),
    "WRONG_DEVICE": (15, 9, 5),
    "NOT_SERVING": (16, 14, 5),
    "DRAINING": (17, 14, 4),
    "DEVICE_LOST": (18, 14, 4),
    "BIND_TIMEOUT": (19, 4, 4),
    "CLOSED": (20, 1, 4),
    "INTERNAL": (21, 13, 5),
    "INPUTS_STALLED": (22, 4, 4),
    "STORE_UNKNOWN": (23, 5, 2),
    "STORE_EXISTS": (24, 6, 2),
    "STORE_DENIED": (25, 7, 2),
}
# google.rpc.Code -> action, for an error without a reason (others: fail)
CODE_ACTIONS = {
    1: 4,
    2: 4,
    3: 1,
    4: 4,
    8: 2,
    10: 4,
    11: 1,
    12: 2,
    14: 4,
}
REASON_METADATA_KEY = "cache-dit-opd-reason"  # kReasonMetadataKey

# ---- session_memory.h
PROTOCOL_VERSION = 2  # kProtocolVersion
LAYOUT_VERSION = 2  # kLayoutVersion
SESSION_MEMORY_MAGIC = 0x504F4443  # kSessionMemoryMagic
BIND_REQUEST_MAGIC = 0x444E4942  # kBindRequestMagic
STORE_ATTACH_MAGIC = 0x48435441  # kStoreAttachMagic
VMM_REGION_MAGIC = 0x4D4D5652  # kVmmRegionMagic
MAX_VMM_CHUNKS = 240  # kMaxVmmChunks
TOKEN_BYTES = 32  # kTokenBytes
LANES_OFFSET = 4096  # kLanesOffset

# struct BindRequest
BIND_REQUEST_SIZE = 48
BIND_REQUEST_FIELDS = {
    "magic": (0, "<I"),
    "protocol_version": (4, "<I"),
    "session_id": (8, "<Q"),
    "token": (16, "<32s"),
}

# struct BindReply
BIND_REPLY_SIZE = 272
BIND_REPLY_FIELDS = {
    "status_code": (0, "<i"),
    "layout_version": (4, "<I"),
    "shared_memory_bytes": (8, "<Q"),
    "reason": (16, "<I"),
    "message": (20, "<252s"),
}

# struct StoreAttachRequest
STORE_ATTACH_REQUEST_SIZE = 568
STORE_ATTACH_REQUEST_FIELDS = {
    "magic": (0, "<I"),
    "protocol_version": (4, "<I"),
    "session_id": (8, "<Q"),
    "token": (16, "<32s"),
    "name_bytes": (48, "<I"),
    "reserved": (52, "<I"),
    "name": (56, "<512s"),
}

# struct StoreAttachReply
STORE_ATTACH_REPLY_SIZE = 384
STORE_ATTACH_REPLY_FIELDS = {
    "status_code": (0, "<i"),
    "reason": (4, "<I"),
    "region_id": (8, "<Q"),
    "daemon_instance": (16, "<Q"),
    "block_id": (24, "<Q"),
    "block_bytes": (32, "<Q"),
    "offset": (40, "<Q"),
    "bytes": (48, "<Q"),
    "dtype": (56, "<I"),
    "ndim": (60, "<I"),
    "shape": (64, "<8q"),
    "message": (128, "<256s"),
}

# struct VmmRegionRequest
VMM_REGION_REQUEST_SIZE = 3904
VMM_REGION_REQUEST_FIELDS = {
    "magic": (0, "<I"),
    "protocol_version": (4, "<I"),
    "session_id": (8, "<Q"),
    "token": (16, "<32s"),
    "client_base": (48, "<Q"),
    "chunk_count": (56, "<I"),
    "reserved": (60, "<I"),
    "chunk_bytes": (64, "<240Q"),
    "chunk_ids": (1984, "<240Q"),
}

# struct VmmRegionReply
VMM_REGION_REPLY_SIZE = 280
VMM_REGION_REPLY_FIELDS = {
    "status_code": (0, "<i"),
    "reason": (4, "<I"),
    "region_id": (8, "<Q"),
    "mapped_bytes": (16, "<Q"),
    "message": (24, "<256s"),
}

# struct SessionMemoryHeader
SESSION_HEADER_SIZE = 4096
SESSION_HEADER_FIELDS = {
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

# struct LaneSemaphores
LANE_SIZE = 128
LANE_FIELDS = {
    "inputs_ready": (0, "<Q"),
    "done": (64, "<Q"),
}

# ---- ring.h
RING_VERSION = 2  # kRingVersion
RING_CONTROL_BYTES = 256  # kRingControlBytes
SLOT_BYTES = 2048  # kSlotBytes
COMPLETION_BYTES = 256  # kCompletionBytes
DEFAULT_RING_CAPACITY = 64  # kDefaultRingCapacity
RECORD_MAGIC = 0x4C4C4143  # kRecordMagic
DOORBELL_AWAKE = 0  # kDoorbellAwake
DOORBELL_SLEEPING = 1  # kDoorbellSleeping
# RingArgKind
ARG_KINDS = {
    "none": 0,
    "tensor": 1,
    "int": 2,
    "float": 3,
    "bool": 4,
    "int_list": 5,
    "float_list": 6,
    "bool_list": 7,
}

# struct RingControl
RING_CONTROL_SIZE = 256
RING_CONTROL_FIELDS = {
    "version": (0, "<I"),
    "capacity": (4, "<I"),
    "slot_bytes": (8, "<I"),
    "completion_bytes": (12, "<I"),
    "sq_tail": (64, "<Q"),
    "sq_head": (128, "<Q"),
    "doorbell": (192, "<I"),
}

# struct RingArgHeader
ARG_HEADER_SIZE = 8
ARG_HEADER_FIELDS = {
    "kind": (0, "<I"),
    "count": (4, "<I"),
}

# struct RecordHeader
RECORD_HEADER_SIZE = 64
RECORD_HEADER_FIELDS = {
    "magic": (0, "<I"),
    "record_bytes": (4, "<I"),
    "ticket": (8, "<Q"),
    "seq": (16, "<Q"),
    "lane": (24, "<I"),
    "op_index": (28, "<I"),
    "nargs": (32, "<I"),
    "flags": (36, "<I"),
    "reserved": (40, "<24s"),
}

# struct CompletionRecord
COMPLETION_SIZE = 256
COMPLETION_FIELDS = {
    "done_ticket": (0, "<Q"),
    "ticket": (8, "<Q"),
    "seq": (16, "<Q"),
    "lane": (24, "<I"),
    "status_code": (28, "<i"),
    "reason": (32, "<I"),
    "message": (36, "<220s"),
}
