#include "server/session/peer_policy.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

namespace cache_dit_opd {

PeerPolicy PeerPolicy::ForThisProcess(std::optional<gid_t> allowed_gid) {
  return PeerPolicy(geteuid(), allowed_gid);
}

namespace {
std::string GroupList(const std::vector<gid_t>& groups) {
  std::string out = "[";
  for (size_t i = 0; i < groups.size(); ++i) out += (i ? ", " : "") + std::to_string(groups[i]);
  return out + "]";
}
}  // namespace

Status PeerPolicy::Admit(const PeerCred& peer) const {
  if (peer.uid == own_uid_) return Status::Ok();
  if (allowed_gid_ && (peer.gid == *allowed_gid_ ||
                       std::find(peer.groups.begin(), peer.groups.end(), *allowed_gid_) != peer.groups.end())) {
    return Status::Ok();
  }
  if (allowed_gid_) {
    return Status::Rejected(Reason::kPeerRefused, "peer pid ", peer.pid, " (uid ", peer.uid, ", gid ", peer.gid,
                            ", groups ", GroupList(peer.groups), ") is neither the daemon's uid ", own_uid_,
                            " nor in --allowed-gid ", *allowed_gid_);
  }
  return Status::Rejected(Reason::kPeerRefused, "peer pid ", peer.pid, " (uid ", peer.uid, ", gid ", peer.gid,
                          ") is not the daemon's uid ", own_uid_,
                          "; start the daemon with --allowed-gid to admit a group");
}

Status PeerPolicy::AdmitAdmin(const PeerCred& peer) const {
  if (peer.uid == 0 || peer.uid == own_uid_) return Status::Ok();
  return Status::Rejected(Reason::kPeerRefused, "admin request from pid ", peer.pid, " (uid ", peer.uid,
                          ") refused: only root and the daemon's uid ", own_uid_, " may drain it");
}

Status ReadPeerCred(int fd, PeerCred* out) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return Status::Rejected(Reason::kInternal, "getsockopt(SO_PEERCRED): ", std::strerror(errno));
  }
  *out = PeerCred{cred.pid, cred.uid, cred.gid, {}};
  // The kernel answers ERANGE with the size it needs (the peer's groups are
  // fixed at connect(), so the second call fits).
  std::vector<gid_t> groups(16);
  for (int attempt = 0; attempt < 2; ++attempt) {
    socklen_t glen = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
    if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &glen) == 0) {
      groups.resize(glen / sizeof(gid_t));
      out->groups = std::move(groups);
      return Status::Ok();
    }
    if (errno == ENOPROTOOPT) return Status::Ok();  // before Linux 4.13: the primary gid alone decides
    if (errno != ERANGE) {
      return Status::Rejected(Reason::kInternal, "getsockopt(SO_PEERGROUPS): ", std::strerror(errno));
    }
    groups.resize(glen / sizeof(gid_t));
  }
  return Status::Rejected(Reason::kInternal, "getsockopt(SO_PEERGROUPS): the group list kept growing");
}

Status InnermostPid(pid_t pid, pid_t* out) {
  if (pid <= 0) {
    return Status::Rejected(Reason::kPeerRefused, "the peer is outside the daemon's PID namespace (SO_PEERCRED pid ",
                            pid, "): run the daemon in the PID namespace of its clients or an ancestor of it "
                            "(a container: hostPID)");
  }
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("NSpid:", 0) != 0) continue;
    std::istringstream fields(line.substr(6));
    long last = -1;
    for (long v; fields >> v;) last = v;
    if (last <= 0) break;
    *out = static_cast<pid_t>(last);
    return Status::Ok();
  }
  return Status::Rejected(Reason::kPeerRefused, "cannot read the PID namespace of peer pid ", pid,
                          " from /proc/", pid, "/status");
}

namespace {

// Up to `max_bytes` of /proc/<pid>/<file>, trailing NULs and newlines dropped,
// inner NULs as spaces, other control characters as '?' (no control
// characters into a terminal).
std::string ReadProcText(pid_t pid, const char* file, size_t max_bytes) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/" + file, std::ios::binary);
  std::string text(max_bytes, '\0');
  in.read(text.data(), static_cast<std::streamsize>(max_bytes));
  text.resize(static_cast<size_t>(in.gcount()));
  while (!text.empty() && (text.back() == '\0' || text.back() == '\n')) text.pop_back();
  for (char& c : text) {
    if (c == '\0') c = ' ';
    else if (static_cast<unsigned char>(c) < 0x20) c = '?';
  }
  return text;
}

}  // namespace

std::string ReadCommandLine(pid_t pid, size_t max_bytes) { return ReadProcText(pid, "cmdline", max_bytes); }

std::string ReadCommandName(pid_t pid) {
  std::string name = ReadProcText(pid, "comm", 64);
  return name.empty() ? name : "[" + name + "]";
}

}  // namespace cache_dit_opd
