#include "server/exec/executor.h"

#include <gtest/gtest.h>
#include <time.h>

#include <chrono>
#include <condition_variable>
#include <future>
#include <limits>
#include <thread>

#include "tests/cpp/server/executor_test_util.h"
#include "tests/fake_daemon/fakes.h"

namespace cache_dit_opd {
namespace {

using namespace std::chrono_literals;
using testing::FakeDeviceOps;
using testing::FakeRegionOpener;
using testing::FakeRunner;
using testing::Handle;
using testing::NewTestSession;
using testing::Req;
using testing::SetInputsReady;
using testing::WaitUntil;

// Collects completions; Wait() blocks until `n` arrived.
class Results {
 public:
  Executor::Completion Slot(int i) {
    return [this, i](const Status& s) {
      std::lock_guard<std::mutex> lock(mu_);
      got_[i] = s;
      order_.push_back(i);
      cv_.notify_all();
    };
  }
  bool Wait(size_t n, std::chrono::milliseconds timeout = 5000ms) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return got_.size() >= n; });
  }
  bool Has(int i) {
    std::lock_guard<std::mutex> lock(mu_);
    return got_.count(i) > 0;
  }
  Status Get(int i) {
    std::lock_guard<std::mutex> lock(mu_);
    return got_.at(i);
  }
  std::vector<int> order() {
    std::lock_guard<std::mutex> lock(mu_);
    return order_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<int, Status> got_;
  std::vector<int> order_;
};


CallRequest HostOrdered(uint32_t lane, std::string op = "noop") {
  CallRequest r = Req(lane, 0, std::move(op));
  r.host_ordered = true;
  return r;
}


// The host-check executor (no parking slot): a call whose inputs are not
// ready stays queued on the host. LaunchAheadTest below covers the slots.
class ExecutorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    runner_.device = &device_;  // runs follow their stream's order
    ExecutorOptions o;
    o.parking_slots = 0;
    Recreate(o);
  }
  void TearDown() override { executor_->Stop(); }
  void Recreate(ExecutorOptions o) {
    if (executor_) executor_->Stop();
    o.on_stalled = [this](const std::shared_ptr<Session>& s, const Status& why) {
      std::lock_guard<std::mutex> lock(mu_);
      stalled_.emplace_back(s->id(), why);
    };
    executor_ = std::make_unique<Executor>(&device_, &runner_, &stats_, o, [this](const Status& s) {
      std::lock_guard<std::mutex> lock(mu_);
      ++fatal_calls_;
      fatal_ = s;
    });
    executor_->Start();
  }
  std::vector<std::pair<uint64_t, Status>> stalled() {
    std::lock_guard<std::mutex> lock(mu_);
    return stalled_;
  }

  std::shared_ptr<Session> NewSession(uint32_t lanes, bool bound = true) {
    return NewTestSession(++next_id_, lanes, &device_, &opener_, bound);
  }

  // Before the device fake: its stream threads may still run a call's
  // record (into the runner) until the device fake joins them.
  FakeRunner runner_;
  FakeDeviceOps device_;
  FakeRegionOpener opener_;
  DaemonStats stats_;
  std::unique_ptr<Executor> executor_;
  uint64_t next_id_ = 0;
  std::mutex mu_;
  int fatal_calls_ = 0;
  Status fatal_;
  std::vector<std::pair<uint64_t, Status>> stalled_;  // guarded by mu_
};

TEST_F(ExecutorTest, RunsInSeqOrderAndWritesDone) {
  auto s = NewSession(1);
  SetInputsReady(*s, 0, 3);
  Results r;
  for (int i = 1; i <= 3; ++i) executor_->Submit(s, Req(0, i), r.Slot(i));
  ASSERT_TRUE(r.Wait(3));
  for (int i = 1; i <= 3; ++i) EXPECT_TRUE(r.Get(i).ok()) << r.Get(i).ToString();
  ASSERT_TRUE(WaitUntil([&] { return s->memory().Done(0) == 3; }));
  auto ran = runner_.ran_copy();
  ASSERT_EQ(ran.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(ran[i].seq, uint64_t(i + 1));
    EXPECT_EQ(ran[i].stream, s->lane(0).stream);
  }
  EXPECT_EQ(s->memory().Done(0), 3u);
  EXPECT_EQ(s->lane(0).Completed(), 3u);
  EXPECT_EQ(s->calls.load(), 3u);
  EXPECT_EQ(stats_.calls.load(), 3u);
}

