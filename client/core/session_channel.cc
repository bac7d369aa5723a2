#include "client/core/session_channel.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "cache_dit_opd/v1/session_memory.h"

namespace cache_dit_opd::client {

namespace v1 = ::cache_dit_opd::v1;

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

Status ConnectSessionChannel(const std::string& path, UniqueFd* out) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return Status::InvalidArgument("session channel path '", path, "' is empty or longer than ",
                                   sizeof(addr.sun_path) - 1, " bytes");
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return Status::Internal("socket(AF_UNIX, SOCK_SEQPACKET): ", std::strerror(errno));
  int rc;
  do {
    rc = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    return Status::Unavailable("connect to session channel ", path, ": ", std::strerror(errno));
  }
  *out = std::move(fd);
  return Status::Ok();
}

namespace {

// The daemon's refusal in a reply of type R (BindReply, StoreAttachReply),
// prefixed with `what`; OK when status_code is 0.
template <typename R>
Status Refusal(const R& reply, const char* what) {
  if (reply.status_code == 0) return Status::Ok();
  const size_t len = strnlen(reply.message, sizeof(reply.message));
  const int code = reply.status_code;
  const auto sc = (code > 0 && code <= static_cast<int>(StatusCode::kUnavailable)) ? static_cast<StatusCode>(code)
                                                                                  : StatusCode::kUnknown;
  return Status(sc, std::string(what) + " refused by the daemon: " + std::string(reply.message, len),
                ReasonFromWire(reply.reason));
}

// Sends one request message and receives the one reply the daemon answers
// it with, of type R (or a BindReply refusal, which is how the daemon
// answers a connection it refuses before reading it). A refusal comes back
// as the daemon's status and reason, prefixed with `what`; on success
// `*reply` and `*fds` hold the reply and every descriptor that came with it
// (owned, so none leaks on an error path).
template <typename R>
Status Exchange(int fd, const void* request, size_t request_bytes, const char* what, int timeout_ms, R* reply,
                std::vector<UniqueFd>* fds) {
  ssize_t n;
  do {
    n = ::send(fd, request, request_bytes, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  // EPIPE / ECONNRESET: the daemon has already answered and closed (a
  // refusal at accept); its reply is still queued here, so read it.
  const bool peer_closed = n < 0 && (errno == EPIPE || errno == ECONNRESET);
  if (n != static_cast<ssize_t>(request_bytes) && !peer_closed) {
    return Status::Unavailable("send ", what, " request on the session channel: ",
                               n < 0 ? std::strerror(errno) : "short write");
  }

  pollfd p{fd, POLLIN, 0};
  int rc;
  do {
    rc = ::poll(&p, 1, timeout_ms);
  } while (rc < 0 && errno == EINTR);
  if (rc == 0) return Status::DeadlineExceeded("no reply to the ", what, " request within ", timeout_ms, " ms");
  if (rc < 0) return Status::Internal("poll(session channel): ", std::strerror(errno));

  // One byte more than the larger reply, so an oversized message shows up
  // as MSG_TRUNC or a longer read instead of passing as a valid reply.
  alignas(8) char buf[std::max(sizeof(R), sizeof(v1::BindReply)) + 1];
  constexpr int kMaxFds = 8;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)];
  iovec iov{buf, sizeof(buf)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  do {
    n = ::recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return Status::Unavailable("recvmsg(session channel): ", std::strerror(errno));

  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int f;
        std::memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        fds->emplace_back(f);
      }
    }
  }
  if (n == 0) {
    return Status::Unavailable("the daemon closed the session channel before replying to the ", what,
                               " request (session expired, wrong token, or daemon shutting down)");
  }
  if (!(msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) && sizeof(R) != sizeof(v1::BindReply) &&
      n == static_cast<ssize_t>(sizeof(v1::BindReply))) {
    v1::BindReply refused;  // refused before the request was read
    std::memcpy(&refused, buf, sizeof(refused));
    if (Status s = Refusal(refused, what); !s.ok()) return s;
    return Status::Internal("malformed reply to the ", what, " request: a bind reply that refuses nothing");
  }
  if (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC) || n != static_cast<ssize_t>(sizeof(R))) {
    return Status::Internal("malformed reply to the ", what, " request: ", n, " bytes (expected ", sizeof(R), ")",
                            (msg.msg_flags & MSG_CTRUNC) ? ", control data truncated" : "");
  }
  std::memcpy(reply, buf, sizeof(*reply));
  return Refusal(*reply, what);
}

}  // namespace

