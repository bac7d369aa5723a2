#include "client/core/session_engine.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "client/core/monitor.h"
#include "common/intentional_leak.h"
#include "common/cuda/device_guard.h"

namespace cache_dit_opd::client {

Status CallAnswer::status() const {
  if (code == 0) return Status::Ok();
  const auto sc = code > 0 && code <= static_cast<int>(StatusCode::kUnavailable) ? static_cast<StatusCode>(code)
                                                                                 : StatusCode::kUnknown;
  return Status(sc, message, ReasonFromWire(reason));
}

namespace {

class CudaDevice final : public EngineDevice {
 public:
  CudaDevice(const cuda::DriverApi* api, int device) : api_(api), device_(device) {}
  Status RegisterHostMemory(void* p, size_t bytes, uint64_t* device_address) override {
    cuda::DeviceGuard guard(device_);
    OPD_RETURN_IF_ERROR(guard.status());
    CUresult r = api_->mem_host_register(p, bytes, CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_PORTABLE);
    if (r != CUDA_SUCCESS) {
      return Status::Internal("cuMemHostRegister(session memory, ", bytes, " bytes): ", cuda::DriverErrorString(r));
    }
    CUdeviceptr dev = 0;
    r = api_->mem_host_get_device_pointer(&dev, p, 0);
    if (r != CUDA_SUCCESS) {
      api_->mem_host_unregister(p);
      return Status::Internal("cuMemHostGetDevicePointer(session memory): ", cuda::DriverErrorString(r));
    }
    *device_address = dev;
    return Status::Ok();
  }
  void UnregisterHostMemory(void* p) override {
    cuda::DeviceGuard guard(device_);
    if (guard.status().ok()) api_->mem_host_unregister(p);
  }
  std::unique_ptr<LaneStreamOps> LaneOps(const SessionMapping* memory, uint64_t device_base) override {
    return std::make_unique<CudaLaneOps>(api_, device_, memory, device_base);
  }
  std::unique_ptr<AllocationBackend> Allocations() override {
    return std::make_unique<CudaAllocationBackend>(api_);
  }
  Status Enter(std::optional<cuda::DeviceGuard>* guard) override {
    guard->emplace(device_);
    return (*guard)->status();
  }

