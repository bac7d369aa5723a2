#include "server/session/session_channel.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <spdlog/spdlog.h>

#include "common/log_throttle.h"
#include "common/out_of_descriptors.h"
#include "cache_dit_opd/v1/session_memory.h"
#include "server/session/unix_socket.h"

namespace cache_dit_opd {
namespace {

constexpr int kListenBacklog = 64;

// One SEQPACKET message of `bytes` with `fd` (when >= 0) as SCM_RIGHTS.
Status SendMessage(int sock, const void* bytes, size_t size, int fd, const char* what) {
  iovec iov{const_cast<void*>(bytes), size};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  if (fd >= 0) {
    std::memset(control, 0, sizeof(control));
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  ssize_t n = sendmsg(sock, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (n != static_cast<ssize_t>(size)) {
    return Status::Internal("sendmsg(", what, "): ", n < 0 ? std::strerror(errno) : "short write");
  }
  return Status::Ok();
}

// The reply's message field: the status message cut at a UTF-8 boundary and
// NUL-terminated (clients decode it as text; strncpy could end mid-sequence).
template <size_t N>
void CopyMessage(char (&field)[N], const Status& status) {
  const size_t n = Utf8Prefix(status.message(), N - 1);
  std::memcpy(field, status.message().data(), n);
  std::memset(field + n, 0, N - n);
}

}  // namespace

Status SendBindReply(int sock, const Status& status, uint64_t shared_memory_bytes, int fd) {
  v1::BindReply reply{};
  reply.status_code = static_cast<int32_t>(status.code());
  reply.layout_version = v1::kLayoutVersion;
  reply.shared_memory_bytes = status.ok() ? shared_memory_bytes : 0;
  reply.reason = static_cast<uint32_t>(status.reason());
  CopyMessage(reply.message, status);
  return SendMessage(sock, &reply, sizeof(reply), fd, "BindReply");
}

Status SendAttachReply(int sock, const Status& status, v1::StoreAttachReply reply, int fd) {
  if (!status.ok()) reply = v1::StoreAttachReply{};
  reply.status_code = static_cast<int32_t>(status.code());
  reply.reason = static_cast<uint32_t>(status.reason());
  CopyMessage(reply.message, status);
  return SendMessage(sock, &reply, sizeof(reply), status.ok() ? fd : -1, "StoreAttachReply");
}

Status SendRegionReply(int sock, const Status& status, uint64_t region_id, uint64_t mapped_bytes) {
  v1::VmmRegionReply reply{};
  reply.status_code = static_cast<int32_t>(status.code());
  reply.reason = static_cast<uint32_t>(status.reason());
  if (status.ok()) {
    reply.region_id = region_id;
    reply.mapped_bytes = mapped_bytes;
  }
  CopyMessage(reply.message, status);
  return SendMessage(sock, &reply, sizeof(reply), -1, "VmmRegionReply");
}

SessionChannel::SessionChannel(std::string path, SessionManager* manager, std::chrono::milliseconds tick,
                               SessionChannelLimits limits)
    : path_(std::move(path)), manager_(manager), tick_(tick), limits_(std::move(limits)) {
  if (!limits_.read_peer) limits_.read_peer = ReadPeerCred;
}

SessionChannel::~SessionChannel() { Stop(); }

Status SessionChannel::Listen() {
  return ListenUnix(path_, SOCK_SEQPACKET, kListenBacklog, &listen_fd_, &created_);
}

Status SessionChannel::Start() {
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd_ < 0) return Status::Internal("epoll_create1: ", std::strerror(errno));
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) return Status::Internal("eventfd: ", std::strerror(errno));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = wake_fd_;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  if (listen_fd_ >= 0) {
    ev.data.fd = listen_fd_;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, listen_fd_, &ev);
  }
  thread_ = std::thread([this] { Loop(); });
  return Status::Ok();
}

