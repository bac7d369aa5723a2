#include "server/daemon.h"

#include <unistd.h>

#include <algorithm>
#include <random>
#include <thread>

#include <spdlog/spdlog.h>

#include "common/log_throttle.h"
#include "cache_dit_opd/v1/session_memory.h"

namespace cache_dit_opd {

using Clock = std::chrono::steady_clock;

namespace {
uint64_t MillisSince(Clock::time_point t) {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count());
}

uint64_t RandomInstance() {
  std::random_device rd;
  return (uint64_t{rd()} << 32) ^ rd();
}

// A weight-store block's key among a session's regions (never an IPC
// handle's 64 bytes).
std::string StoreRegionKey(uint64_t publish_id) { return "store-block:" + std::to_string(publish_id); }

// A client's run of virtual-memory chunks among its session's regions: its
// first byte in the client and each chunk's buffer id (a chunk mapped again
// by the client is another chunk, with another id).
std::string ChunkRunKey(const v1::VmmRegionRequest& req) {
  std::string key = "chunks:";
  key += std::to_string(req.client_base);
  for (uint32_t i = 0; i < req.chunk_count; ++i) {
    key += ':';
    key += std::to_string(req.chunk_ids[i]);
  }
  return key;
}
}  // namespace

Daemon::Daemon(const Options& options, DaemonInfo info, std::vector<OpInfo> catalog,
               std::string not_serving_reason, DaemonDeps deps, std::string session_socket)
    : options_(options),
      info_(std::move(info)),
      catalog_(std::move(catalog)),
      deps_(deps),
      session_socket_(std::move(session_socket)),
      instance_(RandomInstance()),
      stats_(catalog_) {
  health_ = not_serving_reason.empty() ? Health::kServing : Health::kNoDevice;
  not_serving_reason_ = std::move(not_serving_reason);

  reaper_ = std::make_unique<Reaper>();
  ExecutorOptions executor_options;
  executor_options.spin = std::chrono::microseconds(options_.spin_us);
  executor_options.thread_name = "opd-exec";
  executor_options.parking_slots = static_cast<int>(options_.parking_slots);
  executor_options.park_busy_lanes = static_cast<int>(options_.park_busy_lanes);
  executor_options.park_deadline = std::chrono::milliseconds(options_.park_deadline_ms);
  executor_options.max_calls_ahead = static_cast<int>(options_.calls_ahead);
  // Ending the session waits for the executor, so never on its thread.
  executor_options.on_stalled = [this](const std::shared_ptr<Session>& s, const Status& why) {
    const uint64_t id = s->id();
    if (!reaper_->Post([this, id, why] { sessions_->End(id, why); })) {
      spdlog::warn("session {}: shutting down; its stalled inputs end it with every other", id);
    }
  };
  executor_ = std::make_unique<ExecutorPool>(deps_.device_ops, deps_.runner, &stats_, executor_options,
                                             static_cast<int>(options_.executor_threads),
                                             [this](const Status& s) { OnFatal(s); });
  SessionLimits limits;
  limits.max_sessions = options_.max_sessions;
  limits.max_sessions_per_uid = options_.max_sessions_per_uid;
  limits.max_lanes = options_.max_lanes;
  limits.regions = RegionLimits{options_.max_regions, options_.max_mapped_bytes};
  limits.bind_timeout_ms = options_.bind_timeout_ms;
  limits.ring_capacity = options_.ring ? options_.ring_capacity : 0;
  sessions_ = std::make_unique<SessionManager>(
      limits, info_.device_index, info_.gpu_uuid, deps_.device_ops, deps_.opener,
      PeerPolicy::ForThisProcess(options_.allowed_gid),
      [this](const std::shared_ptr<Session>& s, const Status& reason) { OnSessionEnd(s, reason); },
      [this](const std::shared_ptr<Session>& s) { OnSessionBound(s); });
  if (deps_.store_allocator != nullptr && options_.max_store_bytes > 0) {
    store_ = std::make_unique<server::WeightStore>(deps_.store_allocator, options_.max_store_bytes,
                                                   options_.allowed_gid, options_.max_store_entries);
  }
  channel_ = std::make_unique<SessionChannel>(session_socket_, sessions_.get());
  channel_->SetAdminHandler([this](v1::AdminCommand, const PeerCred& peer) {
    OPD_RETURN_IF_ERROR(PeerPolicy::ForThisProcess(options_.allowed_gid).AdmitAdmin(peer));
    RequestShutdown(0, "drain requested by pid " + std::to_string(peer.pid) + " uid " + std::to_string(peer.uid));
    return Status::Ok();
  });
  // Registering may release a session's pending regions (which may
  // synchronize the device): on the reaper, off the channel thread.
  channel_->SetAttachHandler([this](std::shared_ptr<Session> s, std::string name, int reply_fd) {
    auto task = [this, s = std::move(s), name = std::move(name), reply_fd] {
      v1::StoreAttachReply reply{};
      int fd = -1;
      Status st = AttachStore(*s, name, &reply, &fd);
      if (!st.ok()) {
        static LogThrottle refused(10, std::chrono::seconds(10));  // a peer attaches at will
        if (const auto v = refused.Next(); v.log) {
          spdlog::warn("session {}: store attach of '{}' refused: {}{}", s->id(), name, st.ToString(),
                       SuppressedNote(v.suppressed));
        }
      }
      (void)SendAttachReply(reply_fd, st, reply, fd);  // best effort: the peer may be gone
      if (fd >= 0) close(fd);
      close(reply_fd);
    };
    if (!reaper_->Post(task)) {
      (void)SendAttachReply(reply_fd, Status::Rejected(Reason::kDraining, "the daemon is shutting down"), {}, -1);
      close(reply_fd);
    }
  });
  // The chunks are mapped here, on the channel thread, while their
  // descriptors are open; registering (which may release other regions, and
  // so synchronize the device) on the reaper.
  channel_->SetRegionHandler([this](std::shared_ptr<Session> s, const v1::VmmRegionRequest& req,
                                    std::span<const int> fds, int reply_fd) {
    auto answer = [s, reply_fd](const Status& st, uint64_t region_id, uint64_t bytes) {
      if (!st.ok()) {
        static LogThrottle refused(10, std::chrono::seconds(10));  // a peer asks at will
        if (const auto v = refused.Next(); v.log) {
          spdlog::warn("session {}: region of client chunks refused: {}{}", s->id(), st.ToString(),
                       SuppressedNote(v.suppressed));
        }
      }
      (void)SendRegionReply(reply_fd, st, region_id, bytes);  // best effort: the peer may be gone
      close(reply_fd);
    };
    std::string key = ChunkRunKey(req);
    uint64_t region_id = 0;
    if (s->regions().FindLent(key, &region_id)) {
      MappedRegion m;
      if (s->regions().Resolve(region_id, &m).ok()) return answer(Status::Ok(), region_id, m.size);
    }
    Status st;
    {
      std::lock_guard<std::mutex> lock(mu_);
      st = NotServingLocked();
    }
    void* base = nullptr;
    uint64_t size = 0;
    if (st.ok()) st = deps_.opener->OpenChunks(fds, std::span<const uint64_t>(req.chunk_bytes, req.chunk_count), &base, &size);
    if (!st.ok()) return answer(st, 0, 0);
    RegionOpener* opener = deps_.opener;
    std::shared_ptr<const void> mapping(base, [opener](const void* p) { opener->CloseChunks(const_cast<void*>(p)); });
    auto task = [s, key = std::move(key), base, size, mapping = std::move(mapping), answer]() mutable {
      RegionRegistry::Registered r;
      Status rs = s->regions().RegisterLent(key, base, size, RegionRegistry::Lent{.read_only = false, .counts_bytes = true},
                                            {std::move(mapping)}, &r);
      answer(rs, r.region_id, size);
    };
    if (!reaper_->Post(std::move(task))) answer(Status::Rejected(Reason::kDraining, "the daemon is shutting down"), 0, 0);
  });
}

