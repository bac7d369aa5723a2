// The daemon's executor threads (server/exec/executor_pool.h): which one
// serves a session, that a session's calls, ring and end stay on it, the
// split of the parking slots, one failure for all, and many clients at once.
// The single executor's ordering rules are executor_test.cc's.
#include "server/exec/executor_pool.h"

#include <gtest/gtest.h>
#include <pthread.h>

#include <array>
#include <atomic>
#include <chrono>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tests/cpp/server/executor_test_util.h"
#include "tests/fake_daemon/fakes.h"

namespace cache_dit_opd {
namespace {

using namespace std::chrono_literals;
using testing::FakeDeviceOps;
using testing::FakeRegionOpener;
using testing::FakeRunner;
using testing::NewTestSession;
using testing::Req;
using testing::SetInputsReady;
using testing::WaitUntil;

std::string ThreadName() {
  std::array<char, 16> name{};
  pthread_getname_np(pthread_self(), name.data(), name.size());
  return name.data();
}


// FakeRunner that also notes the thread each call ran on, per lane stream.
class ThreadNotingRunner final : public FakeRunner {
 public:
  Status Run(PreparedCall& call, void* stream, bool* sticky) override {
    {
      std::lock_guard<std::mutex> lock(threads_mu);
      threads[stream].insert(ThreadName());
    }
    return FakeRunner::Run(call, stream, sticky);
  }
  std::set<std::string> ThreadsOf(void* stream) {
    std::lock_guard<std::mutex> lock(threads_mu);
    return threads[stream];
  }
  std::mutex threads_mu;
  std::map<void*, std::set<std::string>> threads;
};

// Answers counted by status, for many submitting threads.
struct Tally {
  std::atomic<int> ok{0}, failed{0};
  std::mutex mu;
  std::vector<Status> failures;
  Executor::Completion Slot() {
    return [this](const Status& s) {
      if (s.ok()) {
        ok.fetch_add(1);
        return;
      }
      std::lock_guard<std::mutex> lock(mu);
      failures.push_back(s);
      failed.fetch_add(1);
    };
  }
};

class ExecutorPoolTest : public ::testing::Test {
 protected:
  void TearDown() override {
    if (pool_) pool_->Stop();
  }
  void Make(int threads, int parking_slots = 0, int park_busy_lanes = 0) {
    if (pool_) pool_->Stop();
    runner_.device = &device_;
    ExecutorOptions o;
    o.parking_slots = parking_slots;
    o.park_busy_lanes = park_busy_lanes;
    pool_ = std::make_unique<ExecutorPool>(&device_, &runner_, &stats_, o, threads, [this](const Status& s) {
      std::lock_guard<std::mutex> lock(mu_);
      ++fatal_calls_;
      fatal_ = s;
    });
    pool_->Start();
  }
  std::shared_ptr<Session> NewSession(uint32_t lanes = 1) {
    return NewTestSession(++next_id_, lanes, &device_, &opener_);
  }
  size_t WaitsOn(void* stream) {
    std::lock_guard<std::mutex> lock(device_.mu);
    size_t n = 0;
    for (auto& [st, v] : device_.waits) n += st == stream ? 1 : 0;
    return n;
  }
  int fatal_calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return fatal_calls_;
  }

