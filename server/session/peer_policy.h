// File: server/session/peer_policy.h
//
// Who may bind a session on the session channel. The peer's identity comes
// from SO_PEERCRED (the kernel's record of the connecting process, not
// anything the peer says). Admitted: the daemon's own uid, or, when
// --allowed-gid is given, a peer whose gid equals it. The pid is checked
// separately against OpenSession's client_pid (SessionManager::Bind).
#pragma once

#include <sys/types.h>

#include <optional>

#include "common/status.h"

namespace cache_dit_opd {

struct PeerCred {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

class PeerPolicy {
 public:
  PeerPolicy(uid_t own_uid, std::optional<gid_t> allowed_gid) : own_uid_(own_uid), allowed_gid_(allowed_gid) {}
  // The daemon's effective uid and --allowed-gid.
  static PeerPolicy ForThisProcess(std::optional<gid_t> allowed_gid);

  // PERMISSION_DENIED naming the peer's pid, uid and gid when not admitted.
  Status Admit(const PeerCred& peer) const;

  uid_t own_uid() const { return own_uid_; }
  std::optional<gid_t> allowed_gid() const { return allowed_gid_; }

 private:
  uid_t own_uid_;
  std::optional<gid_t> allowed_gid_;
};

// Reads SO_PEERCRED of a connected Unix socket. INTERNAL on failure.
Status ReadPeerCred(int fd, PeerCred* out);

}  // namespace cache_dit_opd
