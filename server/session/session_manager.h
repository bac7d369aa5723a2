// File: server/session/session_manager.h
//
// The table of live sessions and every rule about who may use one:
//   Open      protocol version, expected GPU, limits; over gRPC also the
//             opener (its connection's SO_PEERCRED, server/grpc/
//             peer_acceptor.h): admitted uid/gid, pid == client_pid, and
//             --max-sessions-per-uid counting the sessions it is opening;
//             creates the session (shared memory, lanes) and its random token.
//   Bind      the session channel's BindRequest plus SO_PEERCRED: admitted
//             uid/gid (PeerPolicy), pid == OpenSession's client_pid, right
//             token, not bound yet. Only then is the session usable; the
//             bind hook then runs (the daemon starts the session's ring
//             consumer there).
//   Authorize every session-scoped RPC: token size, id, token, bound.
//   AdmitAttach, AdmitVmmRegion
//             the session channel's StoreAttachRequest / VmmRegionRequest
//             plus SO_PEERCRED: the message, then Authorize, then the peer
//             must be the process that bound the session (pid and uid).
//   End       removes the session at once (later RPCs: NOT_FOUND) and hands
//             it to the end hook (the daemon drops its queued calls, waits
//             for its lanes to drain on the reaper, then unmaps).
//   Tick      drops sessions not bound within --bind-timeout-ms and beats
//             every session's heartbeat (the channel thread calls it ~10/s).
//
// Error codes: INVALID_ARGUMENT (token not 32 bytes, client_pid <= 0, name
// too long), NOT_FOUND (unknown session), PERMISSION_DENIED (wrong token,
// peer not admitted, pid mismatch), FAILED_PRECONDITION (protocol or GPU
// mismatch, not bound yet), INVALID_ARGUMENT [MALFORMED] (a bind request
// that breaks the format, or one for a session bound already: a client
// does that only by mistake, and fails the session), RESOURCE_EXHAUSTED (--max-sessions,
// --max-sessions-per-uid; a bind past the latter, for a session opened
// in-process, leaves it unbound to expire),
// UNAVAILABLE (draining). Thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cache_dit_opd/v1/session_memory.h"
#include "common/status.h"
#include "server/device/device_ops.h"
#include "server/device/region_opener.h"
#include "server/session/peer_policy.h"
#include "server/session/region_registry.h"
#include "server/session/session.h"

namespace cache_dit_opd {

struct SessionLimits {
  uint32_t max_sessions = 64;
  // Sessions one uid may hold at once, bound or opened over gRPC and not
  // bound yet; 0: no cap but max_sessions.
  // For a daemon shared by several users: one user's runaway process cannot
  // take every session slot from the others.
  uint32_t max_sessions_per_uid = 0;
  uint32_t max_lanes = 16;
  RegionLimits regions;
  uint32_t bind_timeout_ms = 5000;
  // Call ring slots given to a session that asks for the ring (a power of
  // two); 0: the ring is not offered (--no-ring).
  uint32_t ring_capacity = 0;
};

struct OpenSessionParams {
  uint32_t protocol_version = 0;
  int32_t client_pid = 0;
  std::string gpu_uuid;  // "" accepts any
  uint32_t lanes = 0;    // 0 means 1; more than --max-lanes is cut down
  std::string client_name;
  bool want_ring = false;  // granted when SessionLimits::ring_capacity > 0
  // The process that asks, as its gRPC connection's SO_PEERCRED tells;
  // absent only for in-process callers (tests), which skip the peer rules.
  std::optional<PeerCred> opener;
};

inline constexpr size_t kMaxClientNameBytes = 128;

class SessionManager {
 public:
  // Called once per ended session, outside the manager's lock, with the
  // reason (the first one, if several raced).
  using EndHook = std::function<void(const std::shared_ptr<Session>&, const Status& reason)>;
  // Called once per bound session, outside the manager's lock, on the
  // binding thread. The session may already have ended again by then (a
  // racing CloseSession): check its state under the hook's own lock.
  using BindHook = std::function<void(const std::shared_ptr<Session>&)>;
  using Clock = std::chrono::steady_clock;