  // Before the device fake: its stream threads may still run a call's
  // record (into the runner) until the device fake joins them.
  ThreadNotingRunner runner_;
  FakeDeviceOps device_;
  FakeRegionOpener opener_;
  DaemonStats stats_;
  std::unique_ptr<ExecutorPool> pool_;
  uint64_t next_id_ = 0;
  std::mutex mu_;
  int fatal_calls_ = 0;
  Status fatal_;
};

TEST_F(ExecutorPoolTest, TheParkingSlotsAreSplitAndTheirSumIsTheBound) {
  struct Case {
    int threads, slots;
    std::vector<int> want;
  };
  for (const Case& c : {Case{1, 8, {8}}, Case{2, 8, {4, 4}}, Case{3, 8, {3, 3, 2}}, Case{3, 2, {1, 1, 0}},
                        Case{4, 0, {0, 0, 0, 0}}}) {
    Make(c.threads, c.slots);
    ASSERT_EQ(pool_->threads(), c.threads);
    std::vector<int> got;
    for (int i = 0; i < c.threads; ++i) got.push_back(pool_->parking_slots(i));
    EXPECT_EQ(got, c.want) << c.threads << " threads, " << c.slots << " slots";
  }
  Make(0);
  EXPECT_EQ(pool_->threads(), 1);
  Make(ExecutorPool::kMaxThreads + 5);
  EXPECT_EQ(pool_->threads(), ExecutorPool::kMaxThreads);
}

// --park-busy-lanes bounds the GPU's work, so the executors count their
// busy lanes together: a lane of one executor waits on the host while
// another executor's lane is busy, and parks once that one has finished.
TEST_F(ExecutorPoolTest, BusyLanesAreCountedOverEveryExecutor) {
  Make(/*threads=*/2, /*parking_slots=*/8, /*park_busy_lanes=*/1);
  auto a = NewSession(), b = NewSession();
  ASSERT_NE(pool_->ExecutorOf(*a), pool_->ExecutorOf(*b));
  Tally t;
  pool_->Submit(a, Req(0, 1), t.Slot());
  ASSERT_TRUE(WaitUntil([&] { return pool_->parked() == 1u; }));
  pool_->Submit(b, Req(0, 1), t.Slot());
  ASSERT_TRUE(WaitUntil([&] { return t.ok.load() == 2; }));  // both accepted
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(pool_->parked(), 1u);  // b's lane: on the host, though its executor has free slots
  EXPECT_EQ(WaitsOn(b->lane(0).stream), 0u);
  SetInputsReady(*a, 0, 1);
  ASSERT_TRUE(WaitUntil([&] { return a->memory().Done(0) == 1u; }));
  ASSERT_TRUE(WaitUntil([&] { return WaitsOn(b->lane(0).stream) == 1u; }));  // a finished: b parks
  EXPECT_EQ(b->memory().Done(0), 0u);
  SetInputsReady(*b, 0, 1);
  ASSERT_TRUE(WaitUntil([&] { return b->memory().Done(0) == 1u; }));
}

TEST_F(ExecutorPoolTest, SessionsAreSpreadAndEachRunsOnOneExecutor) {
  Make(3);
  std::vector<std::shared_ptr<Session>> sessions;
  for (int i = 0; i < 6; ++i) sessions.push_back(NewSession(2));
  Tally t;
  constexpr uint64_t kCalls = 20;
  for (auto& s : sessions) {
    for (uint32_t lane = 0; lane < 2; ++lane) {
      SetInputsReady(*s, lane, kCalls);
      for (uint64_t n = 1; n <= kCalls; ++n) pool_->Submit(s, Req(lane, n), t.Slot());
    }
  }
  ASSERT_TRUE(WaitUntil([&] { return pool_->pending() == 0; }));
  EXPECT_EQ(t.ok.load(), static_cast<int>(6 * 2 * kCalls));
  std::map<int, int> per_executor;
  for (auto& s : sessions) {
    const int e = pool_->ExecutorOf(*s);
    ++per_executor[e];
    for (uint32_t lane = 0; lane < 2; ++lane) {
      EXPECT_EQ(s->memory().Done(lane), kCalls);
      // Both lanes of a session, every call: the one thread of its executor.
      EXPECT_EQ(runner_.ThreadsOf(s->lane(lane).stream), std::set<std::string>{"opd-executor-" + std::to_string(e)})
          << "session " << s->id() << " lane " << lane;
    }
  }
  EXPECT_EQ(per_executor, (std::map<int, int>{{0, 2}, {1, 2}, {2, 2}}));
}

TEST_F(ExecutorPoolTest, AnEndedSessionsPlaceGoesToTheNextAndItsEndRunsOnItsExecutor) {
  Make(2);
  auto a = NewSession(), b = NewSession(), c = NewSession();
  EXPECT_EQ(pool_->ExecutorOf(*a), 0);
  EXPECT_EQ(pool_->ExecutorOf(*b), 1);
  EXPECT_EQ(pool_->ExecutorOf(*c), 0);  // ties go to the first
  std::promise<std::string> ended;
  b->set_state(SessionState::kClosed);
  pool_->DropSession(b, Status::Rejected(Reason::kClosed, "closed"), [&] { ended.set_value(ThreadName()); });
  auto f = ended.get_future();
  ASSERT_EQ(f.wait_for(5s), std::future_status::ready);
  EXPECT_EQ(f.get(), "opd-executor-1");
  pool_->DropSession(b, Status::Rejected(Reason::kClosed, "closed"), nullptr);  // counted once
  auto d = NewSession();
  EXPECT_EQ(pool_->ExecutorOf(*d), 1);  // executor 0 serves a and c
  auto e = NewSession();
  EXPECT_EQ(pool_->ExecutorOf(*e), 1);  // 2 and 1: a second drop of b did not count
  EXPECT_EQ(pool_->ExecutorOf(*b), 1);  // an ended session keeps its executor
}

// A source that submits what it holds when polled, as a RingConsumer hands
// its records to the daemon's Call; notes the thread that polls it.
class QueueSource final : public CallSource {
 public:
  QueueSource(ExecutorPool* pool, std::shared_ptr<Session> s, Tally* t) : pool_(pool), s_(std::move(s)), t_(t) {}
  void Publish(CallRequest r) {
    std::lock_guard<std::mutex> lock(mu_);
    records_.push_back(std::move(r));
  }
  size_t Poll() override {
    std::vector<CallRequest> take;
    {
      std::lock_guard<std::mutex> lock(mu_);
      take.swap(records_);
      if (!take.empty()) pollers_.insert(ThreadName());
    }
    for (CallRequest& r : take) pool_->Submit(s_, std::move(r), t_->Slot());
    return take.size();
  }
  bool ArmSleep() override {
    std::lock_guard<std::mutex> lock(mu_);
    return records_.empty();
  }
  void Disarm() override {}
  uint32_t* doorbell() const override { return &bell_; }
  uint32_t sleeping_value() const override { return 0; }
  bool finished() const override { return done_.load(); }
  void Finish() { done_.store(true); }
  std::set<std::string> pollers() {
    std::lock_guard<std::mutex> lock(mu_);
    return pollers_;
  }

