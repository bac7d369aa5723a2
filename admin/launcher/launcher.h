// File: admin/launcher/launcher.h
//
// `cache-dit-opd-launcher`: one supervisor per node for hosts and containers
// without systemd. It starts one `cache-dit-opd` per GPU, restarts a daemon
// that fails, and stops them all on SIGTERM/SIGINT/SIGHUP. The contract:
//
//   - GPU i of the list (--gpus, else every GPU nvidia-smi lists) gets a
//     daemon with CUDA_VISIBLE_DEVICES=<its UUID> (so inside it the GPU is
//     device 0: the UUID, not an ordinal, is what survives reordering) and
//     the arguments `--device 0 [--metrics-address HOST:<base+i>]
//     <daemon flags after -->`, HOST being --metrics-host (default
//     127.0.0.1; an IPv6 address is given bare and bracketed by the
//     launcher: `--metrics-host fd00::5` -> [fd00::5]:<base+i>). Its sockets
//     are then <runtime dir>/<UUID>.sock and <UUID>.session.sock, the names
//     clients look for.
//   - a daemon that exits 0 has drained on purpose and is not restarted; one
//     that exits non-zero or dies of a signal is restarted after a backoff
//     (Backoff below).
//   - SIGTERM, SIGINT or SIGHUP: SIGTERM to every running daemon (each drains
//     within its own --drain-deadline-ms), pending restarts cancelled, wait
//     for all; a second signal is logged and ignored. The launcher exits
//     when no daemon runs and none is due to restart.
//   - exit status: 0 when every daemon running at the stop exited 0 (or,
//     without a stop, when every daemon exited 0 by itself); 1 when one of
//     them failed during the stop; 2 for a usage error (kExitUsage). A
//     daemon that was waiting for a restart when the stop came was already
//     reported as failed and does not count: nothing of it was running.
//   - every event is one line on stderr naming the GPU UUID.
//
// Nothing runs in signal context: the signals are blocked and read from a
// signalfd, SIGCHLD included, by one thread that also keeps the restart
// timers (RunLauncher). Parsing, the backoff policy and the child's command
// line are plain functions so tests need no processes.
//
//   LauncherOptions opts;
//   bool help = false;
//   Status s = ParseLauncherOptions(argc, argv, &opts, &help);
//   if (!s.ok()) { fprintf(stderr, "%s\n%s", s.message().c_str(), LauncherUsage().c_str()); return 2; }
//   ... ResolveDaemonBinary, EnumerateGpus when opts.gpus is empty, CheckGpuCount ...
//   return RunLauncher(opts, daemon_path);
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace cache_dit_opd::launcher {

inline constexpr int kExitOk = 0;
inline constexpr int kExitChildFailed = 1;
inline constexpr int kExitUsage = 2;

struct LauncherOptions {
  std::string daemon;                  // --daemon: the daemon binary; "" = ResolveDaemonBinary's default
  std::vector<std::string> gpus;       // --gpus: GPU UUIDs, in order; empty = EnumerateGpus
  std::string metrics_host = "127.0.0.1";  // --metrics-host: as given (IPv6 bare; DaemonArgs brackets it)
  uint32_t metrics_port_base = 9464;   // --metrics-port-base: GPU i gets <metrics_host>:<base+i>; 0 = no flag
  uint32_t backoff_initial_ms = 500;   // --backoff-initial-ms: delay before the first restart
  uint32_t backoff_max_ms = 30000;     // --backoff-max-ms: the doubling stops here
  uint32_t stable_ms = 60000;          // --stable-ms: an uptime this long resets the failure count
  std::vector<std::string> daemon_flags;  // everything after `--`, passed to every daemon unchanged
};

// ParseLauncherOptions
//
// Accepts `--flag value` and `--flag=value`; everything after `--` is a
// daemon flag. Sets `*help` for -h/--help. INVALID_ARGUMENT naming the flag
// and the value on an unknown flag, a missing or malformed value, a value out
// of range, a --gpus entry that is not a GPU UUID (or named twice), a
// --metrics-host that CheckMetricsHost refuses or that comes with
// --metrics-port-base 0 (there is no address to give it to), or a daemon
// flag the launcher sets itself (--device, --socket: every daemon would
// claim the same socket; --metrics-address unless --metrics-port-base 0).
Status ParseLauncherOptions(int argc, const char* const* argv, LauncherOptions* opts, bool* help);

// "GPU-a,GPU-b" -> {"GPU-a", "GPU-b"}; each must pass IsGpuUuid, none twice
// (case-insensitively: two daemons on one GPU would fight for its socket).
Status ParseGpuList(std::string_view text, std::vector<std::string>* out);

// nvidia-smi's `--query-gpu=uuid --format=csv,noheader` output -> the UUIDs,
// one per non-empty line (whitespace trimmed). INVALID_ARGUMENT naming a line
// that is not a GPU UUID; NOT_FOUND when there is none.
Status ParseNvidiaSmiUuids(std::string_view output, std::vector<std::string>* out);

// EnumerateGpus
//
// Every GPU of the node, by running `nvidia-smi --query-gpu=uuid
// --format=csv,noheader` (from PATH). NOT_FOUND when nvidia-smi is missing,
// fails, or lists no GPU; the message says which and suggests --gpus. The one
// place that knows how GPUs are found: replace it (NVML, /proc/driver/nvidia)
// without touching the rest.
Status EnumerateGpus(std::vector<std::string>* out);

// ResolveDaemonBinary
//
// `flag` (--daemon) when given: a name without '/' is looked up on PATH.
// Otherwise `cache-dit-opd` next to the launcher's own executable
// (/proc/self/exe: an image keeps all binaries in one bin/), else on PATH.
// NOT_FOUND (naming where it looked) when there is no executable file.
Status ResolveDaemonBinary(const std::string& flag, std::string* out);

// CheckMetricsHost
//
// A --metrics-host value: a host name or IPv4 address (letters, digits, '.',
// '-', '_'), or an IPv6 address WITHOUT brackets (inet_pton AF_INET6; the
// launcher adds the brackets, so $(POD_IP) from the downward API works
// unchanged on IPv4 and IPv6 clusters). INVALID_ARGUMENT naming the value
// when it is empty, holds a space or another character outside that set,
// is bracketed ("[::1]": give ::1), or holds ':' without being an IPv6
// address ("host:9464": the port comes from --metrics-port-base).
Status CheckMetricsHost(std::string_view host);

// INVALID_ARGUMENT when `gpu_count` GPUs need metrics ports past 65535.
Status CheckGpuCount(const LauncherOptions& opts, size_t gpu_count);

// The daemon's arguments for GPU number `index` (0-based), argv[0] excluded:
// --device 0, --metrics-address <metrics_host>:<base+index> when base > 0
// ("[<metrics_host>]:<base+index>" for an IPv6 metrics_host), then
// opts.daemon_flags.
std::vector<std::string> DaemonArgs(const LauncherOptions& opts, size_t index);

// Backoff
//
// The restart delay of one GPU's daemon: `initial_ms` after the first failure,
// doubled for each consecutive failure, at most `max_ms`. A daemon that had
// stayed up at least `stable_ms` before it failed starts the count again
// (its failure is a first one).
//
//   Backoff b(500, 30000, 60000);
//   b.OnFailure(10)     -> 500
//   b.OnFailure(10)     -> 1000
//   b.OnFailure(60000)  -> 500   (it had been stable)
class Backoff {
 public:
  Backoff(uint32_t initial_ms, uint32_t max_ms, uint32_t stable_ms)
      : initial_ms_(initial_ms), max_ms_(max_ms), stable_ms_(stable_ms) {}

  // A failure after `uptime_ms` of running: the delay before the restart.
  uint32_t OnFailure(uint64_t uptime_ms);
  // Consecutive failures so far (after OnFailure: 1 for a first failure).
  uint32_t failures() const { return failures_; }

 private:
  uint32_t initial_ms_;
  uint32_t max_ms_;
  uint32_t stable_ms_;
  uint32_t failures_ = 0;
};

// RunLauncher
//
// Supervises one daemon (`daemon_path`, resolved) per entry of opts.gpus
// until all have exited and none is due to restart; returns the exit status
// (kExitOk or kExitChildFailed). Blocks SIGTERM, SIGINT, SIGHUP and SIGCHLD
// in the calling thread, which must be the process's only thread (a signal
// sent to the process could otherwise go to another thread, and
// PR_SET_PDEATHSIG follows the thread that forked), and ignores SIGPIPE.
int RunLauncher(const LauncherOptions& opts, const std::string& daemon_path);

// The --help text, and the one-line usage.
std::string LauncherHelp();
std::string LauncherUsage();

}  // namespace cache_dit_opd::launcher
