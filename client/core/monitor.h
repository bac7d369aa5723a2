// File: client/core/monitor.h
//
// The session monitor: one process-wide thread that watches every session's
// channel and daemon process, and owns the shared memory of sessions that
// have ended.
//
// Releasing waits from the host (docs/DESIGN.md section 5: no stream waits
// forever). The client always enqueues a call's "done" wait, even when the
// RPC failed, because the daemon may have received the call and may still
// write its outputs. Who releases such waits:
//   - the daemon itself, for every number it received (run or rejected, in
//     order on its lane stream), including when it ends a session;
//   - the monitor, from the host, once the daemon can no longer write the
//     client's memory: when the daemon process has exited (a pidfd of the
//     channel's peer, from SO_PEERCRED) at once; when the daemon closed the
//     session channel but is still alive (or its pid cannot be watched),
//     after kReleaseGrace. Values are re-asserted for kReassertWindow: a
//     dying daemon's GPU work can still land a smaller value.
// A release raises every lane's "done" to the client's last issued number;
// the session is failed (Issue returns UNAVAILABLE) as soon as the channel
// closes.
//
// Freeing ended sessions. The shared memory stays mapped and registered
// until every lane's fence event has completed (every stream passed its
// waits on it), then it is unregistered and unmapped. If the daemon does not
// close its end within kCloseGrace after the client shut down its write
// side, the client closes the channel fully.
// Internal to opd_client.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>

#include "client/core/cuda_backend.h"
#include "client/core/lanes.h"
#include "client/core/session_channel.h"
#include "client/core/session_mapping.h"

namespace cache_dit_opd::client {

// SessionCore
//
// What a session's CUDA streams can still reference after the session object
// is gone: the mapping, its CUDA registration, the lane fence events, the
// lane table and the channel.
struct SessionCore {
  uint64_t session_id = 0;
  int device = -1;
  const cuda::DriverApi* api = nullptr;
  std::unique_ptr<SessionMemory> memory;
  bool host_registered = false;  // memory is registered with cuMemHostRegister
  std::unique_ptr<CudaLaneOps> ops;
  std::unique_ptr<LaneTable> lanes;
  UniqueFd channel;
  UniqueFd daemon_pidfd;  // readable once the daemon process exited; invalid if unavailable
  int32_t daemon_pid = 0;  // the channel peer's pid (SO_PEERCRED); 0 if unknown

  // Frees everything (unregister, events, unmap) unless Leak() was called.
  ~SessionCore();
  // Keeps the mapping, registration and events for the process's lifetime.
  void Leak();

 private:
  bool leak_ = false;
};

inline constexpr std::chrono::milliseconds kReassertWindow{5000};
inline constexpr std::chrono::milliseconds kReleaseGrace{30000};
inline constexpr std::chrono::milliseconds kCloseGrace{10000};

class SessionMonitor {
 public:
  // The process's monitor, started on first use; nullptr once it has been
  // destroyed at process exit (a Client with static storage can outlive it).
  static SessionMonitor* Get();

  // Starts watching a bound session's channel.
  void Watch(const std::shared_ptr<SessionCore>& core);
  // The session ended on the client side (its channel write side is shut
  // down): free its memory once that is safe.
  void Retire(const std::shared_ptr<SessionCore>& core);

  // Ended sessions not freed yet (tests).
  size_t retired_count() const;

  ~SessionMonitor();

 private:
  SessionMonitor();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace cache_dit_opd::client
