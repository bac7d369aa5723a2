#include "server/runtime_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace cache_dit_opd {
namespace {

constexpr size_t kMaxSocketPath = sizeof(sockaddr_un{}.sun_path) - 1;

std::string Getenv(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

bool IsWritableDir(const std::string& dir) {
  struct stat st;
  return stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && access(dir.c_str(), W_OK | X_OK) == 0;
}

// Creates `dir` (one level) with mode 0770 when missing; ok when it exists
// and is writable.
Status EnsureDir(const std::string& dir) {
  if (IsWritableDir(dir)) return Status::Ok();
  if (mkdir(dir.c_str(), 0770) != 0 && errno != EEXIST) {
    return Status::FailedPrecondition("cannot create runtime dir ", dir, ": ", std::strerror(errno));
  }
  // mkdir's mode went through the umask; group members need to reach the sockets.
  chmod(dir.c_str(), 0770);
  if (!IsWritableDir(dir)) {
    return Status::FailedPrecondition("runtime dir ", dir, " is not a writable directory");
  }
  return Status::Ok();
}

std::string Absolute(const std::string& path) {
  if (!path.empty() && path[0] == '/') return path;
  char cwd[4096];
  if (getcwd(cwd, sizeof(cwd)) == nullptr) return path;
  return std::string(cwd) + "/" + path;
}

}  // namespace

RuntimeDirEnv RuntimeDirEnvFromProcess() {
  RuntimeDirEnv env;
  env.opd_runtime_dir = Getenv("CACHE_DIT_OPD_RUNTIME_DIR");
  env.xdg_runtime_dir = Getenv("XDG_RUNTIME_DIR");
  return env;
}

Status ChooseRuntimeDir(const std::string& flag_dir, const RuntimeDirEnv& env, std::string* dir) {
  if (!flag_dir.empty()) {
    OPD_RETURN_IF_ERROR(EnsureDir(flag_dir));
    *dir = Absolute(flag_dir);
    return Status::Ok();
  }
  if (!env.opd_runtime_dir.empty()) {
    OPD_RETURN_IF_ERROR(EnsureDir(env.opd_runtime_dir));
    *dir = Absolute(env.opd_runtime_dir);
    return Status::Ok();
  }
  if (EnsureDir(env.system_dir).ok()) {
    *dir = env.system_dir;
    return Status::Ok();
  }
  std::string base = env.xdg_runtime_dir.empty() ? env.fallback_base : env.xdg_runtime_dir;
  std::string candidate = base + "/cache-dit-opd";
  OPD_RETURN_IF_ERROR(EnsureDir(candidate));
  *dir = Absolute(candidate);
  return Status::Ok();
}

std::string SessionSocketPath(const std::string& grpc_socket) {
  const std::string suffix = ".sock";
  if (grpc_socket.size() > suffix.size() &&
      grpc_socket.compare(grpc_socket.size() - suffix.size(), suffix.size(), suffix) == 0) {
    return grpc_socket.substr(0, grpc_socket.size() - suffix.size()) + ".session.sock";
  }
  return grpc_socket + ".session.sock";
}

Status ResolveSocketPaths(const Options& opts, const std::string& gpu_uuid, const RuntimeDirEnv& env,
                          SocketPaths* out) {
  std::string grpc;
  if (!opts.socket.empty()) {
    grpc = Absolute(opts.socket);
  } else {
    if (gpu_uuid.empty()) {
      return Status::FailedPrecondition(
          "no usable GPU, so the socket cannot be named after its UUID; pass --socket PATH to serve "
          "version and health only");
    }
    std::string dir;
    OPD_RETURN_IF_ERROR(ChooseRuntimeDir(opts.runtime_dir, env, &dir));
    grpc = dir + "/" + gpu_uuid + ".sock";
  }
  out->grpc = grpc;
  out->session = SessionSocketPath(grpc);
  out->lock = grpc + ".lock";
  for (const std::string* p : {&out->grpc, &out->session}) {
    if (p->size() > kMaxSocketPath) {
      return Status::InvalidArgument("socket path ", *p, " is ", p->size(), " bytes; Unix sockets allow ",
                                     kMaxSocketPath);
    }
  }
  return Status::Ok();
}

SocketState ProbeSocket(const std::string& path, int sock_type) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return SocketState::kAbsent;
  if (!S_ISSOCK(st.st_mode)) return SocketState::kNotASocket;
  int fd = socket(AF_UNIX, sock_type | SOCK_CLOEXEC, 0);
  if (fd < 0) return SocketState::kLive;  // cannot tell: be safe, never delete
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  int rc = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  int err = errno;
  close(fd);
  if (rc == 0) return SocketState::kLive;
  // ECONNREFUSED: nobody listens. EPROTOTYPE: a listener of another socket
  // type is alive there.
  return err == ECONNREFUSED ? SocketState::kStale : SocketState::kLive;
}

Status PrepareSocketPath(const std::string& path, int sock_type) {
  switch (ProbeSocket(path, sock_type)) {
    case SocketState::kAbsent:
      return Status::Ok();
    case SocketState::kNotASocket:
      return Status::FailedPrecondition(path, " exists and is not a socket; refusing to replace it");
    case SocketState::kLive:
      return Status::FailedPrecondition("another daemon is serving ", path,
                                        " (a connection was accepted); stop it first");
    case SocketState::kStale:
      if (unlink(path.c_str()) != 0 && errno != ENOENT) {
        return Status::FailedPrecondition("cannot remove stale socket ", path, ": ", std::strerror(errno));
      }
      return Status::Ok();
  }
  return Status::Ok();
}

Status InstanceLock::Acquire(const std::string& path, std::unique_ptr<InstanceLock>* out) {
  int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0660);
  if (fd < 0) return Status::FailedPrecondition("cannot open lock file ", path, ": ", std::strerror(errno));
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    int err = errno;
    close(fd);
    if (err == EWOULDBLOCK) {
      return Status::FailedPrecondition("another daemon holds ", path, "; it serves the same socket");
    }
    return Status::FailedPrecondition("flock ", path, ": ", std::strerror(err));
  }
  out->reset(new InstanceLock(fd));
  return Status::Ok();
}

InstanceLock::~InstanceLock() {
  if (fd_ >= 0) close(fd_);  // releases the flock
}

}  // namespace cache_dit_opd
