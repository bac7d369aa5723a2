// File: client/python/native_session.h
//
// The native side of one Python client session (python/cache_dit_opd,
// _session.Session): the session's SessionEngine (client/core/
// session_engine.h: memory, lanes, ring, region cache, liveness; the same
// engine the C++ client runs on) and what the proxy kernels
// (proxy_kernel.cpp) need beyond it: the op table the catalog check filled
// and per-session counters.
//
// Division of work: Python keeps the control plane. It opens and binds the
// session over gRPC and the session channel and hands the memfd and the
// channel to Create; it registers regions over gRPC and mirrors them here
// (AddRegion / ForgetRegion); it checks the op catalog (SetOp) and turns
// rejections into exceptions. Every call runs here, in the proxy kernels.
//
// Whatever a proxy kernel cannot finish it hands to the op's Python
// implementation, after recording why (LastFallback, per thread): Python
// acts on that (opens a session, registers the allocation, raises the
// daemon's rejection by its reason, ...) and dispatches the op again.
//
// Torch-free and gRPC-free. Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <string>
#include <unordered_map>

#include "client/core/session_engine.h"
#include "common/status.h"

namespace cache_dit_opd::client {

// Why a proxy kernel handed a call to Python (python/cache_dit_opd/_native.py
// mirrors the values).
enum class ProxyFallback : int {
  kNoSession = 0,    // no active session for the device (or a forked child's)
  kFailed,           // the session failed: LastFallback().status says why
  kPendingErrors,    // rejected asynchronous calls wait to be raised
  kCapturing,        // a CUDA graph capture is under way
  kUnknownOp,        // op not in the checked catalog
  kArgument,         // an argument the record cannot carry natively
  kRegionMiss,       // an allocation not registered yet
  kRejected,         // the daemon rejected a synchronous call: LastFallback().status
  kBroken,           // the ring failed under the call: LastFallback().status
  kCount,
};

// The last fallback of this thread.
struct Fallback {
  ProxyFallback why = ProxyFallback::kNoSession;
  Status status;  // the daemon's rejection or the failure (kFailed, kRejected, kBroken)
};
const Fallback& LastFallback();
void SetLastFallback(ProxyFallback why, Status status = Status());

class NativeSession {
 public:
  static Status Create(int device, BoundSession bound, const EngineOptions& options,
                       std::shared_ptr<NativeSession>* out);
  ~NativeSession();

  SessionEngine& engine() { return *engine_; }
  int device() const { return engine_->device(); }

  // -- ops (Python: after the family's schemas matched the catalog) --------
  void SetOp(const std::string& name_overload, uint32_t op_index);
  // "name.overload" (overload empty: "name") -> catalog index.
  bool OpIndex(const std::string& name_overload, uint32_t* op_index) const;

  // -- counters --------------------------------------------------------------
  void CountNative() { native_calls_.fetch_add(1, std::memory_order_relaxed); }
  void CountFallback(ProxyFallback why) {
    fallbacks_[static_cast<int>(why)].fetch_add(1, std::memory_order_relaxed);
  }
  uint64_t native_calls() const { return native_calls_.load(std::memory_order_relaxed); }
  uint64_t fallbacks(ProxyFallback why) const {
    return fallbacks_[static_cast<int>(why)].load(std::memory_order_relaxed);
  }

 private:
  explicit NativeSession(std::shared_ptr<SessionEngine> engine) : engine_(std::move(engine)) {}

  std::shared_ptr<SessionEngine> engine_;
  mutable std::shared_mutex ops_mu_;
  std::unordered_map<std::string, uint32_t> ops_;  // guarded by ops_mu_
  std::atomic<uint64_t> native_calls_{0};
  std::atomic<uint64_t> fallbacks_[static_cast<int>(ProxyFallback::kCount)] = {};
};

// The session the native kernels use for `device` in this process: set by
// Python once the session is open and its catalog checked, cleared when it
// fails or closes. nullptr when none.
std::shared_ptr<NativeSession> ActiveNativeSession(int device);
void SetActiveNativeSession(int device, std::shared_ptr<NativeSession> session);
// Clears `device`'s entry if it still holds `session`.
void ClearActiveNativeSession(int device, const NativeSession* session);

// Asynchronous mode as Python sets it: the process default, and a per-thread
// override (-1: none) for async_calls() scopes.
void SetAsyncProcess(bool enabled);
void SetAsyncThread(int mode);
bool AsyncCallsEnabled();

}  // namespace cache_dit_opd::client