Daemon::~Daemon() { Stop(); }

Status Daemon::Start() {
  OPD_RETURN_IF_ERROR(channel_->Listen());
  OPD_RETURN_IF_ERROR(channel_->Start());
  reaper_->Start();
  executor_->Start();
  return Status::Ok();
}

VersionInfo Daemon::Version() const {
  VersionInfo v;
  v.info = info_;
  v.protocol_version = v1::kProtocolVersion;
  v.layout_version = v1::kLayoutVersion;
  std::lock_guard<std::mutex> lock(mu_);
  v.serving = health_ == Health::kServing;
  v.not_serving_reason = not_serving_reason_;
  v.ring_available = options_.ring;
  v.daemon_pid = getpid();
  v.daemon_uid = geteuid();
  v.metrics_address = metrics_address_;
  v.health_reason = health_ == Health::kNoDevice   ? Reason::kNotServing
                    : health_ == Health::kDraining ? Reason::kDraining
                    : health_ == Health::kDeviceLost ? Reason::kDeviceLost
                                                     : Reason::kUnspecified;
  v.uptime_ms = MillisSince(started_);
  v.session_channel_path = session_socket_;
  return v;
}

void Daemon::set_metrics_address(std::string address) {
  std::lock_guard<std::mutex> lock(mu_);
  metrics_address_ = std::move(address);
}

