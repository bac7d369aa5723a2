#include "client/discovery.h"

#include <cuda_runtime_api.h>
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "common/cuda/device_guard.h"
#include "common/cuda/driver_api.h"
#include "common/gpu_uuid.h"

namespace cache_dit_opd::client {
namespace {

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

std::string JoinPath(const std::string& dir, const std::string& name) {
  if (!dir.empty() && dir.back() == '/') return dir + name;
  return dir + "/" + name;
}

}  // namespace

DiscoveryEnv DiscoveryEnv::FromEnvironment() {
  DiscoveryEnv env;
  env.address = Env("CACHE_DIT_OPD_ADDRESS");
  env.runtime_dir = Env("CACHE_DIT_OPD_RUNTIME_DIR");
  env.xdg_runtime_dir = Env("XDG_RUNTIME_DIR");
  return env;
}

Status DeviceUuid(int device, std::string* uuid) {
  cudaDeviceProp prop{};
  cudaError_t err = cudaGetDeviceProperties(&prop, device);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Status::Unavailable("cudaGetDeviceProperties(", device, "): ", cuda::RuntimeErrorString(err));
  }
  *uuid = FormatGpuUuid(reinterpret_cast<const uint8_t*>(prop.uuid.bytes));
  return Status::Ok();
}

Status AddressFromOverride(std::string_view value, DaemonAddress* out) {
  if (value.empty()) return Status::InvalidArgument("CACHE_DIT_OPD_ADDRESS is empty");
  DaemonAddress a;
  a.source = "CACHE_DIT_OPD_ADDRESS";
  if (value.rfind("unix-abstract:", 0) == 0) {
    a.target = std::string(value);
  } else if (value.rfind("unix:", 0) == 0) {
    a.target = std::string(value);
    std::string_view path = value.substr(5);
    // gRPC accepts unix:/abs, unix:rel and unix:///abs.
    if (path.rfind("//", 0) == 0) path.remove_prefix(2);
    a.socket_path = std::string(path);
  } else if (value.find("://") != std::string_view::npos ||
             value.rfind("dns:", 0) == 0 || value.rfind("ipv4:", 0) == 0 ||
             value.rfind("ipv6:", 0) == 0 || value.rfind("vsock:", 0) == 0) {
    return Status::InvalidArgument("CACHE_DIT_OPD_ADDRESS '", value,
                                   "' is not a Unix socket path or unix: URI; the daemon listens "
                                   "only on Unix sockets");
  } else {
    a.socket_path = std::string(value);
    a.target = "unix:" + a.socket_path;
  }
  *out = std::move(a);
  return Status::Ok();
}

std::vector<std::string> DaemonSearchDirs(const DiscoveryEnv& env) {
  std::vector<std::string> dirs;
  auto add = [&](const std::string& d) {
    if (d.empty()) return;
    for (const auto& have : dirs) {
      if (have == d) return;
    }
    dirs.push_back(d);
  };
  add(env.runtime_dir);
  add(env.system_dir);
  if (!env.xdg_runtime_dir.empty()) add(JoinPath(env.xdg_runtime_dir, "cache-dit-opd"));
  add(env.tmp_dir);
  return dirs;
}

Status FindDaemon(std::string_view gpu_uuid, const DiscoveryEnv& env, DaemonAddress* out) {
  if (!env.address.empty()) return AddressFromOverride(env.address, out);
  if (!IsGpuUuid(gpu_uuid)) {
    return Status::InvalidArgument("'", gpu_uuid,
                                   "' is not a GPU UUID (expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-"
                                   "xxxxxxxxxxxx, as nvidia-smi -L prints it)");
  }
  const std::string name = std::string(gpu_uuid) + ".sock";
  std::ostringstream tried;
  for (const std::string& dir : DaemonSearchDirs(env)) {
    const std::string path = JoinPath(dir, name);
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
      tried << "\n  " << path << " (absent)";
      continue;
    }
    if (!S_ISSOCK(st.st_mode)) {
      tried << "\n  " << path << " (exists but is not a socket)";
      continue;
    }
    out->socket_path = path;
    out->target = "unix:" + path;
    out->source = dir;
    return Status::Ok();
  }
  return Status::NotFound("no cache-dit-opd daemon socket for ", gpu_uuid, "; tried:", tried.str(),
                          "\nStart one with `cache-dit-opd --device <ordinal>` (or the systemd "
                          "unit), or set CACHE_DIT_OPD_ADDRESS to its socket path");
}

}  // namespace cache_dit_opd::client
