#include "client/core/lanes.h"

#include <vector>

namespace cache_dit_opd::client {

StreamKey KeyOfStream(void* stream) {
  StreamKey k;
  k.stream = reinterpret_cast<uintptr_t>(stream);
  if (k.stream == kPerThreadStreamHandle) {
    // A process-unique id per thread (std::thread::id values can be reused).
    static std::atomic<uint64_t> next{1};
    thread_local const uint64_t id = next.fetch_add(1, std::memory_order_relaxed);
    k.thread = id;
  }
  return k;
}

LaneTable::LaneTable(SessionMapping* memory, LaneStreamOps* ops)
    : memory_(memory), ops_(ops), lane_count_(memory->lane_count()), lanes_(new Lane[lane_count_]) {}

uint32_t LaneTable::LaneOf(const StreamKey& key) {
  std::lock_guard<std::mutex> lock(map_mu_);
  auto it = by_stream_.find(key);
  if (it != by_stream_.end()) return it->second;
  uint32_t best = 0;
  for (uint32_t l = 1; l < lane_count_; ++l) {
    if (lanes_[l].streams < lanes_[best].streams) best = l;
  }
  ++lanes_[best].streams;
  by_stream_.emplace(key, best);
  return best;
}

void LaneTable::Forget(const StreamKey& key) {
  uint32_t l;
  {
    std::lock_guard<std::mutex> lock(map_mu_);
    auto it = by_stream_.find(key);
    if (it == by_stream_.end()) return;
    l = it->second;
    --lanes_[l].streams;
    by_stream_.erase(it);
  }
  // The handle may come back as a new stream: its first call must still be
  // ordered after the old stream's last one.
  std::lock_guard<std::mutex> lock(lanes_[l].mu);
  lanes_[l].fence_next = true;
}

Status LaneTable::Issue(void* stream, const IssueOptions& options, const SendFn& send,
                        uint64_t* seq_out, uint32_t* lane_out) {
  const StreamKey key = KeyOfStream(stream);
  const uint32_t l = LaneOf(key);
  if (lane_out) *lane_out = l;
  Lane& lane = lanes_[l];
  std::lock_guard<std::mutex> lock(lane.mu);
  if (failed()) return failure();
  if (lane.has_last && (!(lane.last == key) || lane.fence_next)) {
    // The lane's previous writes were enqueued on another stream; without
    // this wait our inputs_ready could land before theirs and the semaphore
    // would go backwards.
    OPD_RETURN_IF_ERROR(ops_->WaitFence(stream, l));
  }
  const uint64_t seq = lane.issued.load(std::memory_order_relaxed) + 1;
  if (options.signal_inputs_ready && options.wait_done) {
    OPD_RETURN_IF_ERROR(ops_->WriteInputsReadyThenWaitDone(stream, l, seq));
  } else if (options.signal_inputs_ready) {
    OPD_RETURN_IF_ERROR(ops_->WriteInputsReady(stream, l, seq));
  } else if (options.wait_done) {
    OPD_RETURN_IF_ERROR(ops_->WaitDone(stream, l, seq));
  }
  // From here the number is spent, even if the send fails: the daemon may
  // have seen it, and a number is never reused on a lane.
  lane.issued.store(seq, std::memory_order_release);
  lane.last = key;
  lane.has_last = true;
  lane.fence_next = false;
  if (seq_out) *seq_out = seq;

  Status result = send(l, seq);
  Status f = ops_->RecordFence(stream, l);
  if (result.ok() && !f.ok()) result = f;
  // ReleaseFromHost may have run while we held the lock (it skips busy
  // lanes on its first pass); make sure this lane is released too.
  if (released_.load(std::memory_order_acquire)) RaiseLaneDone(l, seq);
  return result;
}

void LaneTable::Fail(const Status& reason) {
  std::lock_guard<std::mutex> lock(failure_mu_);
  if (failed_.load(std::memory_order_relaxed)) return;
  failure_ = reason.ok() ? Status::Unavailable("session failed") : reason;
  failed_.store(true, std::memory_order_release);
}

Status LaneTable::failure() const {
  std::lock_guard<std::mutex> lock(failure_mu_);
  return failure_;
}

void LaneTable::RaiseLaneDone(uint32_t lane, uint64_t issued) {
  RaiseSemaphore(&memory_->lane(lane)->done, issued);
}

void LaneTable::ReleaseFromHost(const Status& reason) {
  Fail(reason);
  released_.store(true, std::memory_order_seq_cst);
  // First pass: every idle lane at once. A lane whose mutex is held has a
  // call in flight; its RPC fails promptly once the daemon is gone, and
  // Issue releases the lane itself before unlocking. The second pass waits
  // for those, so no lane is missed whatever the interleaving.
  std::vector<uint32_t> busy;
  for (uint32_t l = 0; l < lane_count_; ++l) {
    std::unique_lock<std::mutex> lock(lanes_[l].mu, std::try_to_lock);
    if (!lock.owns_lock()) {
      busy.push_back(l);
      continue;
    }
    RaiseLaneDone(l, lanes_[l].issued.load(std::memory_order_acquire));
  }
  for (uint32_t l : busy) {
    std::lock_guard<std::mutex> lock(lanes_[l].mu);
    RaiseLaneDone(l, lanes_[l].issued.load(std::memory_order_acquire));
  }
}

int LaneTable::FencesPassed() {
  std::vector<std::unique_lock<std::mutex>> held;
  held.reserve(lane_count_);
  for (uint32_t l = 0; l < lane_count_; ++l) {
    held.emplace_back(lanes_[l].mu, std::try_to_lock);
    if (!held.back().owns_lock()) return 0;
  }
  return ops_->FencesPassed();
}

uint64_t LaneTable::issued(uint32_t lane) const {
  return lanes_[lane].issued.load(std::memory_order_acquire);
}

}  // namespace cache_dit_opd::client
