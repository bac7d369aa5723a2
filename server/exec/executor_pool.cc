#include "server/exec/executor_pool.h"

#include <algorithm>
#include <string>
#include <utility>

namespace cache_dit_opd {

namespace {
// Session::executor_shard: -1 unassigned, i assigned to executor i, i +
// kDropped assigned and dropped (no longer counted as live).
constexpr int kUnassigned = -1;
constexpr int kDropped = 1 << 8;
static_assert(ExecutorPool::kMaxThreads <= kDropped);

int Clamped(int threads) { return std::clamp(threads, 1, ExecutorPool::kMaxThreads); }
}  // namespace

ExecutorPool::ExecutorPool(DeviceOps* device, CallRunner* runner, DaemonStats* stats, ExecutorOptions options,
                           int threads, Executor::FatalHook on_fatal)
    : live_(new std::atomic<int>[static_cast<size_t>(Clamped(threads))]()), on_fatal_(std::move(on_fatal)) {
  const int n = Clamped(threads);
  const int slots = options.parking_slots < 0 ? 0 : options.parking_slots;
  // One count of busy lanes for all: --park-busy-lanes is a bound on the GPU's work.
  options.busy_lanes = std::make_shared<std::atomic<int>>(0);
  for (int i = 0; i < n; ++i) {
    ExecutorOptions o = options;
    o.parking_slots = slots / n + (i < slots % n ? 1 : 0);
    if (n > 1) o.thread_name = options.thread_name + "-" + std::to_string(i);
    slots_.push_back(o.parking_slots);
    executors_.push_back(std::make_unique<Executor>(device, runner, stats, std::move(o),
                                                    [this](const Status& s) { OnFatal(s); }));
  }
}

void ExecutorPool::Start() {
  for (auto& e : executors_) e->Start();
}

void ExecutorPool::Stop() {
  for (auto& e : executors_) e->Stop();
}

int ExecutorPool::ExecutorOf(Session& session) {
  if (const int assigned = Assigned(session); assigned >= 0) return assigned;
  int best = 0;
  for (int i = 1; i < threads(); ++i) {
    if (live_[i].load(std::memory_order_relaxed) < live_[best].load(std::memory_order_relaxed)) best = i;
  }
  // Two first calls may race (a ring record and a gRPC call, or a call and
  // the session's end): one assignment wins and both use it.
  int unassigned = kUnassigned;
  if (session.executor_shard.compare_exchange_strong(unassigned, best, std::memory_order_acq_rel)) {
    live_[best].fetch_add(1, std::memory_order_relaxed);
    return best;
  }
  return Assigned(session);
}

int ExecutorPool::Assigned(const Session& session) {
  const int v = session.executor_shard.load(std::memory_order_acquire);
  return v == kUnassigned ? -1 : v % kDropped;
}

void ExecutorPool::Submit(const std::shared_ptr<Session>& session, CallRequest req, Executor::Completion done) {
  executors_[ExecutorOf(*session)]->Submit(session, std::move(req), std::move(done));
}

void ExecutorPool::SubmitRejected(const std::shared_ptr<Session>& session, uint32_t lane, uint64_t seq,
                                  CallTransport transport, Status reason, Executor::Completion done) {
  executors_[ExecutorOf(*session)]->SubmitRejected(session, lane, seq, transport, std::move(reason),
                                                   std::move(done));
}

void ExecutorPool::DropSession(const std::shared_ptr<Session>& session, Status reason,
                               std::function<void()> then) {
  const int i = ExecutorOf(*session);
  int live = i;
  if (session->executor_shard.compare_exchange_strong(live, i + kDropped, std::memory_order_acq_rel)) {
    live_[i].fetch_sub(1, std::memory_order_relaxed);
  }
  executors_[i]->DropSession(session, std::move(reason), std::move(then));
}

void ExecutorPool::AddRing(const std::shared_ptr<Session>& session, std::shared_ptr<CallSource> source) {
  executors_[ExecutorOf(*session)]->AddRing(std::move(source));
}

size_t ExecutorPool::pending() const {
  size_t n = 0;
  for (const auto& e : executors_) n += e->pending();
  return n;
}

size_t ExecutorPool::parked() const {
  size_t n = 0;
  for (const auto& e : executors_) n += e->parked();
  return n;
}

std::vector<uint64_t> ExecutorPool::busy_ns() const {
  std::vector<uint64_t> out;
  out.reserve(executors_.size());
  for (const auto& e : executors_) out.push_back(e->busy_ns());
  return out;
}

bool ExecutorPool::failed() const {
  for (const auto& e : executors_) {
    if (e->failed()) return true;
  }
  return false;
}

void ExecutorPool::OnFatal(const Status& status) {
  if (fatal_.exchange(true, std::memory_order_acq_rel)) return;
  // The CUDA context is the pool's, not one executor's: every other
  // executor rejects from now on too (their own hook calls end above).
  for (auto& e : executors_) e->Fail(status);
  if (on_fatal_) on_fatal_(status);
}

}  // namespace cache_dit_opd
