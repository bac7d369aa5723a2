#include "server/options.h"

#include <grp.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <limits>
#include <string_view>

#include "common/flags.h"

namespace cache_dit_opd {
namespace {

Status ParseGid(const std::string& text, gid_t* out) {
  uint64_t v = 0;
  if (ParseUnsigned("--allowed-gid", text, 0, std::numeric_limits<gid_t>::max() - 1, &v).ok()) {
    *out = static_cast<gid_t>(v);
    return Status::Ok();
  }
  struct group grp;
  struct group* found = nullptr;
  char buf[16384];
  if (getgrnam_r(text.c_str(), &grp, buf, sizeof(buf), &found) == 0 && found != nullptr) {
    *out = found->gr_gid;
    return Status::Ok();
  }
  return Status::InvalidArgument("--allowed-gid: '", text, "' is neither a gid nor a known group name");
}

const char* kLogLevels[] = {"trace", "debug", "info", "warn", "error", "critical", "off"};

}  // namespace

Status CheckMetricsAddress(const std::string& address) {
  if (address.empty()) return Status::Ok();
  const size_t colon = address.rfind(':');
  const std::string host = colon == std::string::npos ? "" : address.substr(0, colon);
  const std::string port = colon == std::string::npos ? "" : address.substr(colon + 1);
  const bool bracketed = host.size() >= 2 && host.front() == '[' && host.back() == ']';
  const bool host_ok = !host.empty() && (bracketed || host.find(':') == std::string::npos);
  const bool port_ok = !port.empty() && port.size() <= 5 &&
                       std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
                       std::stoul(port) >= 1 && std::stoul(port) <= 65535;
  if (!host_ok || !port_ok) {
    return Status::InvalidArgument("--metrics-address '", address,
                                   "': expected HOST:PORT (e.g. 127.0.0.1:9464, [::1]:9464, 0.0.0.0:9464) or \"\"");
  }
  return Status::Ok();
}

Status ParseByteSize(const std::string& text, uint64_t* out) {
  if (text.empty()) return Status::InvalidArgument("empty size");
  std::string digits = text;
  uint64_t mult = 1;
  char last = text.back();
  switch (last) {
    case 'k': case 'K': mult = 1ull << 10; break;
    case 'm': case 'M': mult = 1ull << 20; break;
    case 'g': case 'G': mult = 1ull << 30; break;
    case 't': case 'T': mult = 1ull << 40; break;
    default: break;
  }
  if (mult != 1) digits.pop_back();
  uint64_t v = 0;
  Status s = ParseUnsigned("size", digits, 0, std::numeric_limits<uint64_t>::max(), &v);
  if (!s.ok()) return Status::InvalidArgument("'", text, "' is not a byte size (e.g. 4096, 64M, 2G)");
  if (v > std::numeric_limits<uint64_t>::max() / mult) {
    return Status::InvalidArgument("'", text, "' overflows 64 bits");
  }
  *out = v * mult;
  return Status::Ok();
}

Status ParseOptions(int argc, const char* const* argv, Options* opts, bool* help) {
  *help = false;
  FlagArgs args(argc, argv);
  while (args.Next()) {
    const std::string& arg = args.arg();
    if (arg == "-h" || arg == "--help") {
      *help = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0) {
      return Status::InvalidArgument("unexpected argument '", arg, "' (flags start with --)");
    }
    const std::string& flag = args.flag();
    std::string value;
    auto next = [&] { return args.Value(&value); };
    if (flag == "--device") {
      OPD_RETURN_IF_ERROR(next());
      OPD_RETURN_IF_ERROR(ParseUnsigned(flag, value, 0, 1023, &opts->device));
    } else if (flag == "--socket") {
      OPD_RETURN_IF_ERROR(next());
      if (value.empty()) return Status::InvalidArgument("--socket: empty path");
      opts->socket = value;
    } else if (flag == "--runtime-dir") {
      OPD_RETURN_IF_ERROR(next());
      if (value.empty()) return Status::InvalidArgument("--runtime-dir: empty path");
      opts->runtime_dir = value;
    } else if (flag == "--log-level") {
      OPD_RETURN_IF_ERROR(next());
      bool known = false;
      for (const char* l : kLogLevels) known |= (value == l);
      if (!known) {
        return Status::InvalidArgument("--log-level: '", value,
                                       "' is not one of trace, debug, info, warn, error, critical, off");
      }
      opts->log_level = value;
    } else if (flag == "--max-sessions") {
      OPD_RETURN_IF_ERROR(next());
      OPD_RETURN_IF_ERROR(ParseUnsigned(flag, value, 1, 1u << 16, &opts->max_sessions));
    } else if (flag == "--max-sessions-per-uid") {
      OPD_RETURN_IF_ERROR(next());
      OPD_RETURN_IF_ERROR(ParseUnsigned(flag, value, 0, 1u << 16, &opts->max_sessions_per_uid));
    } else if (flag == "--max-lanes") {
      OPD_RETURN_IF_ERROR(next());
      OPD_RETURN_IF_ERROR(ParseUnsigned(flag, value, 1, 1024, &opts->max_lanes));
    } else if (flag == "--max-regions") {
      OPD_RETURN_IF_ERROR(next());
      OPD_RETURN_IF_ERROR(ParseUnsigned(flag, value, 1, 1u << 20, &opts->max_regions));
    } else if (flag == "--max-mapped-bytes") {
      OPD_RETURN_IF_ERROR(next());
      Status s = ParseByteSize(value, &opts->max_mapped_bytes);
      if (!s.ok()) return Status::InvalidArgument("--max-mapped-bytes: ", s.message());
      if (opts->max_mapped_bytes == 0) return Status::InvalidArgument("--max-mapped-bytes: must be > 0");
    } else if (flag == "--max-store-bytes") {
      OPD_RETURN_IF_ERROR(next());
      Status s = ParseByteSize(value, &opts->max_store_bytes);
      if (!s.ok()) return Status::InvalidArgument("--max-store-bytes: ", s.message());
    } else if (flag == "--max-store-entries") {
      OPD_RETURN_IF_ERROR(next());
      OPD_RETURN_IF_ERROR(ParseUnsigned(flag, value, 1, 1u << 20, &opts->max_store_entries));
    } else if (flag == "--max-message-bytes") {
      OPD_RETURN_IF_ERROR(next());
      uint64_t v = 0;
      Status s = ParseByteSize(value, &v);
      if (!s.ok()) return Status::InvalidArgument("--max-message-bytes: ", s.message());
      if (v < 4096 || v > (1ull << 30)) {
        return Status::InvalidArgument("--max-message-bytes: ", v, " is out of range [4096, 1G]");
      }
      opts->max_message_bytes = v;
    } else if (flag == "--drain-deadline-ms") {
      OPD_RETURN_IF_ERROR(next());
      OPD_RETURN_IF_ERROR(ParseUnsigned(flag, value, 0, 3600000, &opts->drain_deadline_ms));
    } else if (flag == "--bind-timeout-ms") {
      OPD_RETURN_IF_ERROR(next());
      OPD_RETURN_IF_ERROR(ParseUnsigned(flag, value, 1, 3600000, &opts->bind_timeout_ms));
    } else if (flag == "--allowed-gid") {
      OPD_RETURN_IF_ERROR(next());
      gid_t gid = 0;
      OPD_RETURN_IF_ERROR(ParseGid(value, &gid));
      opts->allowed_gid = gid;
    } else if (flag == "--ring" || flag == "--no-ring") {
      if (args.has_inline_value()) {
        OPD_RETURN_IF_ERROR(next());
        return Status::InvalidArgument(flag, " takes no value (got '", value, "')");
      }
      opts->ring = flag == "--ring";
    } else if (flag == "--ring-capacity") {
      OPD_RETURN_IF_ERROR(next());
      OPD_RETURN_IF_ERROR(ParseUnsigned(flag, value, 8, 1024, &opts->ring_capacity));
      if ((opts->ring_capacity & (opts->ring_capacity - 1)) != 0) {
        return Status::InvalidArgument(flag, ": ", opts->ring_capacity, " is not a power of two");
      }
    } else if (flag == "--spin-us") {
      OPD_RETURN_IF_ERROR(next());
      OPD_RETURN_IF_ERROR(ParseUnsigned(flag, value, 0, 100000, &opts->spin_us));
    } else if (flag == "--executor-threads") {
      OPD_RETURN_IF_ERROR(next());
      OPD_RETURN_IF_ERROR(ParseUnsigned(flag, value, 1, 16, &opts->executor_threads));
    } else if (flag == "--parking-slots") {
      OPD_RETURN_IF_ERROR(next());
      OPD_RETURN_IF_ERROR(ParseUnsigned(flag, value, 0, 32, &opts->parking_slots));
    } else if (flag == "--park-busy-lanes") {
      OPD_RETURN_IF_ERROR(next());
      OPD_RETURN_IF_ERROR(ParseUnsigned(flag, value, 0, 4096, &opts->park_busy_lanes));
    } else if (flag == "--park-deadline-ms") {
      OPD_RETURN_IF_ERROR(next());
      OPD_RETURN_IF_ERROR(ParseUnsigned(flag, value, 1, 3600000, &opts->park_deadline_ms));
    } else if (flag == "--calls-ahead") {
      OPD_RETURN_IF_ERROR(next());
      OPD_RETURN_IF_ERROR(ParseUnsigned(flag, value, 1, 64, &opts->calls_ahead));
    } else if (flag == "--held-calls") {
      OPD_RETURN_IF_ERROR(next());
      OPD_RETURN_IF_ERROR(ParseUnsigned(flag, value, 1, 4096, &opts->held_calls));
    } else if (flag == "--memory-trim-ms") {
      OPD_RETURN_IF_ERROR(next());
      OPD_RETURN_IF_ERROR(ParseUnsigned(flag, value, 0, 3600000, &opts->memory_trim_ms));
    } else if (flag == "--metrics-address") {
      OPD_RETURN_IF_ERROR(next());
      OPD_RETURN_IF_ERROR(CheckMetricsAddress(value));
      opts->metrics_address = value;
      opts->metrics_address_given = true;
    } else if (flag == "--load-library") {
      OPD_RETURN_IF_ERROR(next());
      if (value.empty()) return Status::InvalidArgument("--load-library: empty path");
      opts->load_libraries.push_back(value);
    } else {
      return Status::InvalidArgument("unknown flag '", flag, "'");
    }
  }
  return Status::Ok();
}

std::string OptionsUsage() {
  return "usage: cache-dit-opd [--device N] [--socket PATH] [--runtime-dir DIR] [--log-level LEVEL]\n"
         "                     [--max-sessions N] [--max-sessions-per-uid N] [--max-lanes N] [--max-regions N]\n"
         "                     [--max-mapped-bytes SIZE] [--max-store-bytes SIZE] [--max-store-entries N]\n"
         "                     [--max-message-bytes SIZE]\n"
         "                     [--drain-deadline-ms MS] [--bind-timeout-ms MS] [--allowed-gid GID]\n"
         "                     [--load-library PATH]... [--ring | --no-ring] [--ring-capacity N]\n"
         "                     [--spin-us US] [--executor-threads N] [--parking-slots N]\n"
         "                     [--park-busy-lanes N] [--park-deadline-ms MS] [--calls-ahead N]\n"
         "                     [--held-calls N]\n"
         "                     [--memory-trim-ms MS]\n"
         "                     [--metrics-address HOST:PORT] ; see --help\n";
}

std::string OptionsHelp() {
  return OptionsUsage() +
         "\n"
         "cache-dit-opd: the operator daemon. Owns one GPU and serves the cache_dit_cuda_ops\n"
         "operators to client processes over gRPC on a Unix socket; client tensors are mapped\n"
         "with CUDA IPC and never copied.\n"
         "\n"
         "Flags (--flag VALUE or --flag=VALUE; SIZE takes K, M, G, T suffixes, powers of 1024):\n"
         "  --device N               CUDA ordinal to serve, as this process sees it (default 0).\n"
         "  --socket PATH            gRPC socket path. Default: <runtime dir>/<GPU-UUID>.sock.\n"
         "                           The session channel is the same path with .sock replaced by\n"
         "                           .session.sock. Required when no GPU is usable (the daemon then\n"
         "                           only answers GetVersion and reports health NOT_SERVING).\n"
         "  --runtime-dir DIR        Directory for the sockets. Default: $CACHE_DIT_OPD_RUNTIME_DIR,\n"
         "                           else /run/cache-dit-opd when writable, else\n"
         "                           ${XDG_RUNTIME_DIR:-/tmp}/cache-dit-opd (created mode 0770).\n"
         "  --log-level LEVEL        trace, debug, info, warn, error, critical or off (default info).\n"
         "  --max-sessions N         Open sessions at once (default 64).\n"
         "  --max-sessions-per-uid N Sessions one uid may hold at once, bound or being opened\n"
         "                           (default 0: no cap but --max-sessions); for a daemon\n"
         "                           several users share.\n"
         "  --max-lanes N            Lanes (client streams) per session (default 16).\n"
         "  --max-regions N          Mapped regions per session (default 4096); idle regions are\n"
         "                           evicted least recently used first.\n"
         "  --max-mapped-bytes SIZE  Bytes mapped per session (default 1T).\n"
         "  --max-store-bytes SIZE   Device bytes the weight store may hold for all clients\n"
         "                           (default 0: no store; e.g. 16G).\n"
         "  --max-store-entries N    Entries the weight store may hold for all clients, in\n"
         "                           [1, 1048576] (default 16384): each costs the daemon host\n"
         "                           memory, and an empty tensor no device bytes.\n"
         "  --max-message-bytes SIZE Largest gRPC request a client may send (default 64K; the\n"
         "                           largest request of the protocol is ~21K: no tensor travels by\n"
         "                           value). Replies may be up to max(SIZE, 4M). gRPC buffers at most\n"
         "                           max(64M, 16 x SIZE) for all clients together.\n"
         "  --drain-deadline-ms MS   On SIGTERM/SIGINT, time given to in-flight calls before the\n"
         "                           remaining ones are dropped and sessions are ended (default 5000).\n"
         "  --bind-timeout-ms MS     A session not bound on the session channel within this time is\n"
         "                           dropped (default 5000).\n"
         "  --allowed-gid GID        Also admit session-channel peers in group GID, primary or\n"
         "                           supplementary (number or group name); by default only the\n"
         "                           daemon's own uid is admitted.\n"
         "  --load-library PATH      Load an extra op library (dlopen; its TORCH_LIBRARY\n"
         "                           registrations add ops). Repeatable.\n"
         "  --ring, --no-ring        Offer (default) or not the shared-memory call ring: a session\n"
         "                           that asks for it gets call records in and completions out in\n"
         "                           its shared memory (proto/cache_dit_opd/v1/ring.h); gRPC Call\n"
         "                           keeps working either way.\n"
         "  --ring-capacity N        Slots of each session's call ring, a power of two in\n"
         "                           [8, 1024] (default 64; about 2.3 KiB of shared memory each).\n"
         "  --spin-us US             After its last call, an executor thread busy-polls this long\n"
         "                           before sleeping on its sessions' futex doorbells. Default 200;\n"
         "                           0 sleeps at once. Waking a sleeping thread costs tens of\n"
         "                           microseconds per call; an idle daemon uses no CPU.\n"
         "  --executor-threads N     Threads that poll the sessions' call rings and launch their\n"
         "                           calls, in [1, 16] (default 1). Each session is served by one,\n"
         "                           the one with the fewest sessions when it starts; more threads\n"
         "                           serve more busy clients at once, each busy one costing a core.\n"
         "                           The parking slots are split between them.\n"
         "  --parking-slots N        Lanes that may have a GPU wait on their client's inputs parked\n"
         "                           at once, in [0, 32] (default 8; at most a quarter of\n"
         "                           CUDA_DEVICE_MAX_CONNECTIONS, which the daemon sets to 32).\n"
         "                           Such a lane's calls are launched as soon as they are decoded;\n"
         "                           other lanes' calls wait on the host until their inputs are\n"
         "                           ready. 0: every call waits on the host, one GPU memory\n"
         "                           operation fewer a call: more calls/s for many busy launch-\n"
         "                           bound clients, fewer for one (deploy/README.md, MPS).\n"
         "  --park-busy-lanes N      Launch ahead only while at most N lanes (over every executor\n"
         "                           thread) have calls queued or on the GPU, in [0, 4096]\n"
         "                           (default 3; 0: no limit). With more, every call waits on the\n"
         "                           host: a parked wait costs the GPU a memory operation per call,\n"
         "                           which many busy lanes pay for more than the host check.\n"
         "  --park-deadline-ms MS    A parked lane whose inputs are behind and whose stream has\n"
         "                           finished nothing for MS gives up its slot when another lane\n"
         "                           needs one; its session ends with INPUTS_STALLED (default 2000).\n"
         "  --calls-ahead N          Calls a lane may have on the GPU beyond what its stream has\n"
         "                           finished, in [1, 64] (default 32); later ones wait in the\n"
         "                           daemon. Bounds a lane stream's command queue.\n"
         "  --held-calls N           Decoded calls a session may have waiting in the daemon, in\n"
         "                           [1, 4096] (default 256); beyond it the client's calls wait in\n"
         "                           its own ring, so a client far ahead of the GPU costs the\n"
         "                           daemon no memory; a gRPC call beyond it is refused with\n"
         "                           RESOURCE_EXHAUSTED.\n"
         "  --memory-trim-ms MS      Every MS, give memory freed since (more than 16M of it, e.g.\n"
         "                           after a burst of oversized requests) back to the kernel with\n"
         "                           malloc_trim (default 10000; 0: never).\n"
         "  --metrics-address HOST:PORT\n"
         "                           Serve Prometheus metrics at http://HOST:PORT/metrics (default\n"
         "                           127.0.0.1:9464; \"\" turns it off; GetVersion reports it). When\n"
         "                           the default port is taken (a\n"
         "                           second daemon on the node) the daemon serves without metrics and\n"
         "                           says so; an address given here that cannot be bound is an error.\n"
         "                           Names and labels: server/metrics/metrics_exporter.h.\n"
         "  -h, --help               Print this help and exit.\n"
         "\n"
         "Sockets are created mode 0660. A stale socket (nobody accepts on it) is replaced; a live\n"
         "one makes the daemon refuse to start. SIGTERM/SIGINT drain and exit 0; a sticky CUDA\n"
         "error fails every session and exits non-zero so that a supervisor restarts the daemon.\n";
}

}  // namespace cache_dit_opd