void SessionChannel::Wake() {
  if (wake_fd_ < 0) return;
  uint64_t one = 1;
  ssize_t n = write(wake_fd_, &one, sizeof(one));
  (void)n;
}

void SessionChannel::StopAccepting() {
  stop_accepting_.store(true);
  Wake();
}

void SessionChannel::CloseSession(uint64_t session_id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    close_requests_.push_back(session_id);
  }
  Wake();
}

void SessionChannel::Stop() {
  stop_.store(true);
  Wake();
  if (thread_.joinable()) thread_.join();
  for (Conn& c : conns_) close(c.fd);
  conns_.clear();
  if (listen_fd_ >= 0) close(listen_fd_);
  listen_fd_ = -1;
  if (created_) unlink(path_.c_str());
  created_ = false;
  if (wake_fd_ >= 0) close(wake_fd_);
  if (epoll_fd_ >= 0) close(epoll_fd_);
  wake_fd_ = epoll_fd_ = -1;
}

void SessionChannel::ForgetUnbound(const Conn& conn) {
  if (conn.session_id != 0) return;
  --unbound_;
  auto it = unbound_by_uid_.find(conn.peer.uid);
  if (it != unbound_by_uid_.end() && --it->second == 0) unbound_by_uid_.erase(it);
}

void SessionChannel::CloseConn(int fd) {
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
  close(fd);
  auto it = std::find_if(conns_.begin(), conns_.end(), [fd](const Conn& c) { return c.fd == fd; });
  if (it == conns_.end()) return;
  ForgetUnbound(*it);
  conns_.erase(it);
}

Status SessionChannel::AdmitUnbound(const PeerCred& peer) const {
  // The uid's own cap first: it is what the peer can do something about.
  auto it = unbound_by_uid_.find(peer.uid);
  const size_t of_uid = it == unbound_by_uid_.end() ? 0 : it->second;
  if (of_uid >= limits_.max_unbound_per_uid) {
    return Status::Rejected(Reason::kResourceExhausted, "uid ", peer.uid, " holds ", of_uid,
                            " session-channel connections that have not sent their bind request, at most ",
                            limits_.max_unbound_per_uid, " per uid");
  }
  if (unbound_ >= limits_.max_unbound) {
    return Status::Rejected(Reason::kResourceExhausted, unbound_,
                            " session-channel connections have not sent their bind request, at most ",
                            limits_.max_unbound);
  }
  return Status::Ok();
}

void SessionChannel::PauseAccepting() {
  if (accept_paused_ || listen_fd_ < 0) return;
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, listen_fd_, nullptr);
  accept_paused_ = true;
}

void SessionChannel::ResumeAccepting() {
  if (!accept_paused_) return;
  accept_paused_ = false;
  if (listen_fd_ < 0) return;
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = listen_fd_;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, listen_fd_, &ev);
}

void SessionChannel::Accept() {
  // A peer can cause each of these at will: a bounded number of lines per interval.
  static LogThrottle accept_failed(10, std::chrono::seconds(10));
  static LogThrottle refused(10, std::chrono::seconds(10));
  while (true) {
    int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      const int err = errno;
      if (err == EAGAIN || err == EINTR) return;
      if (OutOfDescriptors(err)) PauseAccepting();  // retried at the next tick
      if (const auto v = accept_failed.Next(); v.log) {
        spdlog::warn("session channel: accept: {}{}{}", std::strerror(err),
                     OutOfDescriptors(err) ? "; not accepting until the next tick" : "", SuppressedNote(v.suppressed));
      }
      return;
    }
    Conn c;
    c.fd = fd;
    Status s = limits_.read_peer(fd, &c.peer);
    if (s.ok()) s = AdmitUnbound(c.peer);
    if (!s.ok()) {
      if (const auto v = refused.Next(); v.log) {
        spdlog::warn("session channel: connection from pid {} uid {} refused: {}{}", c.peer.pid, c.peer.uid,
                     s.ToString(), SuppressedNote(v.suppressed));
      }
      (void)SendBindReply(fd, s, 0, -1);  // best effort: the peer may be gone
      close(fd);
      continue;
    }
    const auto first_message = std::min<std::chrono::milliseconds>(
        limits_.first_message_timeout, std::chrono::milliseconds(manager_->bind_timeout_ms()));
    c.deadline = std::chrono::steady_clock::now() + first_message;
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.fd = fd;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
    conns_.push_back(c);
    ++unbound_;
    ++unbound_by_uid_[c.peer.uid];
  }
}

