// The shared-memory call ring, daemon side (proto/cache_dit_opd/v1/ring.h):
// the record decoder (common/ring_decode.h), Executor::SubmitRejected, the
// consumer thread (server/ring/ring_consumer.h) over a real memfd mapping with the
// real Executor and fake device ops, and the daemon wiring (offer, bind,
// violation, teardown) through the session channel; and the client's C++
// encoder and producer (common/ring_encode.h, client/core/ring_producer.h)
// against that decoder and consumer. CPU only.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <future>
#include <limits>
#include <random>
#include <thread>

#include "client/core/ring_producer.h"
#include "common/futex.h"
#include "common/ring_decode.h"
#include "common/ring_encode.h"
#include "ring_test_util.h"
#include "server/daemon.h"
#include "server/exec/executor.h"
#include "server/ring/ring_consumer.h"
#include "test_util.h"
#include "tests/fake_daemon/fakes.h"

namespace cache_dit_opd {
namespace {

using namespace std::chrono_literals;
using testing::FakeDeviceOps;
using testing::FakeRegionOpener;
using testing::FakeRunner;
using testing::RecordBuilder;
using testing::RingClient;
using client::RecordArgs;
using client::RingCompletion;
using client::RingProducer;
using Clock = std::chrono::steady_clock;

const std::vector<OpInfo> kCatalog = {
    {"op", "out", "cache_dit_cuda_ops::op.out(...)"},
    {"reject", "out", "cache_dit_cuda_ops::reject.out(...)"},
    {"zeta", "", "cache_dit_cuda_ops::zeta(...)"},
};
constexpr uint32_t kOp = 0;      // kCatalog's "op.out"
constexpr uint32_t kReject = 1;  // "reject.out": FakeRunner refuses it

template <typename Pred>
bool WaitUntil(Pred pred, std::chrono::milliseconds timeout = 5000ms) {
  const auto deadline = Clock::now() + timeout;
  while (!pred()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

Status Decode(const RecordBuilder& r, CallRequest* req = nullptr, RecordIds* ids = nullptr) {
  std::vector<uint8_t> b = r.Bytes();
  CallRequest local_req;
  RecordIds local_ids;
  return DecodeRecord(b.data(), b.size(), kCatalog, req ? req : &local_req, ids ? ids : &local_ids);
}

// ---------------------------------------------------------------------------
// Record codec

TEST(RingCodecTest, RoundTripsEveryKind) {
  RecordBuilder r(/*ticket=*/77, /*lane=*/3, /*seq=*/12, /*op_index=*/2);
  r.Tensor(5, 4096, {2, 3, 4}, {12, 4, 1}, DType::kBFloat16)
      .Int(-42)
      .Float(0.1)
      .Bool(1)
      .Bool(0)
      .IntList({1, -2, INT64_MAX, INT64_MIN})
      .FloatList({1.5, -0.0, 1e300})
      .BoolList({1, 0, 1})
      .None()
      .Tensor(9, 0, {}, {}, DType::kFloat8E5M2)
      .IntList({});
  CallRequest req;
  RecordIds ids;
  Status s = Decode(r, &req, &ids);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(ids.header_usable);
  EXPECT_EQ(ids.ticket, 77u);
  EXPECT_EQ(ids.lane, 3u);
  EXPECT_EQ(ids.seq, 12u);
  EXPECT_EQ(req.op, "zeta");
  EXPECT_EQ(req.overload, "");
  EXPECT_EQ(req.lane, 3u);
  EXPECT_EQ(req.seq, 12u);
  ASSERT_EQ(req.args.size(), 11u);
  const auto& t = std::get<TensorRef>(req.args[0]);
  EXPECT_EQ(t.region_id, 5u);
  EXPECT_EQ(t.byte_offset, 4096u);
  EXPECT_EQ(t.sizes, (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(t.strides, (std::vector<int64_t>{12, 4, 1}));
  EXPECT_EQ(t.dtype, DType::kBFloat16);
  EXPECT_EQ(std::get<int64_t>(req.args[1]), -42);
  EXPECT_EQ(std::get<double>(req.args[2]), 0.1);
  EXPECT_EQ(std::get<bool>(req.args[3]), true);
  EXPECT_EQ(std::get<bool>(req.args[4]), false);
  EXPECT_EQ(std::get<std::vector<int64_t>>(req.args[5]), (std::vector<int64_t>{1, -2, INT64_MAX, INT64_MIN}));
  const auto& fl = std::get<std::vector<double>>(req.args[6]);
  ASSERT_EQ(fl.size(), 3u);
  EXPECT_EQ(fl[0], 1.5);
  EXPECT_TRUE(std::signbit(fl[1]));
  EXPECT_EQ(fl[2], 1e300);
  EXPECT_EQ(std::get<std::vector<bool>>(req.args[7]), (std::vector<bool>{true, false, true}));
  EXPECT_TRUE(std::holds_alternative<NoneArg>(req.args[8]));
  const auto& scalar = std::get<TensorRef>(req.args[9]);
  EXPECT_TRUE(scalar.sizes.empty());
  EXPECT_EQ(scalar.dtype, DType::kFloat8E5M2);
  EXPECT_TRUE(std::get<std::vector<int64_t>>(req.args[10]).empty());
}

TEST(RingCodecTest, LimitsThemselvesAreAccepted) {
  // No arguments at all.
  CallRequest req;
  ASSERT_TRUE(Decode(RecordBuilder(0, 0, 1), &req).ok());
  EXPECT_EQ(req.op, "op");
  EXPECT_EQ(req.overload, "out");
  EXPECT_TRUE(req.args.empty());
  // 32 arguments, an 8-dim tensor among them; a 64-value list.
  RecordBuilder many(0, 0, 1);
  many.Tensor(1, 0, {1, 2, 3, 4, 5, 6, 7, 8}, {8, 7, 6, 5, 4, 3, 2, 1}, DType::kFloat32);
  for (int i = 1; i < kMaxArgs; ++i) many.Int(i);
  ASSERT_TRUE(Decode(many, &req).ok());
  EXPECT_EQ(req.args.size(), 32u);
  ASSERT_TRUE(Decode(RecordBuilder(0, 0, 1).FloatList(std::vector<double>(64, 2.0)), &req).ok());
  // A record filling the whole 2048-byte slot: 3 lists of 64 values plus
  // (2048 - 64 - 3 * 520) / 8 - 1 = 52 more values in a fourth.
  RecordBuilder full(0, 0, 1);
  full.IntList(std::vector<int64_t>(64, 1)).IntList(std::vector<int64_t>(64, 2)).IntList(std::vector<int64_t>(64, 3));
  full.IntList(std::vector<int64_t>(52, 4));
  ASSERT_EQ(full.Bytes().size(), v1::kSlotBytes);
  ASSERT_TRUE(Decode(full, &req).ok());
}

TEST(RingCodecTest, MalformedRecordsNameFieldAndValue) {
  struct Case {
    const char* what;
    RecordBuilder record;
    const char* expect;
    bool header_usable;
  };
  auto R = [] { return RecordBuilder(7, 1, 4); };
  std::vector<Case> cases = {
      {"bad magic", R().Magic(0xDEADBEEF), "magic 0xdeadbeef", false},
      {"record_bytes too big", R().RecordBytes(2056), "record_bytes 2056 exceeds", true},
      {"record_bytes far too big", R().RecordBytes(0xFFFFFFF8u), "record_bytes 4294967288", true},
      {"record_bytes too small", R().RecordBytes(56), "record_bytes 56 is less than", true},
      {"record_bytes zero", R().RecordBytes(0), "record_bytes 0", true},
      {"record_bytes unaligned", R().Int(1).RecordBytes(68), "record_bytes 68 is not a multiple of 8", true},
      {"record_bytes past the buffer", R().RecordBytes(128), "record_bytes 128 exceeds the 64 bytes", true},
      {"nargs 33", R().Nargs(33), "nargs 33 exceeds 32", true},
      {"nargs huge", R().Nargs(0xFFFFFFFFu), "nargs 4294967295", true},
      {"op_index out of range", RecordBuilder(7, 1, 4, 3), "op_index 3 is out of range", true},
      {"op_index huge", RecordBuilder(7, 1, 4, 0xFFFFFFFFu), "op_index 4294967295", true},
      {"arg header past record_bytes", R().Int(1).Nargs(2), "argument 1: header at byte 80 runs past", true},
      {"arg payload past record_bytes", R().Int(1).RecordBytes(72), "argument 0: int payload of 8 bytes", true},
      {"tensor payload past record_bytes", R().Header(1, 2).Put(int64_t{1}), "argument 0: tensor payload of 56", true},
      {"unknown kind", R().Int(1).Header(9, 1).Put(int64_t{0}), "argument 1: unknown kind 9", true},
      {"huge kind", R().Header(0x80000000u, 0), "unknown kind 2147483648", true},
      {"tensor ndim 9", R().Tensor(1, 0, std::vector<int64_t>(9, 1), std::vector<int64_t>(9, 1), DType::kFloat32),
       "argument 0: tensor ndim 9 exceeds 8", true},
      {"int list 65", R().IntList(std::vector<int64_t>(65, 0)), "int_list of 65 values exceeds 64", true},
      {"float list 65", R().FloatList(std::vector<double>(65, 0)), "float_list of 65 values", true},
      {"bool list 65", R().BoolList(std::vector<int64_t>(65, 0)), "bool_list of 65 values", true},
      {"list count huge", R().Header(5, 0xFFFFFFFFu), "int_list of 4294967295 values", true},
      {"bool 2", R().Bool(2), "argument 0: bool value 2 is not 0 or 1", true},
      {"bool -1", R().Int(3).Bool(-1), "argument 1: bool value -1", true},
      {"bool list element", R().BoolList({0, 1, 3}), "bool_list value 3 at index 2", true},
      {"int count 2", R().Header(2, 2).Put(int64_t{1}).Put(int64_t{2}), "int count 2 is not 1", true},
      {"float count 0", R().Header(3, 0), "float count 0 is not 1", true},
      {"none count 1", R().Header(0, 1), "none count 1 is not 0", true},
      {"dtype 0", R().Tensor(1, 0, {1}, {1}, DType::kUnspecified), "argument 0: dtype 0 is not", true},
      {"dtype 12", R().Tensor(1, 0, {1}, {1}, static_cast<DType>(12)), "dtype 12", true},
      {"dtype negative", R().Tensor(1, 0, {1}, {1}, static_cast<DType>(-3)), "dtype -3", true},
      {"bytes after the last argument", R().Int(1).Nargs(0), "arguments end at byte 64 but record_bytes is 80", true},
  };
  for (const Case& c : cases) {
    CallRequest req;
    req.op = "stale";
    RecordIds ids;
    Status s = Decode(c.record, &req, &ids);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.what;
    EXPECT_NE(s.message().find(c.expect), std::string::npos) << c.what << ": " << s.message();
    EXPECT_EQ(ids.header_usable, c.header_usable) << c.what;
    EXPECT_EQ(ids.lane, c.record.Bytes().size() >= 64 ? 1u : 0u) << c.what;
    EXPECT_EQ(ids.seq, 4u) << c.what;
    EXPECT_TRUE(req.op.empty() && req.args.empty()) << c.what << ": output not cleared";
  }
}

TEST(RingCodecTest, ShortBufferHasNoUsableHeader) {
  std::vector<uint8_t> b = RecordBuilder(1, 2, 3).Bytes();
  CallRequest req;
  RecordIds ids;
  Status s = DecodeRecord(b.data(), 63, kCatalog, &req, &ids);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("63 bytes"), std::string::npos) << s.message();
  EXPECT_FALSE(ids.header_usable);
  EXPECT_FALSE(DecodeRecord(nullptr, 0, kCatalog, &req, &ids).ok());
}

TEST(RingCodecTest, RandomMutationsNeverCrashOrPassUncheckedValues) {
  RecordBuilder base(5, 0, 9);
  base.Tensor(3, 128, {4, 4}, {4, 1}, DType::kFloat16).IntList({1, 2, 3}).Bool(1).FloatList({0.5}).None();
  const std::vector<uint8_t> good = base.Bytes();
  std::mt19937_64 rng(12345);
  int ok = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    std::vector<uint8_t> b(v1::kSlotBytes);
    std::memcpy(b.data(), good.data(), good.size());
    for (size_t i = good.size(); i < b.size(); ++i) b[i] = static_cast<uint8_t>(rng());
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) b[rng() % (good.size() + 16)] = static_cast<uint8_t>(rng());
    CallRequest req;
    RecordIds ids;
    Status s = DecodeRecord(b.data(), b.size(), kCatalog, &req, &ids);
    if (s.ok()) {
      ++ok;
      ASSERT_LE(req.args.size(), static_cast<size_t>(kMaxArgs));
      for (const Arg& a : req.args) {
        if (const auto* t = std::get_if<TensorRef>(&a)) {
          ASSERT_LE(t->sizes.size(), static_cast<size_t>(kMaxTensorDims));
          ASSERT_EQ(t->sizes.size(), t->strides.size());
          ASSERT_TRUE(IsWireDType(static_cast<int>(t->dtype))) << static_cast<int>(t->dtype);
        }
        if (const auto* l = std::get_if<std::vector<int64_t>>(&a)) {
          ASSERT_LE(l->size(), static_cast<size_t>(kMaxListLength));
        }
      }
    } else {
      ASSERT_EQ(s.code(), StatusCode::kInvalidArgument);
    }
  }
  EXPECT_GT(ok, 0);  // value-only flips (region ids, offsets, ints) still decode
}

// Every kind through the encoder decodes to the same values.
TEST(RingRecordTest, EveryKindRoundTripsThroughTheDaemonDecoder) {
  RecordArgs a;
  const int64_t sizes[3] = {2, 3, 4}, strides[3] = {12, 4, 1};
  const int64_t ints[2] = {-5, 1LL << 40};
  const double floats[2] = {0.5, -2.25};
  const bool bools[3] = {true, false, true};
  ASSERT_TRUE(a.AddTensor(7, 4096, DType::kBFloat16, 3, sizes, strides));
  ASSERT_TRUE(a.AddNone());
  ASSERT_TRUE(a.AddInt(-42));
  ASSERT_TRUE(a.AddFloat(1.5));
  ASSERT_TRUE(a.AddBool(true));
  ASSERT_TRUE(a.AddIntList(ints, 2));
  ASSERT_TRUE(a.AddFloatList(floats, 2));
  ASSERT_TRUE(a.AddBoolList(bools, 3));
  std::vector<uint8_t> rec(sizeof(v1::RecordHeader) + a.size());
  v1::RecordHeader h{};
  h.magic = v1::kRecordMagic;
  h.record_bytes = static_cast<uint32_t>(rec.size());
  h.ticket = 3;
  h.seq = 9;
  h.lane = 1;
  h.op_index = kOp;
  h.nargs = a.count();
  std::memcpy(rec.data(), &h, sizeof(h));
  std::memcpy(rec.data() + sizeof(h), a.data(), a.size());
  CallRequest req;
  RecordIds ids;
  Status s = DecodeRecord(rec.data(), rec.size(), kCatalog, &req, &ids);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(req.op, "op");
  EXPECT_EQ(req.seq, 9u);
  EXPECT_EQ(req.lane, 1u);
  ASSERT_EQ(req.args.size(), 8u);
  const auto& t = std::get<TensorRef>(req.args[0]);
  EXPECT_EQ(t.region_id, 7u);
  EXPECT_EQ(t.byte_offset, 4096u);
  EXPECT_EQ(t.dtype, DType::kBFloat16);
  EXPECT_EQ(t.sizes, (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(t.strides, (std::vector<int64_t>{12, 4, 1}));
  EXPECT_TRUE(std::holds_alternative<NoneArg>(req.args[1]));
  EXPECT_EQ(std::get<int64_t>(req.args[2]), -42);
  EXPECT_EQ(std::get<double>(req.args[3]), 1.5);
  EXPECT_EQ(std::get<bool>(req.args[4]), true);
  EXPECT_EQ(std::get<std::vector<int64_t>>(req.args[5]), (std::vector<int64_t>{-5, 1LL << 40}));
  EXPECT_EQ(std::get<std::vector<double>>(req.args[6]), (std::vector<double>{0.5, -2.25}));
  EXPECT_EQ(std::get<std::vector<bool>>(req.args[7]), (std::vector<bool>{true, false, true}));
}

TEST(RingRecordTest, WhatDoesNotFitIsRefusedAndLeavesTheRecordUnchanged) {
  RecordArgs a;
  const int64_t nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  EXPECT_FALSE(a.AddTensor(1, 0, DType::kFloat32, 9, nine, nine));  // > kMaxTensorDims
  std::vector<int64_t> long_list(kMaxListLength + 1, 0);
  EXPECT_FALSE(a.AddIntList(long_list.data(), long_list.size()));
  EXPECT_EQ(a.size(), 0u);
  EXPECT_EQ(a.count(), 0u);
  for (int i = 0; i < kMaxArgs; ++i) ASSERT_TRUE(a.AddInt(i));
  const size_t full = a.size();
  EXPECT_FALSE(a.AddNone());  // > kMaxArgs
  EXPECT_EQ(a.size(), full);
  EXPECT_EQ(a.count(), static_cast<uint32_t>(kMaxArgs));
  // Bytes: 31 lists of 64 values do not fit 1984 bytes.
  RecordArgs b;
  std::vector<int64_t> list(kMaxListLength, 1);
  int added = 0;
  while (b.AddIntList(list.data(), list.size())) ++added;
  EXPECT_EQ(added, static_cast<int>(RecordArgs::kCapacity / (8 + 8 * kMaxListLength)));
  EXPECT_LE(b.size(), RecordArgs::kCapacity);
}

// ---------------------------------------------------------------------------
// Executor::SubmitRejected

class RingExecutorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    executor_ = std::make_unique<Executor>(&device_, &runner_, &stats_, ExecutorOptions{}, nullptr);
    executor_->Start();
    SessionConfig c;
    c.id = 1;
    c.lanes = 2;
    c.client_pid = 1;
    ASSERT_TRUE(Session::Create(c, &device_, &opener_, &session_).ok());
    session_->set_state(SessionState::kBound);
  }
  void TearDown() override { executor_->Stop(); }
  CallRequest Req(uint32_t lane, uint64_t seq) {
    CallRequest r;
    r.op = "op";
    r.overload = "out";
    r.lane = lane;
    r.seq = seq;
    return r;
  }

  FakeDeviceOps device_;
  FakeRegionOpener opener_;
  FakeRunner runner_;
  DaemonStats stats_;
  std::unique_ptr<Executor> executor_;
  std::shared_ptr<Session> session_;
};

TEST_F(RingExecutorTest, PreRejectedCallTakesItsSeqAndCompletesInOrder) {
  std::promise<Status> first;
  executor_->Submit(session_, Req(0, 1), [&](const Status& s) { first.set_value(s); });
  EXPECT_TRUE(first.get_future().get().ok());  // accepted; its inputs are not ready

  Status answer;
  bool answered = false;
  executor_->SubmitRejected(session_, 0, 2, CallTransport::kRing, Status::InvalidArgument("record says no"),
                            [&](const Status& s) {
                              answer = s;
                              answered = true;
                            });
  ASSERT_TRUE(answered);  // at once, on this thread
  EXPECT_EQ(answer.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(answer.message(), "record says no");
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(session_->memory().Done(0), 0u);  // not before seq 1 ran

  // The lane moved on: seq 3 is next.
  std::promise<Status> third;
  executor_->Submit(session_, Req(0, 3), [&](const Status& s) { third.set_value(s); });
  EXPECT_TRUE(third.get_future().get().ok());

  std::atomic_ref<uint64_t>(session_->memory().lane(0)->inputs_ready).store(3);
  ASSERT_TRUE(WaitUntil([&] { return session_->memory().Done(0) == 3; }));
  auto ran = runner_.ran_copy();
  ASSERT_EQ(ran.size(), 2u);
  EXPECT_EQ(ran[0].seq, 1u);
  EXPECT_EQ(ran[1].seq, 3u);
  EXPECT_EQ(session_->errors.load(), 1u);
  EXPECT_EQ(executor_->pending(), 0u);
}

TEST_F(RingExecutorTest, PreRejectedCallOutOfOrderTouchesNoLane) {
  for (auto [lane, seq] : {std::pair<uint32_t, uint64_t>{0, 5}, {0, 0}, {7, 1}}) {
    Status answer;
    executor_->SubmitRejected(session_, lane, seq, CallTransport::kRing, Status::InvalidArgument("bad record"),
                              [&](const Status& s) { answer = s; });
    EXPECT_EQ(answer.message(), "bad record");
  }
  std::promise<Status> p;
  executor_->Submit(session_, Req(0, 1), [&](const Status& s) { p.set_value(s); });
  EXPECT_TRUE(p.get_future().get().ok());  // seq 1 is still the lane's next
  EXPECT_EQ(session_->errors.load(), 3u);
}

TEST_F(RingExecutorTest, DropWritesDoneForPreRejectedCallsWithoutAnsweringTwice) {
  std::promise<Status> first;
  executor_->Submit(session_, Req(1, 1), [&](const Status& s) { first.set_value(s); });
  ASSERT_TRUE(first.get_future().get().ok());
  int answers = 0;
  executor_->SubmitRejected(session_, 1, 2, CallTransport::kRing, Status::InvalidArgument("x"),
                            [&](const Status&) { ++answers; });
  session_->set_state(SessionState::kClosed);
  std::promise<void> dropped;
  executor_->DropSession(session_, Status::Cancelled("ended"), [&] { dropped.set_value(); });
  ASSERT_EQ(dropped.get_future().wait_for(5s), std::future_status::ready);
  EXPECT_EQ(answers, 1);
  // Call 1 went to the GPU behind a parked wait, released by the drop: its
  // "done" and the covering one follow on the lane stream.
  EXPECT_TRUE(WaitUntil([&] { return session_->memory().Done(1) == 2; }));
}

// ---------------------------------------------------------------------------
// The consumer over a real memfd, the real executor, fake device ops.

// A runner that records every request it was asked to prepare and can hold
// the executor thread in Prepare (a busy daemon: completions stop coming).
class CapturingRunner : public FakeRunner {
 public:
  Status Prepare(const CallRequest& req, const RegionResolver& regions,
                 std::unique_ptr<PreparedCall>* out) override {
    {
      std::unique_lock<std::mutex> lock(gate_mu_);
      ++waiting_;
      gate_cv_.wait(lock, [&] { return open_; });
      --waiting_;
      seen_.push_back(req);
    }
    return FakeRunner::Prepare(req, regions, out);
  }
  void Hold() {
    std::lock_guard<std::mutex> lock(gate_mu_);
    open_ = false;
  }
  void Release() {
    {
      std::lock_guard<std::mutex> lock(gate_mu_);
      open_ = true;
    }
    gate_cv_.notify_all();
  }
  std::vector<CallRequest> seen() {
    std::lock_guard<std::mutex> lock(gate_mu_);
    return seen_;
  }
  // Threads held in Prepare now.
  int waiting() {
    std::lock_guard<std::mutex> lock(gate_mu_);
    return waiting_;
  }

 private:
  std::mutex gate_mu_;
  std::condition_variable gate_cv_;
  bool open_ = true;
  int waiting_ = 0;
  std::vector<CallRequest> seen_;
};

class RingConsumerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    executor_ = std::make_unique<Executor>(&device_, &runner_, &stats_, ExecutorOptions{}, nullptr);
    executor_->Start();
  }
  void TearDown() override {
    runner_.Release();
    if (consumer_) consumer_->Stop();
    executor_->Stop();
  }

  void StartRing(uint32_t lanes = 1, uint32_t capacity = 8, RingConsumerOptions options = {}) {
    SessionConfig c;
    c.id = 1;
    c.lanes = lanes;
    c.client_pid = 1;
    c.ring_capacity = capacity;
    ASSERT_TRUE(Session::Create(c, &device_, &opener_, &session_).ok());
    session_->set_state(SessionState::kBound);
    for (uint32_t i = 0; i < lanes; ++i) SetInputsReady(i, uint64_t{1} << 40);
    RingConsumer::Sink sink;
    sink.submit = [this](CallRequest r, RingConsumer::Completion d) {
      executor_->Submit(session_, std::move(r), std::move(d));
    };
    sink.submit_rejected = [this](uint32_t lane, uint64_t seq, Status s, RingConsumer::Completion d) {
      executor_->SubmitRejected(session_, lane, seq, CallTransport::kRing, std::move(s), std::move(d));
    };
    sink.on_violation = [this](const Status& s) {
      std::lock_guard<std::mutex> lock(mu_);
      violations_.push_back(s);
    };
    consumer_ = std::make_unique<RingConsumer>(session_, &kCatalog, std::move(sink), std::move(options));
    consumer_->Start();
    client_ = std::make_unique<RingClient>(session_->memory().data());
  }
  void SetInputsReady(uint32_t lane, uint64_t v) {
    std::atomic_ref<uint64_t>(session_->memory().lane(lane)->inputs_ready).store(v, std::memory_order_release);
  }
  std::vector<Status> violations() {
    std::lock_guard<std::mutex> lock(mu_);
    return violations_;
  }
  v1::CompletionRecord Completion(uint64_t t) {
    v1::CompletionRecord c{};
    EXPECT_TRUE(client_->Wait(t, &c)) << "no completion for ticket " << t;
    return c;
  }
  // A thread publishing calls seq 1..n on lane 0 (the ring's back-pressure
  // may hold it), counting each once published.
  std::thread PublishInOrder(uint64_t n, std::atomic<uint64_t>* published) {
    return std::thread([this, n, published] {
      for (uint64_t seq = 1; seq <= n; ++seq) {
        client_->Publish(RecordBuilder(0, 0, seq).Int(static_cast<int64_t>(seq)));
        published->fetch_add(1);
      }
    });
  }
  // Completions 0..n-1 accept seq 1..n.
  void ExpectAcceptedInOrder(uint64_t n) {
    for (uint64_t t = 0; t < n; ++t) {
      v1::CompletionRecord c = Completion(t);
      EXPECT_EQ(c.status_code, 0) << c.message;
      EXPECT_EQ(c.seq, t + 1);
    }
  }

  FakeDeviceOps device_;
  FakeRegionOpener opener_;
  CapturingRunner runner_;
  DaemonStats stats_;
  std::unique_ptr<Executor> executor_;
  std::shared_ptr<Session> session_;
  std::unique_ptr<RingConsumer> consumer_;
  std::unique_ptr<RingClient> client_;
  std::mutex mu_;
  std::vector<Status> violations_;
};

TEST_F(RingConsumerTest, LayoutInTheSessionMemory) {
  StartRing(/*lanes=*/3, /*capacity=*/16);
  const auto* h = session_->memory().header();
  EXPECT_EQ(h->ring_offset % 4096, 0u);
  EXPECT_GE(h->ring_offset, SessionMemory::LaneOffset(3));
  EXPECT_EQ(h->ring_bytes, v1::RingBytes(16));
  EXPECT_LE(h->ring_offset + h->ring_bytes, h->total_bytes);
  EXPECT_EQ(h->total_bytes, session_->memory().bytes());
  const v1::RingControl* c = client_->control();
  EXPECT_EQ(c->version, v1::kRingVersion);
  EXPECT_EQ(c->capacity, 16u);
  EXPECT_EQ(c->slot_bytes, v1::kSlotBytes);
  EXPECT_EQ(c->completion_bytes, v1::kCompletionBytes);
  EXPECT_EQ(c->sq_tail, 0u);
  EXPECT_EQ(c->sq_head, 0u);
  std::unique_ptr<SessionMemory> none;
  ASSERT_TRUE(SessionMemory::Create(9, 1, 0, &none).ok());
  EXPECT_EQ(none->header()->ring_offset, 0u);
  EXPECT_EQ(none->header()->ring_bytes, 0u);
  EXPECT_EQ(none->ring_control(), nullptr);
  EXPECT_FALSE(SessionMemory::Create(9, 1, 12, &none).ok());  // not a power of two
}

TEST_F(RingConsumerTest, WrapsAroundManyTimesInOrder) {
  StartRing(/*lanes=*/1, /*capacity=*/8);
  constexpr uint64_t kCalls = 100;  // 12.5 times around
  for (uint64_t seq = 1; seq <= kCalls; ++seq) {
    uint64_t t = client_->Publish(RecordBuilder(0, 0, seq).Int(static_cast<int64_t>(seq)));
    ASSERT_EQ(t, seq - 1);
  }
  for (uint64_t t = 0; t < kCalls; ++t) {
    v1::CompletionRecord c = Completion(t);
    EXPECT_EQ(c.status_code, 0) << c.message;
    EXPECT_EQ(c.ticket, t);
    EXPECT_EQ(c.seq, t + 1);
    EXPECT_EQ(c.lane, 0u);
    EXPECT_STREQ(c.message, "");
  }
  ASSERT_TRUE(WaitUntil([&] { return session_->memory().Done(0) == kCalls; }));
  auto seen = runner_.seen();
  ASSERT_EQ(seen.size(), kCalls);
  for (uint64_t i = 0; i < kCalls; ++i) {
    EXPECT_EQ(seen[i].seq, i + 1);
    EXPECT_EQ(std::get<int64_t>(seen[i].args.at(0)), static_cast<int64_t>(i + 1));
  }
  EXPECT_EQ(client_->head(), kCalls);
  EXPECT_EQ(client_->overwritten(), 0);
  EXPECT_EQ(consumer_->records(), kCalls);
  EXPECT_EQ(consumer_->malformed(), 0u);
  EXPECT_TRUE(violations().empty());
}

TEST_F(RingConsumerTest, RingFullMakesTheProducerWaitAndNothingIsOverwritten) {
  StartRing(/*lanes=*/1, /*capacity=*/8);
  runner_.Hold();  // the executor answers nothing until released
  constexpr uint64_t kCalls = 40;
  std::atomic<uint64_t> published{0};
  std::thread producer = PublishInOrder(kCalls, &published);
  ASSERT_TRUE(WaitUntil([&] { return published.load() == 8; }));
  std::this_thread::sleep_for(150ms);
  EXPECT_EQ(published.load(), 8u);  // the ninth waits for completion 0
  EXPECT_EQ(client_->tail(), 8u);
  EXPECT_EQ(client_->head(), 8u);  // the daemon copied all it was given and waits too
  runner_.Release();
  producer.join();
  ExpectAcceptedInOrder(kCalls);
  EXPECT_EQ(client_->overwritten(), 0);
  ASSERT_TRUE(WaitUntil([&] { return session_->memory().Done(0) == kCalls; }));
}

TEST_F(RingConsumerTest, AClientFarAheadOfItsGpuWaitsOnItsRingNotInTheDaemonsMemory) {
  // Inputs never ready and no parking slot: every accepted call stays held.
  executor_->Stop();
  ExecutorOptions no_parking;
  no_parking.parking_slots = 0;
  executor_ = std::make_unique<Executor>(&device_, &runner_, &stats_, no_parking, nullptr);
  executor_->Start();
  RingConsumerOptions o;
  o.max_held = 4;
  StartRing(/*lanes=*/1, /*capacity=*/8, o);
  SetInputsReady(0, 0);
  constexpr uint64_t kCalls = 30;
  std::atomic<uint64_t> published{0};
  std::thread producer = PublishInOrder(kCalls, &published);
  // Four taken and answered; the client fills the ring's 8 slots past the
  // last answer it has (tickets 4..11) and waits for completion 4.
  ASSERT_TRUE(WaitUntil([&] { return published.load() == 12; }));
  ASSERT_TRUE(WaitUntil([&] { return session_->held.load() == 4; }));
  std::this_thread::sleep_for(150ms);
  EXPECT_EQ(published.load(), 12u);
  EXPECT_EQ(client_->head(), 4u);
  EXPECT_EQ(session_->held.load(), 4u);
  EXPECT_EQ(runner_.seen().size(), 4u);
  EXPECT_EQ(session_->memory().Done(0), 0u);

  SetInputsReady(0, kCalls);
  producer.join();
  ExpectAcceptedInOrder(kCalls);
  ASSERT_TRUE(WaitUntil([&] { return session_->memory().Done(0) == kCalls; }));
  ASSERT_TRUE(WaitUntil([&] { return session_->held.load() == 0; }));
  EXPECT_EQ(client_->overwritten(), 0);
  EXPECT_TRUE(violations().empty());
}

TEST_F(RingConsumerTest, MalformedAndTornRecordsFailOnlyThemselves) {
  StartRing(/*lanes=*/2, /*capacity=*/8);
  struct Step {
    RecordBuilder record;
    int code;
    const char* message;  // substring
  };
  // Lane 0 seqs 1..7 and lane 1 seqs 1..2, interleaved with garbage.
  std::vector<Step> steps = {
      {RecordBuilder(0, 0, 1).Int(1), 0, ""},
      {RecordBuilder(0, 0, 2).Int(2).Nargs(40), 3, "nargs 40 exceeds 32"},          // seq 2 completes in order
      {RecordBuilder(0, 0, 3).Int(3), 0, ""},
      {RecordBuilder(0, 0, 4).Magic(0x12345678), 3, "magic 0x12345678"},           // no lane touched
      {RecordBuilder(0, 0, 4).Int(4), 0, ""},
      {RecordBuilder(0, 1, 1).Header(11, 1).Put(int64_t{0}), 3, "unknown kind 11"},  // lane 1 seq 1
      {RecordBuilder(0, 1, 2).Int(5), 0, ""},
      {RecordBuilder(0, 0, 5, /*op_index=*/1), 3, "fake validation refused seq 5"},  // rejected by validation
      {RecordBuilder(0, 0, 6, /*op_index=*/99), 3, "op_index 99"},
      {RecordBuilder(0, 0, 9).Int(9), 3, "expected seq 7, got 9"},                   // out of order
      {RecordBuilder(0, 0, 7).Bool(2), 3, "bool value 2"},
      {RecordBuilder(0, 0, 8).Tensor(1, 0, std::vector<int64_t>(9, 1), std::vector<int64_t>(9, 1), DType::kFloat32),
       3, "tensor ndim 9"},
      {RecordBuilder(0, 0, 9).Int(10), 0, ""},
  };
  for (size_t i = 0; i < steps.size(); ++i) client_->Publish(steps[i].record);
  // A torn record: the header of a new one over the tail of an older one
  // (its arguments are whatever the slot still held).
  const uint64_t torn = client_->Publish([&](uint64_t t) {
    std::vector<uint8_t> b = RecordBuilder(t, 0, 10).IntList({1, 2, 3}).Int(4).Bytes();
    std::fill(b.begin() + 64 + 8 + 8, b.end(), 0xAB);  // after header, list header, one value
    return b;
  });
  // A record whose ticket field is not its slot's ticket (a stale copy).
  const uint64_t stale = client_->Publish([&](uint64_t t) { return RecordBuilder(t + 8, 0, 10).Int(1).Bytes(); });
  const uint64_t last = client_->Publish(RecordBuilder(0, 0, 11).Int(11));

  for (size_t i = 0; i < steps.size(); ++i) {
    v1::CompletionRecord c = Completion(i);
    EXPECT_EQ(c.status_code, steps[i].code) << "step " << i << ": " << c.message;
    EXPECT_NE(std::string(c.message).find(steps[i].message), std::string::npos) << "step " << i << ": " << c.message;
    EXPECT_EQ(c.ticket, i);
  }
  v1::CompletionRecord c = Completion(torn);
  EXPECT_EQ(c.status_code, 3);
  EXPECT_NE(std::string(c.message).find("argument 1: unknown kind"), std::string::npos) << c.message;
  c = Completion(stale);
  EXPECT_EQ(c.status_code, 3);
  EXPECT_NE(std::string(c.message).find("record ticket " + std::to_string(stale + 8)), std::string::npos)
      << c.message;
  c = Completion(last);
  EXPECT_EQ(c.status_code, 0) << c.message;
  EXPECT_EQ(c.seq, 11u);
  // Every seq on both lanes completed in order, the malformed ones included.
  ASSERT_TRUE(WaitUntil([&] { return session_->memory().Done(0) == 11 && session_->memory().Done(1) == 2; }))
      << session_->memory().Done(0) << " " << session_->memory().Done(1);
  std::vector<uint64_t> ran;
  for (const auto& r : runner_.ran_copy()) {
    if (r.lane == 0) ran.push_back(r.seq);
  }
  EXPECT_EQ(ran, (std::vector<uint64_t>{1, 3, 4, 9, 11}));
  EXPECT_EQ(consumer_->malformed(), 8u);  // not the validation or seq rejections
  EXPECT_TRUE(violations().empty());
}

TEST_F(RingConsumerTest, ARecordRewrittenAfterPublicationIsDecodedFromTheFirstCopy) {
  RingConsumerOptions o;
  // Between the consumer's copy and its decode, the "client" rewrites the
  // slot: other op, other values, a broken magic.
  std::atomic<int> rewrites{0};
  SessionMemory* memory = nullptr;
  o.after_copy = [&](uint64_t ticket) {
    auto* slot = const_cast<uint8_t*>(memory->ring_slot(ticket));
    std::vector<uint8_t> evil = RecordBuilder(ticket, 0, 1, /*op_index=*/2).Int(666).Int(777).Bytes();
    std::memcpy(slot, evil.data(), evil.size());
    slot[0] ^= 0xFF;
    rewrites.fetch_add(1);
  };
  // StartRing creates the session; the hook reads `memory` only once records flow.
  StartRing(1, 8, o);
  memory = &session_->memory();
  const uint64_t t = client_->Publish(RecordBuilder(0, 0, 1).Int(42));
  v1::CompletionRecord c = Completion(t);
  EXPECT_EQ(c.status_code, 0) << c.message;
  EXPECT_EQ(rewrites.load(), 1);
  auto seen = runner_.seen();
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].op, "op");
  ASSERT_EQ(seen[0].args.size(), 1u);
  EXPECT_EQ(std::get<int64_t>(seen[0].args[0]), 42);
  // The slot really holds the rewrite.
  EXPECT_NE(std::memcmp(memory->ring_slot(t), RecordBuilder(0, 0, 1).Int(42).Bytes().data(), 64), 0);
}

