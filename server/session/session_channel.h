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
//   or: client sends AdminRequest (an operator's drain, session_memory.h)
//   daemon answers BindReply{the admin handler's status} and closes
//
//   or: client sends StoreAttachRequest (a bound session's process
//   attaching a weight-store entry): SessionManager::AdmitAttach checks the
//   message, the session (token, bound) and that the peer is the process
//   that bound it (SO_PEERCRED pid and uid), then the channel hands a
//   duplicate of the connection to the attach handler, which answers
//   StoreAttachReply (+ the block's descriptor) from its own thread; the
//   channel closes its end at once (a refusal it answers itself)
//
//   or: client sends VmmRegionRequest with its chunks' descriptors (a bound
//   session's process registering virtual memory): SessionManager::
//   AdmitVmmRegion checks it as an attach, then the region handler maps the
//   chunks (on the channel thread: the descriptors are closed when it
//   returns) and answers VmmRegionReply from its own thread
//
// When a bound connection closes (the client exited or crashed, or closed it
// deliberately) the session ends at once. When the session ends for another
// reason (CloseSession, bind timeout, shutdown) CloseSession(id) closes the
// connection so the client notices. The thread also calls
// SessionManager::Tick about every 100 ms (bind deadlines, heartbeats).
//
// Hostile peers (SessionChannelLimits): a connection is "unbound" from
// accept until its first message, which is handled at once (bound, or
// refused and closed). The peer's SO_PEERCRED is read at accept; a
// connection that would make its uid hold more than max_unbound_per_uid
// unbound connections, or all peers more than max_unbound, is answered
// BindReply{RESOURCE_EXHAUSTED, naming the count and the limit} and closed,
// so one uid cannot hold every slot and lock other uids out of binding. An
// unbound connection that sends nothing within first_message_timeout (at
// most the bind timeout) is answered BIND_TIMEOUT and closed. Without
// --allowed-gid every admitted client has the daemon's uid: the cap then
// cannot tell a uid's processes apart, and the deadline is what bounds how
// long one of them can keep the others from binding. When accept
// fails for want of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM)
// the channel stops polling the listening socket until the next tick
// instead of spinning on it. Every refusal is logged through a LogThrottle.
//
// Only the channel thread closes connection descriptors, so a descriptor
// number is never reused under a request that still names it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cache_dit_opd/v1/session_memory.h"
#include "common/status.h"
#include "server/session/session_manager.h"

namespace cache_dit_opd {

struct SessionChannelLimits {
  // Unbound connections (accepted, no message yet), all peers together.
  size_t max_unbound = 256;
  // Unbound connections of one uid (SO_PEERCRED at accept).
  size_t max_unbound_per_uid = 16;
  // Time an accepted connection has to send its bind request; the smaller
  // of this and SessionManager::bind_timeout_ms() applies. A client sends
  // its request right after connecting, so this need not cover the
  // session's bind timeout (which runs from OpenSession and is enforced by
  // SessionManager::Tick either way).
  std::chrono::milliseconds first_message_timeout{1000};
  // Reads the credentials of an accepted connection; empty: ReadPeerCred.
  // Tests inject peers of other uids here.
  std::function<Status(int fd, PeerCred* out)> read_peer;
};

class SessionChannel {
 public:
  SessionChannel(std::string path, SessionManager* manager,
                 std::chrono::milliseconds tick = std::chrono::milliseconds(100),
                 SessionChannelLimits limits = {});
  ~SessionChannel();
  SessionChannel(const SessionChannel&) = delete;
  SessionChannel& operator=(const SessionChannel&) = delete;

