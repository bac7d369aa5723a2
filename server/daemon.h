// File: server/daemon.h
//
// The daemon's core, independent of any transport: what every RPC does, in
// terms of the plain types of server/ (the gRPC service in
// server/grpc/grpc_service.h only converts messages and statuses; each session's
// shared-memory call ring calls Call() the same way, from its RingConsumer).
//
// Owns and wires: SessionManager (sessions, tokens, binding), SessionChannel
// (the SOCK_SEQPACKET socket and its thread), ExecutorPool (--executor-threads
// threads; each session's calls are polled from its ring and launched by one
// of them; lane ordering), Reaper (region open/close, session teardown), one
// RingConsumer per bound session with a ring (handed to the session's
// executor at bind, stopped when the session ends; a ring
// protocol violation ends that session on the reaper thread) and the stats.
//
// Without a GPU (DaemonDeps null) the daemon still runs: Version() answers,
// serving() is false with the probe's reason, and OpenSession fails
// UNAVAILABLE with that reason.
//
// Lifecycle (main.cc):  Start -> [serve] -> WaitForShutdownRequest -> Drain
//                       -> (transport shutdown) -> Stop
#pragma once

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common/call.h"
#include "common/status.h"
#include "server/device/device_ops.h"
#include "server/device/region_opener.h"
#include "server/exec/call_runner.h"
#include "server/exec/executor_pool.h"
#include "server/exec/stats.h"
#include "server/options.h"
#include "server/ring/ring_consumer.h"
#include "server/session/reaper.h"
#include "server/session/region_registry.h"
#include "server/session/session_channel.h"
#include "server/session/session_manager.h"
#include "server/store/publish_file.h"
#include "server/store/publish_tensors.h"
#include "server/store/weight_store.h"

namespace cache_dit_opd {

// Facts for GetVersion, fixed at start-up.
struct DaemonInfo {
  std::string daemon_version;
  std::string git_commit;
  std::string torch_version;
  int cuda_runtime_version = 0;
  int cuda_driver_version = 0;
  int device_index = -1;
  std::string gpu_uuid;
  std::string gpu_name;
};

struct VersionInfo {
  DaemonInfo info;
  uint32_t protocol_version = 0;
  uint32_t layout_version = 0;
  bool serving = false;
  std::string not_serving_reason;
  bool ring_available = false;
  int64_t daemon_pid = 0;
  uint32_t daemon_uid = 0;
  std::string metrics_address;   // "" when the exposer is off
  Reason health_reason = Reason::kUnspecified;  // kNotServing, kDraining, kDeviceLost
  uint64_t uptime_ms = 0;
  std::string session_channel_path;
};

// The GPU-facing parts; all null when the daemon has no usable GPU.
struct DaemonDeps {
  DeviceOps* device_ops = nullptr;
  RegionOpener* opener = nullptr;
  CallRunner* runner = nullptr;
  // The weight store's memory; null: the store is off (its RPCs say so).
  StoreAllocator* store_allocator = nullptr;
};

// The weight store as ListStore reports it.
struct StoreListing {
  std::vector<server::StoreEntryInfo> entries;
  uint64_t used_bytes = 0;
  uint64_t max_bytes = 0;
};

struct OpenSessionResult {
  uint64_t session_id = 0;
  SessionToken token{};
  std::vector<OpInfo> catalog;
  std::string session_channel_path;
  uint32_t lanes = 0;
  uint32_t layout_version = 0;
  uint64_t shared_memory_bytes = 0;
  bool ring_enabled = false;
  std::string gpu_uuid;
  int device_index = -1;
  uint32_t bind_timeout_ms = 0;
};

struct SessionStatsEntry {
  uint64_t session_id = 0;
  int32_t client_pid = 0;  // bound pid; 0 before bind
  uint32_t client_uid = 0;
  uint64_t calls = 0;
  uint64_t errors = 0;
  RegionCounts regions;
  uint32_t lanes = 0;
  std::string client_name;
  std::string command;
  bool bound = false;
  uint32_t ring_slots = 0;
  uint32_t ring_pending = 0;
  uint64_t idle_ms = 0;
  uint64_t age_ms = 0;
  int32_t executor = -1;  // the executor thread serving it; -1 before its first call or ring
};

// One op overload through one transport (opd.proto OpStats).
struct OpStatsEntry {
  std::string name;
  std::string overload;
  CallTransport transport = CallTransport::kGrpc;
  uint64_t calls = 0;
  uint64_t rejections = 0;
  std::array<double, kCallStageCount> stage_mean_us{};  // by CallStage
};

struct StatsSnapshot {
  uint64_t sessions = 0;
  uint64_t calls = 0;
  uint64_t errors = 0;
  uint64_t regions = 0;
  uint64_t mapped_bytes = 0;
  double call_p50_us = 0;
  double call_p99_us = 0;
  uint64_t sessions_closed = 0;
  uint64_t store_entries = 0;  // the weight store (all 0 when it is off)
  uint64_t store_bytes = 0;
  uint64_t store_max_bytes = 0;
  uint32_t executor_threads = 0;  // --executor-threads
  std::vector<uint64_t> executor_busy_ns;  // Executor::busy_ns of each executor thread
  std::vector<SessionStatsEntry> sessions_detail;
  struct Stage {
    std::string name;
    double p50_us = 0;
    double p99_us = 0;
    uint64_t count = 0;
  };
  std::vector<Stage> stages;  // empty before the first call
  std::vector<OpStatsEntry> ops;  // rows with a call or a rejection
};

class Daemon {
 public:
  // `not_serving_reason` is "" when the GPU is usable (then `deps` must be
  // complete). `session_socket` is where the channel listens.
  Daemon(const Options& options, DaemonInfo info, std::vector<OpInfo> catalog, std::string not_serving_reason,
         DaemonDeps deps, std::string session_socket);
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // Listens on the session socket (path must be free) and starts the
  // channel, executor and reaper threads.
  Status Start();

