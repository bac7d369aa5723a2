// File: server/options.h
//
// Command-line options of `cache-dit-opd`. Each field has its default inline;
// `--help` (OptionsHelp) documents every flag. Parsing never exits the
// process: main decides what to do with the result.
//
//   Options opts;
//   bool help = false;
//   Status s = ParseOptions(argc, argv, &opts, &help);
//   if (!s.ok()) { fprintf(stderr, "%s\n%s", s.message().c_str(), OptionsUsage().c_str()); return 2; }
//   if (help) { fputs(OptionsHelp().c_str(), stdout); return 0; }
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <sys/types.h>
#include <vector>

#include "cache_dit_opd/v1/ring.h"
#include "common/status.h"

namespace cache_dit_opd {

struct Options {
  int device = 0;                        // --device: CUDA ordinal in the daemon's process
  std::string socket;                    // --socket: gRPC socket path; "" = <runtime dir>/<GPU-UUID>.sock
  std::string runtime_dir;               // --runtime-dir: overrides the runtime-dir rule (docs/DESIGN.md section 4)
  std::string log_level = "info";        // --log-level: trace, debug, info, warn, error, critical, off
  uint32_t max_sessions = 64;            // --max-sessions: open sessions at once
  uint32_t max_sessions_per_uid = 0;     // --max-sessions-per-uid: sessions per uid, bound or being opened (0: no cap)
  uint32_t max_lanes = 16;               // --max-lanes: lanes per session
  uint64_t max_regions = 4096;           // --max-regions: mapped regions per session
  uint64_t max_mapped_bytes = 1ull << 40;  // --max-mapped-bytes: bytes mapped per session (1 TiB)
  uint64_t max_store_bytes = 0;  // --max-store-bytes: the weight store's bytes, all clients (0: no store)
  uint64_t max_store_entries = 16384;  // --max-store-entries: its entries (an empty tensor takes no bytes)
  // --max-message-bytes: the largest gRPC request a client may send. No
  // tensor travels by value: the largest request protocol 2 allows (a Call
  // of wire.h's kMaxArgs arguments, each a kMaxListLength list of 10-byte
  // varints) is about 21 KiB (tests/cpp/server/proto_test.cc). Every byte
  // of headroom is memory a hostile request makes the daemon take: a
  // request of empty Arguments parses to ~28x its size (measured at 4 MiB:
  // +116 MiB of peak RSS). Replies: server/grpc/grpc_server.h.
  uint64_t max_message_bytes = 64ull << 10;
  uint32_t drain_deadline_ms = 5000;     // --drain-deadline-ms: SIGTERM drain budget
  uint32_t bind_timeout_ms = 5000;       // --bind-timeout-ms: time to bind a session on the channel
  std::optional<gid_t> allowed_gid;      // --allowed-gid: a group admitted besides the daemon's uid
  std::vector<std::string> load_libraries;  // --load-library (repeatable): extra op libraries
  bool ring = true;                      // --ring / --no-ring: offer the shared-memory call ring
  uint32_t ring_capacity = v1::kDefaultRingCapacity;  // --ring-capacity: slots per ring, power of two 8..1024
  uint32_t spin_us = 200;                // --spin-us: busy-poll window after the last call (each executor)
  uint32_t executor_threads = 1;         // --executor-threads: executors polling rings and launching, 1..16
  uint32_t parking_slots = 8;            // --parking-slots: lanes with a GPU wait parked at once (0: host checks)
  uint32_t park_busy_lanes = 3;          // --park-busy-lanes: launch ahead only while <= N lanes are busy (0: always)
  uint32_t park_deadline_ms = 2000;      // --park-deadline-ms: a parked lane this still loses its slot
  uint32_t calls_ahead = 32;             // --calls-ahead: a lane's calls on the GPU beyond its visible inputs
  uint32_t held_calls = 256;             // --held-calls: a session's decoded calls not yet launched
  uint32_t memory_trim_ms = 10000;       // --memory-trim-ms: freed memory back to the kernel (0: never)
  // --metrics-address: where Prometheus /metrics is served; "" = off.
  std::string metrics_address = "127.0.0.1:9464";
  bool metrics_address_given = false;    // on the command line (a bind failure is then fatal)
};

// ParseOptions
//
// Accepts `--flag value` and `--flag=value`; sizes take K, M, G, T suffixes
// (powers of 1024); --allowed-gid takes a number or a group name; --ring and
// --no-ring take no value (the last one wins). Sets
// `*help` for -h/--help. INVALID_ARGUMENT naming the flag and the value on
// an unknown flag, a missing or malformed value, or a value out of range.
Status ParseOptions(int argc, const char* const* argv, Options* opts, bool* help);

// The full --help text: every flag, its default and its meaning.
std::string OptionsHelp();

// One line: "usage: cache-dit-opd [--device N] ...; see --help".
std::string OptionsUsage();

// "" (off), or HOST:PORT with a port in [1, 65535] and a non-empty host
// (an IPv6 host in brackets: "[::1]:9464"). INVALID_ARGUMENT naming the
// value otherwise.
Status CheckMetricsAddress(const std::string& address);

// Parses "64", "4K", "16M", "2G", "1T" (bytes). INVALID_ARGUMENT otherwise.
Status ParseByteSize(const std::string& text, uint64_t* out);

}  // namespace cache_dit_opd