  // SessionChannel::Listen
  //
  // Creates the socket at `path` with mode 0660 and listens. The path must
  // be free (see PrepareSocketPath in server/runtime_dir.h). INTERNAL naming
  // the syscall on failure.
  Status Listen();
  // What an AdminRequest does (the daemon's drain; it checks the peer).
  // Without a handler, admin requests are UNIMPLEMENTED. Set before Start.
  using AdminHandler = std::function<Status(v1::AdminCommand, const PeerCred&)>;
  void SetAdminHandler(AdminHandler handler) { admin_ = std::move(handler); }
  // What a StoreAttachRequest does once the channel has admitted it (the
  // daemon's weight store): called on the channel thread with the session,
  // the entry's name and `reply_fd`, a descriptor of the connection that
  // the handler owns: it answers with SendAttachReply (from any thread: the
  // work may synchronize the device) and closes it. Without a handler,
  // attach requests are UNIMPLEMENTED. Set before Start.
  using AttachHandler = std::function<void(std::shared_ptr<Session>, std::string name, int reply_fd)>;
  void SetAttachHandler(AttachHandler handler) { attach_ = std::move(handler); }
  // What a VmmRegionRequest does once admitted: called on the channel thread
  // with the session, the request, its chunks' descriptors (the channel's,
  // closed when the handler returns: it maps them before) and `reply_fd`,
  // which it owns and answers with SendRegionReply. Without a handler,
  // region requests are UNIMPLEMENTED. Set before Start.
  using RegionHandler =
      std::function<void(std::shared_ptr<Session>, const v1::VmmRegionRequest&, std::span<const int> fds, int reply_fd)>;
  void SetRegionHandler(RegionHandler handler) { region_ = std::move(handler); }
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
    PeerCred peer;            // SO_PEERCRED, read at accept
    std::chrono::steady_clock::time_point deadline;  // for unbound connections
  };

  void Loop();
  void Accept();
  // Status::Ok(), or why a new connection of `peer` is refused (the caps).
  Status AdmitUnbound(const PeerCred& peer) const;
  // The connection leaves the unbound counts (bound, or closing).
  void ForgetUnbound(const Conn& conn);
  void PauseAccepting();
  void ResumeAccepting();
  void OnReadable(Conn& conn);
  // The first message of a connection: a bind, an admin request or an
  // attach (by its size).
  void HandleFirstMessage(Conn& conn);
  void HandleBind(Conn& conn, std::string_view bytes);
  void RefuseBind(Conn& conn, const Status& why);
  Status HandleAdmin(std::string_view bytes, const PeerCred& peer);
  void HandleAttach(Conn& conn, std::string_view bytes);
  void HandleRegion(Conn& conn, std::string_view bytes, std::span<const int> fds, bool truncated);
  // An admitted request goes to `hand` with a duplicate of the connection
  // (which the handler answers and closes); a refused one (or a failed
  // duplicate) is logged through a throttle and answered with `refuse`.
  // Either way the channel closes its end.
  void HandOver(Conn& conn, Status admitted, const char* what, const std::function<void(int)>& hand,
                const std::function<void(int, const Status&)>& refuse);
  void CloseConn(int fd);
  void Wake();

  const std::string path_;
  SessionManager* const manager_;
  const std::chrono::milliseconds tick_;
  SessionChannelLimits limits_;
  AdminHandler admin_;
  AttachHandler attach_;
  RegionHandler region_;

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
  size_t unbound_ = 0;       // conns_ with session_id 0
  std::unordered_map<uid_t, size_t> unbound_by_uid_;  // the same, per uid (no zero entries)
  bool accept_paused_ = false;  // the listening socket is out of epoll until the next tick
};

// Sends `reply` (and `fd` when >= 0, as SCM_RIGHTS) as one SEQPACKET message.
Status SendBindReply(int sock, const Status& status, uint64_t shared_memory_bytes, int fd);
// Sends `reply` with `status` written into it (and `fd` when >= 0).
Status SendAttachReply(int sock, const Status& status, v1::StoreAttachReply reply, int fd);
// Sends VmmRegionReply{status, region_id, mapped_bytes}.
Status SendRegionReply(int sock, const Status& status, uint64_t region_id, uint64_t mapped_bytes);

}  // namespace cache_dit_opd
