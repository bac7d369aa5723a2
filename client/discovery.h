// File: client/discovery.h
//
// Finding the daemon that serves a GPU. The daemon picks its own runtime dir
// and binds `<GPU-UUID>.sock` there (docs/DESIGN.md section 4); a client never
// applies that rule itself. It looks for an existing socket, in this order:
//
//   1. CACHE_DIT_OPD_ADDRESS   overrides everything: a socket path or a
//                              `unix:` URI, used as given (not checked here)
//   2. $CACHE_DIT_OPD_RUNTIME_DIR/<GPU-UUID>.sock
//   3. /run/cache-dit-opd/<GPU-UUID>.sock
//   4. $XDG_RUNTIME_DIR/cache-dit-opd/<GPU-UUID>.sock
//   5. /tmp/cache-dit-opd/<GPU-UUID>.sock
//
// The first candidate that exists and is a Unix socket wins. Unset or empty
// variables are skipped. GPUs are named by UUID, never by ordinal: ordinals
// change under CUDA_VISIBLE_DEVICES.
//
//   std::string uuid;
//   OPD_RETURN_IF_ERROR(DeviceUuid(0, &uuid));       // "GPU-5f1c...-..."
//   DaemonAddress addr;
//   OPD_RETURN_IF_ERROR(FindDaemon(uuid, DiscoveryEnv::FromEnvironment(), &addr));
//   auto channel = grpc::CreateChannel(addr.target, ...);
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace cache_dit_opd::client {

// DiscoveryEnv
//
// The inputs of discovery, read from the environment by FromEnvironment()
// and set directly by tests. Empty means unset.
struct DiscoveryEnv {
  std::string address;          // CACHE_DIT_OPD_ADDRESS
  std::string runtime_dir;      // CACHE_DIT_OPD_RUNTIME_DIR
  std::string xdg_runtime_dir;  // XDG_RUNTIME_DIR
  std::string system_dir = "/run/cache-dit-opd";
  std::string tmp_dir = "/tmp/cache-dit-opd";

  static DiscoveryEnv FromEnvironment();
};

// DaemonAddress
//
// Where to reach a daemon. `target` is a gRPC target ("unix:/abs/path" or the
// override verbatim); `socket_path` is the filesystem path when there is one
// ("" for unix-abstract: targets); `source` says which rule found it, for
// error messages ("CACHE_DIT_OPD_ADDRESS", "/run/cache-dit-opd", ...).
struct DaemonAddress {
  std::string target;
  std::string socket_path;
  std::string source;
};

// DeviceUuid
//
// UUID of CUDA device `device` of this process, from
// cudaGetDeviceProperties().uuid. UNAVAILABLE when there is no such device
// or no driver.
Status DeviceUuid(int device, std::string* uuid);

// AddressFromOverride
//
// Turns a CACHE_DIT_OPD_ADDRESS value into a DaemonAddress: "unix:..." and
// "unix-abstract:..." are used verbatim; a bare path becomes "unix:<path>".
// INVALID_ARGUMENT for other URI schemes (the daemon listens only on Unix
// sockets) and for an empty value.
Status AddressFromOverride(std::string_view value, DaemonAddress* out);

// DaemonSearchDirs
//
// The directories searched for `<GPU-UUID>.sock`, in order (rules 2-5
// above; unset variables skipped, duplicates kept once).
std::vector<std::string> DaemonSearchDirs(const DiscoveryEnv& env);

// FindDaemon
//
// Applies the rules above for `gpu_uuid`. NOT_FOUND when no socket exists;
// the message lists every path tried and how to start a daemon.
// INVALID_ARGUMENT when `gpu_uuid` is not a GPU UUID.
Status FindDaemon(std::string_view gpu_uuid, const DiscoveryEnv& env, DaemonAddress* out);

}  // namespace cache_dit_opd::client
