// The C surface of libcache_dit_opd_native.so for the Python client (ctypes;
// python/cache_dit_opd/_native.py mirrors every signature and struct here).
// Sessions are named by integer handles, never by pointers, so a stale
// handle from Python is an error, not a dangling pointer. Every function is
// noexcept at the boundary: C++ exceptions never cross into ctypes.
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>

#include "client/python/functional_kernel.h"
#include "client/python/native_session.h"
#include "client/python/proxy_kernel.h"

using cache_dit_opd::Reason;
using cache_dit_opd::Status;
using cache_dit_opd::StatusCode;
using namespace cache_dit_opd::client;

namespace {

std::mutex g_mu;
std::map<int64_t, std::shared_ptr<NativeSession>> g_sessions;  // guarded by g_mu
int64_t g_next_handle = 1;                                    // guarded by g_mu

std::shared_ptr<NativeSession> Find(int64_t h) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_sessions.find(h);
  return it == g_sessions.end() ? nullptr : it->second;
}

// Runs `f` so that no exception crosses into ctypes: `failed` when it throws.
template <typename F, typename R>
R NoThrow(F&& f, R failed) noexcept {
  try {
    return f();
  } catch (...) {
    return failed;
  }
}

void CopyOut(const std::string& s, char* buf, size_t len) {
  if (buf == nullptr || len == 0) return;
  const size_t n = std::min(s.size(), len - 1);
  std::memcpy(buf, s.data(), n);
  buf[n] = '\0';
}

}  // namespace

// A status across the boundary (struct OpdStatus in _native.py).
struct OpdStatus {
  int32_t code;     // google.rpc.Code; 0 OK
  uint32_t reason;  // wire.h Reason
  char message[512];
};

// One rejected asynchronous call (struct OpdRejected in _native.py).
struct OpdRejected {
  uint64_t ticket;
  uint64_t seq;
  uint32_t lane;
  uint32_t op_index;
  int32_t code;
  uint32_t reason;
  uint32_t nregions;
  uint32_t pad;
  uint64_t regions[32];
  char message[256];
};

namespace {

void Fill(const Status& s, OpdStatus* out) {
  if (out == nullptr) return;
  out->code = static_cast<int32_t>(s.code());
  out->reason = static_cast<uint32_t>(s.reason());
  CopyOut(s.message(), out->message, sizeof(out->message));
}

int TakeRejected(NativeSession& s, int wait, OpdRejected* out, int max) {
  int rc = 0;
  if (wait) {
    Status st = s.engine().WaitConsumed();
    if (!st.ok()) rc = -static_cast<int>(st.code());
  }
  if (max <= 0 || !s.engine().HasRejected()) return rc;
  std::vector<RejectedCall> got = s.engine().TakeRejected(static_cast<size_t>(max));
  int n = 0;
  for (RejectedCall& r : got) {
    OpdRejected& o = out[n++];
    o = OpdRejected{};
    o.ticket = r.ticket;
    o.seq = r.seq;
    o.lane = r.lane;
    o.op_index = r.op_index;
    o.code = r.code;
    o.reason = r.reason;
    o.nregions = static_cast<uint32_t>(std::min<size_t>(r.regions.size(), 32));
    std::copy_n(r.regions.begin(), o.nregions, o.regions);
    CopyOut(r.message, o.message, sizeof(o.message));
  }
  return rc < 0 && n == 0 ? rc : n;
}

}  // namespace