TEST_F(RingConsumerTest, TailFarAheadIsAViolationAndStopsTheConsumer) {
  StartRing(1, 8);
  client_->Publish(RecordBuilder(0, 0, 1).Int(1));
  Completion(0);
  client_->SetTail(1 + 9);  // 9 records ahead of head 1, capacity 8
  ASSERT_TRUE(WaitUntil([&] { return !violations().empty(); }));
  auto v = violations();
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].code(), StatusCode::kInvalidArgument);
  EXPECT_NE(v[0].message().find("sq_tail 10 is 9 records ahead of the daemon's head 1"), std::string::npos)
      << v[0].message();
  EXPECT_EQ(client_->head(), 1u);  // nothing past the violation was taken
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(consumer_->records(), 1u);
  EXPECT_EQ(violations().size(), 1u);  // once
}

TEST_F(RingConsumerTest, TailBehindHeadIsAViolation) {
  StartRing(1, 8);
  for (uint64_t seq = 1; seq <= 3; ++seq) client_->Publish(RecordBuilder(0, 0, seq));
  Completion(2);
  client_->SetTail(1);
  ASSERT_TRUE(WaitUntil([&] { return !violations().empty(); }));
  EXPECT_NE(violations()[0].message().find("sq_tail 1 is behind the daemon's head 3"), std::string::npos)
      << violations()[0].message();
  client_->SetTail(~uint64_t{0});  // and a wrapped 64-bit tail is simply ignored now
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(consumer_->records(), 3u);
}

