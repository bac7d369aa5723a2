// Lane and sequence bookkeeping (client/core/lanes.h) with host memory standing
// in for the GPU: stream operations are logged, and "the GPU" applies
// inputs_ready writes to the shared memory at once.
#include "client/core/lanes.h"

#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "tests/cpp/client/fake_memory.h"

namespace cache_dit_opd::client {
namespace {

struct Op {
  std::string what;  // "write", "wait", "fence", "waitfence"
  uintptr_t stream;
  uint32_t lane;
  uint64_t value;
};

class HostOps : public LaneStreamOps {
 public:
  explicit HostOps(SessionMapping* m) : m_(m) {}
  Status WriteInputsReady(void* s, uint32_t lane, uint64_t v) override {
    if (fail_write) return Status::Internal("stream is dead");
    // A GPU write lands after earlier stream work; here at once. The lane
    // rules guarantee the values only grow: check it.
    uint64_t* p = &m_->lane(lane)->inputs_ready;
    EXPECT_GT(v, LoadSemaphore(p)) << "inputs_ready went backwards on lane " << lane;
    StoreSemaphore(p, v);
    Log({"write", reinterpret_cast<uintptr_t>(s), lane, v});
    return Status::Ok();
  }
  Status WaitDone(void* s, uint32_t lane, uint64_t v) override {
    Log({"wait", reinterpret_cast<uintptr_t>(s), lane, v});
    return Status::Ok();
  }
  Status RecordFence(void* s, uint32_t lane) override {
    Log({"fence", reinterpret_cast<uintptr_t>(s), lane, 0});
    return Status::Ok();
  }
  Status WaitFence(void* s, uint32_t lane) override {
    Log({"waitfence", reinterpret_cast<uintptr_t>(s), lane, 0});
    return Status::Ok();
  }
  std::vector<Op> Take() {
    std::lock_guard<std::mutex> l(mu_);
    return std::move(log_);
  }
  bool fail_write = false;

