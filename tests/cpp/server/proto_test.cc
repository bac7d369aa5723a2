#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

#include "cache_dit_opd/v1/opd.pb.h"
#include "cache_dit_opd/v1/wire.h"
#include "common/call_proto.h"
#include "server/options.h"
#include "server/grpc/grpc_status.h"
#include "server/grpc/proto_convert.h"

namespace cache_dit_opd {
namespace {

v1::CallRequest SampleCall() {
  v1::CallRequest c;
  c.set_session_id(7);
  c.set_token(std::string(32, '\x01'));
  c.set_op("fused_merge_attn_states");
  c.set_overload("out");
  c.set_lane(1);
  c.set_seq(42);
  auto* t = c.add_args()->mutable_tensor();
  t->set_region_id(3);
  t->set_byte_offset(128);
  for (int64_t s : {2, 16, 8, 64}) t->add_sizes(s);
  for (int64_t s : {8192, 512, 64, 1}) t->add_strides(s);
  t->set_dtype(v1::DTYPE_BFLOAT16);
  c.add_args()->set_int_value(-5);
  c.add_args()->set_float_value(0.125);
  c.add_args()->set_bool_value(true);
  auto* ints = c.add_args()->mutable_int_list();
  for (int64_t v : {1, 2, 3, 4}) ints->add_values(v);
  c.add_args()->mutable_float_list()->add_values(1.5);
  c.add_args()->mutable_bool_list()->add_values(false);
  c.add_args()->mutable_none();
  return c;
}

TEST(ProtoTest, ACallRoundTripsThroughTheClientsEncoder) {
  CallRequest r;
  ASSERT_TRUE(CallFromProto(SampleCall(), &r).ok());
  v1::CallRequest again;
  again.set_session_id(7);
  again.set_token(std::string(32, '\x01'));
  CallToProto(r, &again);
  EXPECT_EQ(again.SerializeAsString(), SampleCall().SerializeAsString());
  r.host_ordered = true;
  CallToProto(r, &again);
  CallRequest back;
  ASSERT_TRUE(CallFromProto(again, &back).ok());
  EXPECT_TRUE(back.host_ordered);
}

// An empty list is a list on the wire too: CallToProto once left the oneof
// unset for one (it only touched the list to add a value), so the daemon
// refused the C++ client's call with "argument i has no value"
// (tests/fuzz/call_proto_fuzz found it; its input is in the corpus).
TEST(ProtoTest, EmptyListsTravelAsLists) {
  CallRequest r;
  r.op = "op";
  r.overload = "out";
  r.args = {std::vector<int64_t>{}, std::vector<double>{}, std::vector<bool>{}};
  v1::CallRequest m;
  CallToProto(r, &m);
  ASSERT_EQ(m.args_size(), 3);
  EXPECT_EQ(m.args(0).value_case(), v1::Argument::kIntList);
  EXPECT_EQ(m.args(1).value_case(), v1::Argument::kFloatList);
  EXPECT_EQ(m.args(2).value_case(), v1::Argument::kBoolList);
  CallRequest back;
  Status s = CallFromProto(m, &back);
  ASSERT_TRUE(s.ok()) << s.ToString();
  ASSERT_EQ(back.args.size(), 3u);
  EXPECT_TRUE(std::get<std::vector<int64_t>>(back.args[0]).empty());
  EXPECT_TRUE(std::get<std::vector<double>>(back.args[1]).empty());
  EXPECT_TRUE(std::get<std::vector<bool>>(back.args[2]).empty());
}

TEST(ProtoTest, CallRequestDecodesToPlainTypes) {
  CallRequest r;
  ASSERT_TRUE(CallFromProto(SampleCall(), &r).ok());
  EXPECT_EQ(r.op, "fused_merge_attn_states");
  EXPECT_EQ(r.overload, "out");
  EXPECT_EQ(r.lane, 1u);
  EXPECT_EQ(r.seq, 42u);
  ASSERT_EQ(r.args.size(), 8u);
  const auto& t = std::get<TensorRef>(r.args[0]);
  EXPECT_EQ(t.region_id, 3u);
  EXPECT_EQ(t.byte_offset, 128u);
  EXPECT_EQ(t.sizes, (std::vector<int64_t>{2, 16, 8, 64}));
  EXPECT_EQ(t.strides, (std::vector<int64_t>{8192, 512, 64, 1}));
  EXPECT_EQ(t.dtype, DType::kBFloat16);
  EXPECT_EQ(std::get<int64_t>(r.args[1]), -5);
  EXPECT_EQ(std::get<double>(r.args[2]), 0.125);
  EXPECT_EQ(std::get<bool>(r.args[3]), true);
  EXPECT_EQ(std::get<std::vector<int64_t>>(r.args[4]), (std::vector<int64_t>{1, 2, 3, 4}));
  EXPECT_EQ(std::get<std::vector<double>>(r.args[5]), (std::vector<double>{1.5}));
  EXPECT_EQ(std::get<std::vector<bool>>(r.args[6]), (std::vector<bool>{false}));
  EXPECT_TRUE(std::holds_alternative<NoneArg>(r.args[7]));
}

// The largest request protocol 2 lets a client send: every field at its
// widest encoding, kMaxArgs arguments each the widest argument (a list of
// kMaxListLength negative int64s, 10 bytes each on the wire; wider than
// a float list of 8-byte doubles or a tensor of kMaxTensorDims sizes and
// strides). --max-message-bytes' default must hold it with room to spare:
// lowering the default below this breaks clients, raising it far above
// is memory a hostile request makes the daemon take (options.h).
TEST(ProtoTest, TheLargestRequestFitsTheDefaultMessageLimitTwice) {
  constexpr int64_t kWidest = std::numeric_limits<int64_t>::min();
  constexpr uint64_t kWidestU = std::numeric_limits<uint64_t>::max();
  v1::CallRequest c;
  c.set_session_id(kWidestU);
  c.set_token(std::string(32, '\xff'));
  c.set_op(std::string(128, 'o'));  // op names in the catalog are at most ~40 bytes
  c.set_overload(std::string(32, 'v'));
  c.set_lane(std::numeric_limits<uint32_t>::max());
  c.set_seq(kWidestU);
  c.set_host_ordered(true);
  v1::Argument widest_tensor;
  auto* t = widest_tensor.mutable_tensor();
  t->set_region_id(kWidestU);
  t->set_byte_offset(kWidestU);
  for (int i = 0; i < v1::kMaxTensorDims; ++i) t->add_sizes(kWidest), t->add_strides(kWidest);
  t->set_dtype(v1::DTYPE_FLOAT8_E5M2);
  v1::Argument widest_floats;
  for (int i = 0; i < v1::kMaxListLength; ++i) widest_floats.mutable_float_list()->add_values(1e300);
  v1::Argument widest;
  for (int i = 0; i < v1::kMaxListLength; ++i) widest.mutable_int_list()->add_values(kWidest);
  ASSERT_GE(widest.ByteSizeLong(), widest_tensor.ByteSizeLong());
  ASSERT_GE(widest.ByteSizeLong(), widest_floats.ByteSizeLong());
  for (int i = 0; i < v1::kMaxArgs; ++i) *c.add_args() = widest;
  const size_t bytes = c.ByteSizeLong();
  EXPECT_GT(bytes, 16u << 10);  // the bound in options.h (~21 KiB) is what it says
  EXPECT_LT(bytes, 24u << 10);
  EXPECT_LE(2 * bytes, Options{}.max_message_bytes) << bytes;
}

TEST(ProtoTest, MalformedCallsAreInvalidArgument) {
  auto expect_bad = [](v1::CallRequest c, const std::string& needle) {
    CallRequest r;
    Status s = CallFromProto(c, &r);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << needle;
    EXPECT_EQ(s.reason(), Reason::kBadArgument) << needle;
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  };
  v1::CallRequest c = SampleCall();
  for (int i = 0; i < 30; ++i) c.add_args()->set_int_value(i);
  expect_bad(c, "38 arguments");

  c = SampleCall();
  c.mutable_args(0)->mutable_tensor()->add_sizes(1);
  expect_bad(c, "5 sizes but 4 strides");

  c = SampleCall();
  for (int i = 0; i < 5; ++i) {
    c.mutable_args(0)->mutable_tensor()->add_sizes(1);
    c.mutable_args(0)->mutable_tensor()->add_strides(1);
  }
  expect_bad(c, "9 dims");

  c = SampleCall();
  c.mutable_args(0)->mutable_tensor()->set_dtype(v1::DTYPE_UNSPECIFIED);
  expect_bad(c, "dtype 0");
  c.mutable_args(0)->mutable_tensor()->set_dtype(static_cast<v1::DType>(99));
  expect_bad(c, "dtype 99");

  c = SampleCall();
  for (int i = 0; i < 70; ++i) c.mutable_args(4)->mutable_int_list()->add_values(i);
  expect_bad(c, "argument 4: list of 74");

  c = SampleCall();
  c.add_args();  // oneof unset
  expect_bad(c, "argument 8 has no value");
}

TEST(ProtoTest, RepliesCarryEveryField) {
  OpenSessionResult o;
  o.session_id = 9;
  o.token.fill(0xab);
  o.catalog = {{"a", "", "cache_dit_cuda_ops::a(Tensor x) -> Tensor"},
               {"a", "out", "cache_dit_cuda_ops::a.out(Tensor x, *, Tensor(a!) out) -> Tensor(a!)"}};
  o.session_channel_path = "/run/x.session.sock";
  o.lanes = 2;
  o.layout_version = 1;
  o.shared_memory_bytes = 8192;
  o.gpu_uuid = "GPU-x";
  o.device_index = 0;
  o.bind_timeout_ms = 5000;
  v1::OpenSessionReply r;
  ToProto(o, &r);
  EXPECT_EQ(r.token().size(), 32u);
  EXPECT_EQ(static_cast<uint8_t>(r.token()[5]), 0xab);
  ASSERT_EQ(r.catalog_size(), 2);
  EXPECT_EQ(r.catalog(1).overload(), "out");
  EXPECT_EQ(r.bind_timeout_ms(), 5000u);
  EXPECT_EQ(r.shared_memory_bytes(), 8192u);

  VersionInfo v;
  v.info.daemon_version = "0.1.0";
  v.protocol_version = 1;
  v.layout_version = 1;
  v.serving = false;
  v.not_serving_reason = "no GPU: test";
  v.info.device_index = -1;
  v1::VersionReply vr;
  ToProto(v, &vr);
  EXPECT_EQ(vr.protocol_version(), 1u);
  EXPECT_FALSE(vr.serving());
  EXPECT_EQ(vr.not_serving_reason(), "no GPU: test");
  EXPECT_EQ(vr.device_index(), -1);

  StatsSnapshot st;
  st.sessions = 1;
  st.calls = 10;
  st.call_p50_us = 3.5;
  SessionStatsEntry e;
  e.session_id = 4;
  e.regions.pending_unmaps = 2;
  st.sessions_detail.push_back(e);
  st.stages.push_back({"run", 4.5, 9.0, 7});
  v1::StatsReply sr;
  ToProto(st, &sr);
  EXPECT_EQ(sr.calls(), 10u);
  EXPECT_EQ(sr.call_p50_us(), 3.5);
  ASSERT_EQ(sr.session_size(), 1);
  EXPECT_EQ(sr.session(0).pending_unmaps(), 2u);
  ASSERT_EQ(sr.stages_size(), 1);
  EXPECT_EQ(sr.stages(0).name(), "run");
  EXPECT_EQ(sr.stages(0).p99_us(), 9.0);
  EXPECT_EQ(sr.stages(0).count(), 7u);
}

TEST(GrpcStatusTest, OneToOneCodesAndMessages) {
  EXPECT_TRUE(ToGrpcStatus(Status::Ok()).ok());
  for (int c = 1; c <= 14; ++c) {
    Status s(static_cast<StatusCode>(c), "value 17 is bad");
    grpc::Status g = ToGrpcStatus(s);
    EXPECT_EQ(static_cast<int>(g.error_code()), c);
    EXPECT_EQ(g.error_message(), "value 17 is bad");
  }
  EXPECT_EQ(ToGrpcStatus(Status::InvalidArgument("x")).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(ToGrpcStatus(Status::NotFound("x")).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(ToGrpcStatus(Status::FailedPrecondition("x")).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(ToGrpcStatus(Status::ResourceExhausted("x")).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(ToGrpcStatus(Status::PermissionDenied("x")).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(ToGrpcStatus(Status::Unavailable("x")).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(ToGrpcStatus(Status(static_cast<StatusCode>(99), "odd")).error_code(), grpc::StatusCode::UNKNOWN);
}

TEST(GrpcStatusTest, LongMessagesAreCutOnACharacterBoundaryWithANote) {
  const std::string fits(kMaxGrpcMessageBytes, 'a');
  EXPECT_EQ(ToGrpcStatus(Status::InvalidArgument(fits)).error_message(), fits);
  // "é" is two bytes: a cut at any byte position lands before a whole one.
  for (size_t lead : {0, 1}) {
    std::string value(lead, 'x');
    for (int i = 0; i < 20000; ++i) value += "\xc3\xa9";
    const std::string m = ToGrpcStatus(Status::InvalidArgument("op '", value, "' is unknown")).error_message();
    ASSERT_LE(m.size(), kMaxGrpcMessageBytes);
    const size_t note = m.rfind("... (");
    ASSERT_NE(note, std::string::npos) << m.substr(m.size() - 80);
    const std::string kept = m.substr(0, note);
    EXPECT_EQ(kept.rfind("op '", 0), 0u);
    EXPECT_TRUE(kept.size() <= lead + 4 || (kept.size() - lead - 4) % 2 == 0) << kept.size();  // whole characters
    const size_t total = std::string("op '").size() + value.size() + std::string("' is unknown").size();
    EXPECT_EQ(m.substr(note), "... (" + std::to_string(total - kept.size()) + " more bytes cut)");
  }
}

}  // namespace
}  // namespace cache_dit_opd
