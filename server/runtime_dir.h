// File: server/runtime_dir.h
//
// Where the daemon's sockets live (docs/DESIGN.md section 4) and how a socket path
// is claimed safely.
//
// Runtime dir, first that applies: --runtime-dir; $CACHE_DIT_OPD_RUNTIME_DIR;
// /run/cache-dit-opd when it is (or can be made) writable;
// ${XDG_RUNTIME_DIR:-/tmp}/cache-dit-opd. A directory the daemon creates gets
// mode 0770. Sockets: <dir>/<GPU-UUID>.sock (gRPC) and
// <dir>/<GPU-UUID>.session.sock (session channel); --socket PATH overrides
// the first and the second is PATH with ".sock" replaced by ".session.sock".
//
// Claiming a path: an instance lock (<grpc socket>.lock, flock) serializes
// daemons racing for the same GPU; then for each socket path: absent -> ok;
// a socket nobody accepts on (stale, left by a crash) -> removed; a socket
// someone accepts on -> FAILED_PRECONDITION ("another daemon is serving");
// anything that is not a socket -> FAILED_PRECONDITION (never deleted).
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "server/options.h"

namespace cache_dit_opd {

// The environment the runtime-dir rule reads, injectable for tests.
struct RuntimeDirEnv {
  std::string opd_runtime_dir;                 // $CACHE_DIT_OPD_RUNTIME_DIR ("" = unset)
  std::string xdg_runtime_dir;                 // $XDG_RUNTIME_DIR ("" = unset)
  std::string system_dir = "/run/cache-dit-opd";
  std::string fallback_base = "/tmp";          // used when XDG_RUNTIME_DIR is unset
};

RuntimeDirEnv RuntimeDirEnvFromProcess();

// ChooseRuntimeDir
//
// Applies the rule above (`flag_dir` is --runtime-dir, "" when unset) and
// creates the chosen directory when missing. FAILED_PRECONDITION naming the
// directory when it cannot be created or written.
Status ChooseRuntimeDir(const std::string& flag_dir, const RuntimeDirEnv& env, std::string* dir);

struct SocketPaths {
  std::string grpc;     // absolute path of the gRPC socket
  std::string session;  // absolute path of the session channel socket
  std::string lock;     // instance lock file
};

// SessionSocketPath: "/a/b.sock" -> "/a/b.session.sock"; "/a/b" -> "/a/b.session.sock".
std::string SessionSocketPath(const std::string& grpc_socket);

// ResolveSocketPaths
//
// --socket when given, else <ChooseRuntimeDir>/<gpu_uuid>.sock. With no
// --socket and no GPU (`gpu_uuid` empty) fails FAILED_PRECONDITION telling
// the user to pass --socket. INVALID_ARGUMENT when a path exceeds the
// sockaddr_un limit (107 bytes).
Status ResolveSocketPaths(const Options& opts, const std::string& gpu_uuid, const RuntimeDirEnv& env,
                          SocketPaths* out);

enum class SocketState { kAbsent, kStale, kLive, kNotASocket };

// Probes `path` by connecting with `sock_type` (SOCK_STREAM or
// SOCK_SEQPACKET); a connection refused means stale.
SocketState ProbeSocket(const std::string& path, int sock_type);

// PrepareSocketPath
//
// Makes `path` free for bind(): removes a stale socket, refuses a live one or
// a non-socket with FAILED_PRECONDITION naming the path.
Status PrepareSocketPath(const std::string& path, int sock_type);

// An exclusive flock on a lock file, held for the daemon's life. The file is
// left in place on release (removing it would race with the next daemon).
class InstanceLock {
 public:
  // FAILED_PRECONDITION when another process holds the lock.
  static Status Acquire(const std::string& path, std::unique_ptr<InstanceLock>* out);
  ~InstanceLock();
  InstanceLock(const InstanceLock&) = delete;
  InstanceLock& operator=(const InstanceLock&) = delete;

 private:
  explicit InstanceLock(int fd) : fd_(fd) {}
  int fd_;
};

}  // namespace cache_dit_opd
