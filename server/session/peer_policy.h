// File: server/session/peer_policy.h
//
// Who may bind a session on the session channel. The peer's identity comes
// from SO_PEERCRED (the kernel's record of the connecting process, not
// anything the peer says) and its groups from SO_PEERGROUPS. Admitted: the
// daemon's own uid, or, when --allowed-gid is given, a peer that has that
// group as its primary or as a supplementary group (as file permissions
// would). The pid is checked separately against OpenSession's client_pid
// (SessionManager::Bind).
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace cache_dit_opd {

struct PeerCred {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;              // effective, primary
  std::vector<gid_t> groups;  // supplementary, as the kernel recorded them at connect()
};

class PeerPolicy {
 public:
  PeerPolicy(uid_t own_uid, std::optional<gid_t> allowed_gid) : own_uid_(own_uid), allowed_gid_(allowed_gid) {}
  // The daemon's effective uid and --allowed-gid.
  static PeerPolicy ForThisProcess(std::optional<gid_t> allowed_gid);

  // PEER_REFUSED naming the peer's pid, uid, gid and groups when not admitted.
  Status Admit(const PeerCred& peer) const;
  // Admin requests (drain): root or the daemon's own uid only; --allowed-gid
  // admits clients, not operators.
  Status AdmitAdmin(const PeerCred& peer) const;

  uid_t own_uid() const { return own_uid_; }
  std::optional<gid_t> allowed_gid() const { return allowed_gid_; }

 private:
  uid_t own_uid_;
  std::optional<gid_t> allowed_gid_;
};

// Reads SO_PEERCRED and SO_PEERGROUPS of a connected Unix socket (a kernel
// without SO_PEERGROUPS, before Linux 4.13, leaves `groups` empty). INTERNAL
// on failure.
Status ReadPeerCred(int fd, PeerCred* out);

// The pid `pid` (as this process's PID namespace numbers it) has in its own,
// innermost PID namespace: the last field of /proc/<pid>/status "NSpid".
// Equal to `pid` for a process of this namespace; a client in a child
// namespace (a container, `unshare --pid`) knows itself by the inner one.
// SO_PEERCRED reports pid 0 for a peer outside this namespace's hierarchy:
// PEER_REFUSED saying so. PEER_REFUSED when /proc cannot tell.
Status InnermostPid(pid_t pid, pid_t* out);

// /proc/<pid>/cmdline with arguments joined by spaces, cut at `max_bytes`;
// "" when unreadable. For people (opdctl sessions), never for decisions.
// Reading it reads the process's memory, which that process can make block
// forever (argv in a FUSE-backed mapping): call it only for a process that
// could stop the caller anyway (the same uid).
std::string ReadCommandLine(pid_t pid, size_t max_bytes = 256);

// "[<name>]": /proc/<pid>/comm (at most 15 bytes, held by the kernel: never
// blocks), as ps shows a process whose arguments it does not read; "" when
// unreadable.
std::string ReadCommandName(pid_t pid);

}  // namespace cache_dit_opd