TEST_F(RingConsumerTest, ATailSeenMidStoreIsNotAViolation) {
  RingConsumerOptions o;
  o.spin = 10s;  // spinning on sq_tail, so it sees the transient value
  StartRing(1, 8, o);
  for (uint64_t seq = 1; seq <= 255; ++seq) client_->Publish(RecordBuilder(0, 0, seq));
  Completion(254);
  // Tail 255 -> 256 stored byte by byte, low byte first: 0xFF, then 0x00
  // (reads as 0: behind the head), then 0x01 in the second byte. What the
  // daemon can see of such a store is the sequence of values the word takes,
  // so the test stores those values, each as one atomic store (release: the
  // first publishes the record): 255 -> 0 -> 256. Byte stores racing with the
  // daemon's 8-byte load would be a data race in this process, where the
  // "client" is a thread; the consumer cannot tell the two apart.
  std::vector<uint8_t> rec = RecordBuilder(255, 0, 256).Bytes();
  std::memcpy(client_->slot(255), rec.data(), rec.size());
  std::atomic_ref<uint64_t> tail(client_->control()->sq_tail);
  tail.store(0x00, std::memory_order_release);  // the low byte cleared
  std::this_thread::sleep_for(5ms);              // the storing thread preempted mid-store
  tail.store(0x100, std::memory_order_release);  // then 0x01 in the second byte
  v1::CompletionRecord c = Completion(255);
  EXPECT_EQ(c.status_code, 0) << c.message;
  EXPECT_TRUE(violations().empty());
}

