#include "server/session/peer_policy.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace cache_dit_opd {

PeerPolicy PeerPolicy::ForThisProcess(std::optional<gid_t> allowed_gid) {
  return PeerPolicy(geteuid(), allowed_gid);
}

Status PeerPolicy::Admit(const PeerCred& peer) const {
  if (peer.uid == own_uid_) return Status::Ok();
  if (allowed_gid_ && peer.gid == *allowed_gid_) return Status::Ok();
  if (allowed_gid_) {
    return Status::Rejected(Reason::kPeerRefused, "peer pid ", peer.pid, " (uid ", peer.uid, ", gid ", peer.gid,
                                    ") is neither the daemon's uid ", own_uid_, " nor in --allowed-gid ",
                                    *allowed_gid_);
  }
  return Status::Rejected(Reason::kPeerRefused, "peer pid ", peer.pid, " (uid ", peer.uid, ", gid ", peer.gid,
                                  ") is not the daemon's uid ", own_uid_,
                                  "; start the daemon with --allowed-gid to admit a group");
}

Status ReadPeerCred(int fd, PeerCred* out) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return Status::Internal("getsockopt(SO_PEERCRED): ", std::strerror(errno));
  }
  *out = PeerCred{cred.pid, cred.uid, cred.gid};
  return Status::Ok();
}

}  // namespace cache_dit_opd