extern "C" {

// Bumped whenever a signature or struct below changes.
__attribute__((visibility("default"))) int opd_native_abi_version() { return 4; }

// sizeof the boundary's structs (0: OpdStatus, 1: OpdRejected): _native.py
// refuses a library whose structs are not the size of its ctypes copies.
__attribute__((visibility("default"))) uint64_t opd_native_struct_bytes(int which) {
  return which == 0 ? sizeof(OpdStatus) : which == 1 ? sizeof(OpdRejected) : 0;
}

// The wire protocol this library speaks (session_memory.h kProtocolVersion).
__attribute__((visibility("default"))) int opd_native_protocol_version() {
  return static_cast<int>(cache_dit_opd::v1::kProtocolVersion);
}

// "" when the op now has the native kernel, else why not.
__attribute__((visibility("default"))) int opd_native_register_kernel(const char* name_overload, char* err,
                                                                    size_t err_len) {
  try {
    const std::string why = RegisterProxyKernel(name_overload);
    CopyOut(why, err, err_len);
    return why.empty() ? 0 : -1;
  } catch (const std::exception& e) {
    CopyOut(e.what(), err, err_len);
    return -1;
  }
}

// 1 when the functional op `name` had the native kernel and no longer has
// it, 0 when it had none.
__attribute__((visibility("default"))) int opd_native_unregister_kernel(const char* name) {
  try {
    return UnregisterFunctionalKernel(name) ? 1 : 0;
  } catch (const std::exception&) {
    return 0;  // no exception crosses the C boundary (taking the lock is all that can throw)
  }
}

// Takes over a bound session: `memfd` and `channel` (the session channel the
// bind ran on) become the engine's, also on failure. A handle > 0, or 0 with
// the reason in `status`.
__attribute__((visibility("default"))) int64_t opd_native_open(int device, int memfd, int channel,
                                                             uint64_t memory_bytes, uint64_t session_id,
                                                             uint32_t lanes, uint64_t spin_ns,
                                                             uint64_t call_timeout_ns, uint64_t heartbeat_timeout_ns,
                                                             OpdStatus* status) {
  try {
    BoundSession bound;
    bound.session_id = session_id;
    bound.lanes = lanes;
    bound.memory_bytes = memory_bytes;
    bound.memfd.reset(memfd);
    bound.channel.reset(channel);
    EngineOptions o;
    o.spin = std::chrono::nanoseconds(spin_ns);
    o.call_timeout = std::chrono::nanoseconds(call_timeout_ns);
    o.heartbeat_timeout = std::chrono::nanoseconds(heartbeat_timeout_ns);
    std::shared_ptr<NativeSession> s;
    Status st = NativeSession::Create(device, std::move(bound), o, &s);
    Fill(st, status);
    if (!st.ok()) return 0;
    std::lock_guard<std::mutex> lock(g_mu);
    const int64_t h = g_next_handle++;
    g_sessions.emplace(h, std::move(s));
    return h;
  } catch (const std::exception& e) {
    Fill(Status::Internal(e.what()), status);
    return 0;
  }
}

// Ends the session on the client side (the engine half-closes the channel;
// the monitor frees the memory once no stream can wait on it) and forgets
// the handle.
__attribute__((visibility("default"))) void opd_native_close(int64_t h) {
  std::shared_ptr<NativeSession> s;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_sessions.find(h);
    if (it == g_sessions.end()) return;
    s = std::move(it->second);
    g_sessions.erase(it);
  }
  NoThrow([&] {
    ClearActiveNativeSession(s->device(), s.get());
    s->engine().Close();
    return 0;
  }, -1);
}

// Makes the session the one the native kernels use for its device (active=1)
// or stops that (active=0).
__attribute__((visibility("default"))) int opd_native_activate(int64_t h, int active) {
  return NoThrow([&] {
    auto s = Find(h);
    if (!s) return -1;
    if (active) {
      SetActiveNativeSession(s->device(), s);
    } else {
      ClearActiveNativeSession(s->device(), s.get());
    }
    return 0;
  }, -1);
}

__attribute__((visibility("default"))) int opd_native_set_op(int64_t h, const char* name_overload,
                                                           uint32_t op_index) {
  return NoThrow([&] {
    auto s = Find(h);
    if (!s) return -1;
    s->SetOp(name_overload, op_index);
    return 0;
  }, -1);
}

__attribute__((visibility("default"))) int opd_native_add_region(int64_t h, uint64_t base, uint64_t size,
                                                               uint64_t buffer_id, uint64_t region_id) {
  return NoThrow([&] {
    auto s = Find(h);
    if (!s) return -1;
    s->engine().AddRegion(base, size, buffer_id, region_id);
    return 0;
  }, -1);
}

__attribute__((visibility("default"))) int opd_native_add_fixed_region(int64_t h, uint64_t base, uint64_t size,
                                                                     uint64_t region_id) {
  return NoThrow([&] {
    auto s = Find(h);
    if (!s) return -1;
    s->engine().AddFixedRegion(base, size, region_id);
    return 0;
  }, -1);
}

// `chunks`: `count` triples (base, size, buffer id), in address order.
__attribute__((visibility("default"))) int opd_native_add_run_region(int64_t h, const uint64_t* chunks, uint32_t count,
                                                                   uint64_t region_id) {
  return NoThrow([&] {
    auto s = Find(h);
    if (!s || count == 0) return -1;
    std::vector<Chunk> run(count);
    for (uint32_t i = 0; i < count; ++i) run[i] = {chunks[3 * i], chunks[3 * i + 1], chunks[3 * i + 2]};
    s->engine().AddRunRegion(std::move(run), region_id);
    return 0;
  }, -1);
}