Status SessionChannel::HandleAdmin(std::string_view bytes, const PeerCred& peer) {
  v1::AdminRequest req;
  std::memcpy(&req, bytes.data(), sizeof(req));
  if (req.magic != v1::kAdminRequestMagic) {
    return Status::Rejected(Reason::kMalformed, "a ", sizeof(req), "-byte message that is not an admin request (magic 0x",
                            std::hex, req.magic, ")");
  }
  if (req.protocol_version != v1::kProtocolVersion) {
    return Status::Rejected(Reason::kVersionMismatch, "admin request of protocol version ", req.protocol_version,
                            ", this daemon speaks ", v1::kProtocolVersion);
  }
  if (req.command != static_cast<uint32_t>(v1::AdminCommand::kDrain) || req.reserved != 0) {
    return Status::Rejected(Reason::kBadArgument, "unknown admin command ", req.command);
  }
  if (!admin_) return Status::Rejected(Reason::kUnsupported, "this daemon takes no admin requests");
  Status s = admin_(v1::AdminCommand::kDrain, peer);
  static LogThrottle logged(10, std::chrono::seconds(10));  // any peer can ask
  if (const auto v = logged.Next(); v.log) {
    spdlog::warn("session channel: drain requested by pid {} uid {}: {}{}", peer.pid, peer.uid,
                 s.ok() ? "accepted" : s.ToString(), SuppressedNote(v.suppressed));
  }
  return s;
}

void SessionChannel::HandleFirstMessage(Conn& conn) {
  // One message; MSG_TRUNC reports its real length so oversize is caught.
  // Descriptors come only with a region request; any that come are closed
  // at the end of this function.
  alignas(8) char buf[std::max({sizeof(v1::BindRequest), sizeof(v1::AdminRequest), sizeof(v1::StoreAttachRequest),
                                sizeof(v1::VmmRegionRequest)}) + 1];
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * v1::kMaxVmmChunks)];
  iovec iov{buf, sizeof(buf)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n = recvmsg(conn.fd, &msg, MSG_DONTWAIT | MSG_TRUNC | MSG_CMSG_CLOEXEC);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
  // A message of no bytes (n == 0, which also reads as the end of the
  // connection) can still carry descriptors: they are ours to close too.
  std::vector<int> fds;
  for (cmsghdr* c = n >= 0 ? CMSG_FIRSTHDR(&msg) : nullptr; c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); ++i) {
      int f;
      std::memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      fds.push_back(f);
    }
  }
  struct CloseFds {
    std::vector<int>& fds;
    ~CloseFds() {
      for (const int f : fds) close(f);
    }
  } close_fds{fds};
  if (n <= 0) {
    CloseConn(conn.fd);  // closed before binding
    return;
  }
  const std::string_view bytes(buf, std::min<size_t>(static_cast<size_t>(n), sizeof(buf)));
  if (static_cast<size_t>(n) == sizeof(v1::VmmRegionRequest)) {
    // More descriptors than a request may carry were cut (and closed by the kernel): malformed.
    HandleRegion(conn, bytes, (msg.msg_flags & MSG_CTRUNC) ? std::span<const int>() : std::span<const int>(fds),
                 (msg.msg_flags & MSG_CTRUNC) != 0);
  } else if (static_cast<size_t>(n) == sizeof(v1::AdminRequest)) {
    Status a = HandleAdmin(bytes, conn.peer);
    (void)SendBindReply(conn.fd, a, 0, -1);  // best effort: the peer may be gone
    CloseConn(conn.fd);
  } else if (static_cast<size_t>(n) == sizeof(v1::StoreAttachRequest)) {
    HandleAttach(conn, bytes);
  } else if (static_cast<size_t>(n) > sizeof(v1::BindRequest)) {
    RefuseBind(conn, Status::Rejected(Reason::kMalformed, "bind request is ", n, " bytes, expected ",
                                      sizeof(v1::BindRequest)));
  } else {
    HandleBind(conn, bytes);
  }
}

