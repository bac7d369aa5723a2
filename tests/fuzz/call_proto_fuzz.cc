// call_proto_fuzz: the daemon's conversion of a gRPC Call (common/call_proto.h
// CallFromProto on a v1::CallRequest parsed from the client's bytes),
// cross-checked with the other transport's decoder (the call ring,
// common/ring_decode.h) on the same call.
//
// Input: byte 0 picks the transport of the rest: even, a serialized
// v1::CallRequest; odd, a ring record (slot copy).
//
// Checks, protobuf input:
//   - CallFromProto accepts exactly what call_proto.h's contract admits
//     (argument count, a set oneof, dims, ranks, dtype, list lengths),
//     recomputed here from the message; a rejection is BAD_ARGUMENT;
//   - CallToProto gives back the message (session_id, token and unknown
//     fields aside), and converting that again gives the same call;
//   - the accepted call goes into a ring record exactly when layout v1 has
//     room for it, and the ring decoder then yields the same call.
// Ring input: every record the ring decoder accepts travels through
// protobuf (CallToProto, serialize, parse) and CallFromProto accepts it as
// the same call: neither transport refuses what the other carries.
#include <cstdint>
#include <string>
#include <vector>

#include <google/protobuf/stubs/logging.h>

#include "cache_dit_opd/v1/opd.pb.h"
#include "common/call_proto.h"
#include "common/ring_decode.h"
#include "common/ring_encode.h"
#include "tests/fuzz/fuzz_util.h"