bool Daemon::serving() const {
  std::lock_guard<std::mutex> lock(mu_);
  return health_ == Health::kServing;
}

Daemon::Health Daemon::health() const {
  std::lock_guard<std::mutex> lock(mu_);
  return health_;
}

Status Daemon::NotServingLocked() const {
  switch (health_) {
    case Health::kServing: return Status::Ok();
    case Health::kNoDevice: return Status::Rejected(Reason::kNotServing, not_serving_reason_);
    case Health::kDraining: return Status::Rejected(Reason::kDraining, not_serving_reason_);
    case Health::kDeviceLost: return Status::Rejected(Reason::kDeviceLost, not_serving_reason_);
  }
  return Status::Rejected(Reason::kInternal, "unknown health state");
}

std::string Daemon::not_serving_reason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return not_serving_reason_;
}

void Daemon::SetHealthListener(std::function<void(bool)> listener) {
  std::lock_guard<std::mutex> lock(mu_);
  health_listener_ = std::move(listener);
}

void Daemon::SetNotServing(Health health, const std::string& reason) {
  std::function<void(bool)> listener;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // A lost device outranks draining: keep saying why the daemon will exit 1.
    if (health_ == Health::kDeviceLost) return;
    health_ = health;
    not_serving_reason_ = reason;
    listener = health_listener_;
  }
  if (listener) listener(false);
}

Status Daemon::OpenSession(const OpenSessionParams& params, OpenSessionResult* out) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    OPD_RETURN_IF_ERROR(NotServingLocked());
  }
  std::shared_ptr<Session> s;
  OPD_RETURN_IF_ERROR(sessions_->Open(params, &s));
  out->session_id = s->id();
  out->token = s->token();
  out->catalog = catalog_;
  out->session_channel_path = session_socket_;
  out->lanes = s->lane_count();
  out->layout_version = v1::kLayoutVersion;
  out->shared_memory_bytes = s->memory().bytes();
  out->ring_enabled = s->has_ring();
  out->gpu_uuid = info_.gpu_uuid;
  out->device_index = info_.device_index;
  out->bind_timeout_ms = options_.bind_timeout_ms;
  return Status::Ok();
}

Status Daemon::CloseSession(uint64_t session_id, std::string_view token) {
  return sessions_->Close(session_id, token);
}

void Daemon::RegisterRegion(uint64_t session_id, std::string_view token, std::string handle,
                            uint64_t claimed_size,
                            std::function<void(const Status&, const RegionRegistry::Registered&)> done) {
  std::shared_ptr<Session> s;
  Status st = sessions_->Authorize(session_id, token, /*require_bound=*/true, &s);
  if (st.ok() && handle.size() != kIpcHandleBytes) {
    st = Status::Rejected(Reason::kBadArgument, "ipc_handle is ", handle.size(), " bytes, expected ",
                          kIpcHandleBytes);
  }
  if (st.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    st = NotServingLocked();
  }
  if (!st.ok()) {
    done(st, RegionRegistry::Registered{});
    return;
  }
  auto task = [s, handle = std::move(handle), claimed_size, done]() {
    RegionRegistry::Registered r;
    Status rs = s->regions().Register(handle, claimed_size, &r);
    if (rs.ok()) {
      spdlog::debug("session {}: region {} ({} bytes){}", s->id(), r.region_id, r.mapped_size,
                    r.reused ? " reused" : " mapped");
    } else {
      // A peer can cause this at will: a bounded number of lines per interval.
      static LogThrottle refused(10, std::chrono::seconds(10));
      if (const auto v = refused.Next(); v.log) {
        spdlog::warn("session {}: RegisterRegion refused: {}{}", s->id(), rs.ToString(), SuppressedNote(v.suppressed));
      }
    }
    done(rs, r);
  };
  if (!reaper_->Post(task)) {
    done(Status::Rejected(Reason::kDraining, "the daemon is shutting down"), RegionRegistry::Registered{});
  }
}

