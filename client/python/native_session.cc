#include "client/python/native_session.h"

#include <mutex>
#include <vector>

namespace cache_dit_opd::client {

namespace {
thread_local Fallback t_fallback;
}  // namespace

const Fallback& LastFallback() { return t_fallback; }

void SetLastFallback(ProxyFallback why, Status status) {
  t_fallback.why = why;
  t_fallback.status = std::move(status);
}

Status NativeSession::Create(int device, BoundSession bound, const EngineOptions& options,
                             std::shared_ptr<NativeSession>* out) {
  std::shared_ptr<SessionEngine> engine;
  // No registrar: Python registers regions itself and mirrors them here.
  OPD_RETURN_IF_ERROR(SessionEngine::Create(device, std::move(bound), options, nullptr, &engine));
  if (!engine->has_ring()) {
    engine->Close();
    return Status::FailedPrecondition("session ", engine->session_id(), " has no call ring");
  }
  out->reset(new NativeSession(std::move(engine)));
  return Status::Ok();
}

// The engine is retired (freed by the monitor once no stream can wait on its
// memory): a NativeSession is dropped only after Python closed or failed it.
NativeSession::~NativeSession() { engine_->Close(); }

void NativeSession::SetOp(const std::string& name_overload, uint32_t op_index) {
  std::unique_lock lock(ops_mu_);
  ops_[name_overload] = op_index;
}

bool NativeSession::OpIndex(const std::string& name_overload, uint32_t* op_index) const {
  std::shared_lock lock(ops_mu_);
  auto it = ops_.find(name_overload);
  if (it == ops_.end()) return false;
  *op_index = it->second;
  return true;
}

// -- process-wide state ------------------------------------------------------------

namespace {

std::mutex g_active_mu;
std::vector<std::shared_ptr<NativeSession>> g_active;  // by device; guarded by g_active_mu
std::atomic<bool> g_async_process{false};
thread_local int t_async = -1;

}  // namespace

std::shared_ptr<NativeSession> ActiveNativeSession(int device) {
  std::lock_guard<std::mutex> lock(g_active_mu);
  if (device < 0 || static_cast<size_t>(device) >= g_active.size()) return nullptr;
  return g_active[device];
}

void SetActiveNativeSession(int device, std::shared_ptr<NativeSession> session) {
  if (device < 0) return;
  std::lock_guard<std::mutex> lock(g_active_mu);
  if (static_cast<size_t>(device) >= g_active.size()) g_active.resize(device + 1);
  g_active[device] = std::move(session);
}

void ClearActiveNativeSession(int device, const NativeSession* session) {
  std::lock_guard<std::mutex> lock(g_active_mu);
  if (device >= 0 && static_cast<size_t>(device) < g_active.size() && g_active[device].get() == session) {
    g_active[device].reset();
  }
}

void SetAsyncProcess(bool enabled) { g_async_process.store(enabled, std::memory_order_relaxed); }
void SetAsyncThread(int mode) { t_async = mode; }
bool AsyncCallsEnabled() { return t_async < 0 ? g_async_process.load(std::memory_order_relaxed) : t_async != 0; }

}  // namespace cache_dit_opd::client