  // --- RPCs (errors as in proto/cache_dit_opd/v1/opd.proto) ---
  VersionInfo Version() const;
  Status OpenSession(const OpenSessionParams& params, OpenSessionResult* out);
  Status CloseSession(uint64_t session_id, std::string_view token);
  // Completes on the reaper thread (opening a handle takes 0.1-10 ms).
  void RegisterRegion(uint64_t session_id, std::string_view token, std::string handle, uint64_t claimed_size,
                      std::function<void(const Status&, const RegionRegistry::Registered&)> done);
  Status UnregisterRegion(uint64_t session_id, std::string_view token, uint64_t region_id, bool* deferred);
  // Answered once the call is accepted (validated and queued to run when its
  // inputs are ready) or rejected; a gRPC call is refused (RESOURCE_EXHAUSTED)
  // while its session holds --held-calls calls.
  void Call(uint64_t session_id, std::string_view token, CallRequest req, Executor::Completion done);
  // A call its transport could not decode but whose lane and seq are known
  // (a malformed ring record): the same session checks as Call, then
  // Executor::SubmitRejected, so the seq completes in order when it is the
  // lane's next. Always answered with `reason`.
  void CallRejected(uint64_t session_id, std::string_view token, uint32_t lane, uint64_t seq,
                    CallTransport transport, Status reason, Executor::Completion done);
  Status GetStats(uint64_t session_id, std::string_view token, StatsSnapshot* out) const;
  // The weight store (server/store/). PublishFile completes on the store's
  // thread; the owner and the reader of an entry is the bound session's peer.
  void PublishFile(uint64_t session_id, std::string_view token, server::PublishFileParams params,
                   std::function<void(const Status&, const StoreListing&)> done);
  // PublishTensors: the session's own tensors (dense views in its regions)
  // copied into one new set, on the store's thread.
  void PublishTensors(uint64_t session_id, std::string_view token, std::vector<server::NamedTensor> tensors,
                      std::vector<uid_t> readers, std::function<void(const Status&, const StoreListing&)> done);
  // What a StoreAttachRequest does once the session channel admitted it (on
  // the reaper thread): looks `name` up as the session's peer, lends the
  // session its set's block as a read-only region and exports the block's
  // descriptor into `*fd` (-1 for an empty tensor). Reply fields as
  // session_memory.h says; status and message are the caller's.
  Status AttachStore(Session& s, std::string_view name, v1::StoreAttachReply* reply, int* fd);
  // Random at start: with a block id, what a client's mapping must match.
  uint64_t instance() const { return instance_; }
  // session_id 0: every entry (the operator's view, as GetStats(0)).
  Status ListStore(uint64_t session_id, std::string_view token, std::string_view prefix, StoreListing* out) const;
  Status DeleteStore(uint64_t session_id, std::string_view token, std::string_view name);
  // GetStats of every session without what takes the call path's locks
  // (the latency reservoirs) or walks the per-op table: for a scrape.
  StatsSnapshot Gauges() const;
  // The per-op counters and histograms (read by the metrics exporter).
  const CallMetrics& call_metrics() const { return stats_.per_op; }
  // Where /metrics is served, for GetVersion; set by main once listening.
  void set_metrics_address(std::string address);