Status Daemon::UnregisterRegion(uint64_t session_id, std::string_view token, uint64_t region_id, bool* deferred) {
  std::shared_ptr<Session> s;
  OPD_RETURN_IF_ERROR(sessions_->Authorize(session_id, token, /*require_bound=*/true, &s));
  OPD_RETURN_IF_ERROR(s->regions().Unregister(region_id, deferred));
  // The reaper closes it now if idle, else once its last call has finished.
  reaper_->Watch(s);
  return Status::Ok();
}

void Daemon::Call(uint64_t session_id, std::string_view token, CallRequest req, Executor::Completion done) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (Status st = NotServingLocked(); !st.ok()) {
      lock.unlock();
      stats_.Count(stats_.per_op.Row(req.op, req.overload), req.transport, st);
      done(st);
      return;
    }
  }
  std::shared_ptr<Session> s;
  Status st = sessions_->Authorize(session_id, token, /*require_bound=*/true, &s);
  // The ring consumer stops taking records at --held-calls (the rest wait in
  // the ring); a gRPC caller has no ring to wait in, so past the bound it is
  // refused, its seq not taken (it may send it again). Without this a client
  // whose inputs never become ready could queue calls until memory runs out.
  // Concurrent gRPC threads can each pass the check: the bound is exceeded
  // by at most their number.
  if (st.ok() && req.transport == CallTransport::kGrpc) {
    if (const uint64_t held = s->held.load(std::memory_order_acquire); held >= options_.held_calls) {
      st = Status::Rejected(Reason::kResourceExhausted, "session ", session_id, " has ", held,
                            " calls waiting in the daemon, the most --held-calls allows; call again once earlier "
                            "calls have run");
    }
  }
  if (!st.ok()) {
    stats_.Count(stats_.per_op.Row(req.op, req.overload), req.transport, st);
    done(st);
    return;
  }
  executor_->Submit(s, std::move(req), std::move(done));
}

void Daemon::CallRejected(uint64_t session_id, std::string_view token, uint32_t lane, uint64_t seq,
                          CallTransport transport, Status reason, Executor::Completion done) {
  bool refused;
  {
    std::lock_guard<std::mutex> lock(mu_);
    refused = health_ != Health::kServing;
  }
  std::shared_ptr<Session> s;
  if (!refused) refused = !sessions_->Authorize(session_id, token, /*require_bound=*/true, &s).ok();
  if (refused) {
    // Nobody takes the seq; the transport's own error is the answer.
    stats_.Count(stats_.per_op.other_row(), transport, reason);
    done(reason);
    return;
  }
  executor_->SubmitRejected(s, lane, seq, transport, std::move(reason), std::move(done));
}

Status Daemon::Store(server::WeightStore** out) const {
  if (store_) {
    *out = store_.get();
    return Status::Ok();
  }
  if (deps_.store_allocator == nullptr) {
    return Status::Rejected(Reason::kNotServing, "the weight store needs the daemon's GPU: ",
                            not_serving_reason().empty() ? "this device backend has no store memory" : not_serving_reason());
  }
  return Status::Rejected(Reason::kResourceExhausted,
                          "the weight store is off: start the daemon with --max-store-bytes SIZE (e.g. 16G)");
}