namespace cache_dit_opd {
namespace {

using fuzz::CallDifference;
using fuzz::MakeRecord;
using fuzz::RecordFields;

const std::vector<OpInfo>& RingCatalog() {
  static const auto* catalog = new std::vector<OpInfo>{
      {"fp8_comm_per_token_quant", "out", ""},
      {"fused_merge_attn_states", "out", ""},
  };
  return *catalog;
}

// call_proto.h's contract, read off the message itself.
bool ProtoAdmissible(const v1::CallRequest& in) {
  if (in.args_size() > kMaxArgs) return false;
  for (const v1::Argument& a : in.args()) {
    switch (a.value_case()) {
      case v1::Argument::kTensor:
        if (a.tensor().sizes_size() > kMaxTensorDims || a.tensor().sizes_size() != a.tensor().strides_size() ||
            !IsWireDType(static_cast<int>(a.tensor().dtype()))) {
          return false;
        }
        break;
      case v1::Argument::kIntList:
        if (a.int_list().values_size() > kMaxListLength) return false;
        break;
      case v1::Argument::kFloatList:
        if (a.float_list().values_size() > kMaxListLength) return false;
        break;
      case v1::Argument::kBoolList:
        if (a.bool_list().values_size() > kMaxListLength) return false;
        break;
      case v1::Argument::VALUE_NOT_SET: return false;
      default: break;
    }
  }
  return true;
}

void CheckRingCarries(const CallRequest& call) {
  client::RecordArgs enc;
  const bool fits = call.args.size() <= static_cast<size_t>(kMaxArgs) &&
                    fuzz::RingPayloadBytes(call.args) <= client::RecordArgs::kCapacity;
  const bool assigned = enc.AssignCall(call.args);
  OPD_FUZZ_CHECK(assigned == fits, "the ring encoder says ", assigned, " for arguments of ",
                 fuzz::RingPayloadBytes(call.args), " bytes (room: ", client::RecordArgs::kCapacity, ")");
  if (!assigned) return;
  const std::vector<OpInfo> catalog = {{call.op, call.overload, ""}};
  const std::string rec = MakeRecord(enc, RecordFields{0, call.seq, call.lane, 0, 0});
  CallRequest ring_call;
  RecordIds ids;
  const Status s = DecodeRecord(reinterpret_cast<const uint8_t*>(rec.data()), rec.size(), catalog, &ring_call, &ids);
  OPD_FUZZ_CHECK(s.ok(), "the ring refuses a call the gRPC path accepted: ", s.ToString());
  CallRequest expected = call;
  expected.host_ordered = false;  // the ring has no host-ordered calls
  const std::string diff = CallDifference(expected, ring_call);
  OPD_FUZZ_CHECK(diff.empty(), "the two transports decode different calls: ", diff);
}

void CheckProto(const uint8_t* data, size_t size) {
  v1::CallRequest in;
  if (!in.ParseFromArray(data, static_cast<int>(size))) return;
  CallRequest call;
  const Status s = CallFromProto(in, &call);
  const bool admissible = ProtoAdmissible(in);
  OPD_FUZZ_CHECK(s.ok() == admissible, "CallFromProto says ", s.ToString(), " where the contract says ",
                 admissible ? "accept" : "reject");
  if (!s.ok()) {
    OPD_FUZZ_CHECK(s.reason() == Reason::kBadArgument && s.code() == StatusCode::kInvalidArgument, s.ToString());
    return;
  }
  const std::string limits = fuzz::WireLimitsHold(call);
  OPD_FUZZ_CHECK(limits.empty(), "accepted call breaks a wire limit: ", limits);
  OPD_FUZZ_CHECK(call.op == in.op() && call.overload == in.overload() && call.lane == in.lane() &&
                 call.seq == in.seq() && call.host_ordered == in.host_ordered() &&
                 call.args.size() == static_cast<size_t>(in.args_size()));

  v1::CallRequest back;
  CallToProto(call, &back);
  v1::CallRequest canonical = in;
  canonical.clear_session_id();
  canonical.clear_token();
  canonical.DiscardUnknownFields();
  OPD_FUZZ_CHECK(back.SerializeAsString() == canonical.SerializeAsString(),
                 "CallToProto(CallFromProto(m)) is not m: ", back.ShortDebugString(), " vs ",
                 canonical.ShortDebugString());
  CallRequest again;
  const Status s2 = CallFromProto(back, &again);
  OPD_FUZZ_CHECK(s2.ok(), s2.ToString());
  const std::string diff = CallDifference(call, again);
  OPD_FUZZ_CHECK(diff.empty(), "proto round trip differs: ", diff);

  CheckRingCarries(call);
}

void CheckRing(const uint8_t* data, size_t size) {
  CallRequest call;
  RecordIds ids;
  if (!DecodeRecord(data, size, RingCatalog(), &call, &ids).ok()) return;
  v1::CallRequest msg;
  CallToProto(call, &msg);
  v1::CallRequest parsed;
  OPD_FUZZ_CHECK(parsed.ParseFromString(msg.SerializeAsString()));
  CallRequest grpc_call;
  const Status s = CallFromProto(parsed, &grpc_call);
  OPD_FUZZ_CHECK(s.ok(), "the gRPC path refuses a call the ring accepted: ", s.ToString());
  const std::string diff = CallDifference(call, grpc_call);
  OPD_FUZZ_CHECK(diff.empty(), "the two transports decode different calls: ", diff);
}

std::vector<Arg> SampleArgs(int which) {
  switch (which) {
    case 0:
      return {TensorRef{1, 0, {4, 64}, {64, 1}, DType::kBFloat16},
              TensorRef{1, 4096, {4, 66}, {66, 1}, DType::kFloat8E4M3FN}};
    case 1:
      return {NoneArg{}, int64_t{-3}, 2.5, true, std::vector<int64_t>{1, 2, 3}, std::vector<double>{0.25, -0.0},
              std::vector<bool>{true, false}};
    case 2:
      return {TensorRef{kNoRegion, 0, {0, 8}, {8, 1}, DType::kFloat16},
              TensorRef{2, 128, {}, {}, DType::kFloat32},
              TensorRef{3, 0, {1, 2, 1, 2, 1, 2, 1, 2}, {16, 8, 8, 4, 4, 2, 2, 1}, DType::kInt64}};
    default: {
      std::vector<Arg> args;
      std::vector<int64_t> long_list(kMaxListLength);
      for (int i = 0; i < kMaxListLength; ++i) long_list[i] = i;
      for (int i = 0; i < 3; ++i) args.emplace_back(long_list);
      return args;
    }
  }
}

std::vector<std::string> Seeds() {
  std::vector<std::string> out;
  for (int which = 0; which < 4; ++which) {
    CallRequest call;
    call.op = which % 2 ? "fused_merge_attn_states" : "fp8_comm_per_token_quant";
    call.overload = "out";
    call.lane = static_cast<uint32_t>(which);
    call.seq = 1 + static_cast<uint64_t>(which);
    call.host_ordered = which == 3;
    call.args = SampleArgs(which);
    v1::CallRequest msg;
    CallToProto(call, &msg);
    msg.set_session_id(7);
    msg.set_token(std::string(32, 'T'));
    out.push_back(std::string(1, '\0') + msg.SerializeAsString());

    client::RecordArgs enc;
    if (enc.AssignCall(call.args)) {
      out.push_back(std::string(1, '\1') + MakeRecord(enc, RecordFields{0, call.seq, call.lane, which % 2 ? 1u : 0u, 0}));
    }
  }
  // A message the contract refuses: an argument with no value.
  v1::CallRequest bad;
  bad.set_op("fp8_comm_per_token_quant");
  bad.add_args();
  out.push_back(std::string(1, '\0') + bad.SerializeAsString());
  return out;
}

// One byte chooses the parser: protobuf (even) or the ring record (odd).
void Run(const uint8_t* data, size_t size) {
  // Parsing refuses a string field that is not UTF-8, and logs each time.
  static const bool quiet = [] {
    google::protobuf::SetLogHandler(nullptr);
    return true;
  }();
  (void)quiet;
  if (size == 0) return;
  if (data[0] % 2 == 0) {
    CheckProto(data + 1, size - 1);
  } else {
    CheckRing(data + 1, size - 1);
  }
}

}  // namespace
}  // namespace cache_dit_opd

OPD_FUZZ_TARGET(cache_dit_opd::Seeds, cache_dit_opd::Run)