TEST_F(RingConsumerTest, ManyProducerThreadsOfOneClient) {
  StartRing(/*lanes=*/2, /*capacity=*/8);
  constexpr int kThreads = 4;
  constexpr int kPerThread = 150;
  std::mutex seq_mu;  // the client takes a lane's seq under the same lock that publishes
  uint64_t next_seq[2] = {1, 1};
  std::vector<std::thread> threads;
  std::vector<std::vector<uint64_t>> tickets(kThreads);
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      const uint32_t lane = static_cast<uint32_t>(i % 2);
      for (int k = 0; k < kPerThread; ++k) {
        tickets[i].push_back(client_->Publish([&](uint64_t t) {
          std::lock_guard<std::mutex> lock(seq_mu);  // under the publish lock already: order = ticket order
          return RecordBuilder(t, lane, next_seq[lane]++).Int(i * 1000 + k).Bytes();
        }));
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kThreads; ++i) {
    for (uint64_t t : tickets[i]) {
      v1::CompletionRecord c = Completion(t);
      EXPECT_EQ(c.status_code, 0) << "ticket " << t << ": " << c.message;
      EXPECT_EQ(c.lane, static_cast<uint32_t>(i % 2));
    }
  }
  const uint64_t per_lane = kThreads / 2 * kPerThread;
  ASSERT_TRUE(WaitUntil([&] {
    return session_->memory().Done(0) == per_lane && session_->memory().Done(1) == per_lane;
  }));
  std::vector<uint64_t> last(2, 0);
  for (const auto& r : runner_.ran_copy()) {
    EXPECT_EQ(r.seq, last[r.lane] + 1);
    last[r.lane] = r.seq;
  }
  EXPECT_EQ(client_->overwritten(), 0);
  EXPECT_EQ(consumer_->records(), uint64_t{kThreads} * kPerThread);
}