void Daemon::Publish(uint64_t session_id, std::string_view token, std::string what, PublishWork work,
                     std::function<void(const Status&, const StoreListing&)> done) {
  server::WeightStore* store = nullptr;
  std::shared_ptr<Session> s;
  Status st = Store(&store);
  if (st.ok()) st = sessions_->Authorize(session_id, token, /*require_bound=*/true, &s);
  if (st.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    st = NotServingLocked();
  }
  if (!st.ok()) {
    done(st, StoreListing{});
    return;
  }
  // The task holds the session: the regions a publish copies from stay (pinned) until it is done.
  auto task = [store, s, what = std::move(what), work = std::move(work), done]() {
    StoreListing listing;
    Status ps = work(*store, *s, &listing.entries);
    listing.used_bytes = store->used_bytes();
    listing.max_bytes = store->max_bytes();
    // A peer publishes (and fails to) at will: a bounded number of lines per interval, either way.
    static LogThrottle published(10, std::chrono::seconds(10)), refused(10, std::chrono::seconds(10));
    if (ps.ok()) {
      if (const auto v = published.Next(); v.log) {
        spdlog::info("store: uid {} published {} tensors from {} ({} of {} bytes in use){}", s->peer().uid,
                     listing.entries.size(), what, listing.used_bytes, listing.max_bytes, SuppressedNote(v.suppressed));
      }
    } else if (const auto v = refused.Next(); v.log) {
      spdlog::warn("store: publish from {} by uid {} refused: {}{}", what, s->peer().uid, ps.ToString(),
                   SuppressedNote(v.suppressed));
    }
    done(ps, listing);
  };
  if (!store_worker_.Post(std::move(task))) {
    done(Status::Rejected(Reason::kDraining, "the daemon is shutting down"), StoreListing{});
  }
}

void Daemon::PublishFile(uint64_t session_id, std::string_view token, server::PublishFileParams params,
                         std::function<void(const Status&, const StoreListing&)> done) {
  std::string what = params.path + " under '" + params.prefix + "'";
  Publish(session_id, token, std::move(what),
          [params = std::move(params), stop = store_worker_.stop_token()](
              server::WeightStore& store, Session& s, std::vector<server::StoreEntryInfo>* out) {
            return server::PublishFile(store, s.peer(), params, out, stop);
          },
          std::move(done));
}

void Daemon::PublishTensors(uint64_t session_id, std::string_view token, std::vector<server::NamedTensor> tensors,
                            std::vector<uid_t> readers, std::function<void(const Status&, const StoreListing&)> done) {
  Publish(session_id, token, "session " + std::to_string(session_id) + "'s tensors",
          [tensors = std::move(tensors), readers = std::move(readers)](
              server::WeightStore& store, Session& s, std::vector<server::StoreEntryInfo>* out) {
            return server::PublishTensors(store, s.peer(), s.regions(), tensors, readers, out);
          },
          std::move(done));
}

Status Daemon::AttachStore(Session& s, std::string_view name, v1::StoreAttachReply* reply, int* fd) {
  server::WeightStore* store = nullptr;
  OPD_RETURN_IF_ERROR(Store(&store));
  {
    std::lock_guard<std::mutex> lock(mu_);
    OPD_RETURN_IF_ERROR(NotServingLocked());
  }
  server::StoreRef ref;
  OPD_RETURN_IF_ERROR(store->Lookup(s.peer(), name, &ref));
  reply->daemon_instance = instance_;
  reply->block_id = ref->publish_id;
  reply->offset = ref->offset;
  reply->bytes = ref->bytes;
  reply->dtype = static_cast<uint32_t>(ref->dtype);
  reply->ndim = static_cast<uint32_t>(ref->shape.size());
  std::copy(ref->shape.begin(), ref->shape.end(), reply->shape);
  if (ref->block == nullptr) {  // an empty tensor: no memory, no region
    reply->region_id = kNoRegion;
    return Status::Ok();
  }
  reply->block_bytes = ref->block->bytes();
  // The session reaches every entry of the set through the block: it holds
  // each it may read (so each counts the attachment, and stays until the
  // region is released).
  std::vector<std::shared_ptr<const void>> held{ref};
  for (server::StoreRef& e : store->SetEntries(s.peer(), ref->publish_id)) held.push_back(std::move(e));
  // The descriptor first: a failed export (the daemon out of descriptors)
  // then leaves no region behind that the client never heard of.
  OPD_RETURN_IF_ERROR(ref->block->ExportFd(fd));
  RegionRegistry::Registered r;
  void* base = reinterpret_cast<void*>(ref->block->address());
  if (Status rs = s.regions().RegisterLent(StoreRegionKey(ref->publish_id), base, ref->block->bytes(),
                                           RegionRegistry::Lent{.read_only = true, .counts_bytes = false},
                                           std::move(held), &r);
      !rs.ok()) {
    ::close(*fd);
    *fd = -1;
    return rs;
  }
  reply->region_id = r.region_id;
  return Status::Ok();
}

