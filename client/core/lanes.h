// File: client/core/lanes.h
//
// Lanes: the per-stream ordering channels of a session (docs/DESIGN.md section 1).
// Each client stream that makes calls is bound to one lane; a lane carries
// two monotonic 64-bit timeline semaphores in the session's shared memory:
//
//   inputs_ready  the client's stream writes n after the work that produces
//                 call n's inputs (cuStreamWriteValue64_v2); the daemon runs
//                 call n only once it reads inputs_ready >= n.
//   done          the daemon's lane stream writes n after call n's kernel
//                 (also for a rejected call); the client's stream waits for
//                 done >= n (cuStreamWaitValue64_v2) before its next work.
//
// LaneTable keeps the bookkeeping: stream -> lane, the next sequence number,
// and the rule that a lane's number is taken, its GPU write enqueued and the
// call sent under one per-lane mutex, so the semaphore only ever grows. The
// GPU operations go through LaneStreamOps (CUDA in the client, host memory in
// tests). No host synchronization anywhere on this path.
//
// Streams and lanes:
//   - A stream keeps its lane for the session's life. With more streams than
//     lanes, a new stream shares the lane with the fewest streams; when a
//     lane's calls switch stream, the new stream first waits for the fence
//     the previous stream recorded after its last call (an event), so the
//     lane's writes stay ordered. Sharing therefore serializes those streams.
//   - Streams are told apart by handle. cudaStreamPerThread names a different
//     stream in every thread, so it is keyed by (handle, thread). A stream
//     destroyed and re-created at the same handle is indistinguishable: call
//     Client::ForgetStream() before destroying a stream you called on.
//   - Stream 0 is the legacy default stream.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "client/core/session_mapping.h"
#include "common/status.h"

namespace cache_dit_opd::client {

// The handle value of cudaStreamPerThread (cuda_runtime_api.h), without
// including CUDA headers here.
inline constexpr uintptr_t kPerThreadStreamHandle = 0x2;

struct StreamKey {
  uintptr_t stream = 0;
  uint64_t thread = 0;  // non-zero only for the per-thread default stream
  bool operator==(const StreamKey& o) const { return stream == o.stream && thread == o.thread; }
};

// The key of `stream` as seen from the calling thread.
StreamKey KeyOfStream(void* stream);

// LaneStreamOps
//
// What a lane enqueues on a stream. Every method only enqueues (never waits
// for the GPU) and returns non-OK when the enqueue itself failed.
class LaneStreamOps {
 public:
  virtual ~LaneStreamOps() = default;
  // `stream`: lane[lane].inputs_ready = value, after the stream's earlier work.
  virtual Status WriteInputsReady(void* stream, uint32_t lane, uint64_t value) = 0;
  // `stream`: wait until lane[lane].done >= value before later work.
  virtual Status WaitDone(void* stream, uint32_t lane, uint64_t value) = 0;
  // Both of the above, in that order, as one enqueue where the backend can
  // (one driver call for the two memory operations instead of two).
  virtual Status WriteInputsReadyThenWaitDone(void* stream, uint32_t lane, uint64_t value) {
    OPD_RETURN_IF_ERROR(WriteInputsReady(stream, lane, value));
    return WaitDone(stream, lane, value);
  }
  // `stream`: mark the point after this lane's operations (the lane's fence).
  virtual Status RecordFence(void* stream, uint32_t lane) = 0;
  // `stream`: wait for the lane's last recorded fence.
  virtual Status WaitFence(void* stream, uint32_t lane) = 0;
  // 1: every recorded fence has completed (no stream can still wait on the
  // lanes' memory); 0: some have not yet; -1: unknowable.
  virtual int FencesPassed() const { return 1; }
  // Keep whatever the fences hold for the process's life (a stream may still
  // need it and nothing can prove otherwise).
  virtual void Leak() {}
};

// IssueOptions
//
// signal_inputs_ready = false skips the inputs_ready write: the daemon then
// must not run the call until a later call (or the host) raises the value.
// It exists for tests of a client that never signals. wait_done = false
// leaves the stream unordered with the call's completion (benchmarks of the
// host path only).
struct IssueOptions {
  bool signal_inputs_ready = true;
  bool wait_done = true;
};

class LaneTable {
 public:
  using SendFn = std::function<Status(uint32_t lane, uint64_t seq)>;