  // --- health and lifecycle ---
  // Why the daemon does or does not serve: one state, never read from a
  // message. A lost device outranks draining.
  enum class Health { kServing, kNoDevice, kDraining, kDeviceLost };
  Health health() const;
  bool serving() const;
  std::string not_serving_reason() const;
  // Called with the new serving state whenever it changes (gRPC health).
  void SetHealthListener(std::function<void(bool)> listener);

  // Asks main to shut down with `exit_code` (0: signal, 1: fatal). First
  // request wins. Any thread.
  void RequestShutdown(int exit_code, const std::string& why);
  // Blocks until RequestShutdown; returns its exit code.
  int WaitForShutdownRequest();
  // Stops accepting sessions and calls, lets queued calls finish until
  // --drain-deadline-ms, drops the rest (their "done" written), ends every
  // session and waits (same deadline) for their lanes to drain before
  // unmapping. After a sticky CUDA error it skips the waits.
  void Drain();
  // Joins the threads and removes the session socket. After the transport
  // has shut down (no completion may be pending).
  void Stop();

  const std::vector<OpInfo>& catalog() const { return catalog_; }
  SessionManager& sessions() { return *sessions_; }
  ExecutorPool& executor() { return *executor_; }
  Reaper& reaper() { return *reaper_; }

 private:
  // GetStats; `latency`: also the stage percentiles and the per-op rows.
  Status Snapshot(uint64_t session_id, std::string_view token, bool latency, StatsSnapshot* out) const;
  void SetNotServing(Health health, const std::string& reason);
  // OK while serving, else the rejection of the current state (under mu_).
  Status NotServingLocked() const;
  void OnSessionBound(const std::shared_ptr<Session>& session);
  void OnSessionEnd(const std::shared_ptr<Session>& session, const Status& reason);
  void StopRings();
  void OnFatal(const Status& status);
  // The store, or why there is none (RESOURCE_EXHAUSTED / NOT_SERVING).
  Status Store(server::WeightStore** out) const;
  // The publish RPCs: the same checks, then `work` on the store's thread,
  // logged (naming `what`, the source) and answered the same way.
  using PublishWork =
      std::function<Status(server::WeightStore&, Session&, std::vector<server::StoreEntryInfo>* out)>;
  void Publish(uint64_t session_id, std::string_view token, std::string what, PublishWork work,
               std::function<void(const Status&, const StoreListing&)> done);

  const Options options_;
  const DaemonInfo info_;
  const std::vector<OpInfo> catalog_;
  const DaemonDeps deps_;
  const std::string session_socket_;
  const std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  const uint64_t instance_;

  DaemonStats stats_;
  std::unique_ptr<Reaper> reaper_;
  std::unique_ptr<ExecutorPool> executor_;
  std::unique_ptr<SessionManager> sessions_;
  std::unique_ptr<SessionChannel> channel_;
  std::unique_ptr<server::WeightStore> store_;  // null: no allocator (no GPU) or --max-store-bytes 0
  server::StoreWorker store_worker_;

  mutable std::mutex mu_;
  std::condition_variable shutdown_cv_;
  std::condition_variable ending_cv_;
  uint64_t ending_ = 0;                    // guarded by mu_: sessions ended, not yet released
  Health health_ = Health::kNoDevice;      // guarded by mu_
  std::string not_serving_reason_;         // guarded by mu_: for people (GetVersion, health)
  bool fatal_ = false;                     // guarded by mu_
  bool shutdown_requested_ = false;        // guarded by mu_
  int exit_code_ = 0;                      // guarded by mu_
  std::function<void(bool)> health_listener_;  // guarded by mu_
  std::string metrics_address_;            // guarded by mu_

  // Lock order: never held while taking mu_ or calling into the consumers'
  // sinks; a consumer is stopped (joined) outside it.
  mutable std::mutex rings_mu_;
  std::map<uint64_t, std::shared_ptr<RingConsumer>> rings_;  // guarded by rings_mu_
  bool rings_stopped_ = false;                               // guarded by rings_mu_
};

}  // namespace cache_dit_opd
