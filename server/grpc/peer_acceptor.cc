#include "server/grpc/peer_acceptor.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <grpcpp/server_posix.h>
#include <spdlog/spdlog.h>

#include <cerrno>
#include <charconv>
#include <cstring>

#include "common/log_throttle.h"
#include "common/out_of_descriptors.h"
#include "server/session/unix_socket.h"

namespace cache_dit_opd {
namespace {

constexpr int kListenBacklog = 128;
// Out of descriptors, the pending connection stays queued and the socket
// readable: wait this long instead of polling it in a loop.
constexpr int kAcceptPauseMs = 100;

std::optional<ino_t> SocketInode(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return std::nullopt;
  return st.st_ino;
}

}  // namespace

void PeerTable::Record(int fd, ino_t ino, PeerCred peer) {
  std::lock_guard<std::mutex> lock(mu_);
  by_fd_[fd] = Entry{ino, std::move(peer)};
}

std::optional<PeerCred> PeerTable::Lookup(std::string_view grpc_peer) const {
  constexpr std::string_view kPrefix = "fd:";
  if (!grpc_peer.starts_with(kPrefix)) return std::nullopt;
  grpc_peer.remove_prefix(kPrefix.size());
  int fd = -1;
  const auto [end, ec] = std::from_chars(grpc_peer.data(), grpc_peer.data() + grpc_peer.size(), fd);
  if (ec != std::errc() || end != grpc_peer.data() + grpc_peer.size() || fd < 0) return std::nullopt;
  // Under the lock: Record (after accept4 made the descriptor) happens before.
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_fd_.find(fd);
  if (it == by_fd_.end() || SocketInode(fd) != it->second.ino) return std::nullopt;
  return it->second.peer;
}

PeerAcceptor::~PeerAcceptor() { Stop(); }

Status PeerAcceptor::Start(const std::string& path, grpc::Server* server, PeerTable* table) {
  path_ = path;
  server_ = server;
  table_ = table;
  Status s = ListenUnix(path, SOCK_STREAM, kListenBacklog, &listen_fd_, &created_);
  if (s.ok()) {
    wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake_fd_ < 0) s = Status::Internal("eventfd: ", std::strerror(errno));
  }
  if (!s.ok()) {
    Stop();
    return s;
  }
  thread_ = std::thread([this] { Loop(); });
  return Status::Ok();
}

void PeerAcceptor::Stop() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
    thread_.join();
  }
  if (listen_fd_ >= 0) close(listen_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
  listen_fd_ = wake_fd_ = -1;
  if (created_) unlink(path_.c_str());
  created_ = false;
}

void PeerAcceptor::Loop() {
  // A peer can cause each of these at will: a bounded number of lines per interval.
  static LogThrottle accept_failed(10, std::chrono::seconds(10));
  bool paused = false;
  while (true) {
    pollfd fds[2] = {{wake_fd_, POLLIN, 0}, {listen_fd_, POLLIN, 0}};
    if (poll(fds, paused ? 1 : 2, paused ? kAcceptPauseMs : -1) < 0 && errno != EINTR) return;
    if (fds[0].revents & POLLIN) return;
    paused = false;
    if (!(fds[1].revents & POLLIN)) continue;
    while (true) {
      const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd >= 0) {
        AcceptOne(fd);
        continue;
      }
      const int err = errno;
      if (err == EAGAIN || err == EINTR || err == ECONNABORTED) break;
      paused = OutOfDescriptors(err);
      if (const auto v = accept_failed.Next(); v.log) {
        spdlog::warn("gRPC socket: accept: {}{}{}", std::strerror(err),
                     paused ? fmt::format("; not accepting for {} ms", kAcceptPauseMs) : "",
                     SuppressedNote(v.suppressed));
      }
      break;
    }
  }
}

void PeerAcceptor::AcceptOne(int fd) {
  static LogThrottle unreadable(10, std::chrono::seconds(10));
  PeerCred peer;
  Status s = ReadPeerCred(fd, &peer);
  const std::optional<ino_t> ino = s.ok() ? SocketInode(fd) : std::nullopt;
  if (!ino) {
    if (const auto v = unreadable.Next(); v.log) {
      spdlog::warn("gRPC socket: a connection closed unread: {}{}", s.ok() ? "not a socket" : s.ToString(),
                   SuppressedNote(v.suppressed));
    }
    close(fd);
    return;
  }
  // Recorded before gRPC sees the connection, so its first call finds it.
  table_->Record(fd, *ino, std::move(peer));
  grpc::AddInsecureChannelFromFd(server_, fd);
}

}  // namespace cache_dit_opd
