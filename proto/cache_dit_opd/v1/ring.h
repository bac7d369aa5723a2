// File: proto/cache_dit_opd/v1/ring.h
//
// The shared-memory call ring, layout version 2: the hot-call data plane. It
// lives in the session's memfd (session_memory.h) at
// SessionMemoryHeader::ring_offset, ring_bytes long, when OpenSession granted
// it (OpenSessionReply.ring_enabled). A ring record carries exactly what a
// gRPC Call carries, so the daemon hands both to the same call path:
// validation, dispatch, ordering and completion are identical on both
// transports. Dtype values and limits are wire.h's.
//
// Region layout (offsets from ring_offset; all little-endian):
//   [0, 256)                                   RingControl
//   [256, 256 + capacity * kSlotBytes)          submission slots (client writes)
//   [.., + capacity * kCompletionBytes)         completion slots (daemon writes)
//
// Protocol. `ticket` t is the client's running count of records (first 0);
// record t lives in slot t % capacity, its completion in completion slot
// t % capacity.
//   client: wait until completion t - capacity has been consumed (back-
//           pressure: never drop), write the record into its slot, then
//           store-release sq_tail = t + 1 as ONE aligned 8-byte store (a
//           torn tail reads as a violation), then a full fence (a store may
//           pass a later load on x86: without it a wake-up can be lost),
//           then if doorbell == kDoorbellSleeping, set it to kDoorbellAwake
//           and FUTEX_WAKE it (shared futex).
//   daemon: load-acquire sq_tail; for each t in [head, tail) while the
//           session has fewer calls held (taken, not yet launched) than its
//           bound (server/ring/ring_consumer.h: max_held; past it records
//           wait unread, and so does the client, for its completions): copy slot
//           t % capacity into its own memory ONCE, then validate and decode
//           only the copy; store-release sq_head = t + 1. When the call is
//           accepted or rejected (the executor's answer, same as a gRPC Call's
//           status), write the completion slot (ticket, lane, seq, code,
//           message), then store-release its `done_ticket` = t + 1.
//   client: waits (sync mode) or later checks (async mode) for
//           done_ticket == t + 1 (load-acquire), then reads the completion.
// Record rules the daemon enforces: record_bytes equals the header plus its
// arguments exactly; a none argument has count 0; the ticket matches the slot
// (ticket % capacity); the tensor pad, flags and reserved bytes are ignored.
// Hostile input: the daemon keeps its own head; a tail that is behind its
// head or more than `capacity` ahead, and still so after 20 ms of polls
// (server/ring/ring_consumer.h: kOddTailGrace), is a protocol violation that
// ends the session (only that client is affected). Slot indices are masked by
// capacity (a power of two). A malformed record (bad magic, sizes, counts,
// kinds, op index) fails that call: if its lane and seq are the lane's next,
// the seq is still completed in order ("done" written by the lane stream).
//
// Waking: the daemon spins on sq_tail for --spin-us after its last
// record, then stores doorbell = kDoorbellSleeping, re-checks sq_tail (so a
// record published in between is not missed) and FUTEX_WAITs on the doorbell
// with a timeout. An idle daemon uses no CPU.
//
// Memory ordering. The daemon uses std::atomic_ref acquire/release on the
// control words. The Python client writes a record with plain stores and then
// the tail: on x86-64 (TSO) stores are not reordered with other stores, which
// is what release needs; the client runs only there (the GPU hosts are
// x86-64) and says so if it is not.
#pragma once

#include <cstdint>

#include "cache_dit_opd/v1/wire.h"

namespace cache_dit_opd::v1 {

inline constexpr uint32_t kRingVersion = 2;  // 2: CompletionRecord::reason
inline constexpr uint32_t kRingControlBytes = 256;
inline constexpr uint32_t kSlotBytes = 2048;       // one submission record, at most
inline constexpr uint32_t kCompletionBytes = 256;  // one completion
inline constexpr uint32_t kDefaultRingCapacity = 64;  // slots; a power of two
inline constexpr uint32_t kRecordMagic = 0x4C4C4143u;  // "CALL"
inline constexpr uint32_t kDoorbellAwake = 0;
inline constexpr uint32_t kDoorbellSleeping = 1;

struct RingControl {
  uint32_t version;           // kRingVersion (daemon writes at creation)
  uint32_t capacity;          // slots, a power of two
  uint32_t slot_bytes;        // kSlotBytes
  uint32_t completion_bytes;  // kCompletionBytes
  uint8_t pad0[48];
  alignas(64) uint64_t sq_tail;   // client: records published (monotonic)
  uint8_t pad1[56];
  alignas(64) uint64_t sq_head;   // daemon: records copied out (monotonic)
  uint8_t pad2[56];
  alignas(64) uint32_t doorbell;  // futex word: kDoorbellAwake / kDoorbellSleeping
  uint8_t pad3[60];
};
static_assert(sizeof(RingControl) == kRingControlBytes);

// Argument kinds of a record (values fixed by layout v1).
enum class RingArgKind : uint32_t {
  kNone = 0,
  kTensor = 1,     // count = ndim (<= kMaxTensorDims); then region_id u64, byte_offset u64,
                   // dtype i32 (wire.h DType), pad i32, sizes i64[ndim], strides i64[ndim];
                   // region_id 0 (wire.h kNoRegion): an empty view, byte_offset 0
  kInt = 2,        // count = 1; then i64
  kFloat = 3,      // count = 1; then f64
  kBool = 4,       // count = 1; then i64 (0 or 1)
  kIntList = 5,    // count = n (<= kMaxListLength); then i64[n]
  kFloatList = 6,  // count = n (<= kMaxListLength); then f64[n]
  kBoolList = 7,   // count = n (<= kMaxListLength); then i64[n] (0 or 1)
};

// Each argument: this 8-byte header, then its payload (a multiple of 8 bytes).
struct RingArgHeader {
  uint32_t kind;   // RingArgKind
  uint32_t count;  // see RingArgKind
};
static_assert(sizeof(RingArgHeader) == 8);

// A submission record: this header, then `nargs` arguments back to back, the
// whole at most kSlotBytes.
struct RecordHeader {
  uint32_t magic;         // kRecordMagic
  uint32_t record_bytes;  // header + arguments, <= kSlotBytes, multiple of 8
  uint64_t ticket;        // the record's ticket (echoed in its completion)
  uint64_t seq;           // the lane's sequence number of this call
  uint32_t lane;          // 0 .. lanes-1
  uint32_t op_index;      // index into OpenSessionReply.catalog (name + overload)
  uint32_t nargs;         // <= kMaxArgs (wire.h)
  uint32_t flags;         // bit 0: asynchronous (informational; same handling)
  uint8_t reserved[24];
};
static_assert(sizeof(RecordHeader) == 64);

struct CompletionRecord {
  uint64_t done_ticket;  // ticket + 1 once written (store-release, written last)
  uint64_t ticket;
  uint64_t seq;
  uint32_t lane;
  int32_t status_code;   // google.rpc.Code: 0 accepted, else the rejection
  uint32_t reason;       // wire.h Reason of a rejection (what the client does)
  char message[220];     // NUL-terminated, truncated, for people
};
static_assert(sizeof(CompletionRecord) == kCompletionBytes);

inline constexpr uint64_t RingBytes(uint32_t capacity) {
  return kRingControlBytes + uint64_t{capacity} * (kSlotBytes + kCompletionBytes);
}

}  // namespace cache_dit_opd::v1
