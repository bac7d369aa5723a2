// File: common/ring_decode.h
//
// Decoding of one shared-memory ring record (proto/cache_dit_opd/v1/ring.h)
// into the transport-neutral CallRequest (common/call.h) that the gRPC Call
// also produces, so both transports share validation and dispatch from there
// on. Pure functions over bytes: no I/O, no locks, no shared memory. The
// caller hands over its PRIVATE copy of a slot (the client can rewrite the
// shared slot at any time), so every field is read exactly once here.
//
// Every check is on the wire format only, like proto_convert.cc's FromProto;
// what depends on the op's schema or the session (arity, types, regions,
// views, lane range, seq order) is checked downstream, identically for both
// transports.
//
//   RecordIds ids;
//   CallRequest req;
//   Status s = DecodeRecord(copy, v1::kSlotBytes, catalog, &req, &ids);
//   if (!s.ok() && ids.header_usable) { /* complete ids.lane/ids.seq in order */ }
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cache_dit_opd/v1/ring.h"
#include "common/call.h"
#include "common/status.h"

namespace cache_dit_opd {

// What a record's header claims, filled whenever at least the 64-byte header
// is present, whether or not the rest decodes.
struct RecordIds {
  uint64_t ticket = 0;
  uint32_t lane = 0;
  uint64_t seq = 0;
  // The header is present and carries the record magic, so `lane` and `seq`
  // are the client's own (a malformed record with a usable header still
  // completes its seq in order, if that seq is the lane's next). False for a
  // short buffer or a bad magic: the bytes are not a record at all.
  bool header_usable = false;
};

// DecodeRecord
//
// Decodes the record in bytes[0, n) against `catalog` (the session's op
// catalog, OpenSessionReply.catalog order). On success fills `out` (op and
// overload from catalog[op_index], args in order, lane, seq). Every failure
// is INVALID_ARGUMENT naming the field and its value: short buffer, magic,
// record_bytes (< 64, > kSlotBytes, not a multiple of 8, past `n`), nargs
// (> kMaxArgs), op_index (>= catalog size), an argument header or payload
// past record_bytes, an unknown kind, a count out of range (tensor ndim > 8,
// list > 64 values, scalar count != 1, none count != 0), a bool that is not
// 0 or 1, a dtype outside protocol v1, and bytes left over after the last
// argument. `out` is cleared on failure. Overflow-free: every offset is
// bounded by kSlotBytes before it is used.
Status DecodeRecord(const uint8_t* bytes, size_t n, const std::vector<OpInfo>& catalog, CallRequest* out,
                    RecordIds* ids);

}  // namespace cache_dit_opd
