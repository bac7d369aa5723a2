#include "client/python/native_session.h"

#include <poll.h>
#include <unistd.h>

#include <vector>

namespace cache_dit_opd::client {

Status ProxySession::Create(const ProxySessionConfig& config, std::unique_ptr<ProxySession>* out) {
  std::unique_ptr<ProxySession> s(new ProxySession(config));
  Status st;
  s->api_ = cuda::GetDriverApi(&st);
  if (s->api_ == nullptr) return st;
  OPD_RETURN_IF_ERROR(SessionMemory::Wrap(
      config.memory, config.memory_bytes,
      ExpectedLayout{config.session_id, config.lanes, config.memory_bytes}, &s->memory_));
  const auto* header = static_cast<const v1::SessionMemoryHeader*>(config.memory);
  if (header->ring_offset == 0 || header->ring_bytes == 0) {
    return Status::FailedPrecondition("session ", config.session_id, " has no call ring");
  }
  s->lane_ops_ = std::make_unique<CudaLaneOps>(s->api_, config.device, s->memory_.get(), config.device_base);
  s->lanes_ = std::make_unique<LaneTable>(s->memory_.get(), s->lane_ops_.get());
  ProxySession* self = s.get();
  OPD_RETURN_IF_ERROR(RingProducer::Open(static_cast<uint8_t*>(config.memory) + header->ring_offset,
                                         header->ring_bytes, {config.spin, config.call_timeout},
                                         [self] { return self->Liveness(); }, &s->producer_));
  s->allocations_ = std::make_unique<CudaAllocationBackend>(s->api_);
  *out = std::move(s);
  return Status::Ok();
}

ProxySession::ProxySession(const ProxySessionConfig& config)
    : config_(config), pid_(::getpid()), heartbeat_seen_(std::chrono::steady_clock::now()) {}

ProxySession::~ProxySession() {
  // A stream may still wait behind a fence event (nothing here can prove
  // otherwise, and this runs at process exit too): the events are leaked,
  // as the Python session leaves its shared memory mapped.
  if (lane_ops_) lane_ops_->Leak();
  if (config_.daemon_pidfd >= 0) ::close(config_.daemon_pidfd);
}

void ProxySession::SetOp(const std::string& name_overload, uint32_t op_index) {
  std::unique_lock lock(ops_mu_);
  ops_[name_overload] = op_index;
}

bool ProxySession::OpIndex(const std::string& name_overload, uint32_t* op_index) const {
  std::shared_lock lock(ops_mu_);
  auto it = ops_.find(name_overload);
  if (it == ops_.end()) return false;
  *op_index = it->second;
  return true;
}

void ProxySession::AddRegion(uint64_t base, uint64_t size, uint64_t buffer_id, uint64_t region_id) {
  std::unique_lock lock(regions_mu_);
  regions_[base] = Region{size, buffer_id, region_id};
}

void ProxySession::ForgetRegion(uint64_t base) {
  std::unique_lock lock(regions_mu_);
  regions_.erase(base);
}

bool ProxySession::FindRegion(const void* ptr, uint64_t nbytes, uint64_t* region_id, uint64_t* offset) {
  AllocationInfo a;
  if (!allocations_->Lookup(ptr, &a).ok() || a.device != config_.device) return false;
  const uint64_t p = reinterpret_cast<uint64_t>(ptr);
  // Lookup guarantees base <= p < base + size; the view must end inside too.
  if (nbytes > a.size - (p - a.base)) return false;
  std::shared_lock lock(regions_mu_);
  auto it = regions_.find(a.base);
  // A freed and re-made allocation at the same base has a new buffer id.
  if (it == regions_.end() || it->second.buffer_id != a.buffer_id || it->second.size != a.size) return false;
  *region_id = it->second.region_id;
  *offset = p - a.base;
  return true;
}

Status ProxySession::Call(void* stream, uint32_t op_index, const RecordArgs& args, bool asynchronous,
                          const uint64_t* regions, size_t nregions, int32_t* code, std::string* message) {
  // The caller's current device may be another one: the lane's fence event
  // and stream operations belong to this session's device.
  cuda::DeviceGuard device(config_.device);
  OPD_RETURN_IF_ERROR(device.status());
  RingCompletion answer;
  *code = 0;
  Status s = lanes_->Issue(stream, IssueOptions{}, [&](uint32_t lane, uint64_t seq) -> Status {
    uint64_t ticket = 0;
    OPD_RETURN_IF_ERROR(producer_->Publish(lane, seq, op_index, args, asynchronous ? nullptr : &answer, regions,
                                           nregions, &ticket));
    return asynchronous ? Status::Ok() : producer_->Wait(ticket, &answer);
  });
  if (!s.ok()) {
    Fail(s.ToString());
    return s;
  }
  if (!asynchronous) {
    *code = answer.code;
    *message = std::move(answer.message);
  }
  return Status::Ok();
}

void ProxySession::Fail(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(failure_mu_);
    if (failed_.load(std::memory_order_relaxed)) return;
    failure_ = reason;
    failed_.store(true, std::memory_order_release);
  }
  lanes_->Fail(Status::Unavailable(reason));
}