 private:
  ExecutorPool* pool_;
  std::shared_ptr<Session> s_;
  Tally* t_;
  std::mutex mu_;
  std::vector<CallRequest> records_;
  std::set<std::string> pollers_;
  mutable uint32_t bell_ = 0;
  std::atomic<bool> done_{false};
};

TEST_F(ExecutorPoolTest, ARingIsPolledByTheExecutorThatRunsItsCalls) {
  Make(2);
  Tally t;
  std::vector<std::shared_ptr<Session>> sessions;
  std::vector<std::shared_ptr<QueueSource>> rings;
  for (int i = 0; i < 4; ++i) {
    sessions.push_back(NewSession());
    SetInputsReady(*sessions.back(), 0, 10);
    rings.push_back(std::make_shared<QueueSource>(pool_.get(), sessions.back(), &t));
    pool_->AddRing(sessions.back(), rings.back());
  }
  for (uint64_t n = 1; n <= 10; ++n) {
    for (auto& r : rings) r->Publish(Req(0, n));
  }
  ASSERT_TRUE(WaitUntil([&] { return t.ok.load() == 40 && pool_->pending() == 0; })) << t.ok.load();
  for (size_t i = 0; i < sessions.size(); ++i) {
    const std::string name = "opd-executor-" + std::to_string(pool_->ExecutorOf(*sessions[i]));
    EXPECT_EQ(rings[i]->pollers(), std::set<std::string>{name});
    EXPECT_EQ(runner_.ThreadsOf(sessions[i]->lane(0).stream), std::set<std::string>{name});
    EXPECT_EQ(sessions[i]->memory().Done(0), 10u);
  }
  for (auto& r : rings) r->Finish();
}

TEST_F(ExecutorPoolTest, AStickyErrorOnOneExecutorFailsEveryExecutorOnce) {
  Make(2);
  auto a = NewSession(), b = NewSession();
  ASSERT_NE(pool_->ExecutorOf(*a), pool_->ExecutorOf(*b));
  SetInputsReady(*a, 0, 1);
  Tally t;
  pool_->Submit(a, Req(0, 1, "sticky"), t.Slot());
  ASSERT_TRUE(WaitUntil([&] { return fatal_calls() == 1; }));
  EXPECT_TRUE(pool_->failed());
  // b's executor never saw a CUDA error itself: it rejects too.
  std::promise<Status> answer;
  pool_->Submit(b, Req(0, 1), [&](const Status& s) { answer.set_value(s); });
  auto f = answer.get_future();
  ASSERT_EQ(f.wait_for(5s), std::future_status::ready);
  const Status s = f.get();
  EXPECT_EQ(s.reason(), Reason::kDeviceLost) << s.ToString();
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(fatal_calls(), 1);
}

// Many clients at once, each on its own thread as the transports submit:
// every call answered once, every lane's calls run in seq order on its
// stream, with some lanes launched ahead behind parked waits.
TEST_F(ExecutorPoolTest, ManyClientsAtOnceKeepEveryLaneInOrder) {
  Make(3, /*parking_slots=*/4);
  constexpr int kSessions = 9;
  constexpr uint32_t kLanes = 2;
  constexpr uint64_t kCalls = 200;
  std::vector<std::shared_ptr<Session>> sessions;
  for (int i = 0; i < kSessions; ++i) sessions.push_back(NewSession(kLanes));
  Tally t;
  std::vector<std::thread> clients;
  for (int i = 0; i < kSessions; ++i) {
    clients.emplace_back([&, i] {
      Session& s = *sessions[i];
      for (uint64_t n = 1; n <= kCalls; ++n) {
        for (uint32_t lane = 0; lane < kLanes; ++lane) {
          // Odd sessions' inputs arrive after the call (launched ahead when
          // a slot is free), even ones' before it.
          if (i % 2 == 0) SetInputsReady(s, lane, n);
          pool_->Submit(sessions[i], Req(lane, n), t.Slot());
          if (i % 2 == 1) SetInputsReady(s, lane, n);
        }
      }
    });
  }
  for (auto& c : clients) c.join();
  ASSERT_TRUE(WaitUntil([&] {
    for (auto& s : sessions) {
      for (uint32_t lane = 0; lane < kLanes; ++lane) {
        if (s->memory().Done(lane) != kCalls) return false;
      }
    }
    return pool_->pending() == 0;
  }, 30000ms)) << "pending " << pool_->pending();
  EXPECT_EQ(t.ok.load(), static_cast<int>(kSessions * kLanes * kCalls));
  EXPECT_EQ(t.failed.load(), 0);
  EXPECT_EQ(stats_.calls.load(), kSessions * kLanes * kCalls);
  std::map<void*, std::vector<uint64_t>> runs;
  for (const auto& r : runner_.ran_copy()) runs[r.stream].push_back(r.seq);
  for (auto& s : sessions) {
    for (uint32_t lane = 0; lane < kLanes; ++lane) {
      const std::vector<uint64_t>& seqs = runs[s->lane(lane).stream];
      ASSERT_EQ(seqs.size(), kCalls);
      for (uint64_t n = 0; n < kCalls; ++n) ASSERT_EQ(seqs[n], n + 1) << "session " << s->id() << " lane " << lane;
    }
  }
  EXPECT_TRUE(WaitUntil([&] { return pool_->parked() == 0; }));
}

// A session's first call and its end, from two threads at once: both go to
// the one executor that either picks, and the session stops counting.
TEST_F(ExecutorPoolTest, AFirstCallRacingTheSessionsEndAgreesOnItsExecutor) {
  Make(2);
  for (int i = 0; i < 100; ++i) {
    auto s = NewSession();
    SetInputsReady(*s, 0, 1);
    std::atomic<int> answers{0};
    std::promise<void> ended;
    std::thread caller([&] { pool_->Submit(s, Req(0, 1), [&](const Status&) { answers.fetch_add(1); }); });
    std::thread ender([&] {
      s->set_state(SessionState::kClosed);
      pool_->DropSession(s, Status::Rejected(Reason::kClosed, "closed"), [&] { ended.set_value(); });
    });
    caller.join();
    ender.join();
    ASSERT_EQ(ended.get_future().wait_for(5s), std::future_status::ready) << "iteration " << i;
    ASSERT_TRUE(WaitUntil([&] { return answers.load() == 1 && pool_->pending() == 0; })) << "iteration " << i;
  }
  // Every one ended: neither executor counts any, so ties go to the first.
  auto x = NewSession(), y = NewSession();
  EXPECT_EQ(pool_->ExecutorOf(*x), 0);
  EXPECT_EQ(pool_->ExecutorOf(*y), 1);
}

}  // namespace
}  // namespace cache_dit_opd
