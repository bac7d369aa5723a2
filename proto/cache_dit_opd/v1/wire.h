// File: proto/cache_dit_opd/v1/wire.h
//
// The numbers every transport shares: the wire dtypes (opd.proto's enum
// DType, the ring record's tensor dtype), the limits a call obeys on any
// transport (the ring's fixed record layout is sized from them), and the
// rejection reasons with what a client does about each (opd.proto's enum
// Reason; carried by gRPC errors, ring completions and bind replies). Part of the contract, like opd.proto, ring.h and session_memory.h:
// client and daemon consume these values, nobody redefines them. The Python
// client's copy is generated from this header (python/cache_dit_opd/_wire.py,
// written by proto/tools/wire_py.cc).
//
// Never renumber a dtype; a new one takes the next value and bumps kDTypeCount.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cache_dit_opd::v1 {

// X(enumerator, value, torch name, bytes per element, opd.proto name): the
// torch name is what `str(torch.<dtype>)` prints after "torch."; opd.proto
// spells the same value DTYPE_<proto name> (the daemon static_asserts that
// the two agree). 0 is "unspecified", not a dtype.
#define CACHE_DIT_OPD_WIRE_DTYPES(X)                       \
  X(kFloat32, 1, "float32", 4, FLOAT32)                   \
  X(kFloat16, 2, "float16", 2, FLOAT16)                   \
  X(kBFloat16, 3, "bfloat16", 2, BFLOAT16)                \
  X(kFloat8E4M3FN, 4, "float8_e4m3fn", 1, FLOAT8_E4M3FN)  \
  X(kUInt8, 5, "uint8", 1, UINT8)                         \
  X(kInt8, 6, "int8", 1, INT8)                            \
  X(kInt32, 7, "int32", 4, INT32)                         \
  X(kInt64, 8, "int64", 8, INT64)                         \
  X(kFloat64, 9, "float64", 8, FLOAT64)                   \
  X(kBool, 10, "bool", 1, BOOL)                           \
  X(kFloat8E5M2, 11, "float8_e5m2", 1, FLOAT8_E5M2)

// (The enum itself is common/call.h's DType, built from this table: the
// generated protobuf code owns the name cache_dit_opd::v1::DType.)