void SessionChannel::RefuseBind(Conn& conn, const Status& s) {
  // A peer can cause this at will: a bounded number of lines per interval.
  static LogThrottle refused(10, std::chrono::seconds(10));
  if (const auto v = refused.Next(); v.log) {
    spdlog::warn("session channel: bind refused for pid {} uid {}: {}{}", conn.peer.pid, conn.peer.uid, s.ToString(),
                 SuppressedNote(v.suppressed));
  }
  (void)SendBindReply(conn.fd, s, 0, -1);  // best effort: the peer may be gone
  CloseConn(conn.fd);
}

void SessionChannel::HandleBind(Conn& conn, std::string_view bytes) {
  const PeerCred peer = conn.peer;  // SO_PEERCRED is fixed at connect; read at accept
  std::shared_ptr<Session> session;
  if (Status s = manager_->Bind(bytes, peer, &session); !s.ok()) {
    RefuseBind(conn, s);
    return;
  }
  const int fd = conn.fd;
  Status sent = SendBindReply(fd, Status::Ok(), session->memory().bytes(), session->memory().fd());
  if (!sent.ok()) {
    CloseConn(fd);
    manager_->End(session->id(), Status::Rejected(Reason::kClosed, "session ", session->id(), ": ", sent.message()));
    return;
  }
  ForgetUnbound(conn);
  conn.session_id = session->id();
}

void SessionChannel::HandOver(Conn& conn, Status admitted, const char* what, const std::function<void(int)>& hand,
                              const std::function<void(int, const Status&)>& refuse) {
  if (admitted.ok()) {
    const int reply_fd = fcntl(conn.fd, F_DUPFD_CLOEXEC, 0);
    if (reply_fd >= 0) {
      hand(reply_fd);
      CloseConn(conn.fd);
      return;
    }
    const int err = errno;
    admitted = OutOfDescriptors(err)
                   ? Status::Rejected(Reason::kResourceExhausted, what, ": the daemon is out of descriptors (dup: ",
                                      std::strerror(err), ")")
                   : Status::Rejected(Reason::kInternal, what, ": dup: ", std::strerror(err));
  }
  static LogThrottle refused(10, std::chrono::seconds(10));  // any peer can ask
  if (const auto v = refused.Next(); v.log) {
    spdlog::warn("session channel: {} refused for pid {} uid {}: {}{}", what, conn.peer.pid, conn.peer.uid,
                 admitted.ToString(), SuppressedNote(v.suppressed));
  }
  refuse(conn.fd, admitted);  // best effort: the peer may be gone
  CloseConn(conn.fd);
}

void SessionChannel::HandleAttach(Conn& conn, std::string_view bytes) {
  std::shared_ptr<Session> session;
  std::string name;
  Status s = manager_->AdmitAttach(bytes, conn.peer, &session, &name);
  if (s.ok() && !attach_) s = Status::Rejected(Reason::kUnsupported, "this daemon has no weight store");
  HandOver(
      conn, s, "store attach", [&](int reply_fd) { attach_(std::move(session), std::move(name), reply_fd); },
      [](int fd, const Status& why) { (void)SendAttachReply(fd, why, v1::StoreAttachReply{}, -1); });
}