Status Daemon::ListStore(uint64_t session_id, std::string_view token, std::string_view prefix,
                         StoreListing* out) const {
  server::WeightStore* store = nullptr;
  OPD_RETURN_IF_ERROR(Store(&store));
  PeerCred who;
  who.uid = 0;  // session 0: the operator's view
  if (session_id != 0) {
    std::shared_ptr<Session> s;
    OPD_RETURN_IF_ERROR(sessions_->Authorize(session_id, token, /*require_bound=*/true, &s));
    who = s->peer();
  }
  out->entries = store->List(who, prefix);
  out->used_bytes = store->used_bytes();
  out->max_bytes = store->max_bytes();
  return Status::Ok();
}

Status Daemon::DeleteStore(uint64_t session_id, std::string_view token, std::string_view name) {
  server::WeightStore* store = nullptr;
  OPD_RETURN_IF_ERROR(Store(&store));
  std::shared_ptr<Session> s;
  OPD_RETURN_IF_ERROR(sessions_->Authorize(session_id, token, /*require_bound=*/true, &s));
  OPD_RETURN_IF_ERROR(store->Delete(s->peer(), name));
  static LogThrottle deleted(10, std::chrono::seconds(10));
  if (const auto v = deleted.Next(); v.log) {
    spdlog::info("store: uid {} deleted '{}'{}", s->peer().uid, name, SuppressedNote(v.suppressed));
  }
  return Status::Ok();
}

Status Daemon::GetStats(uint64_t session_id, std::string_view token, StatsSnapshot* out) const {
  return Snapshot(session_id, token, /*latency=*/true, out);
}

StatsSnapshot Daemon::Gauges() const {
  StatsSnapshot out;
  (void)Snapshot(0, "", /*latency=*/false, &out);  // session 0 needs no token: cannot fail
  return out;
}