  // `memory` holds `memory->lane_count()` lanes; both outlive the table.
  LaneTable(SessionMapping* memory, LaneStreamOps* ops);

  uint32_t lane_count() const { return lane_count_; }

  // LaneTable::LaneOf
  //
  // The lane of `key`, binding one on first use: an unused lane if any, else
  // the lane shared by the fewest streams (lowest index on ties).
  uint32_t LaneOf(const StreamKey& key);

  // LaneTable::Forget
  //
  // Unbinds `key`. The next call on its lane, from whatever stream (even a
  // new one at the same handle), first waits for the lane's fence.
  void Forget(const StreamKey& key);

  // LaneTable::Issue
  //
  // Runs one call on `stream`'s lane, holding the lane's mutex throughout:
  //   1. if the lane's previous call came from another stream: WaitFence;
  //   2. seq = last issued + 1; WriteInputsReady(seq) unless skipped;
  //   3. WaitDone(seq) unless skipped; with step 2, one enqueue
  //      (WriteInputsReadyThenWaitDone);
  //   4. send(lane, seq);
  //   5. RecordFence.
  // A failed enqueue in step 2 or 3 consumes no number. The wait is on the
  // stream before the send, whatever the send returns: the daemon may have
  // received the call and may still write its outputs, so the stream must
  // not run ahead of it (enqueued first, it still completes only once the
  // daemon, or the host, writes done). If the daemon never
  // completes that number, the wait is released from the host once the
  // daemon is gone or has ended the session (ReleaseFromHost). Returns the
  // send status (or the first enqueue error). After Fail(), returns the
  // failure at once without taking a number.
  Status Issue(void* stream, const IssueOptions& options, const SendFn& send,
               uint64_t* seq_out = nullptr, uint32_t* lane_out = nullptr);

  // LaneTable::Fail
  //
  // Marks the table failed with `reason` (kept by the first caller); later
  // Issue calls return it. Does not touch the semaphores.
  void Fail(const Status& reason);
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  Status failure() const;

  // LaneTable::ReleaseFromHost
  //
  // Raises every lane's done to its last issued number from the host, so
  // every wait this client enqueued can pass. Only for when the daemon can no
  // longer write those semaphores or the client's memory (its process died,
  // or it closed the session channel after releasing the session); a live
  // daemon may still be writing outputs. Implies Fail(). Idempotent: calling
  // it again re-asserts the values.
  void ReleaseFromHost(const Status& reason);

  // Last number issued on `lane` (0 before the first call). Never blocks.
  uint64_t issued(uint32_t lane) const;

  // LaneTable::FencesPassed
  //
  // The ops' FencesPassed() with every lane's mutex held, for deciding that
  // the lanes' memory may be freed: only after Fail(), which keeps later
  // Issue calls from enqueueing. 0 (not yet) while some lane's mutex is held:
  // an Issue past its failed() check may have enqueued a wait whose fence is
  // not recorded yet. Never blocks (the caller serves other sessions).
  int FencesPassed();

 private:
  struct Lane {
    std::mutex mu;
    // Written under mu; read without it by issued(), which must not wait
    // for a call in flight (diagnostics, tests).
    std::atomic<uint64_t> issued{0};
    StreamKey last{};     // guarded by mu
    bool has_last = false;
    bool fence_next = false;  // guarded by mu: Forget() ran, fence the next call
    uint32_t streams = 0;  // bound streams; guarded by map_mu_
  };
  struct KeyHash {
    size_t operator()(const StreamKey& k) const {
      return std::hash<uintptr_t>()(k.stream) ^ (std::hash<uint64_t>()(k.thread) * 0x9e3779b97f4a7c15ull);
    }
  };
  void RaiseLaneDone(uint32_t lane, uint64_t issued);

  SessionMapping* memory_;
  LaneStreamOps* ops_;
  uint32_t lane_count_;
  std::unique_ptr<Lane[]> lanes_;
  std::mutex map_mu_;
  std::unordered_map<StreamKey, uint32_t, KeyHash> by_stream_;  // guarded by map_mu_
  std::atomic<bool> failed_{false};
  std::atomic<bool> released_{false};
  mutable std::mutex failure_mu_;
  Status failure_;  // guarded by failure_mu_
};

}  // namespace cache_dit_opd::client
