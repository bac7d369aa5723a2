// The client's C++ ring producer and record encoder (client/ring_producer.h,
// client/ring_record.h) against the daemon's real decoder, consumer thread
// and executor (fake device ops) over a real memfd mapping: what the native
// Python client and the daemon exchange, end to end on the CPU.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "client/ring_producer.h"
#include "client/ring_record.h"
#include "fakes.h"
#include "server/executor.h"
#include "server/ring_codec.h"
#include "server/ring_consumer.h"

namespace cache_dit_opd {
namespace {

using namespace std::chrono_literals;
using client::RecordArgs;
using client::RingCompletion;
using client::RingProducer;
using testing::FakeDeviceOps;
using testing::FakeRegionOpener;
using testing::FakeRunner;

const std::vector<OpInfo> kCatalog = {
    {"op", "out", "cache_dit_cuda_ops::op.out(...)"},
    {"reject", "out", "cache_dit_cuda_ops::reject.out(...)"},
};
constexpr uint32_t kOp = 0;
constexpr uint32_t kReject = 1;

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

// A runner whose Prepare can be held: a busy daemon answers nothing.
class GatedRunner : public FakeRunner {
 public:
  Status Prepare(const CallRequest& req, const RegionResolver& regions,
                 std::unique_ptr<PreparedCall>* out) override {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return open_; });
    }
    return FakeRunner::Prepare(req, regions, out);
  }
  void Hold() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = false;
  }
  void Release() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = true;
};

// The daemon side: a session with a ring, the real consumer and executor.
class RingProducerTest : public ::testing::Test {
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
  void StartRing(uint32_t lanes, uint32_t capacity, RingProducer::Options options = {}) {
    SessionConfig c;
    c.id = 1;
    c.lanes = lanes;
    c.client_pid = 1;
    c.ring_capacity = capacity;
    ASSERT_TRUE(Session::Create(c, &device_, &opener_, &session_).ok());
    session_->set_state(SessionState::kBound);
    for (uint32_t i = 0; i < lanes; ++i) {
      std::atomic_ref<uint64_t>(session_->memory().lane(i)->inputs_ready).store(uint64_t{1} << 40);
    }
    RingConsumer::Sink sink;
    sink.submit = [this](CallRequest r, RingConsumer::Completion d) {
      executor_->Submit(session_, std::move(r), std::move(d));
    };
    sink.submit_rejected = [this](uint32_t lane, uint64_t seq, Status s, RingConsumer::Completion d) {
      executor_->SubmitRejected(session_, lane, seq, std::move(s), std::move(d));
    };
    sink.on_violation = [](const Status&) {};
    consumer_ = std::make_unique<RingConsumer>(session_, &kCatalog, std::move(sink), RingConsumerOptions{});
    consumer_->Start();
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

  FakeDeviceOps device_;
  FakeRegionOpener opener_;
  GatedRunner runner_;
  DaemonStats stats_;
  std::unique_ptr<Executor> executor_;
  std::shared_ptr<Session> session_;
  std::unique_ptr<RingConsumer> consumer_;
  std::unique_ptr<RingProducer> producer_;
  std::atomic<bool> alive_{true};
};

TEST_F(RingProducerTest, SynchronousCallsWrapAroundInOrder) {
  StartRing(1, 8);
  for (uint64_t seq = 1; seq <= 100; ++seq) {  // 12.5 times around
    auto [s, code] = SyncCall(0, seq, kOp);
    ASSERT_TRUE(s.ok()) << s.ToString();
    ASSERT_EQ(code, 0);
  }
  EXPECT_EQ(producer_->published(), 100u);
  EXPECT_EQ(producer_->in_flight(), 0u);
  for (int i = 0; i < 5000 && session_->memory().Done(0) < 100; ++i) std::this_thread::sleep_for(1ms);
  std::lock_guard<std::mutex> lock(runner_.mu);
  ASSERT_EQ(runner_.ran.size(), 100u);
  for (uint64_t i = 0; i < 100; ++i) EXPECT_EQ(runner_.ran[i].seq, i + 1);
}

TEST_F(RingProducerTest, ARejectedSynchronousCallReturnsTheDaemonsReason) {
  StartRing(1, 8);
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
  for (uint32_t l = 0; l < kThreads; ++l) EXPECT_EQ(session_->memory().Done(l), uint64_t{kCalls});
}

TEST_F(RingProducerTest, AFullRingMakesPublishWaitNeverDrop) {
  StartRing(1, 8);
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
  StartRing(1, 8, o);
  runner_.Hold();
  auto [s, code] = SyncCall(0, 1, kOp);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
}

TEST_F(RingProducerTest, WakesASleepingConsumerThroughTheDoorbell) {
  StartRing(1, 8);
  auto [s, code] = SyncCall(0, 1, kOp);
  ASSERT_TRUE(s.ok());
  // Idle past the consumer's spin: it sleeps on the doorbell.
  ASSERT_TRUE([&] {
    for (int i = 0; i < 500 && consumer_->sleeps() == 0; ++i) std::this_thread::sleep_for(1ms);
    return consumer_->sleeps() > 0;
  }());
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

}  // namespace
}  // namespace cache_dit_opd
