// The C surface of libcache_dit_opd_proxy.so for the Python client (ctypes,
// python/cache_dit_opd/_native.py mirrors every signature and struct here).
// Sessions are named by integer handles, never by pointers, so a stale
// handle from Python is an error, not a dangling pointer. Every function is
// noexcept at the boundary: C++ exceptions never cross into ctypes.
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>

#include "client/python/native_session.h"
#include "client/python/proxy_kernel.h"

using cache_dit_opd::Status;
using namespace cache_dit_opd::client;

namespace {

std::mutex g_mu;
std::map<int64_t, std::shared_ptr<ProxySession>> g_sessions;  // guarded by g_mu
int64_t g_next_handle = 1;                                   // guarded by g_mu

std::shared_ptr<ProxySession> Find(int64_t h) {
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

// One rejected asynchronous call (struct OpdRejected in _native.py).
struct OpdRejected {
  uint64_t ticket;
  uint64_t seq;
  uint32_t lane;
  uint32_t op_index;
  int32_t code;
  uint32_t nregions;
  uint64_t regions[32];
  char message[256];
};

namespace {

int TakeRejected(ProxySession& s, int wait, OpdRejected* out, int max) {
  int rc = 0;
  if (wait) {
    Status st = s.WaitConsumed();
    if (!st.ok()) rc = -static_cast<int>(st.code());
  }
  if (max <= 0 || !s.HasRejected()) return rc;
  std::vector<RejectedCall> got = s.TakeRejected(static_cast<size_t>(max));
  int n = 0;
  for (RejectedCall& r : got) {
    OpdRejected& o = out[n++];
    o.ticket = r.ticket;
    o.seq = r.seq;
    o.lane = r.lane;
    o.op_index = r.op_index;
    o.code = r.code;
    o.nregions = static_cast<uint32_t>(std::min<size_t>(r.regions.size(), 32));
    std::copy_n(r.regions.begin(), o.nregions, o.regions);
    CopyOut(r.message, o.message, sizeof(o.message));
  }
  return rc < 0 && n == 0 ? rc : n;
}

}  // namespace

extern "C" {

// Bumped whenever a signature or struct below changes.
__attribute__((visibility("default"))) int opd_native_abi_version() { return 1; }

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

// A handle > 0, or 0 with the reason in err.
__attribute__((visibility("default"))) int64_t opd_native_open(int device, void* memory, uint64_t memory_bytes,
                                                             uint64_t device_base, uint64_t session_id,
                                                             uint32_t lanes, int daemon_pidfd, uint64_t spin_ns,
                                                             uint64_t call_timeout_ns, uint64_t heartbeat_timeout_ns,
                                                             char* err, size_t err_len) {
  try {
    ProxySessionConfig c;
    c.device = device;
    c.memory = memory;
    c.memory_bytes = memory_bytes;
    c.device_base = device_base;
    c.session_id = session_id;
    c.lanes = lanes;
    c.daemon_pidfd = daemon_pidfd;
    c.spin = std::chrono::nanoseconds(spin_ns);
    c.call_timeout = std::chrono::nanoseconds(call_timeout_ns);
    c.heartbeat_timeout = std::chrono::nanoseconds(heartbeat_timeout_ns);
    std::unique_ptr<ProxySession> s;
    Status st = ProxySession::Create(c, &s);
    if (!st.ok()) {
      CopyOut(st.ToString(), err, err_len);
      return 0;
    }
    std::lock_guard<std::mutex> lock(g_mu);
    const int64_t h = g_next_handle++;
    g_sessions.emplace(h, std::shared_ptr<ProxySession>(std::move(s)));
    return h;
  } catch (const std::exception& e) {
    CopyOut(e.what(), err, err_len);
    return 0;
  }
}

// Makes the session the one the native kernels use for its device (active=1)
// or stops that (active=0).
__attribute__((visibility("default"))) int opd_native_activate(int64_t h, int active) {
  return NoThrow([&] {
    auto s = Find(h);
    if (!s) return -1;
    if (active) {
      SetActiveProxySession(s->device(), s);
    } else {
      ClearActiveProxySession(s->device(), s.get());
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
    s->AddRegion(base, size, buffer_id, region_id);
    return 0;
  }, -1);
}

__attribute__((visibility("default"))) int opd_native_forget_region(int64_t h, uint64_t base) {
  auto s = Find(h);
  if (!s) return -1;
  s->ForgetRegion(base);
  return 0;
}

// One call whose arguments Python encoded (_ring.encode_args). Returns 0 with
// *code the daemon's answer (synchronous calls; 0 for asynchronous ones), or
// the transport failure's google.rpc.Code (> 0) with the reason in message.
__attribute__((visibility("default"))) int opd_native_call(int64_t h, void* stream, uint32_t op_index,
                                                         const uint8_t* body, uint32_t body_bytes, uint32_t nargs,
                                                         int asynchronous, const uint64_t* regions,
                                                         uint32_t nregions, int32_t* code, char* message,
                                                         size_t message_len) {
  auto s = Find(h);
  if (!s) {
    CopyOut("native session handle is closed", message, message_len);
    return static_cast<int>(cache_dit_opd::StatusCode::kFailedPrecondition);
  }
  RecordArgs args;
  if (!args.AssignEncoded(body, body_bytes, nargs)) {
    CopyOut("encoded arguments exceed one ring record", message, message_len);
    return static_cast<int>(cache_dit_opd::StatusCode::kInvalidArgument);
  }
  try {
    std::string msg;
    Status st = s->Call(stream, op_index, args, asynchronous != 0, regions, nregions, code, &msg);
    if (!st.ok()) {
      CopyOut(st.message(), message, message_len);
      return static_cast<int>(st.code());
    }
    CopyOut(msg, message, message_len);
    return 0;
  } catch (const std::exception& e) {
    CopyOut(e.what(), message, message_len);
    return static_cast<int>(cache_dit_opd::StatusCode::kInternal);
  }
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

__attribute__((visibility("default"))) void opd_native_fail(int64_t h, const char* reason) {
  if (auto s = Find(h)) s->Fail(reason);
}

// Calls whose done had not come, after raising every lane's done from the host.
__attribute__((visibility("default"))) uint64_t opd_native_release_from_host(int64_t h, const char* reason) {
  auto s = Find(h);
  return s ? s->ReleaseFromHost(reason) : 0;
}

// out[0..8]: in_flight, unanswered_async, lanes_behind, native_calls, ring wakes, ring full waits, lane
// count, records published, ring capacity; out[9 + i]: fallbacks by ProxyFallback i (kCount of them).
__attribute__((visibility("default"))) int opd_native_state(int64_t h, uint64_t* out, int n) {
  auto s = Find(h);
  if (!s) return -1;
  constexpr int kFixed = 9;
  const int k = kFixed + static_cast<int>(ProxyFallback::kCount);
  uint64_t v[kFixed + static_cast<int>(ProxyFallback::kCount)] = {
      s->in_flight(), s->unanswered_async(), s->LanesBehind() ? 1u : 0u, s->native_calls(),
      s->ring_wakes(), s->ring_full_waits(), s->lane_count(), s->published(), s->ring_capacity()};
  for (int i = 0; i < static_cast<int>(ProxyFallback::kCount); ++i) {
    v[kFixed + i] = s->fallbacks(static_cast<ProxyFallback>(i));
  }
  std::copy_n(v, std::min(n, k), out);
  return k;
}

// issued, inputs_ready, done of one lane.
__attribute__((visibility("default"))) int opd_native_lane(int64_t h, uint32_t lane, uint64_t* out) {
  auto s = Find(h);
  if (!s || lane >= s->lane_count()) return -1;
  const auto st = s->lane_state(lane);
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
