// File: server/grpc/peer_acceptor.h
//
// Who is on the other end of a gRPC call. gRPC over a Unix socket reports no
// peer credentials (its peer string is "unix:<path>"; grpc/grpc#15511), so
// the daemon accepts the gRPC socket's connections itself:
//   - PeerAcceptor listens on the socket (mode 0660) on one thread, reads
//     each connection's SO_PEERCRED / SO_PEERGROUPS (fixed by the kernel at
//     connect(), nothing the peer says) and hands the connection to gRPC
//     (grpc::AddInsecureChannelFromFd), which names it "fd:<n>" in the
//     call's peer(). Who may connect at all is the socket's file mode; who
//     may open a session, the PeerPolicy (SessionManager::Open).
//   - PeerTable maps that name back to the credentials read at accept.
//
// Why a name is not stale while a call of its connection runs: gRPC closes a
// connection's descriptor only when its transport is destroyed, which waits
// for the connection's last call, so <n> names no other socket meanwhile.
// Lookup also checks that <n> is still the socket it recorded (its inode),
// so a descriptor number reused by anything else is never taken for a peer.
#pragma once

#include <sys/types.h>

#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>

#include "common/status.h"
#include "server/session/peer_policy.h"

namespace grpc {
class Server;
}

namespace cache_dit_opd {

class PeerTable {
 public:
  // The connection `fd` (its socket's inode `ino`) was accepted from `peer`.
  void Record(int fd, ino_t ino, PeerCred peer);
  // The credentials of the connection a call's peer() names; nullopt for a
  // name that is not "fd:<n>" of a connection this table recorded.
  std::optional<PeerCred> Lookup(std::string_view grpc_peer) const;

 private:
  struct Entry {
    ino_t ino;
    PeerCred peer;
  };
  mutable std::mutex mu_;
  std::map<int, Entry> by_fd_;  // an entry is replaced when its number is accepted again
};

class PeerAcceptor {
 public:
  PeerAcceptor() = default;
  ~PeerAcceptor();
  PeerAcceptor(const PeerAcceptor&) = delete;
  PeerAcceptor& operator=(const PeerAcceptor&) = delete;

  // PeerAcceptor::Start
  //
  // Listens on `path` (free: see PrepareSocketPath) and accepts for `server`
  // (started, and outliving Stop), recording each peer in `table`, until
  // Stop. Errors: ListenUnix's.
  Status Start(const std::string& path, grpc::Server* server, PeerTable* table);
  // Stops accepting, joins the thread and removes the socket file;
  // connections already handed to gRPC stay gRPC's. Idempotent.
  void Stop();

 private:
  void Loop();
  void AcceptOne(int fd);

  std::string path_;
  grpc::Server* server_ = nullptr;
  PeerTable* table_ = nullptr;
  int listen_fd_ = -1;
  int wake_fd_ = -1;
  bool created_ = false;
  std::thread thread_;
};

}  // namespace cache_dit_opd