TEST_F(RingConsumerTest, WakesPromptlyAfterIdle) {
  RingConsumerOptions o;
  o.spin = 50us;
  StartRing(1, 8, o);
  std::this_thread::sleep_for(150ms);  // far past the spin window
  EXPECT_GE(consumer_->sleeps(), 1u);
  // (Polled: every 100 ms the futex times out and the word reads "awake" for
  // a few microseconds.)
  EXPECT_TRUE(WaitUntil([&] { return client_->doorbell() == v1::kDoorbellSleeping; }));
  const auto t0 = Clock::now();
  const uint64_t t = client_->Publish(RecordBuilder(0, 0, 1));
  v1::CompletionRecord c{};
  ASSERT_TRUE(client_->Wait(t, &c, 1000ms));
  const auto took = Clock::now() - t0;
  EXPECT_EQ(c.status_code, 0);
  EXPECT_LT(took, 200ms) << std::chrono::duration<double, std::milli>(took).count() << " ms";
}

TEST_F(RingConsumerTest, AMissedWakeUpIsBoundedByTheSleepTimeout) {
  RingConsumerOptions o;
  o.spin = 0us;
  o.sleep_timeout = 100ms;
  StartRing(1, 8, o);
  std::this_thread::sleep_for(50ms);
  const auto t0 = Clock::now();
  const uint64_t t = client_->Publish(RecordBuilder(0, 0, 1), /*wake=*/false);  // a client that forgot
  v1::CompletionRecord c{};
  ASSERT_TRUE(client_->Wait(t, &c, 2000ms));
  EXPECT_LT(Clock::now() - t0, 400ms);
}

TEST_F(RingConsumerTest, AnIdleConsumerBurnsNoCpu) {
  RingConsumerOptions o;
  o.spin = 50us;
  StartRing(1, 8, o);
  client_->Publish(RecordBuilder(0, 0, 1));
  Completion(0);
  std::this_thread::sleep_for(50ms);  // past the spin
  timespec a{}, b{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &a);
  std::this_thread::sleep_for(300ms);
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &b);
  const double cpu_ms = (b.tv_sec - a.tv_sec) * 1e3 + (b.tv_nsec - a.tv_nsec) / 1e6;
  EXPECT_LT(cpu_ms, 15.0) << "the whole process used " << cpu_ms << " ms of CPU in 300 ms of idle";
  EXPECT_LE(consumer_->sleeps(), 10u);  // ~one futex wait per 100 ms
}

TEST_F(RingConsumerTest, AClientScribblingOnTheDoorbellDoesNotMakeItSpin) {
  RingConsumerOptions o;
  o.spin = 0us;
  StartRing(1, 8, o);
  std::atomic<bool> stop{false};
  std::thread scribbler([&] {
    while (!stop.load()) {
      std::atomic_ref<uint32_t>(client_->control()->doorbell).store(7);
      std::this_thread::sleep_for(100us);
    }
  });
  std::this_thread::sleep_for(50ms);
  const uint64_t before = consumer_->sleeps();
  std::this_thread::sleep_for(200ms);
  const uint64_t woke = consumer_->sleeps() - before;
  EXPECT_LT(woke, 1000u);  // backs off ~1 ms per fruitless wake instead of looping on the syscall
  client_->Publish(RecordBuilder(0, 0, 1));
  v1::CompletionRecord c{};
  EXPECT_TRUE(client_->Wait(0, &c, 1000ms));
  stop.store(true);
  scribbler.join();
}

TEST_F(RingConsumerTest, StopIsPromptWhileAsleep) {
  RingConsumerOptions o;
  o.sleep_timeout = 10000ms;  // only the wake can make it prompt
  StartRing(1, 8, o);
  std::this_thread::sleep_for(50ms);
  const auto t0 = Clock::now();
  consumer_->Stop();
  EXPECT_LT(Clock::now() - t0, 100ms);
}