TEST_F(ExecutorTest, SeqMustBePreviousPlusOne) {
  auto s = NewSession(1);
  SetInputsReady(*s, 0, 10);
  Results r;
  executor_->Submit(s, Req(0, 2), r.Slot(2));
  ASSERT_TRUE(r.Wait(1));
  EXPECT_EQ(r.Get(2).code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.Get(2).message().find("expected seq 1, got 2"), std::string::npos) << r.Get(2).message();
  EXPECT_EQ(s->memory().Done(0), 0u);  // no write: done stays monotone
  executor_->Submit(s, Req(0, 1), r.Slot(1));
  ASSERT_TRUE(r.Wait(2));
  EXPECT_TRUE(r.Get(1).ok());
  executor_->Submit(s, Req(0, 1), r.Slot(11));  // a replay
  ASSERT_TRUE(r.Wait(3));
  EXPECT_EQ(r.Get(11).code(), StatusCode::kInvalidArgument);
  // Seq 1's done is written after it runs, which may follow the replay's answer.
  ASSERT_TRUE(WaitUntil([&] { return s->memory().Done(0) == 1; }));
  Results z;
  executor_->Submit(s, Req(0, 0), z.Slot(0));
  ASSERT_TRUE(z.Wait(1));
  EXPECT_EQ(z.Get(0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s->memory().Done(0), 1u);  // neither the replay nor seq 0 wrote a done
}

TEST_F(ExecutorTest, RejectedCallStillCompletesItsSeqInOrder) {
  auto s = NewSession(1);
  Results r;
  executor_->Submit(s, Req(0, 1), r.Slot(1));
  executor_->Submit(s, Req(0, 2, "reject"), r.Slot(2));
  executor_->Submit(s, Req(0, 3), r.Slot(3));
  // Every call is answered at validation, before its inputs are ready...
  ASSERT_TRUE(r.Wait(3));
  EXPECT_TRUE(r.Get(1).ok());
  EXPECT_EQ(r.Get(2).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(r.Get(3).ok());
  EXPECT_EQ(r.order(), (std::vector<int>{1, 2, 3}));
  // ...but "done" of the rejected call 2 waits its turn behind call 1.
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(s->memory().Done(0), 0u);
  EXPECT_TRUE(runner_.ran_copy().empty());
  SetInputsReady(*s, 0, 3);
  ASSERT_TRUE(WaitUntil([&] { return s->memory().Done(0) == 3; }));
  std::vector<uint64_t> written;
  {
    std::lock_guard<std::mutex> lock(device_.mu);
    for (auto& [stream, v] : device_.writes) {
      if (stream == s->lane(0).stream) written.push_back(v);
    }
  }
  EXPECT_EQ(written, (std::vector<uint64_t>{1, 2, 3}));
  EXPECT_EQ(runner_.ran_copy().size(), 2u);
  EXPECT_EQ(s->errors.load(), 1u);
}

TEST_F(ExecutorTest, RejectedHeadDoesNotWaitForInputs) {
  auto s = NewSession(1);
  Results r;
  executor_->Submit(s, Req(0, 1, "reject"), r.Slot(1));
  ASSERT_TRUE(r.Wait(1, 2000ms));
  EXPECT_EQ(r.Get(1).code(), StatusCode::kInvalidArgument);
  // The answer comes at acceptance; the lane writes "done" at its turn, after.
  EXPECT_TRUE(WaitUntil([&] { return s->memory().Done(0) == 1; }, 2000ms));
}

// A client that reads its rejection and then scrapes /metrics (or asks
// GetStats) must find it counted: the answer comes at acceptance, while the
// lane's "done" for it is written only at its turn. Seq 1 waits for inputs
// that never come, so seq 2's turn has not come when it is answered.
TEST_F(ExecutorTest, ARejectionIsCountedBeforeItsAnswer) {
  auto s = NewSession(1);
  const size_t row = stats_.per_op.other_row();
  auto rejections = [&] {
    uint64_t n = 0;
    for (const auto& r : stats_.per_op.counters(row, CallTransport::kGrpc).rejections) n += r.load();
    return n;
  };
  std::mutex mu;
  std::vector<std::array<uint64_t, 4>> seen;  // {rejections, daemon errors, session errors, total observations}
  Results r;
  executor_->Submit(s, Req(0, 1), r.Slot(1));
  executor_->Submit(s, Req(0, 2, "reject"), [&, slot = r.Slot(2)](const Status& st) {
    {
      std::lock_guard<std::mutex> lock(mu);
      seen.push_back({rejections(), stats_.errors.load(), s->errors.load(),
                      stats_.per_op.counters(row, CallTransport::kGrpc)
                          .stages[static_cast<size_t>(CallStage::kTotal)]
                          .Read()
                          .count});
    }
    slot(st);
  });
  ASSERT_TRUE(r.Wait(2));
  EXPECT_EQ(r.Get(2).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s->memory().Done(0), 0u);  // seq 2's turn has not come
  {
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_EQ(seen.size(), 1u);
    EXPECT_EQ(seen[0], (std::array<uint64_t, 4>{1, 1, 1, 1}));
  }
  SetInputsReady(*s, 0, 2);
  ASSERT_TRUE(WaitUntil([&] { return s->memory().Done(0) == 2; }));
  EXPECT_EQ(rejections(), 1u);  // counted once, not again at its turn
  EXPECT_EQ(stats_.errors.load(), 1u);
  EXPECT_EQ(s->errors.load(), 1u);
}

TEST_F(ExecutorTest, StalledLaneBlocksNoOtherLaneOrSession) {
  auto a = NewSession(2);
  auto b = NewSession(1);
  Results r;
  executor_->Submit(a, Req(0, 1), r.Slot(100));  // inputs never ready (yet)
  SetInputsReady(*a, 1, 1);
  SetInputsReady(*b, 0, 2);
  executor_->Submit(a, Req(1, 1), r.Slot(200));
  executor_->Submit(b, Req(0, 1), r.Slot(300));
  executor_->Submit(b, Req(0, 2), r.Slot(301));
  ASSERT_TRUE(r.Wait(4));
  for (int i : {100, 200, 300, 301}) EXPECT_TRUE(r.Get(i).ok()) << i;  // all accepted
  ASSERT_TRUE(WaitUntil([&] { return a->memory().Done(1) == 1 && b->memory().Done(0) == 2; }));
  // Finish writes "done" before it counts the call complete: wait for the count.
  EXPECT_TRUE(WaitUntil([&] { return executor_->pending() == 1; }));
  EXPECT_EQ(a->memory().Done(0), 0u);  // the stalled call has not run
  SetInputsReady(*a, 0, 1);
  ASSERT_TRUE(WaitUntil([&] { return a->memory().Done(0) == 1; }));
  EXPECT_TRUE(WaitUntil([&] { return executor_->pending() == 0; }));
}

TEST_F(ExecutorTest, RejectionsCarryTheirReasons) {
  auto s = NewSession(1);
  auto unbound = NewSession(1, /*bound=*/false);
  auto ended = NewSession(1);
  ended->set_state(SessionState::kClosed);
  Results r;
  executor_->Submit(s, Req(1, 1), r.Slot(1));
  executor_->Submit(s, Req(0, 0), r.Slot(2));
  executor_->Submit(s, Req(0, 2), r.Slot(3));
  executor_->Submit(unbound, Req(0, 1), r.Slot(4));
  executor_->Submit(ended, Req(0, 1), r.Slot(5));
  ASSERT_TRUE(r.Wait(5));
  EXPECT_EQ(r.Get(1).reason(), Reason::kLaneRange);
  EXPECT_EQ(r.Get(2).reason(), Reason::kLaneRange);
  EXPECT_EQ(r.Get(3).reason(), Reason::kLaneSequence);
  EXPECT_EQ(r.Get(4).reason(), Reason::kSessionUnbound);
  EXPECT_EQ(r.Get(5).reason(), Reason::kSessionEnded);
  // What a client does about them: give up, or reconnect and run the call again.
  EXPECT_EQ(r.Get(1).action(), v1::ClientAction::kFail);
  EXPECT_EQ(r.Get(3).action(), v1::ClientAction::kReconnect);
  EXPECT_EQ(r.Get(5).action(), v1::ClientAction::kReconnect);
}

TEST_F(ExecutorTest, HostOrderedCallsAreNumberedByTheDaemonAndAnsweredAfterTheGpu) {
  auto s = NewSession(1);
  device_.hold_writes = true;  // the GPU is behind
  Results r;
  executor_->Submit(s, HostOrdered(0), r.Slot(1));  // inputs_ready is never written: not waited for
  ASSERT_TRUE(WaitUntil([&] { return device_.held_count() == 1; }));  // it ran; its "done" is enqueued
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(r.Has(1)) << "answered before the GPU finished it";
  device_.FlushHeld();
  ASSERT_TRUE(r.Wait(1));
  EXPECT_TRUE(r.Get(1).ok()) << r.Get(1).ToString();
  {
    std::lock_guard<std::mutex> lock(device_.mu);
    device_.hold_writes = false;
  }
  executor_->Submit(s, HostOrdered(0), r.Slot(2));
  ASSERT_TRUE(r.Wait(2));
  EXPECT_TRUE(r.Get(2).ok());
  auto ran = runner_.ran_copy();
  ASSERT_EQ(ran.size(), 2u);
  EXPECT_EQ(ran[0].seq, 1u);
  EXPECT_EQ(ran[1].seq, 2u);
  EXPECT_EQ(s->memory().Done(0), 2u);
  // The lane's numbering is the daemon's now: a client-numbered seq 1 is out of step.
  executor_->Submit(s, Req(0, 1), r.Slot(3));
  ASSERT_TRUE(r.Wait(3));
  EXPECT_EQ(r.Get(3).reason(), Reason::kLaneSequence);
}

TEST_F(ExecutorTest, AHostOrderedCallCarriesNoSeqAndARejectedOneIsAnsweredAtOnce) {
  auto s = NewSession(1);
  Results r;
  CallRequest numbered = HostOrdered(0);
  numbered.seq = 4;
  executor_->Submit(s, numbered, r.Slot(1));
  ASSERT_TRUE(r.Wait(1));
  EXPECT_EQ(r.Get(1).reason(), Reason::kMalformed);
  device_.hold_writes = true;  // the answer of a rejection does not wait for the GPU
  executor_->Submit(s, HostOrdered(0, "reject"), r.Slot(2));
  ASSERT_TRUE(r.Wait(2, 2000ms));
  EXPECT_EQ(r.Get(2).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(runner_.ran_copy().empty());
}

TEST_F(ExecutorTest, StopAnswersHostOrderedCallsStillOnTheGpu) {
  auto s = NewSession(1);
  device_.hold_writes = true;
  Results r;
  executor_->Submit(s, HostOrdered(0), r.Slot(1));
  ASSERT_TRUE(WaitUntil([&] { return device_.held_count() == 1; }));
  executor_->Stop();
  ASSERT_TRUE(r.Wait(1));
  EXPECT_EQ(r.Get(1).reason(), Reason::kDraining);
}

TEST_F(ExecutorTest, ImmediateRejections) {
  auto s = NewSession(2);
  auto unbound = NewSession(1, /*bound=*/false);
  Results r;
  executor_->Submit(s, Req(2, 1), r.Slot(1));
  executor_->Submit(unbound, Req(0, 1), r.Slot(2));
  ASSERT_TRUE(r.Wait(2));
  EXPECT_EQ(r.Get(1).code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.Get(1).message().find("lane 2 out of range"), std::string::npos) << r.Get(1).message();
  EXPECT_EQ(r.Get(2).code(), StatusCode::kFailedPrecondition);
}

TEST_F(ExecutorTest, DropSessionCompletesQueuedCallsAndReleasesDone) {
  auto s = NewSession(2);
  auto other = NewSession(1);
  Results r;
  executor_->Submit(s, Req(0, 1), r.Slot(1));
  executor_->Submit(s, Req(0, 2), r.Slot(2));
  executor_->Submit(s, Req(1, 1), r.Slot(3));
  executor_->Submit(other, Req(0, 1), r.Slot(4));  // also waiting; must survive
  ASSERT_TRUE(r.Wait(4));  // accepted, none can run
  std::promise<void> then;
  s->set_state(SessionState::kClosed);
  executor_->DropSession(s, Status::Cancelled("client died"), [&] { then.set_value(); });
  ASSERT_EQ(then.get_future().wait_for(2s), std::future_status::ready);
  EXPECT_EQ(s->memory().Done(0), 2u);  // released in one write per lane
  EXPECT_EQ(s->memory().Done(1), 1u);
  EXPECT_TRUE(s->Drained());
  EXPECT_EQ(runner_.ran_copy().size(), 0u);
  EXPECT_EQ(other->memory().Done(0), 0u);
  SetInputsReady(*other, 0, 1);
  ASSERT_TRUE(WaitUntil([&] { return other->memory().Done(0) == 1; }));
  EXPECT_EQ(runner_.ran_copy().size(), 1u);
}

TEST_F(ExecutorTest, StickyErrorFailsOnceAndRejectsLaterCalls) {
  auto s = NewSession(1);
  SetInputsReady(*s, 0, 5);
  Results r;
  executor_->Submit(s, Req(0, 1, "sticky"), r.Slot(1));
  ASSERT_TRUE(r.Wait(1));
  EXPECT_TRUE(r.Get(1).ok());  // accepted; the CUDA error comes when it runs
  ASSERT_TRUE(WaitUntil([&] {
    std::lock_guard<std::mutex> lock(mu_);
    return fatal_calls_ > 0;
  }));
  EXPECT_TRUE(executor_->failed());
  executor_->Submit(s, Req(0, 2), r.Slot(2));
  ASSERT_TRUE(r.Wait(2));
  EXPECT_EQ(r.Get(2).code(), StatusCode::kUnavailable);
  EXPECT_NE(r.Get(2).message().find("sticky"), std::string::npos) << r.Get(2).message();
  std::lock_guard<std::mutex> lock(mu_);
  EXPECT_EQ(fatal_calls_, 1);
  EXPECT_NE(fatal_.message().find("sticky"), std::string::npos);
}

TEST_F(ExecutorTest, RegionStaysMappedUntilItsCallFinishesOnTheGpu) {
  auto s = NewSession(1);
  RegionRegistry::Registered reg;
  ASSERT_TRUE(s->regions().Register(Handle(9), 0, &reg).ok());
  device_.hold_writes = true;  // the GPU is behind: "done" not written yet
  SetInputsReady(*s, 0, 1);
  CallRequest req = Req(0, 1);
  TensorRef t;
  t.region_id = reg.region_id;
  t.dtype = DType::kFloat32;
  req.args.push_back(t);
  Results r;
  executor_->Submit(s, req, r.Slot(1));
  ASSERT_TRUE(r.Wait(1));
  ASSERT_TRUE(r.Get(1).ok());
  // Wait for the held "done" write itself (it follows the run): flushing
  // before it is enqueued would leave it held. The executor records the
  // lane's enqueued seq after it enqueues the write: wait for that too.
  ASSERT_TRUE(WaitUntil([&] { return device_.held_count() == 1 && s->lane(0).enqueued.load() == 1; }));
  bool deferred = false;
  ASSERT_TRUE(s->regions().Unregister(reg.region_id, &deferred).ok());
  EXPECT_TRUE(deferred);
  EXPECT_EQ(s->regions().ReleaseCompleted(), 1u);
  EXPECT_EQ(opener_.open_count(), 1);
  EXPECT_FALSE(s->Drained());
  device_.FlushHeld();  // the kernel and the done write complete
  EXPECT_TRUE(s->Drained());
  EXPECT_EQ(s->regions().ReleaseCompleted(), 0u);
  EXPECT_EQ(opener_.open_count(), 0);
}

TEST_F(ExecutorTest, FakedSharedDoneDoesNotReleaseRegions) {
  auto s = NewSession(1);
  RegionRegistry::Registered reg;
  ASSERT_TRUE(s->regions().Register(Handle(8), 0, &reg).ok());
  device_.hold_writes = true;
  SetInputsReady(*s, 0, 1);
  CallRequest req = Req(0, 1);
  TensorRef t;
  t.region_id = reg.region_id;
  req.args.push_back(t);
  Results r;
  executor_->Submit(s, req, r.Slot(1));
  ASSERT_TRUE(r.Wait(1));
  ASSERT_TRUE(WaitUntil([&] { return device_.held_count() == 1 && s->lane(0).enqueued.load() == 1; }));
  // A hostile client writes "done" in the shared memory itself.
  std::atomic_ref<uint64_t>(s->memory().lane(0)->done).store(1000);
  bool deferred = false;
  ASSERT_TRUE(s->regions().Unregister(reg.region_id, &deferred).ok());
  EXPECT_TRUE(deferred);
  EXPECT_EQ(s->regions().ReleaseCompleted(), 1u);
  device_.FlushHeld();
  EXPECT_EQ(s->regions().ReleaseCompleted(), 0u);
}

// Hands back the earlier prepared call for an equal one once its regions
// resolve (as the torch runner does while they are the same mappings), and
// counts what the executor asks of it.
class ReusingRunner final : public FakeRunner {
 public:
  Status Prepare(const CallRequest& req, const RegionResolver& regions,
                 std::unique_ptr<PreparedCall>* out) override {
    ++prepares;
    return FakeRunner::Prepare(req, regions, out);
  }
  Status PrepareAgain(const CallRequest& req, const RegionResolver& regions,
                      const std::shared_ptr<PreparedCall>& previous, std::shared_ptr<PreparedCall>* out,
                      bool* reused) override {
    ++again;
    *reused = false;
    for (const Arg& a : req.args) {
      if (const auto* t = std::get_if<TensorRef>(&a)) {
        MappedRegion r;
        OPD_RETURN_IF_ERROR(regions.Resolve(t->region_id, &r));
      }
    }
    *out = previous;
    *reused = true;
    return Status::Ok();
  }
  Status Validate(PreparedCall&) override {
    ++validates;
    return Status::Ok();
  }
  std::atomic<int> prepares{0}, again{0}, validates{0};
};

TEST_F(ExecutorTest, ACallEqualToOneOfItsLanesLastIsPreparedAgainWithoutValidate) {
  ReusingRunner runner;
  ExecutorOptions o;
  o.parking_slots = 0;
  Executor executor(&device_, &runner, &stats_, o, [](const Status&) {});
  executor.Start();
  auto s = NewSession(2);
  RegionRegistry::Registered reg;
  ASSERT_TRUE(s->regions().Register(Handle(7), 0, &reg).ok());
  SetInputsReady(*s, 0, 100);
  SetInputsReady(*s, 1, 100);
  CallRequest in_region = Req(0, 0, "a");
  TensorRef t;
  t.region_id = reg.region_id;
  t.dtype = DType::kFloat32;
  in_region.args.push_back(t);
  // Lane 0: a, a, b, a, a with other arguments, a; lane 1: a (its own).
  struct Step {
    uint32_t lane;
    std::string op;
    bool with_region;
  };
  const std::vector<Step> steps = {{0, "a", true},  {0, "a", true}, {0, "b", true},
                                   {0, "a", false}, {0, "a", true}, {1, "a", true}};
  uint64_t seq[2] = {0, 0};
  Results r;
  for (size_t i = 0; i < steps.size(); ++i) {
    CallRequest req = steps[i].with_region ? in_region : Req(0, 0, "a");
    req.op = steps[i].op;
    req.lane = steps[i].lane;
    req.seq = ++seq[steps[i].lane];
    executor.Submit(s, req, r.Slot(static_cast<int>(i)));
    ASSERT_TRUE(r.Wait(i + 1));  // accepted before the next arrives
    EXPECT_TRUE(r.Get(static_cast<int>(i)).ok()) << i << ": " << r.Get(static_cast<int>(i)).ToString();
  }
  EXPECT_EQ(runner.prepares.load(), 4);   // lane 0's a, b and argument-less a; lane 1's a
  EXPECT_EQ(runner.again.load(), 2);      // lane 0's second a and its a after the others
  EXPECT_EQ(runner.validates.load(), 4);  // what was prepared afresh, only

  // Its region unregistered, an equal call is rejected: regions are resolved again.
  ASSERT_TRUE(WaitUntil([&] { return s->Drained(); }));
  bool deferred = false;
  ASSERT_TRUE(s->regions().Unregister(reg.region_id, &deferred).ok());
  CallRequest req = in_region;
  req.seq = ++seq[0];
  executor.Submit(s, req, r.Slot(100));
  ASSERT_TRUE(r.Wait(steps.size() + 1));
  EXPECT_EQ(r.Get(100).reason(), Reason::kRegionUnknown) << r.Get(100).ToString();
  EXPECT_EQ(runner.again.load(), 3);
  executor.Stop();
}

double CpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

TEST_F(ExecutorTest, IdleAndWaitingDoNotBurnCpu) {
  double t0 = CpuSeconds();
  std::this_thread::sleep_for(300ms);
  EXPECT_LT(CpuSeconds() - t0, 0.03) << "idle executor used CPU";

  auto s = NewSession(1);
  Results r;
  executor_->Submit(s, Req(0, 1), r.Slot(1));  // waits for inputs forever
  std::this_thread::sleep_for(50ms);           // past the spin window
  t0 = CpuSeconds();
  std::this_thread::sleep_for(500ms);
  // Backoff caps at 1 ms sleeps: a few percent of one core at most.
  EXPECT_LT(CpuSeconds() - t0, 0.15) << "waiting executor burned CPU";
  SetInputsReady(*s, 0, 1);
  ASSERT_TRUE(r.Wait(1));
  EXPECT_TRUE(r.Get(1).ok());

  // After its last call the executor busy-polls for `spin` only, then sleeps.
  ASSERT_TRUE(WaitUntil([&] { return s->memory().Done(0) == 1; }));
  std::this_thread::sleep_for(50ms);
  t0 = CpuSeconds();
  std::this_thread::sleep_for(300ms);
  EXPECT_LT(CpuSeconds() - t0, 0.03) << "executor kept spinning after its last call";
}

// busy_ns counts the passes that did work: at least the 10 slow launches'
// 20 ms, and nothing while the thread only polls or sleeps.
TEST_F(ExecutorTest, BusyTimeCountsWorkAndNotIdling) {
  auto s = NewSession(1);
  SetInputsReady(*s, 0, 10);
  Results r;
  const uint64_t before = executor_->busy_ns();
  for (uint64_t seq = 1; seq <= 10; ++seq) executor_->Submit(s, Req(0, seq, "slow"), r.Slot(static_cast<int>(seq)));
  ASSERT_TRUE(r.Wait(10));
  ASSERT_TRUE(WaitUntil([&] { return s->memory().Done(0) == 10; }));
  std::this_thread::sleep_for(20ms);  // past the spin window: the last pass that did work is over
  const uint64_t worked = executor_->busy_ns();
  EXPECT_GE(worked - before, uint64_t{20'000'000});
  std::this_thread::sleep_for(100ms);  // spinning, then asleep: no work
  EXPECT_EQ(executor_->busy_ns(), worked);
}

TEST_F(ExecutorTest, StopCompletesEverythingQueued) {
  auto s = NewSession(1);
  Results r;
  executor_->Submit(s, Req(0, 1), r.Slot(1));  // accepted, never runs: no inputs
  ASSERT_TRUE(r.Wait(1));
  EXPECT_TRUE(r.Get(1).ok());
  executor_->Stop();
  EXPECT_EQ(s->memory().Done(0), 1u);  // released so the client's stream drains
  EXPECT_TRUE(runner_.ran_copy().empty());
  executor_->Submit(s, Req(0, 2), r.Slot(2));
  ASSERT_TRUE(r.Wait(2));
  EXPECT_EQ(r.Get(2).code(), StatusCode::kUnavailable);
  std::promise<void> then;
  executor_->DropSession(s, Status::Cancelled("late"), [&] { then.set_value(); });
  EXPECT_EQ(then.get_future().wait_for(1s), std::future_status::ready);
}


// Launch ahead: calls whose inputs are not ready go to the GPU behind a
// parked wait while the lane holds one of the (here: 2) parking slots.
class LaunchAheadTest : public ExecutorTest {
 protected:
  void SetUp() override {
    runner_.device = &device_;
    Recreate(Options(2, 10s));
  }
  // Any number of busy lanes may park here (the slots are what is tested);
  // BusyLanesPastTheLimitWaitOnTheHost sets a limit.
  static ExecutorOptions Options(int slots, std::chrono::milliseconds deadline, int busy_lanes = 0) {
    ExecutorOptions o;
    o.parking_slots = slots;
    o.park_deadline = deadline;
    o.park_busy_lanes = busy_lanes;
    return o;
  }
  // An executor with these options over streams whose queues hold a little
  // more than the depth bound allows: three operations per call on the fake
  // (wait, run, done write), so a launch past the bound would block.
  ExecutorOptions RecreateWithFiniteQueues(int slots, std::chrono::milliseconds deadline) {
    const ExecutorOptions o = Options(slots, deadline);
    Recreate(o);
    device_.max_queued = 3 * o.max_calls_ahead + 8;
    return o;
  }
  size_t WaitsOn(void* stream) {
    std::lock_guard<std::mutex> lock(device_.mu);
    size_t n = 0;
    for (auto& [st, v] : device_.waits) n += st == stream ? 1 : 0;
    return n;
  }
};

TEST_F(LaunchAheadTest, LaunchesBeforeTheInputsAndRunsWhenTheyArrive) {
  auto s = NewSession(1);
  Results r;
  for (int i = 1; i <= 3; ++i) executor_->Submit(s, Req(0, i), r.Slot(i));
  ASSERT_TRUE(r.Wait(3));
  // Enqueued on the GPU (nothing left on the host), held by the wait.
  ASSERT_TRUE(WaitUntil([&] { return executor_->pending() == 0; }));
  EXPECT_EQ(executor_->parked(), 1u);
  EXPECT_EQ(WaitsOn(s->lane(0).stream), 3u);
  EXPECT_TRUE(runner_.ran_copy().empty());
  EXPECT_EQ(s->memory().Done(0), 0u);
  SetInputsReady(*s, 0, 2);
  ASSERT_TRUE(WaitUntil([&] { return s->memory().Done(0) == 2; }));
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(s->memory().Done(0), 2u);  // call 3 still waits for its inputs
  SetInputsReady(*s, 0, 3);
  ASSERT_TRUE(WaitUntil([&] { return s->memory().Done(0) == 3; }));
  auto ran = runner_.ran_copy();
  ASSERT_EQ(ran.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(ran[i].seq, uint64_t(i + 1));
  EXPECT_TRUE(WaitUntil([&] { return executor_->parked() == 0; }));  // the slot is free again

  // Inputs the host already sees ready: no wait at all.
  auto ready = NewSession(1);
  SetInputsReady(*ready, 0, 1);
  executor_->Submit(ready, Req(0, 1), r.Slot(10));
  ASSERT_TRUE(WaitUntil([&] { return ready->memory().Done(0) == 1; }));
  EXPECT_EQ(WaitsOn(ready->lane(0).stream), 0u);
}

TEST_F(LaunchAheadTest, BusyLanesPastTheLimitWaitOnTheHost) {
  Recreate(Options(8, 10s, /*busy_lanes=*/2));
  auto s = NewSession(3);
  Results r;
  // Two busy lanes park...
  for (uint32_t l = 0; l < 2; ++l) {
    executor_->Submit(s, Req(l, 1), r.Slot(int(l)));
    ASSERT_TRUE(WaitUntil([&] { return executor_->parked() == l + 1; })) << l;
  }
  // ...a third one's call waits on the host, with nothing on the GPU, free slots or not.
  executor_->Submit(s, Req(2, 1), r.Slot(2));
  ASSERT_TRUE(r.Wait(3));
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(executor_->parked(), 2u);
  EXPECT_EQ(executor_->pending(), 1u);
  EXPECT_EQ(WaitsOn(s->lane(2).stream), 0u);
  // Once the first two have run, two lanes are busy no longer: the third parks.
  SetInputsReady(*s, 0, 1);
  SetInputsReady(*s, 1, 1);
  ASSERT_TRUE(WaitUntil([&] { return s->memory().Done(0) == 1 && s->memory().Done(1) == 1; }));
  ASSERT_TRUE(WaitUntil([&] { return WaitsOn(s->lane(2).stream) == 1u; }));
  EXPECT_EQ(executor_->pending(), 0u);
  EXPECT_EQ(s->memory().Done(2), 0u);
  SetInputsReady(*s, 2, 1);
  ASSERT_TRUE(WaitUntil([&] { return s->memory().Done(2) == 1; }));
}

TEST_F(LaunchAheadTest, StalledLanesBeyondTheSlotsBlockNobody) {
  // One client that never signals, on more lanes than there are slots...
  auto stalled = NewSession(4);
  Results r;
  for (uint32_t l = 0; l < 4; ++l) executor_->Submit(stalled, Req(l, 1), r.Slot(int(l)));
  ASSERT_TRUE(r.Wait(4));
  ASSERT_TRUE(WaitUntil([&] { return executor_->parked() == 2; }));
  // ...while 40 lanes of 8 sessions run, half signalling after they submit.
  std::vector<std::shared_ptr<Session>> busy;
  for (int i = 0; i < 8; ++i) busy.push_back(NewSession(5));
  int slot = 100;
  for (int i = 0; i < 8; ++i) {
    for (uint32_t l = 0; l < 5; ++l) {
      const bool early = (i + l) % 2 == 0;
      if (early) SetInputsReady(*busy[i], l, 3);
      for (int n = 1; n <= 3; ++n) executor_->Submit(busy[i], Req(l, n), r.Slot(slot++));
      if (!early) SetInputsReady(*busy[i], l, 3);
    }
  }
  ASSERT_TRUE(r.Wait(4 + 120));
  ASSERT_TRUE(WaitUntil([&] {
    for (auto& b : busy) {
      for (uint32_t l = 0; l < 5; ++l) {
        if (b->memory().Done(l) != 3) return false;
      }
    }
    return true;
  }));
  for (uint32_t l = 0; l < 4; ++l) EXPECT_EQ(stalled->memory().Done(l), 0u) << l;
  EXPECT_EQ(executor_->parked(), 2u);          // never more than the slots
  EXPECT_EQ(device_.blocked_streams(), 2u);    // only the stalled client's parked lanes
  EXPECT_EQ(executor_->pending(), 2u);         // its other two lanes wait on the host
  EXPECT_TRUE(ExecutorTest::stalled().empty());  // within the deadline: nobody released
}

TEST_F(LaunchAheadTest, AStalledLaneLosesItsSlotPastTheDeadlineWhenAnotherNeedsIt) {
  Recreate(Options(1, 50ms));
  auto a = NewSession(1);
  auto b = NewSession(1);
  Results r;
  executor_->Submit(a, Req(0, 1), r.Slot(1));  // parked, never signalled
  ASSERT_TRUE(WaitUntil([&] { return executor_->parked() == 1 && executor_->pending() == 0; }));
  executor_->Submit(b, Req(0, 1), r.Slot(2));  // needs the slot
  ASSERT_TRUE(WaitUntil([&] { return !stalled().empty(); }));
  auto st = stalled();
  ASSERT_EQ(st.size(), 1u);
  EXPECT_EQ(st[0].first, a->id());
  EXPECT_EQ(st[0].second.reason(), Reason::kInputsStalled);
  EXPECT_NE(st[0].second.message().find("inputs_ready stayed at 0 below parked call 1"), std::string::npos)
      << st[0].second.message();
  // The released wait let a's call through (a's own memory only)...
  EXPECT_EQ(a->memory().InputsReady(0), 1u);
  ASSERT_TRUE(WaitUntil([&] { return a->memory().Done(0) == 1; }));
  // ...and b parked in its place and runs once it signals.
  ASSERT_TRUE(WaitUntil([&] { return executor_->pending() == 0; }));
  EXPECT_EQ(b->memory().Done(0), 0u);
  SetInputsReady(*b, 0, 1);
  ASSERT_TRUE(WaitUntil([&] { return b->memory().Done(0) == 1; }));
}

TEST_F(LaunchAheadTest, AnEndedSessionsParkedWaitsAreReleased) {
  auto dead = NewSession(2);
  auto other = NewSession(1);
  Results r;
  executor_->Submit(dead, Req(0, 1), r.Slot(1));
  executor_->Submit(dead, Req(0, 2), r.Slot(2));
  executor_->Submit(dead, Req(1, 1), r.Slot(3));
  ASSERT_TRUE(WaitUntil([&] { return executor_->parked() == 2 && executor_->pending() == 0; }));
  executor_->Submit(other, Req(0, 1), r.Slot(4));  // no slot left: waits on the host
  ASSERT_TRUE(r.Wait(4));
  // The client dies (SIGKILL): the daemon drops its session.
  dead->set_state(SessionState::kClosed);
  std::promise<void> then;
  executor_->DropSession(dead, Status::Cancelled("client died"), [&] { then.set_value(); });
  ASSERT_EQ(then.get_future().wait_for(2s), std::future_status::ready);
  // Its two slots are free: `other` takes one and goes to the GPU.
  ASSERT_TRUE(WaitUntil([&] { return WaitsOn(other->lane(0).stream) == 1; }));
  EXPECT_EQ(executor_->parked(), 1u);
  // Raised past every seq: it will never signal again.
  EXPECT_EQ(dead->memory().InputsReady(0), v1::kInputsReadyReleased);
  EXPECT_EQ(dead->memory().InputsReady(1), v1::kInputsReadyReleased);
  ASSERT_TRUE(WaitUntil([&] { return dead->Drained(); }));  // the lanes drain: its regions can go
  EXPECT_EQ(dead->memory().Done(0), 2u);
  EXPECT_EQ(dead->memory().Done(1), 1u);
  EXPECT_EQ(other->memory().Done(0), 0u);
  SetInputsReady(*other, 0, 1);
  ASSERT_TRUE(WaitUntil([&] { return other->memory().Done(0) == 1; }));
}

// A CUDA launch blocks while its stream's command queue is full. A client
// that never signals must not be able to fill its lane stream with calls
// parked behind its wait: the executor (which launches for everyone) would
// block in that launch.
TEST_F(LaunchAheadTest, AClientThatNeverSignalsCannotFillItsLaneStream) {
  const ExecutorOptions o = RecreateWithFiniteQueues(2, 10s);
  auto stalled = NewSession(1);
  auto busy = NewSession(1);
  Results r;
  const int n = 4 * o.max_calls_ahead;
  for (int i = 1; i <= n; ++i) executor_->Submit(stalled, Req(0, i), r.Slot(i));
  ASSERT_TRUE(r.Wait(n));
  // Up to the bound behind the parked wait (a few turns of the lane) ...
  ASSERT_TRUE(WaitUntil([&] { return WaitsOn(stalled->lane(0).stream) == size_t(o.max_calls_ahead); }));
  // ... and no further while the executor goes on serving another session:
  // the rest wait on the host. (Each check waits for the state it names:
  // another session's "done" is written before the executor's books move.)
  for (int i = 1; i <= 3; ++i) executor_->Submit(busy, Req(0, i), r.Slot(1000 + i));
  SetInputsReady(*busy, 0, 3);
  ASSERT_TRUE(WaitUntil([&] { return busy->memory().Done(0) == 3; }));
  ASSERT_TRUE(WaitUntil([&] { return executor_->pending() == size_t(n - o.max_calls_ahead); }));
  EXPECT_EQ(WaitsOn(stalled->lane(0).stream), size_t(o.max_calls_ahead));
  // Once the client signals, everything runs, in order.
  SetInputsReady(*stalled, 0, n);
  ASSERT_TRUE(WaitUntil([&] { return stalled->memory().Done(0) == uint64_t(n); }));
  auto ran = runner_.ran_copy();
  std::vector<uint64_t> seqs;
  for (auto& c : ran) {
    if (c.stream == stalled->lane(0).stream) seqs.push_back(c.seq);
  }
  ASSERT_EQ(seqs.size(), size_t(n));
  for (int i = 0; i < n; ++i) EXPECT_EQ(seqs[i], uint64_t(i + 1));
}

// inputs_ready = 2^64 - 1: an unsigned compare on the host reads it as
// "ready", the GPU's cyclic one passes no wait. Neither the slot nor the
// depth bound may follow the client's value: the slot stays taken until the
// stream completes, the bound counts what the stream completed, and the
// executor keeps serving others (it would block in a launch onto the full
// stream otherwise). Past the deadline the wait is released to the parked
// seq, replacing the value, and ending the session drains every call.
TEST_F(LaunchAheadTest, AValueNoWaitPassesNeitherFreesTheSlotNorLiftsTheBound) {
  const ExecutorOptions o = RecreateWithFiniteQueues(1, 50ms);
  auto evil = NewSession(1);
  auto other = NewSession(1);
  Results r;
  executor_->Submit(evil, Req(0, 1), r.Slot(1));
  ASSERT_TRUE(WaitUntil([&] { return executor_->parked() == 1 && executor_->pending() == 0; }));
  SetInputsReady(*evil, 0, ~uint64_t{0});
  const int n = 4 * o.max_calls_ahead;
  for (int i = 2; i <= n; ++i) executor_->Submit(evil, Req(0, i), r.Slot(i));
  ASSERT_TRUE(r.Wait(n));
  ASSERT_TRUE(WaitUntil([&] { return executor_->pending() == size_t(n - o.max_calls_ahead); }));
  EXPECT_EQ(WaitsOn(evil->lane(0).stream), size_t(o.max_calls_ahead));
  EXPECT_EQ(executor_->parked(), 1u);
  EXPECT_EQ(evil->memory().Done(0), 0u);
  executor_->Submit(other, Req(0, 1), r.Slot(1000));  // needs the slot: evil is stalled past the deadline
  ASSERT_TRUE(WaitUntil([&] { return !stalled().empty(); }));
  EXPECT_EQ(stalled()[0].first, evil->id());
  ASSERT_TRUE(WaitUntil([&] { return evil->memory().Done(0) == uint64_t(o.max_calls_ahead); }));
  EXPECT_EQ(evil->memory().InputsReady(0), uint64_t(o.max_calls_ahead));  // the released value replaced it
  SetInputsReady(*other, 0, 1);
  ASSERT_TRUE(WaitUntil([&] { return other->memory().Done(0) == 1; }));
  SetInputsReady(*evil, 0, ~uint64_t{0});  // and again: ending the session replaces it too
  evil->set_state(SessionState::kClosed);
  std::promise<void> then;
  executor_->DropSession(evil, Status::Cancelled("client died"), [&] { then.set_value(); });
  ASSERT_EQ(then.get_future().wait_for(5s), std::future_status::ready);
  ASSERT_TRUE(WaitUntil([&] { return evil->Drained() && evil->memory().Done(0) == uint64_t(n); }));
  EXPECT_EQ(evil->memory().InputsReady(0), v1::kInputsReadyReleased);
}

// A parked lane's progress is what its stream completes: a client moving its
// inputs_ready back and forth below the parked calls is stalled all the same.
TEST_F(LaunchAheadTest, InputsMovingBackAndForthAreNoProgress) {
  Recreate(Options(1, 50ms));
  auto a = NewSession(1);
  auto b = NewSession(1);
  Results r;
  for (int i = 1; i <= 3; ++i) executor_->Submit(a, Req(0, i), r.Slot(i));
  ASSERT_TRUE(WaitUntil([&] { return executor_->parked() == 1 && executor_->pending() == 0; }));
  std::atomic<bool> stop{false};
  std::thread toggler([&] {
    for (uint64_t v = 0; !stop.load(); v ^= 1) {
      SetInputsReady(*a, 0, v);
      std::this_thread::sleep_for(300us);
    }
  });
  executor_->Submit(b, Req(0, 1), r.Slot(10));
  const bool released = WaitUntil([&] { return !stalled().empty(); }, 2000ms);
  stop = true;
  toggler.join();
  ASSERT_TRUE(released);
  EXPECT_EQ(stalled()[0].first, a->id());
  ASSERT_TRUE(WaitUntil([&] { return executor_->pending() == 0; }));  // b parked in a's place
}

// Even a launch blocked on a full queue (the queue shorter than the bound
// above) does not keep a dead client's waits parked: the thread that ends
// the session releases them, not the (blocked) executor thread.
TEST_F(LaunchAheadTest, EndingASessionReleasesItsWaitsWhileTheExecutorIsBlockedInALaunch) {
  device_.max_queued = 4;
  auto dead = NewSession(1);
  auto other = NewSession(1);
  Results r;
  for (int i = 1; i <= 8; ++i) executor_->Submit(dead, Req(0, i), r.Slot(i));
  // The executor is now blocked enqueueing onto the dead client's full stream
  // (three operations per call: the second call's run does not fit), so it
  // answers nothing more until the stream moves.
  ASSERT_TRUE(WaitUntil([&] { return WaitsOn(dead->lane(0).stream) >= 2; }));
  std::this_thread::sleep_for(20ms);
  dead->set_state(SessionState::kClosed);
  std::promise<void> then;
  executor_->DropSession(dead, Status::Cancelled("client died"), [&] { then.set_value(); });
  ASSERT_EQ(then.get_future().wait_for(5s), std::future_status::ready);
  ASSERT_TRUE(r.Wait(8));  // each call answered: accepted before, or dropped
  ASSERT_TRUE(WaitUntil([&] { return dead->Drained(); }));
  EXPECT_EQ(dead->memory().Done(0), 8u);
  executor_->Submit(other, Req(0, 1), r.Slot(100));
  SetInputsReady(*other, 0, 1);
  ASSERT_TRUE(WaitUntil([&] { return other->memory().Done(0) == 1; }));
}

TEST_F(LaunchAheadTest, StopReleasesEveryParkedWait) {
  auto s = NewSession(1);
  Results r;
  executor_->Submit(s, Req(0, 1), r.Slot(1));
  ASSERT_TRUE(WaitUntil([&] { return executor_->parked() == 1 && executor_->pending() == 0; }));
  executor_->Stop();
  EXPECT_EQ(s->memory().InputsReady(0), 1u);
  ASSERT_TRUE(WaitUntil([&] { return s->memory().Done(0) == 1; }));
}

}  // namespace
}  // namespace cache_dit_opd