  SessionManager(SessionLimits limits, int device, std::string gpu_uuid, DeviceOps* device_ops,
                 RegionOpener* opener, PeerPolicy policy, EndHook on_end, BindHook on_bound = nullptr);

  Status Open(const OpenSessionParams& params, std::shared_ptr<Session>* out);

  // SessionManager::Bind
  //
  // `bytes` is the channel message as received (checked: exactly
  // sizeof(BindRequest), magic, protocol version).
  Status Bind(std::string_view bytes, const PeerCred& peer, std::shared_ptr<Session>* out);

  // SessionManager::AdmitAttach
  //
  // `bytes` is the channel message as received. MALFORMED (size, magic,
  // name_bytes outside 1..kMaxStoreNameBytes, reserved != 0),
  // VERSION_MISMATCH, Authorize's reasons, PEER_REFUSED for another pid or
  // uid than the bound peer's. On success the session and the entry name.
  Status AdmitAttach(std::string_view bytes, const PeerCred& peer, std::shared_ptr<Session>* out,
                     std::string* name) const;

  // SessionManager::AdmitVmmRegion
  //
  // `bytes` is the channel message as received, `fds` how many descriptors
  // came with it. MALFORMED (size, magic, chunk_count outside
  // 1..kMaxVmmChunks or unequal to `fds`, a chunk of 0 bytes, chunks whose
  // total overflows, reserved != 0), VERSION_MISMATCH, then AdmitAttach's
  // session and peer rules. On success the session and the request.
  Status AdmitVmmRegion(std::string_view bytes, size_t fds, const PeerCred& peer, std::shared_ptr<Session>* out,
                        v1::VmmRegionRequest* req) const;

  // Session-scoped RPC check; `require_bound` false only for CloseSession.
  Status Authorize(uint64_t session_id, std::string_view token, bool require_bound,
                   std::shared_ptr<Session>* out) const;

  // CloseSession: idempotent (a session this daemon issued that has already
  // ended closes OK); NOT_FOUND for ids never issued.
  Status Close(uint64_t session_id, std::string_view token);

  void End(uint64_t session_id, const Status& reason);
  void EndAll(const Status& reason);
  void Tick(Clock::time_point now);

  // OpenSession fails with `reason` while not accepting.
  void StopAccepting(const Status& reason);

  std::vector<std::shared_ptr<Session>> Snapshot() const;
  size_t size() const;
  // The policy in force (the channel logs it).
  const PeerPolicy& policy() const { return policy_; }
  uint32_t bind_timeout_ms() const { return limits_.bind_timeout_ms; }

 private:
  // Authorize (bound) and the peer is the process that bound the session.
  Status AdmitBoundPeer(uint64_t session_id, const uint8_t (&token)[v1::kTokenBytes], const PeerCred& peer,
                        std::shared_ptr<Session>* out) const;
  // Sessions other than `except` that `uid` holds: bound to it, or opened
  // by it and not bound yet (mu_ held).
  uint32_t HeldBy(uid_t uid, const Session* except) const;
  // RESOURCE_EXHAUSTED when `p` would pass --max-sessions or its opener's
  // --max-sessions-per-uid (mu_ held).
  Status RoomFor(const OpenSessionParams& p) const;

  const SessionLimits limits_;
  const int device_;
  const std::string gpu_uuid_;
  DeviceOps* const device_ops_;
  RegionOpener* const opener_;
  const PeerPolicy policy_;
  const EndHook on_end_;
  const BindHook on_bound_;

  mutable std::mutex mu_;
  std::map<uint64_t, std::shared_ptr<Session>> sessions_;  // guarded by mu_
  uint64_t next_id_ = 1;                                    // guarded by mu_
  bool accepting_ = true;                                   // guarded by mu_
  Status not_accepting_;                                    // guarded by mu_: what Open answers
};

// Compares tokens in constant time.
bool TokenEquals(const SessionToken& a, std::string_view b);

}  // namespace cache_dit_opd