 private:
  const cuda::DriverApi* api_;
  int device_;
};

}  // namespace

Status CudaEngineDevice(int device, std::unique_ptr<EngineDevice>* out) {
  Status st;
  const cuda::DriverApi* api = cuda::GetDriverApi(&st);
  if (api == nullptr) return st;
  *out = std::make_unique<CudaDevice>(api, device);
  return Status::Ok();
}

SessionEngine::SessionEngine(int device, uint64_t session_id, const EngineOptions& options)
    : device_(device),
      session_id_(session_id),
      options_(options),
      pid_(::getpid()),
      heartbeat_seen_(std::chrono::steady_clock::now()) {}

Status SessionEngine::Create(int device, BoundSession bound, const EngineOptions& options, RegionRegistrar* registrar,
                             std::shared_ptr<SessionEngine>* out, std::unique_ptr<EngineDevice> gpu) {
  std::shared_ptr<SessionEngine> e(new SessionEngine(device, bound.session_id, options));
  // The memory first: what the daemon handed over is checked before the
  // device is touched, so a bad memfd is named even where CUDA is absent.
  const ExpectedLayout expect{bound.session_id, bound.lanes, bound.memory_bytes};
  OPD_RETURN_IF_ERROR(SessionMapping::Map(bound.memfd.get(), expect, &e->memory_));
  bound.memfd.reset();  // the mapping keeps the object alive
  if (!gpu) OPD_RETURN_IF_ERROR(CudaEngineDevice(device, &gpu));
  e->gpu_ = std::move(gpu);

  e->channel_ = std::move(bound.channel);
  // The channel's peer is the daemon process (as seen from this pid
  // namespace). A pidfd on it tells the monitor when the daemon is really
  // gone, which is when releasing waits from the host becomes safe.
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (e->channel_.valid() && ::getsockopt(e->channel_.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 &&
      cred.pid > 0) {
    e->daemon_pid_ = cred.pid;
#ifdef SYS_pidfd_open
    const long pfd = ::syscall(SYS_pidfd_open, cred.pid, 0);
    if (pfd >= 0) e->daemon_pidfd_.reset(static_cast<int>(pfd));
#endif
  }

  // Device-mapped so that this process's streams can write and wait on the
  // semaphores; the device address may differ from the host address.
  uint64_t dev = 0;
  OPD_RETURN_IF_ERROR(e->gpu_->RegisterHostMemory(e->memory_->base(), e->memory_->bytes(), &dev));
  e->host_registered_ = true;
  e->lane_ops_ = e->gpu_->LaneOps(e->memory_.get(), dev);
  e->lanes_ = std::make_unique<LaneTable>(e->memory_.get(), e->lane_ops_.get());

  if (e->memory_->ring_bytes() != 0) {
    SessionEngine* self = e.get();
    OPD_RETURN_IF_ERROR(RingProducer::Open(static_cast<uint8_t*>(e->memory_->base()) + e->memory_->ring_offset(),
                                           e->memory_->ring_bytes(), {options.spin, options.call_timeout},
                                           [self] { return self->Liveness(); }, &e->ring_));
  }
  e->allocations_ = e->gpu_->Allocations();
  e->regions_ = std::make_unique<RegionCache>(e->allocations_.get(), registrar, device);

  SessionMonitor* monitor = SessionMonitor::Get();
  if (monitor == nullptr) {
    return Status::Unavailable(
        "no session monitor: the process is exiting, or was forked after its parent's monitor started (CUDA "
        "cannot be used in such a child)");
  }
  monitor->Watch(e);
  *out = std::move(e);
  return Status::Ok();
}

SessionEngine::~SessionEngine() {
  // The lane table references memory and ops: destroy it first.
  ring_.reset();
  lanes_.reset();
  if (leak_) {
    // Kept for the process's life: a stream may still touch them.
    if (lane_ops_) lane_ops_->Leak();
    if (memory_) memory_->Leak();
    IntentionalLeak(lane_ops_);
    IntentionalLeak(memory_);
    return;
  }
  lane_ops_.reset();
  if (host_registered_ && memory_) gpu_->UnregisterHostMemory(memory_->base());
  memory_.reset();
}

Status SessionEngine::CallRing(void* stream, uint32_t op_index, const RecordArgs& args, bool asynchronous,
                               std::span<const uint64_t> regions, const IssueOptions& options, CallAnswer* answer) {
  if (ring_ == nullptr) return Status::FailedPrecondition("session ", session_id_, " has no call ring");
  // The caller's current device may be another one: the lane's fence event
  // and stream operations belong to this session's device.
  std::optional<cuda::DeviceGuard> device;
  OPD_RETURN_IF_ERROR(gpu_->Enter(&device));
  RingCompletion sync;
  *answer = CallAnswer{};
  Status s = lanes_->Issue(stream, options, [&](uint32_t lane, uint64_t seq) -> Status {
    uint64_t ticket = 0;
    OPD_RETURN_IF_ERROR(ring_->Publish(lane, seq, op_index, args, asynchronous ? nullptr : &sync, regions.data(),
                                       regions.size(), &ticket));
    return asynchronous ? Status::Ok() : ring_->Wait(ticket, &sync);
  });
  if (!s.ok()) {
    Fail(s);
    return s;
  }
  if (!asynchronous) {
    answer->code = sync.code;
    answer->reason = sync.reason;
    answer->message = std::move(sync.message);
  }
  return Status::Ok();
}

Status SessionEngine::CallWith(void* stream, const IssueOptions& options, const LaneTable::SendFn& send) {
  std::optional<cuda::DeviceGuard> device;
  OPD_RETURN_IF_ERROR(gpu_->Enter(&device));
  return lanes_->Issue(stream, options, send);
}

bool SessionEngine::HasRejected() { return ring_ != nullptr && ring_->HasRejected(); }

std::vector<RejectedCall> SessionEngine::TakeRejected(size_t max) {
  return ring_ ? ring_->TakeRejected(max) : std::vector<RejectedCall>{};
}

Status SessionEngine::WaitConsumed() { return ring_ ? ring_->WaitConsumed() : Status::Ok(); }

bool SessionEngine::FindRegion(const void* ptr, uint64_t nbytes, uint64_t* region_id, uint64_t* offset) {
  ResolvedRegion r;
  if (!regions_->Find(ptr, nbytes, &r)) return false;
  *region_id = r.region_id;
  *offset = reinterpret_cast<uint64_t>(ptr) - r.alloc.base;
  return true;
}

void SessionEngine::AddRegion(uint64_t base, uint64_t size, uint64_t buffer_id, uint64_t region_id) {
  regions_->Add(AllocationInfo{base, size, buffer_id, device_}, region_id);
}

void SessionEngine::ForgetRegion(uint64_t base) { regions_->Drop(base); }

SessionEngine::LaneState SessionEngine::lane_state(uint32_t lane) const {
  v1::LaneSemaphores* sem = memory_->lane(lane);
  return LaneState{lanes_->issued(lane), LoadSemaphore(&sem->inputs_ready), LoadSemaphore(&sem->done)};
}

bool SessionEngine::LanesBehind() const {
  for (uint32_t l = 0; l < memory_->lane_count(); ++l) {
    if (LoadSemaphore(&memory_->lane(l)->done) < lanes_->issued(l)) return true;
  }
  return false;
}

void SessionEngine::RaiseInputsReadyFromHost(uint32_t lane, uint64_t value) {
  if (lane < memory_->lane_count()) RaiseSemaphore(&memory_->lane(lane)->inputs_ready, value);
}

void SessionEngine::Fail(const Status& reason) { lanes_->Fail(reason); }

Status SessionEngine::HeartbeatLost() {
  if (options_.heartbeat_timeout.count() <= 0) return Status::Ok();
  const uint64_t v = memory_->daemon_heartbeat();
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(heartbeat_mu_);
  if (v != heartbeat_value_) {
    heartbeat_value_ = v;
    heartbeat_seen_ = now;
    heartbeat_armed_ = true;  // it has been seen advancing: from now on a stop means a hung daemon
    return Status::Ok();
  }
  if (!heartbeat_armed_ || now - heartbeat_seen_ <= options_.heartbeat_timeout || !LanesBehind()) {
    return Status::Ok();
  }
  return Status::Rejected(
      Reason::kClosed, "session ", session_id_, ": the daemon's heartbeat has not advanced for ",
      std::chrono::duration_cast<std::chrono::milliseconds>(now - heartbeat_seen_).count(), " ms with calls outstanding (daemon pid ",
      daemon_pid_, " hung or stopped)");
}

Status SessionEngine::Liveness() {
  if (failed()) return failure();
  if (daemon_pidfd_.valid()) {
    pollfd p{daemon_pidfd_.get(), POLLIN, 0};
    if (::poll(&p, 1, 0) > 0) return Status::Rejected(Reason::kClosed, "the daemon process exited");
  }
  return HeartbeatLost();
}

void SessionEngine::ReleaseFromHost(const Status& reason) {
  uint64_t lost = 0;
  if (!reason.ok()) {
    for (uint32_t l = 0; l < memory_->lane_count(); ++l) {
      const LaneState st = lane_state(l);
      if (st.issued > st.done) lost += st.issued - st.done;
    }
  }
  // OK: a re-assertion of the values already released (kReassertWindow).
  lanes_->ReleaseFromHost(reason.ok() ? failure() : reason);
  if (lost > 0) lost_.fetch_add(lost, std::memory_order_acq_rel);
}

int SessionEngine::FencesPassed() const { return lanes_ ? lanes_->FencesPassed() : 1; }

void SessionEngine::Close() {
  if (closed_.exchange(true)) return;
  Fail(Status::Rejected(Reason::kClosed, "session ", session_id_, " was closed by the client"));
  // Half-close: the daemon reads end-of-file and ends the session, while the
  // monitor still sees when the daemon closes its end.
  if (channel_.valid()) ::shutdown(channel_.get(), SHUT_WR);
  if (SessionMonitor* m = SessionMonitor::Get()) {
    m->Retire(shared_from_this());
  } else {
    Leak();  // process exit: streams may still reference the memory
  }
}

}  // namespace cache_dit_opd::client