TEST_F(RingConsumerTest, TeardownWithRecordsPendingNeitherHangsNorLosesADone) {
  StartRing(/*lanes=*/1, /*capacity=*/8);
  SetInputsReady(0, 0);  // accepted calls wait for inputs that never come
  for (uint64_t seq = 1; seq <= 5; ++seq) client_->Publish(RecordBuilder(0, 0, seq));
  for (uint64_t t = 0; t < 5; ++t) EXPECT_EQ(Completion(t).status_code, 0);  // answered when accepted
  runner_.Hold();  // the next ones reach the executor but are not answered yet
  for (uint64_t seq = 6; seq <= 8; ++seq) client_->Publish(RecordBuilder(0, 0, seq));
  ASSERT_TRUE(WaitUntil([&] { return client_->head() == 8; }));
  // The session ends: the daemon's order (Daemon::OnSessionEnd).
  session_->set_state(SessionState::kClosed);
  const auto t0 = Clock::now();
  consumer_->Stop();
  std::promise<void> dropped;
  executor_->DropSession(session_, Status::Cancelled("session 1 closed by its client"), [&] { dropped.set_value(); });
  runner_.Release();  // the executor thread was parked in Prepare
  ASSERT_EQ(dropped.get_future().wait_for(5s), std::future_status::ready);
  EXPECT_LT(Clock::now() - t0, 2s);
  // A record published after the end is never taken.
  std::atomic_ref<uint64_t>(client_->control()->sq_tail).store(9);
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(client_->head(), 8u);
  // Every seq handed over got its "done"; every taken record got an answer.
  EXPECT_EQ(session_->memory().Done(0), 8u);
  int answered_ok = 0, answered_error = 0;
  for (uint64_t t = 5; t < 8; ++t) {
    v1::CompletionRecord c = Completion(t);
    (c.status_code == 0 ? answered_ok : answered_error)++;
  }
  EXPECT_EQ(answered_ok + answered_error, 3);
  // Launched ahead behind the lane's parked wait, the calls were released
  // when the session ended (on their own client's memory): each launched
  // call ran once, in order, and inputs_ready was raised past every seq.
  auto ran = runner_.ran_copy();
  ASSERT_FALSE(ran.empty());
  for (size_t i = 0; i < ran.size(); ++i) EXPECT_EQ(ran[i].seq, i + 1);
  EXPECT_EQ(session_->memory().InputsReady(0), v1::kInputsReadyReleased);
  EXPECT_EQ(executor_->pending(), 0u);
}

// ---------------------------------------------------------------------------
// The client's C++ producer (client/core/ring_producer.h) against this consumer:
// what the native Python client and the C++ client publish.

