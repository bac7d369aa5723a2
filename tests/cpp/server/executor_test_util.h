// Helpers of the executor tests (executor_test.cc, executor_pool_test.cc):
// calls, sessions on fake device operations, a client's inputs_ready.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "common/call.h"
#include "server/session/session.h"

namespace cache_dit_opd::testing {

// Polls `pred` for up to `timeout`: a call is answered when it is accepted,
// and runs later on an executor thread.
template <typename Pred>
bool WaitUntil(Pred pred, std::chrono::milliseconds timeout = std::chrono::milliseconds(5000)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// A call of `op`'s out overload on `lane` with `seq` (the fake runner's
// "reject" and "sticky" fail; any other name runs).
inline CallRequest Req(uint32_t lane, uint64_t seq, std::string op = "noop") {
  CallRequest r;
  r.op = std::move(op);
  r.overload = "out";
  r.lane = lane;
  r.seq = seq;
  return r;
}

// Session `id` with `lanes` lanes on `device`, bound unless told not to.
inline std::shared_ptr<Session> NewTestSession(uint64_t id, uint32_t lanes, DeviceOps* device, RegionOpener* opener,
                                               bool bound = true) {
  SessionConfig c;
  c.id = id;
  c.lanes = lanes;
  c.client_pid = 1;
  std::shared_ptr<Session> s;
  EXPECT_TRUE(Session::Create(c, device, opener, &s).ok());
  if (s && bound) s->set_state(SessionState::kBound);
  return s;
}

// What the client's stream writes when its inputs for call `v` are ready.
inline void SetInputsReady(Session& s, uint32_t lane, uint64_t v) {
  std::atomic_ref<uint64_t>(s.memory().lane(lane)->inputs_ready).store(v, std::memory_order_release);
}

}  // namespace cache_dit_opd::testing