Status Daemon::Snapshot(uint64_t session_id, std::string_view token, bool latency, StatsSnapshot* out) const {
  std::vector<std::shared_ptr<Session>> all = sessions_->Snapshot();
  std::vector<std::shared_ptr<Session>> detail;
  if (session_id != 0) {
    std::shared_ptr<Session> s;
    OPD_RETURN_IF_ERROR(sessions_->Authorize(session_id, token, /*require_bound=*/false, &s));
    detail.push_back(s);
  } else {
    detail = all;
  }
  *out = StatsSnapshot{};
  out->sessions = all.size();
  out->calls = stats_.calls.load();
  out->errors = stats_.errors.load();
  out->sessions_closed = stats_.sessions_closed.load();
  out->executor_threads = static_cast<uint32_t>(executor_->threads());
  out->executor_busy_ns = executor_->busy_ns();
  if (store_) {
    out->store_entries = store_->entries();
    out->store_bytes = store_->used_bytes();
    out->store_max_bytes = store_->max_bytes();
  }
  if (latency) {
    stats_.call_latency_us.Percentiles(&out->call_p50_us, &out->call_p99_us);
    for (const auto& [name, reservoir] :
         {std::pair<const char*, const LatencyReservoir*>{"accept", &stats_.accept_us},
          {"inputs_wait", &stats_.inputs_wait_us},
          {"run", &stats_.run_us}}) {
      StatsSnapshot::Stage stage{name};
      stage.count = reservoir->recorded();
      if (stage.count == 0) continue;
      reservoir->Percentiles(&stage.p50_us, &stage.p99_us);
      out->stages.push_back(std::move(stage));
    }
  }
  for (const auto& s : all) {
    RegionCounts c = s->regions().counts();
    out->regions += c.regions;
    out->mapped_bytes += c.mapped_bytes;
  }
  std::map<uint64_t, uint32_t> ring_pending;
  {
    std::lock_guard<std::mutex> lock(rings_mu_);
    for (const auto& [id, ring] : rings_) ring_pending[id] = ring->Occupancy();
  }
  const int64_t now_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
  for (const auto& s : detail) {
    SessionStatsEntry e;
    e.session_id = s->id();
    e.bound = s->bound();
    e.client_pid = e.bound ? s->peer().pid : 0;
    e.client_uid = e.bound ? s->peer().uid : 0;
    e.calls = s->calls.load();
    e.errors = s->errors.load();
    e.regions = s->regions().counts();
    e.lanes = s->lane_count();
    e.client_name = s->client_name();
    if (e.bound) e.command = s->command();
    e.ring_slots = s->has_ring() ? s->memory().ring_capacity() : 0;
    if (auto it = ring_pending.find(e.session_id); it != ring_pending.end()) e.ring_pending = it->second;
    e.age_ms = MillisSince(s->opened_at());
    const int64_t last = s->last_call_ns.load(std::memory_order_relaxed);
    e.idle_ms = last > 0 ? static_cast<uint64_t>(std::max<int64_t>(now_ns - last, 0) / 1000000) : e.age_ms;
    e.executor = ExecutorPool::Assigned(*s);
    out->sessions_detail.push_back(std::move(e));
  }
  if (!latency) return Status::Ok();
  const CallMetrics& m = stats_.per_op;
  for (size_t row = 0; row < m.rows(); ++row) {
    for (CallTransport t : {CallTransport::kGrpc, CallTransport::kRing}) {
      const OpCallCounters& c = m.counters(row, t);
      OpStatsEntry e{m.op(row).name, m.op(row).overload, t};
      e.calls = c.calls.load(std::memory_order_relaxed);
      for (const auto& r : c.rejections) e.rejections += r.load(std::memory_order_relaxed);
      if (e.calls == 0 && e.rejections == 0) continue;
      for (size_t st = 0; st < kCallStageCount; ++st) {
        const LatencyHistogram::Snapshot h = c.stages[st].Read();
        e.stage_mean_us[st] = h.count ? h.sum_seconds * 1e6 / static_cast<double>(h.count) : 0;
      }
      out->ops.push_back(std::move(e));
    }
  }
  return Status::Ok();
}

void Daemon::OnSessionBound(const std::shared_ptr<Session>& session) {
  if (!session->has_ring()) return;
  const uint64_t id = session->id();
  const std::string token(reinterpret_cast<const char*>(session->token().data()), session->token().size());
  RingConsumer::Sink sink;
  // The gRPC Call's own entry points, token included: the same checks.
  sink.submit = [this, id, token](CallRequest req, Executor::Completion done) {
    Call(id, token, std::move(req), std::move(done));
  };
  sink.submit_rejected = [this, id, token](uint32_t lane, uint64_t seq, Status reason, Executor::Completion done) {
    CallRejected(id, token, lane, seq, CallTransport::kRing, std::move(reason), std::move(done));
  };
  sink.count_unnumbered = [this](const Status& reason) {
    stats_.Count(stats_.per_op.other_row(), CallTransport::kRing, reason);
  };
  // Seen on the executor's thread, which ending the session waits for: post.
  sink.on_violation = [this, id](const Status& why) {
    if (!reaper_->Post([this, id, why] { sessions_->End(id, why); })) {
      spdlog::warn("session {}: shutting down; the ring violation ends it with every other", id);
    }
  };
  RingConsumerOptions ro;  // its spin and sleep are the executor's: it polls the ring
  ro.max_held = options_.held_calls;
  std::lock_guard<std::mutex> lock(rings_mu_);
  // A racing End has set kClosed before its OnSessionEnd takes rings_mu_: if
  // we see kBound here, that OnSessionEnd will find and stop this consumer.
  if (rings_stopped_ || session->state() != SessionState::kBound) return;
  auto consumer = std::make_shared<RingConsumer>(session, &catalog_, std::move(sink), std::move(ro));
  executor_->AddRing(session, consumer);  // polled by the session's executor, like every ring
  rings_[id] = std::move(consumer);
  spdlog::info("session {}: call ring of {} slots served", id, session->memory().ring_capacity());
}