class RingProducerTest : public RingConsumerTest {
 protected:
  // StartRing first; the producer runs over the same memory as the client would.
  void OpenProducer(RingProducer::Options options = {}) {
    auto* mem = static_cast<uint8_t*>(session_->memory().data());
    const auto* h = reinterpret_cast<const v1::SessionMemoryHeader*>(mem);
    Status s = RingProducer::Open(mem + h->ring_offset, h->ring_bytes, options,
                                  [this] { return alive_ ? Status::Ok() : Status::Unavailable("daemon gone"); },
                                  &producer_);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  static RecordArgs IntArg(int64_t v) {
    RecordArgs a;
    EXPECT_TRUE(a.AddInt(v));
    return a;
  }
  // One synchronous call: (status, daemon code).
  std::pair<Status, int32_t> SyncCall(uint32_t lane, uint64_t seq, uint32_t op, std::string* message = nullptr) {
    RingCompletion answer;
    uint64_t ticket = 0;
    Status s = producer_->Publish(lane, seq, op, IntArg(static_cast<int64_t>(seq)), &answer, nullptr, 0, &ticket);
    if (s.ok()) s = producer_->Wait(ticket, &answer);
    if (message) *message = answer.message;
    return {s, answer.code};
  }

  std::unique_ptr<RingProducer> producer_;
  std::atomic<bool> alive_{true};
};

TEST_F(RingProducerTest, SynchronousCallsWrapAroundInOrder) {
  StartRing(1, 8);
  OpenProducer();
  for (uint64_t seq = 1; seq <= 100; ++seq) {  // 12.5 times around
    auto [s, code] = SyncCall(0, seq, kOp);
    ASSERT_TRUE(s.ok()) << s.ToString();
    ASSERT_EQ(code, 0);
  }
  EXPECT_EQ(producer_->published(), 100u);
  EXPECT_EQ(producer_->in_flight(), 0u);
  ASSERT_TRUE(WaitUntil([&] { return session_->memory().Done(0) == 100; }));
  std::lock_guard<std::mutex> lock(runner_.mu);
  ASSERT_EQ(runner_.ran.size(), 100u);
  for (uint64_t i = 0; i < 100; ++i) EXPECT_EQ(runner_.ran[i].seq, i + 1);
}

TEST_F(RingProducerTest, ARejectedSynchronousCallReturnsTheDaemonsReason) {
  StartRing(1, 8);
  OpenProducer();
  std::string message;
  auto [s, code] = SyncCall(0, 1, kReject, &message);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(code, 3);  // INVALID_ARGUMENT
  EXPECT_NE(message.find("fake validation refused seq 1"), std::string::npos) << message;
  auto [s2, code2] = SyncCall(0, 2, kOp);  // the lane goes on
  EXPECT_TRUE(s2.ok());
  EXPECT_EQ(code2, 0);
}

TEST_F(RingProducerTest, AsynchronousRejectionsAreKeptWithTheirRegionsUntilTaken) {
  StartRing(1, 8);
  OpenProducer();
  const uint64_t regions[2] = {11, 12};
  uint64_t ticket = 0;
  for (uint64_t seq = 1; seq <= 20; ++seq) {
    const uint32_t op = seq % 5 == 0 ? kReject : kOp;
    ASSERT_TRUE(producer_->Publish(0, seq, op, IntArg(1), nullptr, regions, 2, &ticket).ok());
  }
  ASSERT_TRUE(producer_->WaitConsumed().ok());
  EXPECT_TRUE(producer_->HasRejected());
  EXPECT_EQ(producer_->unanswered_async(), 0u);
  auto first = producer_->TakeRejected(3);
  auto rest = producer_->TakeRejected();
  ASSERT_EQ(first.size(), 3u);
  ASSERT_EQ(rest.size(), 1u);
  EXPECT_EQ(first[0].seq, 5u);
  EXPECT_EQ(first[2].seq, 15u);
  EXPECT_EQ(rest[0].seq, 20u);
  EXPECT_EQ(rest[0].op_index, kReject);
  EXPECT_EQ(rest[0].code, 3);
  EXPECT_EQ(rest[0].regions, (std::vector<uint64_t>{11, 12}));
  EXPECT_FALSE(producer_->HasRejected());
}

TEST_F(RingProducerTest, ManyThreadsShareOneProducer) {
  StartRing(4, 8);
  OpenProducer();
  constexpr int kThreads = 4, kCalls = 200;
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      for (uint64_t seq = 1; seq <= kCalls; ++seq) {
        auto [s, code] = SyncCall(static_cast<uint32_t>(i), seq, kOp);
        if (!s.ok() || code != 0) bad.fetch_add(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(producer_->published(), uint64_t{kThreads} * kCalls);
  // A call is answered when accepted; its "done" follows once the executor
  // ran it, so the last one's may still be on its way.
  for (uint32_t l = 0; l < kThreads; ++l) {
    EXPECT_TRUE(WaitUntil([&] { return session_->memory().Done(l) == uint64_t{kCalls}; }))
        << "lane " << l << ": done " << session_->memory().Done(l);
  }
}

TEST_F(RingProducerTest, AFullRingMakesPublishWaitNeverDrop) {
  StartRing(1, 8);
  OpenProducer();
  runner_.Hold();  // nothing is answered: the ring fills
  uint64_t ticket = 0;
  for (uint64_t seq = 1; seq <= 8; ++seq) {
    ASSERT_TRUE(producer_->Publish(0, seq, kOp, IntArg(1), nullptr, nullptr, 0, &ticket).ok());
  }
  std::atomic<bool> returned{false};
  Status late;
  std::thread ninth([&] {
    late = producer_->Publish(0, 9, kOp, IntArg(1), nullptr, nullptr, 0, &ticket);
    returned = true;
  });
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(returned.load());  // back-pressure: waits for completion 0
  alive_ = false;                 // the daemon "dies": the wait ends with the liveness reason
  ninth.join();
  EXPECT_EQ(late.code(), StatusCode::kUnavailable) << late.ToString();
  EXPECT_NE(late.message().find("daemon gone"), std::string::npos) << late.message();
  EXPECT_EQ(producer_->published(), 8u);
  EXPECT_EQ(producer_->full_waits(), 1u);
}

TEST_F(RingProducerTest, AWaitEndsAtItsDeadline) {
  RingProducer::Options o;
  o.spin = 10us;
  o.timeout = 50ms;
  StartRing(1, 8);
  OpenProducer(o);
  runner_.Hold();
  auto [s, code] = SyncCall(0, 1, kOp);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
}

TEST_F(RingProducerTest, WakesASleepingConsumerThroughTheDoorbell) {
  StartRing(1, 8);
  OpenProducer();
  auto [s, code] = SyncCall(0, 1, kOp);
  ASSERT_TRUE(s.ok());
  // Idle past the consumer's spin: it sleeps on the doorbell.
  ASSERT_TRUE(WaitUntil([&] { return consumer_->sleeps() > 0; }, 500ms));
  std::this_thread::sleep_for(5ms);
  const auto t0 = std::chrono::steady_clock::now();
  auto [s2, code2] = SyncCall(0, 2, kOp);
  const auto took = std::chrono::steady_clock::now() - t0;
  ASSERT_TRUE(s2.ok());
  EXPECT_GE(producer_->wakes(), 1u);
  // Far below the consumer's 100 ms sleep timeout: the futex wake, not the timeout, woke it.
  EXPECT_LT(took, 50ms);
}

TEST(RingProducerOpenTest, AnInvalidControlBlockIsRefusedNamingTheField) {
  alignas(64) uint8_t ring[v1::kRingControlBytes + 4 * (v1::kSlotBytes + v1::kCompletionBytes)] = {};
  auto* c = reinterpret_cast<v1::RingControl*>(ring);
  c->version = v1::kRingVersion;
  c->capacity = 3;
  c->slot_bytes = v1::kSlotBytes;
  c->completion_bytes = v1::kCompletionBytes;
  std::unique_ptr<RingProducer> p;
  Status s = RingProducer::Open(ring, sizeof(ring), {}, nullptr, &p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("capacity 3"), std::string::npos) << s.message();
  c->capacity = 8;  // needs more bytes than given
  s = RingProducer::Open(ring, sizeof(ring), {}, nullptr, &p);
  EXPECT_NE(s.message().find("8 slots need"), std::string::npos) << s.message();
  c->capacity = 4;
  EXPECT_TRUE(RingProducer::Open(ring, sizeof(ring), {}, nullptr, &p).ok());
  EXPECT_EQ(p->capacity(), 4u);
}

TEST(RingCompletionTest, MessageIsTruncatedOnACharacterBoundaryAndTerminated) {
  std::unique_ptr<SessionMemory> m;
  ASSERT_TRUE(SessionMemory::Create(1, 1, 8, &m).ok());
  constexpr size_t kText = sizeof(v1::CompletionRecord::message) - 1;  // room before the NUL
  std::string msg(kText - 1, 'x');
  msg += "\xC3\xA9 and more";  // a two-byte character straddling the last byte
  WriteRingCompletion(*m, 13, 2, 99, Status::Rejected(Reason::kRegionUnknown, msg));
  const v1::CompletionRecord* c = m->ring_completion(13);
  EXPECT_EQ(c->done_ticket, 14u);
  EXPECT_EQ(c->ticket, 13u);
  EXPECT_EQ(c->lane, 2u);
  EXPECT_EQ(c->seq, 99u);
  EXPECT_EQ(c->status_code, 5);
  EXPECT_EQ(c->reason, static_cast<uint32_t>(Reason::kRegionUnknown));
  EXPECT_EQ(std::strlen(c->message), kText - 1);
  WriteRingCompletion(*m, 21, 0, 1, Status::InvalidArgument(std::string(500, 'y')));
  EXPECT_EQ(std::strlen(m->ring_completion(21)->message), kText);
  EXPECT_EQ(m->ring_completion(21)->reason, 0u);  // none given
  EXPECT_EQ(m->ring_completion(21), m->ring_completion(13));  // 21 % 8 == 13 % 8
}

// ---------------------------------------------------------------------------
// The daemon: offer, bind, serve, violation, teardown.

constexpr char kUuid[] = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee";

class RingDaemonTest : public ::testing::Test {
 protected:
  void StartDaemon(bool ring = true, uint32_t capacity = 8) {
    Options o;
    o.max_lanes = 4;
    o.drain_deadline_ms = 1000;
    o.ring = ring;
    o.ring_capacity = capacity;
    DaemonInfo info;
    info.device_index = 0;
    info.gpu_uuid = kUuid;
    daemon_ = std::make_unique<Daemon>(o, info, kCatalog, "", DaemonDeps{&device_, &opener_, &runner_},
                                       dir_.File("d.session.sock"));
    ASSERT_TRUE(daemon_->Start().ok());
  }
  void TearDown() override {
    runner_.Release();
    if (daemon_) {
      daemon_->RequestShutdown(0, "test end");
      daemon_->Drain();
      daemon_->Stop();
    }
    for (auto& b : bound_) {
      if (b.memory != nullptr) munmap(b.memory, b.bytes);
      if (b.channel_fd >= 0) close(b.channel_fd);
    }
  }

  struct Bound {
    OpenSessionResult open;
    int channel_fd = -1;
    void* memory = nullptr;
    uint64_t bytes = 0;
    v1::LaneSemaphores* lane(uint32_t i) {
      auto* h = static_cast<v1::SessionMemoryHeader*>(memory);
      return reinterpret_cast<v1::LaneSemaphores*>(static_cast<char*>(memory) + h->lanes_offset) + i;
    }
    uint64_t done(uint32_t i) { return std::atomic_ref<uint64_t>(lane(i)->done).load(); }
  };

  Bound& OpenAndBind(bool want_ring = true, uint32_t lanes = 1) {
    Bound b;
    OpenSessionParams p;
    p.protocol_version = v1::kProtocolVersion;
    p.client_pid = getpid();
    p.lanes = lanes;
    p.want_ring = want_ring;
    Status s = daemon_->OpenSession(p, &b.open);
    EXPECT_TRUE(s.ok()) << s.ToString();
    std::string token(reinterpret_cast<const char*>(b.open.token.data()), b.open.token.size());
    testing::BoundChannel c = testing::BindAndMap(b.open.session_channel_path, b.open.session_id, token);
    b.channel_fd = c.fd;
    b.memory = c.memory;
    b.bytes = c.bytes;
    bound_.push_back(b);
    return bound_.back();
  }

  testing::TempDir dir_;
  FakeDeviceOps device_;
  FakeRegionOpener opener_;
  CapturingRunner runner_;
  std::unique_ptr<Daemon> daemon_;
  std::deque<Bound> bound_;
};

TEST_F(RingDaemonTest, OffersTheRingAndServesCallsThroughIt) {
  StartDaemon(/*ring=*/true, /*capacity=*/16);
  EXPECT_TRUE(daemon_->Version().ring_available);
  Bound& b = OpenAndBind(/*want_ring=*/true, /*lanes=*/2);
  EXPECT_TRUE(b.open.ring_enabled);
  auto* h = static_cast<v1::SessionMemoryHeader*>(b.memory);
  EXPECT_EQ(h->ring_offset % 4096, 0u);
  EXPECT_EQ(h->ring_bytes, v1::RingBytes(16));
  EXPECT_LE(h->ring_offset + h->ring_bytes, b.bytes);
  RingClient client(b.memory);
  EXPECT_EQ(client.capacity(), 16u);
  std::atomic_ref<uint64_t>(b.lane(0)->inputs_ready).store(2);
  client.Publish(RecordBuilder(0, 0, 1).Int(1));
  client.Publish(RecordBuilder(0, 0, 2).Int(2).Nargs(99));  // malformed: still completes seq 2 in order
  client.Publish(RecordBuilder(0, 1, 5));                   // out of order on lane 1
  client.Publish(RecordBuilder(0, 0, 3).Magic(0x12345678)); // no usable header: no lane, counted all the same
  v1::CompletionRecord c{};
  ASSERT_TRUE(client.Wait(0, &c));
  EXPECT_EQ(c.status_code, 0) << c.message;
  ASSERT_TRUE(client.Wait(1, &c));
  EXPECT_EQ(c.status_code, 3);
  EXPECT_NE(std::string(c.message).find("nargs 99"), std::string::npos) << c.message;
  ASSERT_TRUE(client.Wait(2, &c));
  EXPECT_EQ(c.status_code, 3);
  EXPECT_NE(std::string(c.message).find("expected seq 1, got 5"), std::string::npos) << c.message;
  ASSERT_TRUE(client.Wait(3, &c));
  EXPECT_EQ(c.status_code, 3);
  EXPECT_NE(std::string(c.message).find("magic 0x12345678"), std::string::npos) << c.message;
  ASSERT_TRUE(WaitUntil([&] { return b.done(0) == 2; }));
  EXPECT_EQ(b.done(1), 0u);
  StatsSnapshot stats;
  // Each rejection is counted before its answer (Executor::Record; the
  // consumer for the one without a lane): every answer has been read.
  ASSERT_TRUE(daemon_->GetStats(0, "", &stats).ok());
  EXPECT_EQ(stats.errors, 3u);
  EXPECT_EQ(stats.calls, 1u);
  // The per-op rows say these came through the ring (the undecodable one
  // under the row of names the catalog does not hold).
  uint64_t ring_calls = 0, ring_rejections = 0;
  for (const OpStatsEntry& o : stats.ops) {
    EXPECT_EQ(o.transport, CallTransport::kRing) << o.name;
    ring_calls += o.calls;
    ring_rejections += o.rejections;
  }
  EXPECT_EQ(ring_calls, 1u);
  EXPECT_EQ(ring_rejections, 3u);

  // The same client without the ring: plain layout.
  Bound& plain = OpenAndBind(/*want_ring=*/false);
  EXPECT_FALSE(plain.open.ring_enabled);
  EXPECT_EQ(static_cast<v1::SessionMemoryHeader*>(plain.memory)->ring_offset, 0u);
  EXPECT_EQ(static_cast<v1::SessionMemoryHeader*>(plain.memory)->ring_bytes, 0u);
}

TEST_F(RingDaemonTest, NoRingFlagIgnoresWantRing) {
  StartDaemon(/*ring=*/false);
  EXPECT_FALSE(daemon_->Version().ring_available);
  Bound& b = OpenAndBind(/*want_ring=*/true);
  EXPECT_FALSE(b.open.ring_enabled);
  EXPECT_EQ(static_cast<v1::SessionMemoryHeader*>(b.memory)->ring_bytes, 0u);
}

TEST_F(RingDaemonTest, AProtocolViolationEndsOnlyThatSession) {
  StartDaemon();
  Bound& bad = OpenAndBind();
  Bound& good = OpenAndBind();
  RingClient bad_client(bad.memory);
  RingClient good_client(good.memory);
  std::atomic_ref<uint64_t>(good.lane(0)->inputs_ready).store(100);
  good_client.Publish(RecordBuilder(0, 0, 1));
  v1::CompletionRecord c{};
  ASSERT_TRUE(good_client.Wait(0, &c));

  bad_client.SetTail(uint64_t{1} << 40);  // absurdly far ahead
  EXPECT_TRUE(testing::PeerClosed(bad.channel_fd));  // the daemon ended it
  ASSERT_TRUE(WaitUntil([&] { return daemon_->sessions().size() == 1; }));

  for (uint64_t seq = 2; seq <= 30; ++seq) good_client.Publish(RecordBuilder(0, 0, seq));
  for (uint64_t t = 1; t < 29; ++t) {
    ASSERT_TRUE(good_client.Wait(t, &c));
    EXPECT_EQ(c.status_code, 0) << c.message;
  }
  ASSERT_TRUE(WaitUntil([&] { return good.done(0) == 30; }));
}

TEST_F(RingDaemonTest, ClientDeathWithRecordsPendingLeavesTheDaemonHealthy) {
  StartDaemon();
  Bound& b = OpenAndBind(true, 2);
  RingClient client(b.memory);
  // Lane 0: accepted calls whose inputs never become ready. Lane 1: a call
  // stuck in validation when the client dies (the executor's thread, which
  // also polls the ring, is held in it: the records after it stay untaken).
  for (uint64_t seq = 1; seq <= 4; ++seq) client.Publish(RecordBuilder(0, 0, seq));
  v1::CompletionRecord c{};
  ASSERT_TRUE(client.Wait(3, &c));
  runner_.Hold();
  for (uint64_t seq = 1; seq <= 3; ++seq) client.Publish(RecordBuilder(0, 1, seq));
  // Taken is not yet held: the client must die while the executor is in
  // that validation, not before it gets there.
  ASSERT_TRUE(WaitUntil([&] { return client.head() >= 5 && runner_.waiting() == 1; }));
  // More records that the daemon may or may not take before it notices.
  for (uint64_t seq = 5; seq <= 8; ++seq) client.Publish(RecordBuilder(0, 0, seq), /*wake=*/false);
  close(b.channel_fd);  // the client dies
  b.channel_fd = -1;
  ASSERT_TRUE(WaitUntil([&] { return daemon_->sessions().size() == 0; }));
  runner_.Release();
  // Every seq the daemon took got its "done" (the drop path), so a stream
  // of the dead client waiting on it would have been released.
  ASSERT_TRUE(WaitUntil([&] { return daemon_->executor().pending() == 0; }));
  const uint64_t taken = client.head();
  EXPECT_GE(taken, 5u);
  for (uint64_t t = 0; t < taken; ++t) {
    ASSERT_TRUE(client.Wait(t, &c, 2000ms)) << "ticket " << t << " taken but never answered";
  }
  // Tickets 0-3: lane 0 seqs 1-4; 4-6: lane 1 seqs 1-3; 7-10: lane 0 seqs
  // 5-8. A taken record takes its seq unless it was handed over after the
  // session ended (SESSION_ENDED) or was removed (SESSION_UNKNOWN).
  uint64_t lane_seqs[2] = {4, 0};
  for (uint64_t t = 4; t < taken; ++t) {
    ASSERT_TRUE(client.Wait(t, &c));
    const auto reason = static_cast<Reason>(c.reason);
    if (reason != Reason::kSessionEnded && reason != Reason::kSessionUnknown) ++lane_seqs[t < 7 ? 1 : 0];
  }
  EXPECT_GE(lane_seqs[1], 1u);  // the held one
  // Lane 0's calls went ahead behind a parked wait that the session's end
  // released: their "done" follows on the lane stream.
  WaitUntil([&] { return b.done(0) == lane_seqs[0] && b.done(1) == lane_seqs[1]; });
  EXPECT_EQ(b.done(0), lane_seqs[0]);
  EXPECT_EQ(b.done(1), lane_seqs[1]);
  // And the daemon still serves a new client through a new ring.
  Bound& next = OpenAndBind();
  RingClient next_client(next.memory);
  std::atomic_ref<uint64_t>(next.lane(0)->inputs_ready).store(1);
  next_client.Publish(RecordBuilder(0, 0, 1));
  ASSERT_TRUE(next_client.Wait(0, &c));
  EXPECT_EQ(c.status_code, 0) << c.message;
  ASSERT_TRUE(WaitUntil([&] { return next.done(0) == 1; }));
}

// A tail more than a capacity ahead is no work: the executor sleeps on it
// instead of spinning, even while the client sets it right now and then,
// inside the violation's grace, and rings the doorbell.
TEST_F(RingDaemonTest, AnImpossibleTailIsNoWorkToSpinOn) {
  StartDaemon();
  Bound& b = OpenAndBind();
  RingClient client(b.memory);
  std::atomic<bool> stop{false};
  std::thread odd([&] {
    std::atomic_ref<uint64_t> tail(client.control()->sq_tail);
    uint32_t* doorbell = &client.control()->doorbell;
    auto ring = [&] {
      std::atomic_ref<uint32_t>(*doorbell).store(v1::kDoorbellAwake);
      FutexWake(doorbell, 1);
    };
    while (!stop.load()) {
      tail.store(1000 * uint64_t{client.capacity()});  // head 0
      ring();
      std::this_thread::sleep_for(12ms);
      tail.store(0);  // sane again before the 20 ms grace ends
      std::this_thread::sleep_for(300us);
      ring();
      std::this_thread::sleep_for(1ms);
    }
  });
  std::this_thread::sleep_for(100ms);
  timespec a{}, c{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &a);
  std::this_thread::sleep_for(300ms);
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c);
  stop.store(true);
  odd.join();
  const double cpu_ms = (c.tv_sec - a.tv_sec) * 1e3 + (c.tv_nsec - a.tv_nsec) / 1e6;
  EXPECT_LT(cpu_ms, 100.0) << "the daemon used " << cpu_ms << " ms of CPU in 300 ms of an impossible tail";
}

TEST_F(RingDaemonTest, IdleRingSessionsCostNoCpu) {
  StartDaemon();
  for (int i = 0; i < 4; ++i) {
    Bound& b = OpenAndBind();
    std::atomic_ref<uint64_t>(b.lane(0)->inputs_ready).store(1);
    RingClient client(b.memory);
    client.Publish(RecordBuilder(0, 0, 1));
    v1::CompletionRecord c{};
    ASSERT_TRUE(client.Wait(0, &c));
  }
  std::this_thread::sleep_for(100ms);  // past every spin window
  timespec a{}, b{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &a);
  std::this_thread::sleep_for(300ms);
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &b);
  const double cpu_ms = (b.tv_sec - a.tv_sec) * 1e3 + (b.tv_nsec - a.tv_nsec) / 1e6;
  EXPECT_LT(cpu_ms, 20.0) << "daemon with 4 idle ring sessions used " << cpu_ms << " ms of CPU in 300 ms";
}

size_t ThreadsOfThisProcess() {
  size_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) n += e.is_directory() ? 1 : 0;
  return n;
}