__attribute__((visibility("default"))) int opd_native_forget_region(int64_t h, uint64_t base) {
  return NoThrow([&] {
    auto s = Find(h);
    if (!s) return -1;
    s->engine().ForgetRegion(base);
    return 0;
  }, -1);
}

// Why this thread's last proxy kernel handed its call to Python: the
// ProxyFallback value, with the daemon's rejection or the failure in `status`.
__attribute__((visibility("default"))) int opd_native_last_fallback(OpdStatus* status) {
  return NoThrow([&] {
    const Fallback& f = LastFallback();
    Fill(f.status, status);
    return static_cast<int>(f.why);
  }, -1);
}

// Takes up to `max` rejected asynchronous calls, oldest first (after
// consuming what has arrived; wait=1 first waits for every record in
// flight). Returns how many were written (call again while it equals max),
// or -(google.rpc.Code) when the wait failed and none were.
__attribute__((visibility("default"))) int opd_native_take_rejected(int64_t h, int wait, OpdRejected* out,
                                                                  int max) {
  auto s = Find(h);
  if (!s) return 0;
  return NoThrow([&] { return TakeRejected(*s, wait, out, max); }, -13);
}

// Fails the session with (code, reason, message): Python saw a rejection
// whose action ends the session.
__attribute__((visibility("default"))) void opd_native_fail(int64_t h, int32_t code, uint32_t reason,
                                                          const char* message) {
  NoThrow([&] {
    if (auto s = Find(h)) {
      s->engine().Fail(Status(static_cast<StatusCode>(code), message, cache_dit_opd::ReasonFromWire(reason)));
    }
    return 0;
  }, -1);
}

// 1 and the failure in `status` when the session failed, 0 while it lives,
// -1 for an unknown handle.
__attribute__((visibility("default"))) int opd_native_failure(int64_t h, OpdStatus* status) {
  return NoThrow([&] {
    auto s = Find(h);
    if (!s) return -1;
    if (!s->engine().failed()) return 0;
    Fill(s->engine().failure(), status);
    return 1;
  }, -1);
}

// Calls whose waits were released from the host since the last call (the
// daemon died with them unfinished).
__attribute__((visibility("default"))) uint64_t opd_native_take_lost(int64_t h) {
  auto s = Find(h);
  return s ? NoThrow([&] { return s->engine().TakeLost(); }, uint64_t{0}) : 0;
}

// out[0..8]: in_flight, unanswered_async, lanes_behind, native_calls, ring wakes, ring full waits, lane
// count, records published, ring capacity; out[9 + i]: fallbacks by ProxyFallback i (kCount of them).
__attribute__((visibility("default"))) int opd_native_state(int64_t h, uint64_t* out, int n) {
  auto s = Find(h);
  if (!s) return -1;
  return NoThrow([&] {
    SessionEngine& e = s->engine();
    constexpr int kFixed = 9;
    const int k = kFixed + static_cast<int>(ProxyFallback::kCount);
    uint64_t v[kFixed + static_cast<int>(ProxyFallback::kCount)] = {
        e.in_flight(),  e.unanswered_async(), e.LanesBehind() ? 1u : 0u, s->native_calls(), e.ring_wakes(),
        e.ring_full_waits(), e.lane_count(), e.published(), e.ring_capacity()};
    for (int i = 0; i < static_cast<int>(ProxyFallback::kCount); ++i) {
      v[kFixed + i] = s->fallbacks(static_cast<ProxyFallback>(i));
    }
    std::copy_n(v, std::min(n, k), out);
    return k;
  }, -1);
}

// issued, inputs_ready, done of one lane.
__attribute__((visibility("default"))) int opd_native_lane(int64_t h, uint32_t lane, uint64_t* out) {
  auto s = Find(h);
  if (!s || lane >= s->engine().lane_count()) return -1;
  const auto st = s->engine().lane_state(lane);
  out[0] = st.issued;
  out[1] = st.inputs_ready;
  out[2] = st.done;
  return 0;
}

__attribute__((visibility("default"))) void opd_native_set_async_process(int enabled) {
  SetAsyncProcess(enabled != 0);
}

// -1: follow the process setting; 0/1: this thread's async_calls() scope.
__attribute__((visibility("default"))) void opd_native_set_async_thread(int mode) { SetAsyncThread(mode); }

}  // extern "C"