void Daemon::StopRings() {
  std::map<uint64_t, std::shared_ptr<RingConsumer>> rings;
  {
    std::lock_guard<std::mutex> lock(rings_mu_);
    rings_stopped_ = true;
    rings.swap(rings_);
  }
  for (auto& [id, consumer] : rings) consumer->RequestStop();
}

void Daemon::OnSessionEnd(const std::shared_ptr<Session>& session, const Status& reason) {
  stats_.sessions_closed.fetch_add(1, std::memory_order_relaxed);
  // The ring first: it takes no record from now on (any it already handed
  // over is answered FAILED_PRECONDITION, or dropped below with the rest).
  std::shared_ptr<RingConsumer> ring;
  {
    std::lock_guard<std::mutex> lock(rings_mu_);
    if (auto it = rings_.find(session->id()); it != rings_.end()) {
      ring = std::move(it->second);
      rings_.erase(it);
    }
  }
  // The executor's thread lets it go; a record it is copying meanwhile is
  // answered (the session is no longer bound) or dropped below.
  if (ring) ring->RequestStop();
  channel_->CloseSession(session->id());
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++ending_;
  }
  // Order: drop its queued calls (their "done" written on the lane streams),
  // then wait on the reaper for the lanes to drain, then unmap.
  executor_->DropSession(session, reason, [this, session] {
    reaper_->Retire(session, [this] {
      std::lock_guard<std::mutex> lock(mu_);
      --ending_;
      ending_cv_.notify_all();
    });
  });
}

void Daemon::OnFatal(const Status& status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    fatal_ = true;
  }
  spdlog::critical("{}; failing every session, exiting for a restart", status.message());
  SetNotServing(Health::kDeviceLost, status.message());
  const Status lost = Status::Rejected(Reason::kDeviceLost, status.message());
  sessions_->StopAccepting(lost);
  sessions_->EndAll(lost);
  RequestShutdown(1, status.message());
}

void Daemon::RequestShutdown(int exit_code, const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shutdown_requested_) return;
    shutdown_requested_ = true;
    exit_code_ = exit_code;
  }
  spdlog::info("shutdown requested: {}", why);
  shutdown_cv_.notify_all();
}

int Daemon::WaitForShutdownRequest() {
  std::unique_lock<std::mutex> lock(mu_);
  shutdown_cv_.wait(lock, [&] { return shutdown_requested_; });
  return exit_code_;
}

void Daemon::Drain() {
  const auto start = Clock::now();
  const auto budget = std::chrono::milliseconds(options_.drain_deadline_ms);
  const auto deadline = start + budget;
  bool fatal;
  {
    std::lock_guard<std::mutex> lock(mu_);
    fatal = fatal_;
  }
  const Status draining = Status::Rejected(Reason::kDraining, "the daemon is shutting down");
  SetNotServing(Health::kDraining, "draining: the daemon is shutting down");
  sessions_->StopAccepting(draining);
  channel_->StopAccepting();

  // Most of the budget goes to queued calls; the rest to the lanes' last
  // kernels before unmapping.
  const auto calls_deadline = start + budget * 8 / 10;
  size_t pending = executor_->pending();
  if (!fatal && pending > 0) {
    spdlog::info("draining {} queued call(s), up to {} ms", pending, options_.drain_deadline_ms);
    while (executor_->pending() > 0 && Clock::now() < calls_deadline && !executor_->failed()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    if (size_t left = executor_->pending(); left > 0) {
      spdlog::warn("drain deadline: dropping {} call(s) still waiting for their inputs", left);
    }
  }
  sessions_->EndAll(draining);
  {
    std::unique_lock<std::mutex> lock(mu_);
    fatal = fatal_;
    if (!fatal) ending_cv_.wait_until(lock, deadline, [&] { return ending_ == 0; });
  }
  if (fatal || reaper_->retiring() > 0) reaper_->Abandon();
}

void Daemon::Stop() {
  StopRings();
  store_worker_.Stop();  // a file being published gives up at its next chunk
  if (channel_) channel_->Stop();
  if (executor_) executor_->Stop();
  if (reaper_) reaper_->Stop();
}

}  // namespace cache_dit_opd
