// File: server/session/session_channel.h
//
// The session channel (docs/DESIGN.md section 1): a SOCK_SEQPACKET Unix socket
// beside the gRPC socket, served by one dedicated thread with epoll, never by
// gRPC threads.
//
//   client connects, sends BindRequest (one message)
//   daemon reads SO_PEERCRED, SessionManager::Bind checks policy, pid, token
//   success: BindReply{OK} + the session's memfd (SCM_RIGHTS); the
//            connection stays open for the session's life
//   failure: BindReply{code, message}; the connection is closed
//
// When a bound connection closes (the client exited or crashed, or closed it
// deliberately) the session ends at once. When the session ends for another
// reason (CloseSession, bind timeout, shutdown) CloseSession(id) closes the
// connection so the client notices. A connection that sends nothing is
// closed after the bind timeout. The thread also calls SessionManager::Tick
// about every 100 ms (bind deadlines, heartbeats).
//
// Only the channel thread closes connection descriptors, so a descriptor
// number is never reused under a request that still names it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "server/session/session_manager.h"

namespace cache_dit_opd {

class SessionChannel {
 public:
  SessionChannel(std::string path, SessionManager* manager,
                 std::chrono::milliseconds tick = std::chrono::milliseconds(100));
  ~SessionChannel();
  SessionChannel(const SessionChannel&) = delete;
  SessionChannel& operator=(const SessionChannel&) = delete;

  // SessionChannel::Listen
  //
  // Creates the socket at `path` with mode 0660 and listens. The path must
  // be free (see PrepareSocketPath in server/runtime_dir.h). INTERNAL naming
  // the syscall on failure.
  Status Listen();
  // Starts the channel thread (after Listen).
  Status Start();
  // Stops accepting new connections (drain); bound ones stay.
  void StopAccepting();
  // Joins the thread, closes every connection and removes the socket file.
  void Stop();

  // Closes the channel of `session_id` (thread-safe, asynchronous).
  void CloseSession(uint64_t session_id);

  const std::string& path() const { return path_; }

 private:
  struct Conn {
    int fd = -1;
    uint64_t session_id = 0;  // 0 until bound
    std::chrono::steady_clock::time_point deadline;  // for unbound connections
  };

  void Loop();
  void Accept();
  void OnReadable(Conn& conn);
  void HandleBind(Conn& conn);
  void CloseConn(int fd);
  void Wake();

  const std::string path_;
  SessionManager* const manager_;
  const std::chrono::milliseconds tick_;

  int listen_fd_ = -1;
  bool created_ = false;  // we bound the socket file, so Stop removes it
  int epoll_fd_ = -1;
  int wake_fd_ = -1;  // eventfd
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> stop_accepting_{false};

  std::mutex mu_;
  std::vector<uint64_t> close_requests_;  // guarded by mu_

  // Channel thread only.
  std::vector<Conn> conns_;  // indexed lookups are by fd; few connections
};

// Sends `reply` (and `fd` when >= 0, as SCM_RIGHTS) as one SEQPACKET message.
Status SendBindReply(int sock, const Status& status, uint64_t shared_memory_bytes, int fd);

}  // namespace cache_dit_opd
