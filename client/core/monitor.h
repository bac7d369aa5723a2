// File: client/core/monitor.h
//
// The session monitor: one process-wide thread that watches every session
// engine's channel and daemon process (client/core/session_engine.h), and
// owns the memory of sessions that have ended. One failure detector for both
// clients.
//
// Detecting a failure. A session fails when
//   - the daemon closes the session channel (it exited, is shutting down, or
//     ended the session),
//   - the daemon process exits (a pidfd of the channel's peer, SO_PEERCRED),
//   - its heartbeat (SessionMemoryHeader::daemon_heartbeat, ~10 increments a
//     second) stops advancing for EngineOptions::heartbeat_timeout while
//     calls are outstanding (a hung or stopped daemon); the client then
//     shuts down its side of the channel, as on close. The thread reads it
//     every 50 ms while calls are outstanding and every heartbeat_timeout / 4
//     (at most 1 s) while a session is idle; with no session it sleeps.
//
// Releasing waits from the host (docs/DESIGN.md section 5: no stream waits
// forever). The client always enqueues a call's "done" wait, even when the
// send failed, because the daemon may have received the call and may still
// write its outputs. Who releases such waits:
//   - the daemon itself, for every number it received (run or rejected, in
//     order on its lane stream), including when it ends a session;
//   - the monitor, from the host, once the daemon can no longer write the
//     client's memory: when the daemon process has exited, at once; when the
//     daemon closed the session channel but is still alive (or its pid cannot
//     be watched), after kReleaseGrace. Values are re-asserted for
//     kReassertWindow: a dying daemon's GPU work can still land a smaller
//     value.
// A release raises every lane's "done" to the client's last issued number
// and counts the calls that had not completed (SessionEngine::TakeLost).
//
// Freeing ended sessions. The memory stays mapped and registered until every
// lane's fence event has completed (every stream passed its waits on it),
// then it is unregistered and unmapped. If the daemon does not close its end
// within kCloseGrace after the client shut down its write side, the client
// closes the channel fully.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>

namespace cache_dit_opd::client {

class SessionEngine;

inline constexpr std::chrono::milliseconds kReassertWindow{5000};
inline constexpr std::chrono::milliseconds kReleaseGrace{30000};
inline constexpr std::chrono::milliseconds kCloseGrace{10000};

class SessionMonitor {
 public:
  // The process's monitor, started on first use; nullptr once it has been
  // destroyed at process exit (an engine with static storage can outlive it),
  // and in a child forked after it started: its thread did not come along,
  // a lock it held may stay held, and CUDA is unusable there anyway.
  static SessionMonitor* Get();

  // Starts watching a bound session.
  void Watch(const std::shared_ptr<SessionEngine>& engine);
  // The client ended the session (its channel write side is shut down):
  // free its memory once that is safe.
  void Retire(const std::shared_ptr<SessionEngine>& engine);

  // Ended sessions not freed yet (tests).
  size_t retired_count() const;

  ~SessionMonitor();

 private:
  SessionMonitor();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace cache_dit_opd::client