// One past the largest wire dtype value: valid values are 1 .. kDTypeCount - 1.
inline constexpr int32_t kDTypeCount = 0
#define CACHE_DIT_OPD_X(e, v, name, bytes, proto) +1
    CACHE_DIT_OPD_WIRE_DTYPES(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
    + 1;

// True for the values protocol v1 defines (kUnspecified is not a dtype).
inline constexpr bool IsWireDType(int64_t value) { return value >= 1 && value < kDTypeCount; }

// Limits that hold for every transport.
inline constexpr int kMaxTensorDims = 8;
inline constexpr int kMaxArgs = 32;
inline constexpr int kMaxListLength = 64;
// A weight-store entry's name: segments of [A-Za-z0-9._-] joined by '/'
// (server/store/weight_store.h has the rules).
inline constexpr size_t kMaxStoreNameBytes = 512;

// Region id 0 names no memory; RegisterRegion never returns it (a
// session's region ids start at 1). A tensor argument (opd.proto TensorRef,
// a ring record's tensor) in region kNoRegion is an empty view: some size is
// 0 (no element), byte_offset is 0; its sizes, strides and dtype are
// checked like any view's, and the op receives an empty tensor of exactly
// those sizes, strides and dtype on the call's device. Region kNoRegion with
// an element, or with a byte offset, is BAD_ARGUMENT. Clients send every
// empty tensor this way and register nothing for it (an empty CUDA tensor's
// data pointer is usually null, inside no allocation).
inline constexpr uint64_t kNoRegion = 0;

// ---- rejection reasons ---------------------------------------------------------
//
// Every error the daemon returns carries a Reason: a value, not prose (no
// client ever reads a message to decide anything). It travels
//   - gRPC: trailing metadata kReasonMetadataKey = the decimal value;
//   - ring: CompletionRecord::reason (ring.h);
//   - session channel: BindReply::reason (session_memory.h).
// A client decides what to do with ActionOf(code, reason) and nothing else.
//
// What a client does:
//   kRaiseValue  the call's arguments are wrong: raise (Python: ValueError);
//                the session and its lanes go on
//   kRaise       raise (Python: RuntimeError); the session goes on
//   kReregister  a region of the call is unknown to the daemon (evicted or
//                unregistered): forget the call's regions, register them
//                again, run the call once more; the session goes on
//   kReconnect   the daemon no longer serves this session (it ended, the
//                daemon restarted, is draining, lost its device) or the
//                lane's numbering is no longer shared: fail the session; the
//                call did not run, so run it once more on a new session
//   kFail        fail the session and raise; running again cannot help
#define CACHE_DIT_OPD_CLIENT_ACTIONS(X) \
  X(kRaiseValue, 1, "raise_value")      \
  X(kRaise, 2, "raise")                 \
  X(kReregister, 3, "reregister")       \
  X(kReconnect, 4, "reconnect")         \
  X(kFail, 5, "fail")

// X(enumerator, value, opd.proto name REASON_<name>, google.rpc.Code, action).
// kUnspecified (0): an error that names no reason (one from gRPC itself, say);
// then the code alone decides (CACHE_DIT_OPD_CODE_ACTIONS).
#define CACHE_DIT_OPD_REASONS(X)                                                         \
  X(kBadArgument, 1, BAD_ARGUMENT, 3, kRaiseValue)          /* a value, type, view or op check */ \
  X(kUnsupported, 2, UNSUPPORTED, 12, kRaise)               /* the daemon cannot run this overload */ \
  X(kOpUnknown, 3, OP_UNKNOWN, 5, kRaise)                   /* op or overload not registered */ \
  X(kRegionUnknown, 4, REGION_UNKNOWN, 5, kReregister)      /* region id unknown to the session */ \
  X(kSessionUnknown, 5, SESSION_UNKNOWN, 5, kReconnect)     /* no such session (daemon restarted?) */ \
  X(kSessionEnded, 6, SESSION_ENDED, 9, kReconnect)         /* the session has ended */ \
  X(kSessionUnbound, 7, SESSION_UNBOUND, 9, kReconnect)     /* not bound on the session channel */ \
  X(kBadToken, 8, BAD_TOKEN, 7, kReconnect)                 /* the token is not this session's */ \
  X(kLaneSequence, 9, LANE_SEQUENCE, 3, kReconnect)         /* seq is not the lane's next */ \
  X(kLaneRange, 10, LANE_RANGE, 3, kFail)                   /* no such lane, or seq 0 */ \
  X(kMalformed, 11, MALFORMED, 3, kFail)                    /* a record or message breaks the format */ \
  X(kResourceExhausted, 12, RESOURCE_EXHAUSTED, 8, kRaise)  /* a limit: sessions, regions, bytes */ \
  X(kPeerRefused, 13, PEER_REFUSED, 7, kFail)               /* uid, gid or pid not admitted */ \
  X(kVersionMismatch, 14, VERSION_MISMATCH, 9, kFail)       /* protocol or layout versions differ */ \
  X(kWrongDevice, 15, WRONG_DEVICE, 9, kFail)               /* the daemon serves another GPU */ \
  X(kNotServing, 16, NOT_SERVING, 14, kFail)                /* the daemon has no usable GPU */ \
  X(kDraining, 17, DRAINING, 14, kReconnect)                /* the daemon is shutting down */ \
  X(kDeviceLost, 18, DEVICE_LOST, 14, kReconnect)           /* sticky CUDA error: the daemon restarts */ \
  X(kBindTimeout, 19, BIND_TIMEOUT, 4, kReconnect)          /* not bound within the bind deadline */ \
  X(kClosed, 20, CLOSED, 1, kReconnect)                     /* closed by its client or its channel */ \
  X(kInternal, 21, INTERNAL, 13, kFail)                     /* a daemon-side failure */ \
  X(kInputsStalled, 22, INPUTS_STALLED, 4, kReconnect)      /* a parked wait on inputs_ready timed out */ \
  X(kStoreUnknown, 23, STORE_UNKNOWN, 5, kRaise)            /* no such store entry (a restarted daemon's is empty) */ \
  X(kStoreExists, 24, STORE_EXISTS, 6, kRaise)              /* a store name that is already published */ \
  X(kStoreDenied, 25, STORE_DENIED, 7, kRaise)              /* may not read or delete the entry, or read the file */

// X(google.rpc.Code, action) for errors without a reason.
#define CACHE_DIT_OPD_CODE_ACTIONS(X) \
  X(1, kReconnect)   /* CANCELLED */          \
  X(2, kReconnect)   /* UNKNOWN */            \
  X(3, kRaiseValue)  /* INVALID_ARGUMENT */   \
  X(4, kReconnect)   /* DEADLINE_EXCEEDED */  \
  X(8, kRaise)       /* RESOURCE_EXHAUSTED */ \
  X(10, kReconnect)  /* ABORTED */            \
  X(11, kRaiseValue) /* OUT_OF_RANGE */       \
  X(12, kRaise)      /* UNIMPLEMENTED */      \
  X(14, kReconnect)  /* UNAVAILABLE */

// The gRPC trailing-metadata key of an error's reason (decimal value).
inline constexpr char kReasonMetadataKey[] = "cache-dit-opd-reason";

enum class ClientAction : uint32_t {
  kNone = 0,  // OK: nothing to do
#define CACHE_DIT_OPD_X(e, v, name) e = v,
  CACHE_DIT_OPD_CLIENT_ACTIONS(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
};

// One past the largest reason value.
inline constexpr uint32_t kReasonCount = 1
#define CACHE_DIT_OPD_X(e, v, proto, code, action) +1
    CACHE_DIT_OPD_REASONS(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
    ;

// ActionOf
//
// What a client does about an error of google.rpc.Code `code` carrying
// `reason` (0 when it carries none): the reason's action when the reason is
// known, else the code's (kFail for a code not listed). kNone for OK.
inline constexpr ClientAction ActionOf(int code, uint32_t reason) {
  if (code == 0) return ClientAction::kNone;
  switch (reason) {
#define CACHE_DIT_OPD_X(e, v, proto, c, action) \
  case v: return ClientAction::action;
    CACHE_DIT_OPD_REASONS(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
    default: break;
  }
  switch (code) {
#define CACHE_DIT_OPD_X(c, action) \
  case c: return ClientAction::action;
    CACHE_DIT_OPD_CODE_ACTIONS(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
    default: return ClientAction::kFail;
  }
}

}  // namespace cache_dit_opd::v1