Status ProxySession::Liveness() {
  if (failed()) {
    std::lock_guard<std::mutex> lock(failure_mu_);
    return Status::Unavailable(failure_);
  }
  if (config_.daemon_pidfd >= 0) {
    pollfd p{config_.daemon_pidfd, POLLIN, 0};
    if (::poll(&p, 1, 0) > 0) return Status::Unavailable("the daemon process exited");
  }
  if (config_.heartbeat_timeout.count() > 0) {
    const uint64_t v = memory_->daemon_heartbeat();
    const auto now = std::chrono::steady_clock::now();
    std::lock_guard<std::mutex> lock(heartbeat_mu_);
    if (v != heartbeat_value_) {
      heartbeat_value_ = v;
      heartbeat_seen_ = now;
      heartbeat_armed_ = true;
    } else if (heartbeat_armed_ && now - heartbeat_seen_ > config_.heartbeat_timeout) {
      return Status::Unavailable(
          "the daemon's heartbeat has not advanced for ",
          std::chrono::duration_cast<std::chrono::milliseconds>(now - heartbeat_seen_).count(), " ms");
    }
  }
  return Status::Ok();
}

uint64_t ProxySession::ReleaseFromHost(const std::string& reason) {
  uint64_t lost = 0;
  for (uint32_t l = 0; l < memory_->lane_count(); ++l) {
    const LaneState st = lane_state(l);
    if (st.issued > st.done) lost += st.issued - st.done;
  }
  Fail(reason);
  lanes_->ReleaseFromHost(Status::Unavailable(reason));
  return lost;
}

bool ProxySession::LanesBehind() const {
  for (uint32_t l = 0; l < memory_->lane_count(); ++l) {
    const LaneState st = lane_state(l);
    if (st.done < st.issued) return true;
  }
  return false;
}

ProxySession::LaneState ProxySession::lane_state(uint32_t lane) const {
  v1::LaneSemaphores* sem = memory_->lane(lane);
  return LaneState{lanes_->issued(lane), LoadSemaphore(&sem->inputs_ready), LoadSemaphore(&sem->done)};
}

// -- process-wide state ------------------------------------------------------------

namespace {

std::mutex g_active_mu;
std::vector<std::shared_ptr<ProxySession>> g_active;  // by device; guarded by g_active_mu
std::atomic<bool> g_async_process{false};
thread_local int t_async = -1;

}  // namespace

std::shared_ptr<ProxySession> ActiveProxySession(int device) {
  std::lock_guard<std::mutex> lock(g_active_mu);
  if (device < 0 || static_cast<size_t>(device) >= g_active.size()) return nullptr;
  return g_active[device];
}

void SetActiveProxySession(int device, std::shared_ptr<ProxySession> session) {
  if (device < 0) return;
  std::lock_guard<std::mutex> lock(g_active_mu);
  if (static_cast<size_t>(device) >= g_active.size()) g_active.resize(device + 1);
  g_active[device] = std::move(session);
}

void ClearActiveProxySession(int device, const ProxySession* session) {
  std::lock_guard<std::mutex> lock(g_active_mu);
  if (device >= 0 && static_cast<size_t>(device) < g_active.size() && g_active[device].get() == session) {
    g_active[device].reset();
  }
}

void SetAsyncProcess(bool enabled) { g_async_process.store(enabled, std::memory_order_relaxed); }
void SetAsyncThread(int mode) { t_async = mode; }
bool AsyncCallsEnabled() { return t_async < 0 ? g_async_process.load(std::memory_order_relaxed) : t_async != 0; }

}  // namespace cache_dit_opd::client
