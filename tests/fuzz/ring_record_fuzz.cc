// ring_record_fuzz: the daemon's decoder of one call-ring record
// (common/ring_decode.h DecodeRecord), on bytes the client wrote into its
// shared slot. The input is the slot copy as the daemon hands it over (any
// length; a real slot is kSlotBytes).
//
// Checks, on every input:
//   - a rejection is a Status (MALFORMED, INVALID_ARGUMENT) with the call
//     cleared; the RecordIds echo the header whenever 64 bytes are there and
//     are "usable" exactly when the magic is right;
//   - an accepted record is within the wire limits, names its catalog entry,
//     and record_bytes is exactly the header plus layout v1's bytes for its
//     arguments (computed here from ring.h, not by the codec);
//   - round trip: the client's encoder (common/ring_encode.h) takes every
//     accepted call, re-encodes the same bytes (the tensor pad, which the
//     decoder ignores, aside), and decoding that gives the same call.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/ring_decode.h"
#include "common/ring_encode.h"
#include "tests/fuzz/fuzz_util.h"

namespace cache_dit_opd {
namespace {

using fuzz::Append;
using fuzz::CallDifference;
using fuzz::MakeRecord;
using fuzz::RecordFields;

const std::vector<OpInfo>& Catalog() {
  static const auto* catalog = new std::vector<OpInfo>{
      {"fp8_comm_per_token_quant", "", ""},
      {"fp8_comm_per_token_quant", "out", ""},
      {"fused_merge_attn_states", "out", ""},
  };
  return *catalog;
}

// The argument bytes [64, record_bytes) of an accepted record with every
// tensor's pad word zeroed: what the encoder writes. Walks ring.h's layout
// itself; only called after DecodeRecord accepted the record, so every
// offset is in range.
std::string CanonicalArgs(const uint8_t* data, const v1::RecordHeader& h) {
  std::string body(reinterpret_cast<const char*>(data) + sizeof(h), h.record_bytes - sizeof(h));
  size_t at = 0;
  for (uint32_t i = 0; i < h.nargs; ++i) {
    v1::RingArgHeader ah;
    std::memcpy(&ah, body.data() + at, sizeof(ah));
    at += sizeof(ah);
    switch (static_cast<v1::RingArgKind>(ah.kind)) {
      case v1::RingArgKind::kNone: break;
      case v1::RingArgKind::kTensor:
        std::memset(body.data() + at + 20, 0, 4);
        at += 24 + 16 * size_t{ah.count};
        break;
      default: at += 8 * size_t{ah.count}; break;
    }
  }
  return body;
}

void CheckRecord(const uint8_t* data, size_t size) {
  CallRequest call;
  RecordIds ids;
  const Status s = DecodeRecord(data, size, Catalog(), &call, &ids);

  v1::RecordHeader h{};
  const bool have_header = size >= sizeof(h);
  if (have_header) std::memcpy(&h, data, sizeof(h));
  if (have_header) {
    OPD_FUZZ_CHECK(ids.ticket == h.ticket && ids.lane == h.lane && ids.seq == h.seq,
                   "RecordIds do not echo the header");
  }
  OPD_FUZZ_CHECK(ids.header_usable == (have_header && h.magic == v1::kRecordMagic),
                 "header_usable is ", ids.header_usable, " for a ", size, "-byte record with magic ", h.magic);

  if (!s.ok()) {
    OPD_FUZZ_CHECK(s.reason() == Reason::kMalformed && s.code() == StatusCode::kInvalidArgument,
                   "a rejected record is not MALFORMED: ", s.ToString());
    OPD_FUZZ_CHECK(CallDifference(call, CallRequest{}).empty() && call.args.empty(),
                   "a rejected record left a call behind");
    return;
  }

  OPD_FUZZ_CHECK(ids.header_usable);
  const std::string limits = fuzz::WireLimitsHold(call);
  OPD_FUZZ_CHECK(limits.empty(), "accepted call breaks a wire limit: ", limits);
  OPD_FUZZ_CHECK(h.op_index < Catalog().size() && call.op == Catalog()[h.op_index].name &&
                     call.overload == Catalog()[h.op_index].overload,
                 "op_index ", h.op_index, " decoded as '", call.op, "'");
  OPD_FUZZ_CHECK(call.args.size() == h.nargs && call.lane == h.lane && call.seq == h.seq && !call.host_ordered);
  OPD_FUZZ_CHECK(h.record_bytes <= size && h.record_bytes <= v1::kSlotBytes);
  OPD_FUZZ_CHECK(h.record_bytes == sizeof(h) + fuzz::RingPayloadBytes(call.args),
                 "record_bytes ", h.record_bytes, " but layout v1 needs ",
                 sizeof(h) + fuzz::RingPayloadBytes(call.args), " for its arguments");

  // Round trip through the client's encoder.
  client::RecordArgs enc;
  OPD_FUZZ_CHECK(enc.AssignCall(call.args), "the encoder refuses a call the decoder accepted (", call.args.size(),
                 " arguments, ", h.record_bytes, " bytes)");
  OPD_FUZZ_CHECK(enc.count() == h.nargs);
  const std::string body(reinterpret_cast<const char*>(enc.data()), enc.size());
  OPD_FUZZ_CHECK(body == CanonicalArgs(data, h), "re-encoded arguments differ from the record's");

  const std::string again = MakeRecord(enc, RecordFields{h.ticket, h.seq, h.lane, h.op_index, h.flags});
  CallRequest call2;
  RecordIds ids2;
  const Status s2 = DecodeRecord(reinterpret_cast<const uint8_t*>(again.data()), again.size(), Catalog(), &call2, &ids2);
  OPD_FUZZ_CHECK(s2.ok(), "re-encoded record rejected: ", s2.ToString());
  const std::string diff = CallDifference(call, call2);
  OPD_FUZZ_CHECK(diff.empty(), "decode(encode(decode(x))) differs: ", diff);
  OPD_FUZZ_CHECK(ids2.ticket == ids.ticket && ids2.lane == ids.lane && ids2.seq == ids.seq && ids2.header_usable);
}

// Valid records of every kind, made by the client's encoder, plus a few
// near misses.
std::vector<std::string> Seeds() {
  std::vector<std::string> out;
  auto add = [&](const client::RecordArgs& a, RecordFields f) { out.push_back(MakeRecord(a, f)); };
  client::RecordArgs a;
  add(a, {0, 1, 0, 0, 0});  // no arguments

  const int64_t sizes[] = {4, 64}, strides[] = {64, 1};
  a.Clear();
  a.AddTensor(1, 0, DType::kBFloat16, 2, sizes, strides);
  const int64_t osizes[] = {4, 66}, ostrides[] = {66, 1};
  a.AddTensor(1, 4096, DType::kFloat8E4M3FN, 2, osizes, ostrides);
  add(a, {7, 3, 1, 1, 1});

  a.Clear();  // every scalar and list kind
  a.AddNone();
  a.AddInt(-5);
  a.AddFloat(0.5);
  a.AddBool(true);
  const int64_t ints[] = {1, 2, 3};
  a.AddIntList(ints, 3);
  const double floats[] = {1.5, -0.0};
  a.AddFloatList(floats, 2);
  const bool bools[] = {true, false, true};
  a.AddBoolList(bools, 3);
  add(a, {2, 9, 2, 2, 0});

  a.Clear();  // an 8-dim view and an empty view without a region
  const int64_t s8[] = {1, 2, 1, 2, 1, 2, 1, 2}, t8[] = {16, 8, 8, 4, 4, 2, 2, 1};
  a.AddTensor(3, 64, DType::kFloat32, 8, s8, t8);
  const int64_t e[] = {0, 16}, es[] = {16, 1};
  a.AddTensor(kNoRegion, 0, DType::kFloat16, 2, e, es);
  a.AddTensor(2, 0, DType::kFloat32, 0, nullptr, nullptr);  // 0-dim
  add(a, {3, 4, 0, 0, 0});

  a.Clear();  // a record that fills its slot: long lists
  int64_t long_ints[kMaxListLength];
  for (int i = 0; i < kMaxListLength; ++i) long_ints[i] = i * 3 - 7;
  while (a.AddIntList(long_ints, kMaxListLength)) {}
  add(a, {4, 5, 0, 1, 0});

  a.Clear();  // kMaxArgs ints
  while (a.AddInt(42)) {}
  add(a, {5, 6, 3, 2, 0});

  // Slack after record_bytes (the slot is larger than the record).
  a.Clear();
  a.AddInt(1);
  std::string slack = MakeRecord(a, {6, 7, 0, 0, 0});
  slack.append(64, '\xAB');
  out.push_back(slack);

  // Near misses: a tensor with a bad dtype, a bool of 2, a short header.
  std::string bad = MakeRecord(a, {0, 1, 0, 0, 0});
  v1::RecordHeader h;
  std::memcpy(&h, bad.data(), sizeof(h));
  h.nargs = 1;
  std::string body;
  Append(&body, v1::RingArgHeader{static_cast<uint32_t>(v1::RingArgKind::kBool), 1});
  Append(&body, int64_t{2});
  h.record_bytes = static_cast<uint32_t>(sizeof(h) + body.size());
  std::string rec;
  Append(&rec, h);
  out.push_back(rec + body);
  out.push_back(rec.substr(0, 40));
  return out;
}

}  // namespace
}  // namespace cache_dit_opd

OPD_FUZZ_TARGET(cache_dit_opd::Seeds, cache_dit_opd::CheckRecord)
