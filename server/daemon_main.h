// File: server/daemon_main.h
//
// The daemon process: parse flags -> probe the device -> claim the sockets ->
// start -> wait for a signal -> drain -> exit. RunDaemon is the whole of the
// cache-dit-opd binary's main (server/main.cc), written against a
// DeviceBackend so that the same process, flags, sockets, gRPC service,
// session channel, rings and executor also run on fake device operations
// (tests/fake_daemon/, the real daemon under the Python client's CPU tests).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/call.h"
#include "common/status.h"
#include "server/device/device_ops.h"
#include "server/device/region_opener.h"
#include "server/device/store_memory.h"
#include "server/exec/call_runner.h"

namespace cache_dit_opd {

// What a daemon process runs its calls on.
class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  // Probes --device. Never fails hard: `ok` false and `reason` say why the
  // daemon will not serve.
  virtual DeviceInfo Probe(int device) = 0;
  // The device seams for a usable `device`; an error makes the daemon run
  // NOT_SERVING with its message.
  virtual Status Open(const DeviceInfo& device, std::unique_ptr<DeviceOps>* ops,
                      std::unique_ptr<RegionOpener>* opener) = 0;
  // Loads an extra op library (--load-library) before the catalog is read.
  virtual Status LoadOpLibrary(const std::string& path) = 0;
  // The ops the daemon serves, sorted by (name, overload).
  virtual std::vector<OpInfo> ListOps() = 0;
  // Runs the calls; valid once Open succeeded, lives as long as the backend.
  virtual CallRunner* runner() = 0;
  // The weight store's memory on the opened device (null: no store); valid
  // once Open succeeded, lives as long as the backend.
  virtual StoreAllocator* store_allocator() = 0;
};

// RunDaemon
//
// The process's main: returns its exit status (0 after a signal, 1 after a
// fatal error such as a sticky CUDA error, 2 for bad flags or sockets).
int RunDaemon(int argc, char** argv, DeviceBackend& backend);

}  // namespace cache_dit_opd