Status BindSession(int fd, uint64_t session_id, std::string_view token, int timeout_ms,
                   uint64_t expected_bytes, UniqueFd* memfd, uint64_t* shm_bytes) {
  if (token.size() != v1::kTokenBytes) {
    return Status::InvalidArgument("session token is ", token.size(), " bytes, expected ", v1::kTokenBytes);
  }
  v1::BindRequest req{};
  req.magic = v1::kBindRequestMagic;
  req.protocol_version = v1::kProtocolVersion;
  req.session_id = session_id;
  std::memcpy(req.token, token.data(), v1::kTokenBytes);
  v1::BindReply reply;
  std::vector<UniqueFd> fds;
  OPD_RETURN_IF_ERROR(Exchange(fd, &req, sizeof(req), "session bind", timeout_ms, &reply, &fds));
  if (reply.layout_version != v1::kLayoutVersion) {
    return Status::FailedPrecondition("daemon session memory layout version ", reply.layout_version,
                                      " is not the client's ", v1::kLayoutVersion);
  }
  if (fds.size() != 1) {
    return Status::Internal("BindReply carried ", fds.size(), " file descriptors, expected exactly 1");
  }
  if (expected_bytes != 0 && reply.shared_memory_bytes != expected_bytes) {
    return Status::Internal("BindReply announces ", reply.shared_memory_bytes,
                            " bytes of session memory, OpenSession announced ", expected_bytes);
  }
  *memfd = std::move(fds[0]);
  *shm_bytes = reply.shared_memory_bytes;
  return Status::Ok();
}

Status AttachStoreEntry(int fd, uint64_t session_id, std::string_view token, std::string_view name, int timeout_ms,
                        StoreAttachment* out) {
  if (token.size() != v1::kTokenBytes) {
    return Status::InvalidArgument("session token is ", token.size(), " bytes, expected ", v1::kTokenBytes);
  }
  if (name.empty() || name.size() > v1::kMaxStoreNameBytes) {
    return Status::InvalidArgument("store name of ", name.size(), " bytes (1 to ", v1::kMaxStoreNameBytes, ")");
  }
  v1::StoreAttachRequest req{};
  req.magic = v1::kStoreAttachMagic;
  req.protocol_version = v1::kProtocolVersion;
  req.session_id = session_id;
  std::memcpy(req.token, token.data(), v1::kTokenBytes);
  req.name_bytes = static_cast<uint32_t>(name.size());
  std::memcpy(req.name, name.data(), name.size());
  std::vector<UniqueFd> fds;
  OPD_RETURN_IF_ERROR(Exchange(fd, &req, sizeof(req), "store attach", timeout_ms, &out->reply, &fds));
  const v1::StoreAttachReply& r = out->reply;
  const size_t want = r.region_id == v1::kNoRegion ? 0 : 1;
  if (fds.size() != want || r.ndim > static_cast<uint32_t>(v1::kMaxTensorDims) ||
      (want == 1 && (r.offset > r.block_bytes || r.bytes > r.block_bytes - r.offset))) {
    return Status::Internal("malformed store attach reply: ", fds.size(), " descriptors for region ", r.region_id,
                            ", ", r.ndim, " dims, bytes [", r.offset, ", +", r.bytes, ") of a ", r.block_bytes,
                            "-byte block");
  }
  out->fd = want ? std::move(fds[0]) : UniqueFd();
  return Status::Ok();
}

Status RequestDrain(int fd, int timeout_ms) {
  v1::AdminRequest req{};
  req.magic = v1::kAdminRequestMagic;
  req.protocol_version = v1::kProtocolVersion;
  req.command = static_cast<uint32_t>(v1::AdminCommand::kDrain);
  v1::BindReply reply;
  std::vector<UniqueFd> fds;
  return Exchange(fd, &req, sizeof(req), "drain", timeout_ms, &reply, &fds);
}

}  // namespace cache_dit_opd::client