void SessionChannel::HandleRegion(Conn& conn, std::string_view bytes, std::span<const int> fds, bool truncated) {
  std::shared_ptr<Session> session;
  v1::VmmRegionRequest req;
  Status s = truncated ? Status::Rejected(Reason::kMalformed, "region request with more than ", v1::kMaxVmmChunks,
                                          " descriptors")
                       : manager_->AdmitVmmRegion(bytes, fds.size(), conn.peer, &session, &req);
  if (s.ok() && !region_) s = Status::Rejected(Reason::kUnsupported, "this daemon maps no client chunks");
  HandOver(
      conn, s, "region request", [&](int reply_fd) { region_(std::move(session), req, fds, reply_fd); },
      [](int fd, const Status& why) { (void)SendRegionReply(fd, why, 0, 0); });
}

void SessionChannel::OnReadable(Conn& conn) {
  if (conn.session_id == 0) {
    HandleFirstMessage(conn);
    return;
  }
  // Bound: the protocol has no further client messages; read to detect EOF.
  char buf[256];
  ssize_t n = recv(conn.fd, buf, sizeof(buf), MSG_DONTWAIT);
  if (n > 0 || (n < 0 && (errno == EAGAIN || errno == EINTR))) return;
  uint64_t id = conn.session_id;
  CloseConn(conn.fd);
  manager_->End(id, Status::Rejected(Reason::kClosed, "session ", id, ": session channel closed by the client"));
}

void SessionChannel::Loop() {
  auto next_tick = std::chrono::steady_clock::now() + tick_;
  epoll_event events[32];
  while (!stop_.load()) {
    auto now = std::chrono::steady_clock::now();
    int timeout_ms = static_cast<int>(
        std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(next_tick - now).count()));
    int n = epoll_wait(epoll_fd_, events, 32, timeout_ms);
    if (n < 0 && errno != EINTR) {
      spdlog::error("session channel: epoll_wait: {}", std::strerror(errno));
      break;
    }
    for (int i = 0; i < n; ++i) {
      int fd = events[i].data.fd;
      if (fd == wake_fd_) {
        uint64_t v;
        ssize_t r = read(wake_fd_, &v, sizeof(v));
        (void)r;
        continue;
      }
      if (fd == listen_fd_) {
        Accept();
        continue;
      }
      auto it = std::find_if(conns_.begin(), conns_.end(), [fd](const Conn& c) { return c.fd == fd; });
      if (it == conns_.end()) continue;
      if ((events[i].events & (EPOLLIN | EPOLLHUP | EPOLLRDHUP | EPOLLERR)) != 0) OnReadable(*it);
    }

    std::vector<uint64_t> closing;
    {
      std::lock_guard<std::mutex> lock(mu_);
      closing.swap(close_requests_);
    }
    for (uint64_t id : closing) {
      auto it = std::find_if(conns_.begin(), conns_.end(), [id](const Conn& c) { return c.session_id == id; });
      if (it != conns_.end()) CloseConn(it->fd);
    }
    if (stop_accepting_.load() && listen_fd_ >= 0) {
      if (!accept_paused_) epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, listen_fd_, nullptr);
      close(listen_fd_);
      listen_fd_ = -1;
    }

    now = std::chrono::steady_clock::now();
    if (now >= next_tick) {
      next_tick = now + tick_;
      const auto first_message = std::min<std::chrono::milliseconds>(
          limits_.first_message_timeout, std::chrono::milliseconds(manager_->bind_timeout_ms()));
      for (size_t i = 0; i < conns_.size();) {
        if (conns_[i].session_id == 0 && now >= conns_[i].deadline) {
          (void)SendBindReply(conns_[i].fd,
                              Status::Rejected(Reason::kBindTimeout, "no bind request within ",
                                               first_message.count(), " ms of connecting"),
                              0, -1);
          CloseConn(conns_[i].fd);
        } else {
          ++i;
        }
      }
      // Descriptors may have been freed since accept failed for want of them.
      ResumeAccepting();
      manager_->Tick(now);
    }
  }
}

}  // namespace cache_dit_opd