TEST_F(RingDaemonTest, RingSessionsAddNoThreads) {
  StartDaemon();
  {
    Bound& b = OpenAndBind();  // the first session starts whatever is lazy
    RingClient client(b.memory);
    std::atomic_ref<uint64_t>(b.lane(0)->inputs_ready).store(1);
    client.Publish(RecordBuilder(0, 0, 1));
    v1::CompletionRecord c{};
    ASSERT_TRUE(client.Wait(0, &c));
  }
  const size_t before = ThreadsOfThisProcess();
  for (int i = 0; i < 8; ++i) {
    Bound& b = OpenAndBind();
    RingClient client(b.memory);
    std::atomic_ref<uint64_t>(b.lane(0)->inputs_ready).store(1);
    client.Publish(RecordBuilder(0, 0, 1));
    v1::CompletionRecord c{};
    ASSERT_TRUE(client.Wait(0, &c));
    ASSERT_TRUE(WaitUntil([&] { return b.done(0) == 1; }));
  }
  // One executor thread polls every ring: 8 more sessions, no more threads.
  EXPECT_EQ(ThreadsOfThisProcess(), before);
}

TEST_F(RingDaemonTest, DrainStopsEveryRing) {
  StartDaemon();
  Bound& a = OpenAndBind();
  Bound& b = OpenAndBind();
  RingClient ca(a.memory), cb(b.memory);
  ca.Publish(RecordBuilder(0, 0, 1));
  cb.Publish(RecordBuilder(0, 0, 1));
  v1::CompletionRecord c{};
  ASSERT_TRUE(ca.Wait(0, &c));
  ASSERT_TRUE(cb.Wait(0, &c));
  daemon_->RequestShutdown(0, "test");
  const auto t0 = Clock::now();
  daemon_->Drain();
  daemon_->Stop();
  EXPECT_LT(Clock::now() - t0, 3s);
  EXPECT_TRUE(testing::PeerClosed(a.channel_fd));
  EXPECT_EQ(a.done(0), 1u);  // the waiting call was dropped and its done written
  daemon_.reset();
}

}  // namespace
}  // namespace cache_dit_opd
