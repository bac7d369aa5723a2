#include "server/session/unix_socket.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace cache_dit_opd {

Status ListenUnix(const std::string& path, int type, int backlog, int* fd, bool* created) {
  *fd = -1;
  *created = false;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) return Status::InvalidArgument("socket path ", path, " is too long");
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  const int s = socket(AF_UNIX, type | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (s < 0) return Status::Internal("socket(AF_UNIX) for ", path, ": ", std::strerror(errno));
  // The file's mode comes from the umask at bind(): 0660 from the first
  // moment rather than fixed afterwards (chmod after would leave a window).
  const mode_t old = umask(0117);
  const int rc = bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const int err = errno;
  umask(old);
  if (rc != 0) {
    close(s);
    return Status::Internal("bind(", path, "): ", std::strerror(err));
  }
  *created = true;
  chmod(path.c_str(), 0660);
  if (listen(s, backlog) != 0) {
    const int lerr = errno;
    close(s);
    return Status::Internal("listen(", path, "): ", std::strerror(lerr));
  }
  *fd = s;
  return Status::Ok();
}

}  // namespace cache_dit_opd
