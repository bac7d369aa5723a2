// The daemon process (server/daemon_main.h): parse -> probe -> claim sockets
// -> start -> wait -> drain -> exit.
#include "server/daemon_main.h"

#include <algorithm>

#include <sys/socket.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include <spdlog/spdlog.h>

#include "server/daemon.h"
#include "server/grpc/grpc_server.h"
#include "server/grpc/grpc_service.h"
#include "server/logging.h"
#include "server/memory_trim.h"
#include "server/options.h"
#include "server/runtime_dir.h"
#include "server/metrics/metrics_exporter.h"
#include "server/signals.h"

#ifndef CACHE_DIT_OPD_VERSION
#define CACHE_DIT_OPD_VERSION "0.0.0"
#endif
#ifndef CACHE_DIT_OPD_GIT_COMMIT
#define CACHE_DIT_OPD_GIT_COMMIT ""
#endif
#ifndef CACHE_DIT_TORCH_VERSION
#define CACHE_DIT_TORCH_VERSION ""
#endif

namespace cache_dit_opd {

int RunDaemon(int argc, char** argv, DeviceBackend& backend) {
  // Before any thread exists, so every thread inherits the mask.
  BlockShutdownSignals();

  Options opts;
  bool help = false;
  Status s = ParseOptions(argc, argv, &opts, &help);
  if (!s.ok()) {
    std::fprintf(stderr, "cache-dit-opd: %s\n%s", s.message().c_str(), OptionsUsage().c_str());
    return 2;
  }
  if (help) {
    std::fputs(OptionsHelp().c_str(), stdout);
    return 0;
  }
  if (Status ls = InitLogging(opts.log_level); !ls.ok()) {
    std::fprintf(stderr, "cache-dit-opd: %s\n", ls.message().c_str());
    return 2;
  }

  DeviceInfo dev = backend.Probe(opts.device);
  if (dev.ok) {
    spdlog::info("device {}: {} {} (CUDA runtime {}, driver {})", dev.index, dev.name, dev.uuid,
                 dev.runtime_version, dev.driver_version);
    // Parked waits stall every stream once they approach the hardware
    // queues (server/exec/executor.h): at most a quarter of them.
    if (dev.connections > 0) {
      const uint32_t cap = static_cast<uint32_t>(std::max(1, dev.connections / 4));
      if (opts.parking_slots > cap) {
        spdlog::warn("--parking-slots {} lowered to {}: {} hardware work queues (CUDA_DEVICE_MAX_CONNECTIONS)",
                     opts.parking_slots, cap, dev.connections);
        opts.parking_slots = cap;
      }
    }
    const std::string busy =
        opts.park_busy_lanes == 0 ? "any number of" : "at most " + std::to_string(opts.park_busy_lanes);
    spdlog::info("launch ahead: {} parking slot(s) while {} lanes are busy, {} hardware work queues, "
                 "park deadline {} ms",
                 opts.parking_slots, busy, dev.connections, opts.park_deadline_ms);
  } else {
    spdlog::warn("not serving: {}", dev.reason);
  }

  for (const std::string& lib : opts.load_libraries) {
    if (Status l = backend.LoadOpLibrary(lib); !l.ok()) {
      spdlog::error("--load-library {}: {}", lib, l.message());
      return 2;
    }
    spdlog::info("loaded op library {}", lib);
  }
  std::vector<OpInfo> catalog = backend.ListOps();
  spdlog::info("serving {} op overload(s) of cache_dit_cuda_ops", catalog.size());
  for (const OpInfo& op : catalog) spdlog::info("  op {}", op.schema);
  if (catalog.empty()) spdlog::warn("no op is registered in cache_dit_cuda_ops; calls will fail NOT_FOUND");

  SocketPaths paths;
  if (Status p = ResolveSocketPaths(opts, dev.ok ? dev.uuid : "", RuntimeDirEnvFromProcess(), &paths); !p.ok()) {
    spdlog::error("{}", p.message());
    return 2;
  }
  std::unique_ptr<InstanceLock> lock;
  if (Status l = InstanceLock::Acquire(paths.lock, &lock); !l.ok()) {
    spdlog::error("{}", l.message());
    return 2;
  }
  if (Status p = PrepareSocketPath(paths.grpc, SOCK_STREAM); !p.ok()) {
    spdlog::error("{}", p.message());
    return 2;
  }
  if (Status p = PrepareSocketPath(paths.session, SOCK_SEQPACKET); !p.ok()) {
    spdlog::error("{}", p.message());
    return 2;
  }

  std::unique_ptr<DeviceOps> device_ops;
  std::unique_ptr<RegionOpener> opener;
  DaemonDeps deps;
  std::string not_serving = dev.ok ? "" : dev.reason;
  if (dev.ok) {
    if (Status d = backend.Open(dev, &device_ops, &opener); !d.ok()) {
      not_serving = d.message();
    } else {
      deps = DaemonDeps{device_ops.get(), opener.get(), backend.runner(), backend.store_allocator()};
    }
  }

  DaemonInfo info;
  info.daemon_version = CACHE_DIT_OPD_VERSION;
  info.git_commit = CACHE_DIT_OPD_GIT_COMMIT;
  info.torch_version = CACHE_DIT_TORCH_VERSION;
  info.cuda_runtime_version = dev.runtime_version;
  info.cuda_driver_version = dev.driver_version;
  info.device_index = dev.ok ? dev.index : -1;
  info.gpu_uuid = dev.ok ? dev.uuid : "";
  info.gpu_name = dev.ok ? dev.name : "";

  Daemon daemon(opts, info, std::move(catalog), not_serving, deps, paths.session);
  if (Status d = daemon.Start(); !d.ok()) {
    spdlog::error("session channel: {}", d.message());
    return 2;
  }
  // Metrics before gRPC, so a fatal bind failure has nothing to shut down.
  MetricsExporter metrics(&daemon);
  if (!opts.metrics_address.empty()) {
    if (Status m = metrics.Start(opts.metrics_address); m.ok()) {
      daemon.set_metrics_address(metrics.address());
      spdlog::info("metrics: http://{}/metrics", metrics.address());
    } else if (opts.metrics_address_given) {
      spdlog::error("{}", m.message());
      daemon.Stop();
      return 2;
    } else {
      // The default port is one per node; the second daemon there still serves.
      spdlog::warn("{} (the default --metrics-address): serving without metrics; give each daemon its own "
                   "--metrics-address, or \"\" to turn metrics off", m.message());
    }
  }
  PeerTable grpc_peers;
  OperatorDaemonService service(&daemon, &grpc_peers);
  GrpcServer server;
  if (Status g = server.Start(paths.grpc, opts.max_message_bytes, &service, daemon.serving(), &grpc_peers);
      !g.ok()) {
    spdlog::error("{}", g.message());
    daemon.Stop();
    return 2;
  }
  daemon.SetHealthListener([&server](bool serving) { server.SetServing(serving); });
  if (opts.ring) {
    spdlog::info("call ring offered: {} slots per session, spin {} us", opts.ring_capacity, opts.spin_us);
  } else {
    spdlog::info("call ring not offered (--no-ring): sessions use gRPC Call");
  }
  spdlog::info("cache-dit-opd {} (pid {}) listening: gRPC unix:{}, session channel {}; health {}{}",
               CACHE_DIT_OPD_VERSION, getpid(), paths.grpc, paths.session,
               daemon.serving() ? "SERVING" : "NOT_SERVING",
               daemon.serving() ? "" : " (" + daemon.not_serving_reason() + ")");

  // Freed memory back to the kernel after bursts (server/memory_trim.h).
  MemoryTrimmer trimmer{std::chrono::milliseconds(opts.memory_trim_ms)};
  if (opts.memory_trim_ms > 0) trimmer.Start();

  SignalWaiter signals;
  signals.Start([&daemon](int sig) {
    daemon.RequestShutdown(0, sig == SIGINT ? "SIGINT" : sig == SIGHUP ? "SIGHUP" : "SIGTERM");
  });

  const int exit_code = daemon.WaitForShutdownRequest();
  daemon.Drain();
  // Every call has completed by now (drained or dropped); what is left
  // in gRPC are cheap handlers.
  server.Shutdown(std::chrono::milliseconds(200));
  daemon.SetHealthListener(nullptr);
  metrics.Stop();
  daemon.Stop();
  signals.Stop();
  trimmer.Stop();
  spdlog::info("cache-dit-opd exiting with status {}", exit_code);
  spdlog::shutdown();
  if (exit_code != 0) {
    // After a sticky CUDA error the context is unusable: skip destructors
    // that would call into it, and let the supervisor restart us.
    std::_Exit(exit_code);
  }
  return 0;
}

}  // namespace cache_dit_opd