 private:
  void Log(Op op) {
    std::lock_guard<std::mutex> l(mu_);
    log_.push_back(op);
  }
  SessionMapping* m_;
  std::mutex mu_;
  std::vector<Op> log_;
};

// A daemon that completes every call at once.
struct FakeDaemon {
  SessionMapping* m;
  std::vector<std::pair<uint32_t, uint64_t>> seen;
  Status reply;
  LaneTable::SendFn Send() {
    return [this](uint32_t lane, uint64_t seq) {
      seen.emplace_back(lane, seq);
      EXPECT_GE(LoadSemaphore(&m->lane(lane)->inputs_ready), seq);
      StoreSemaphore(&m->lane(lane)->done, seq);
      return reply;
    };
  }
};

void* S(uintptr_t v) { return reinterpret_cast<void*>(v); }

// A call on stream 0xA held inside its send (the lane's mutex held) from
// construction until Release(), which lets the send return `reply`.
class CallInFlight {
 public:
  CallInFlight(LaneTable* table, Status reply)
      : thread_([this, table, reply] {
          (void)table->Issue(S(0xA), {}, [&](uint32_t, uint64_t) {
            in_send_ = true;
            while (!go_) std::this_thread::yield();
            return reply;
          });
        }) {
    while (!in_send_) std::this_thread::yield();
  }
  ~CallInFlight() { Release(); }
  void Release() {
    go_ = true;
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::atomic<bool> in_send_{false}, go_{false};  // before thread_: set up before it starts
  std::thread thread_;
};

class LanesTest : public ::testing::Test {
 protected:
  void Init(uint32_t lanes) {
    host_ = std::make_unique<test::HostSession>(lanes);
    ASSERT_TRUE(SessionMapping::Wrap(host_->base, host_->bytes, {7, lanes, 0}, &mem_).ok());
    ops_ = std::make_unique<HostOps>(mem_.get());
    table_ = std::make_unique<LaneTable>(mem_.get(), ops_.get());
    daemon_.m = mem_.get();
  }
  std::unique_ptr<test::HostSession> host_;
  std::unique_ptr<SessionMapping> mem_;
  std::unique_ptr<HostOps> ops_;
  std::unique_ptr<LaneTable> table_;
  FakeDaemon daemon_;
};

TEST_F(LanesTest, OneLanePerStreamAndSequencesStartAtOne) {
  Init(4);
  uint64_t seq = 0;
  uint32_t lane = 99;
  ASSERT_TRUE(table_->Issue(S(0x10), {}, daemon_.Send(), &seq, &lane).ok());
  EXPECT_EQ(lane, 0u);
  EXPECT_EQ(seq, 1u);
  ASSERT_TRUE(table_->Issue(S(0x20), {}, daemon_.Send(), &seq, &lane).ok());
  EXPECT_EQ(lane, 1u);
  EXPECT_EQ(seq, 1u);
  ASSERT_TRUE(table_->Issue(S(0x10), {}, daemon_.Send(), &seq, &lane).ok());
  EXPECT_EQ(lane, 0u);
  EXPECT_EQ(seq, 2u);
  EXPECT_EQ(table_->issued(0), 2u);
  EXPECT_EQ(table_->issued(1), 1u);
  EXPECT_EQ(LoadSemaphore(&mem_->lane(0)->inputs_ready), 2u);
  EXPECT_EQ(LoadSemaphore(&mem_->lane(1)->inputs_ready), 1u);
}

// The wait is enqueued before the send (one batched enqueue with the write
// where the backend has one): on the GPU it completes only once done is
// written, whenever the daemon gets the call.
TEST_F(LanesTest, EachCallIsWriteWaitSendFenceInOrder) {
  Init(2);
  std::vector<std::string> order;
  uint64_t seq = 0;
  ASSERT_TRUE(table_->Issue(S(0x10), {}, [&](uint32_t l, uint64_t s) {
    for (const Op& op : ops_->Take()) order.push_back(op.what + ":" + std::to_string(op.value));
    order.push_back("send:" + std::to_string(s));
    return daemon_.Send()(l, s);
  }, &seq).ok());
  for (const Op& op : ops_->Take()) order.push_back(op.what + ":" + std::to_string(op.value));
  EXPECT_EQ(order, (std::vector<std::string>{"write:1", "wait:1", "send:1", "fence:0"}));
}

TEST_F(LanesTest, SkippingTheSignalWritesNothingButSpendsTheNumber) {
  Init(1);
  IssueOptions no_signal;
  no_signal.signal_inputs_ready = false;
  no_signal.wait_done = false;
  uint64_t seq = 0;
  ASSERT_TRUE(table_->Issue(S(0x10), no_signal, [](uint32_t, uint64_t) { return Status::Ok(); }, &seq).ok());
  EXPECT_EQ(seq, 1u);
  EXPECT_EQ(LoadSemaphore(&mem_->lane(0)->inputs_ready), 0u);
  auto ops = ops_->Take();
  ASSERT_EQ(ops.size(), 1u);
  EXPECT_EQ(ops[0].what, "fence");
  // The next signalled call covers the skipped one too (>= semantics).
  ASSERT_TRUE(table_->Issue(S(0x10), {}, daemon_.Send(), &seq).ok());
  EXPECT_EQ(seq, 2u);
  EXPECT_EQ(LoadSemaphore(&mem_->lane(0)->inputs_ready), 2u);
}

TEST_F(LanesTest, AFailedSendStillWaitsAndKeepsItsNumber) {
  Init(1);
  uint64_t seq = 0;
  Status s = table_->Issue(S(0x10), {}, [](uint32_t, uint64_t) { return Status::Unavailable("daemon gone"); }, &seq);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_EQ(seq, 1u);
  EXPECT_EQ(table_->issued(0), 1u);
  auto ops = ops_->Take();
  ASSERT_EQ(ops.size(), 3u);
  EXPECT_EQ(ops[1].what, "wait");  // the daemon may have the call: never run ahead of it
  EXPECT_EQ(ops[1].value, 1u);
}

TEST_F(LanesTest, AFailedEnqueueSpendsNoNumber) {
  Init(1);
  ops_->fail_write = true;
  bool sent = false;
  Status s = table_->Issue(S(0x10), {}, [&](uint32_t, uint64_t) { sent = true; return Status::Ok(); });
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_FALSE(sent);
  EXPECT_EQ(table_->issued(0), 0u);
  ops_->fail_write = false;
  uint64_t seq = 0;
  ASSERT_TRUE(table_->Issue(S(0x10), {}, daemon_.Send(), &seq).ok());
  EXPECT_EQ(seq, 1u);
}

TEST_F(LanesTest, MoreStreamsThanLanesShareWithAFence) {
  Init(2);
  uint32_t lane = 0;
  ASSERT_TRUE(table_->Issue(S(0xA), {}, daemon_.Send(), nullptr, &lane).ok());
  EXPECT_EQ(lane, 0u);
  ASSERT_TRUE(table_->Issue(S(0xB), {}, daemon_.Send(), nullptr, &lane).ok());
  EXPECT_EQ(lane, 1u);
  ops_->Take();
  // A third stream shares the least-used lane (lane 0 on a tie) and first
  // waits for lane 0's last fence, recorded by stream A.
  uint64_t seq = 0;
  ASSERT_TRUE(table_->Issue(S(0xC), {}, daemon_.Send(), &seq, &lane).ok());
  EXPECT_EQ(lane, 0u);
  EXPECT_EQ(seq, 2u);
  auto ops = ops_->Take();
  ASSERT_GE(ops.size(), 2u);
  EXPECT_EQ(ops[0].what, "waitfence");
  EXPECT_EQ(ops[0].stream, 0xCu);
  EXPECT_EQ(ops[1].what, "write");
  // Same stream again: no fence wait.
  ASSERT_TRUE(table_->Issue(S(0xC), {}, daemon_.Send(), &seq, &lane).ok());
  EXPECT_EQ(ops_->Take()[0].what, "write");
  // Back to A on lane 0: waits for C's fence.
  ASSERT_TRUE(table_->Issue(S(0xA), {}, daemon_.Send(), &seq, &lane).ok());
  EXPECT_EQ(seq, 4u);
  EXPECT_EQ(ops_->Take()[0].what, "waitfence");
  // A fourth stream goes to lane 1 (fewest streams now).
  EXPECT_EQ(table_->LaneOf(KeyOfStream(S(0xD))), 1u);
}

TEST_F(LanesTest, ForgetUnbindsAStream) {
  Init(2);
  EXPECT_EQ(table_->LaneOf(KeyOfStream(S(0xA))), 0u);
  EXPECT_EQ(table_->LaneOf(KeyOfStream(S(0xB))), 1u);
  table_->Forget(KeyOfStream(S(0xA)));
  EXPECT_EQ(table_->LaneOf(KeyOfStream(S(0xC))), 0u);
}

TEST_F(LanesTest, AStreamRecreatedAtAForgottenHandleIsFenced) {
  Init(1);
  ASSERT_TRUE(table_->Issue(S(0xA), {}, daemon_.Send()).ok());
  ASSERT_TRUE(table_->Issue(S(0xA), {}, daemon_.Send()).ok());
  ops_->Take();
  table_->Forget(KeyOfStream(S(0xA)));  // the caller destroys stream 0xA ...
  ASSERT_TRUE(table_->Issue(S(0xA), {}, daemon_.Send()).ok());  // ... and gets a new one at 0xA
  auto ops = ops_->Take();
  ASSERT_FALSE(ops.empty());
  EXPECT_EQ(ops[0].what, "waitfence");
  ASSERT_TRUE(table_->Issue(S(0xA), {}, daemon_.Send()).ok());
  EXPECT_EQ(ops_->Take()[0].what, "write");  // once only
}

TEST_F(LanesTest, PerThreadDefaultStreamIsOneStreamPerThread) {
  Init(4);
  void* per_thread = S(kPerThreadStreamHandle);
  const StreamKey mine = KeyOfStream(per_thread);
  StreamKey theirs;
  std::thread([&] { theirs = KeyOfStream(per_thread); }).join();
  EXPECT_FALSE(mine == theirs);
  EXPECT_TRUE(mine == KeyOfStream(per_thread));
  EXPECT_EQ(KeyOfStream(S(0)).thread, 0u);  // the legacy stream is one stream
  EXPECT_NE(table_->LaneOf(mine), table_->LaneOf(theirs));
}

TEST_F(LanesTest, ReleaseFromHostRaisesDoneToTheLastIssuedNumber) {
  Init(3);
  IssueOptions pending;  // calls the daemon never completes
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(table_->Issue(S(0xA), pending, [](uint32_t, uint64_t) { return Status::Ok(); }).ok());
  }
  ASSERT_TRUE(table_->Issue(S(0xB), pending, [](uint32_t, uint64_t) { return Status::Ok(); }).ok());
  StoreSemaphore(&mem_->lane(0)->done, 2);  // the daemon finished two
  table_->ReleaseFromHost(Status::Unavailable("daemon died"));
  EXPECT_EQ(LoadSemaphore(&mem_->lane(0)->done), 5u);
  EXPECT_EQ(LoadSemaphore(&mem_->lane(1)->done), 1u);
  EXPECT_EQ(LoadSemaphore(&mem_->lane(2)->done), 0u);
  // Failed: no further numbers are taken.
  bool sent = false;
  Status s = table_->Issue(S(0xA), {}, [&](uint32_t, uint64_t) { sent = true; return Status::Ok(); });
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_NE(s.message().find("daemon died"), std::string::npos);
  EXPECT_FALSE(sent);
  EXPECT_EQ(table_->issued(0), 5u);
  // A late smaller value from a dying daemon is overridden by re-asserting.
  StoreSemaphore(&mem_->lane(0)->done, 3);
  table_->ReleaseFromHost(Status());
  EXPECT_EQ(LoadSemaphore(&mem_->lane(0)->done), 5u);
  EXPECT_EQ(table_->failure().message(), "daemon died");  // the first reason is kept
}

TEST_F(LanesTest, ReleaseCoversACallInFlight) {
  Init(1);
  CallInFlight call(table_.get(), Status::Unavailable("connection reset"));
  std::thread releaser([&] { table_->ReleaseFromHost(Status::Unavailable("channel closed")); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  call.Release();
  releaser.join();
  EXPECT_EQ(LoadSemaphore(&mem_->lane(0)->done), 1u);
}

TEST_F(LanesTest, IssuedDoesNotWaitForACallInFlight) {
  Init(1);
  CallInFlight call(table_.get(), Status::Ok());
  EXPECT_EQ(table_->issued(0), 1u);  // would deadlock if it took the lane's mutex
}

// The monitor frees a failed session's memory on FencesPassed() == 1: never
// while an Issue is between its failed() check and its fence (its wait is
// enqueued, its fence not yet recorded), and without blocking on it.
TEST_F(LanesTest, FencesPassedIsNotYetWhileACallIsInFlight) {
  Init(2);
  EXPECT_EQ(table_->FencesPassed(), 1);  // HostOps: every fence passes at once
  CallInFlight call(table_.get(), Status::Unavailable("connection reset"));
  table_->Fail(Status::Unavailable("closed by the client"));
  EXPECT_EQ(table_->FencesPassed(), 0);  // returns at once: the lane's mutex is held
  call.Release();
  EXPECT_EQ(table_->FencesPassed(), 1);
  EXPECT_EQ(table_->Issue(S(0xA), {}, daemon_.Send()).code(), StatusCode::kUnavailable);  // failed: no new call
  EXPECT_EQ(table_->FencesPassed(), 1);
}

TEST_F(LanesTest, ConcurrentStreamsKeepEveryLaneMonotonic) {
  constexpr int kThreads = 6, kCalls = 2000;
  Init(4);  // 6 streams on 4 lanes: two lanes are shared
  std::mutex mu;
  std::map<uint32_t, std::vector<uint64_t>> sent;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kCalls; ++i) {
        Status s = table_->Issue(S(0x100 + t), {}, [&](uint32_t lane, uint64_t seq) {
          std::lock_guard<std::mutex> l(mu);
          sent[lane].push_back(seq);
          return Status::Ok();
        });
        ASSERT_TRUE(s.ok());
      }
    });
  }
  for (auto& th : threads) th.join();
  uint64_t total = 0;
  for (auto& [lane, seqs] : sent) {
    // Sent in order 1, 2, 3, ... on every lane: numbers are taken and
    // published under the lane's mutex.
    for (size_t i = 0; i < seqs.size(); ++i) ASSERT_EQ(seqs[i], i + 1) << "lane " << lane;
    EXPECT_EQ(table_->issued(lane), seqs.size());
    EXPECT_EQ(LoadSemaphore(&mem_->lane(lane)->inputs_ready), seqs.size());
    total += seqs.size();
  }
  EXPECT_EQ(total, uint64_t{kThreads} * kCalls);
}

}  // namespace
}  // namespace cache_dit_opd::client
