// cache-dit-opd-launcher: parse -> find the daemon -> find the GPUs ->
// supervise (admin/launcher/launcher.h has the contract).
#include <cstdio>
#include <string>

#include "admin/launcher/launcher.h"

int main(int argc, char** argv) {
  namespace l = cache_dit_opd::launcher;
  l::LauncherOptions opts;
  bool help = false;
  cache_dit_opd::Status s = l::ParseLauncherOptions(argc, argv, &opts, &help);
  if (!s.ok()) {
    std::fprintf(stderr, "cache-dit-opd-launcher: %s\n%s", s.message().c_str(), l::LauncherUsage().c_str());
    return l::kExitUsage;
  }
  if (help) {
    std::fputs(l::LauncherHelp().c_str(), stdout);
    return l::kExitOk;
  }
  std::string daemon;
  if (s = l::ResolveDaemonBinary(opts.daemon, &daemon); !s.ok()) {
    std::fprintf(stderr, "cache-dit-opd-launcher: %s\n", s.message().c_str());
    return l::kExitUsage;
  }
  // Before RunLauncher blocks any signal: nvidia-smi starts with the mask
  // the launcher was given.
  if (opts.gpus.empty()) {
    if (s = l::EnumerateGpus(&opts.gpus); !s.ok()) {
      std::fprintf(stderr, "cache-dit-opd-launcher: %s\n", s.message().c_str());
      return l::kExitUsage;
    }
  }
  if (s = l::CheckGpuCount(opts, opts.gpus.size()); !s.ok()) {
    std::fprintf(stderr, "cache-dit-opd-launcher: %s\n%s", s.message().c_str(), l::LauncherUsage().c_str());
    return l::kExitUsage;
  }
  return l::RunLauncher(opts, daemon);
}
