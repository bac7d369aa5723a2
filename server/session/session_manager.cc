#include "server/session/session_manager.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include <spdlog/spdlog.h>

#include "common/log_throttle.h"

namespace cache_dit_opd {
namespace {

Status RandomToken(SessionToken* token) {
  size_t got = 0;
  while (got < token->size()) {
    ssize_t n = getrandom(token->data() + got, token->size() - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::Internal("getrandom: ", std::strerror(errno));
    }
    got += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status CheckTokenSize(std::string_view token) {
  if (token.size() != v1::kTokenBytes) {
    return Status::Rejected(Reason::kBadArgument, "token is ", token.size(), " bytes, expected ", v1::kTokenBytes);
  }
  return Status::Ok();
}

// PEER_REFUSED unless `peer` (SO_PEERCRED) is the process whose pid
// OpenSession claimed. A client in a child PID namespace claims its inner
// pid; SO_PEERCRED gives the pid in ours: the same process if its innermost
// pid is the claimed one.
Status IsClaimedProcess(const PeerCred& peer, int32_t claimed, const std::string& what) {
  if (peer.pid == claimed) return Status::Ok();
  pid_t inner = 0;
  OPD_RETURN_IF_ERROR(InnermostPid(peer.pid, &inner));
  if (inner == claimed) return Status::Ok();
  return Status::Rejected(Reason::kPeerRefused, "peer pid ", peer.pid, " (", inner,
                          " in its PID namespace) does not match OpenSession's client_pid ", claimed, " for ", what);
}

Status PerUidExhausted(uid_t uid, uint32_t held, uint32_t cap) {
  return Status::Rejected(Reason::kResourceExhausted, "uid ", uid, " holds ", held,
                          " sessions, bound or being opened (--max-sessions-per-uid ", cap, "); close one first");
}

}  // namespace

bool TokenEquals(const SessionToken& a, std::string_view b) {
  if (b.size() != a.size()) return false;
  uint8_t diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= a[i] ^ static_cast<uint8_t>(b[i]);
  return diff == 0;
}

SessionManager::SessionManager(SessionLimits limits, int device, std::string gpu_uuid, DeviceOps* device_ops,
                               RegionOpener* opener, PeerPolicy policy, EndHook on_end, BindHook on_bound)
    : limits_(limits),
      device_(device),
      gpu_uuid_(std::move(gpu_uuid)),
      device_ops_(device_ops),
      opener_(opener),
      policy_(policy),
      on_end_(std::move(on_end)),
      on_bound_(std::move(on_bound)) {}

uint32_t SessionManager::HeldBy(uid_t uid, const Session* except) const {
  uint32_t held = 0;
  for (const auto& [id, s] : sessions_) {
    if (s.get() == except) continue;
    const bool bound = s->state() == SessionState::kBound && s->peer().uid == uid;
    const bool opening = s->state() == SessionState::kUnbound && s->opener_uid() == uid;
    held += bound || opening ? 1 : 0;
  }
  return held;
}

Status SessionManager::RoomFor(const OpenSessionParams& p) const {
  if (sessions_.size() >= limits_.max_sessions) {
    return Status::Rejected(Reason::kResourceExhausted, sessions_.size(), " sessions are open (--max-sessions ",
                            limits_.max_sessions, ")");
  }
  if (const uint32_t cap = limits_.max_sessions_per_uid; cap > 0 && p.opener) {
    if (const uint32_t held = HeldBy(p.opener->uid, nullptr); held >= cap) {
      return PerUidExhausted(p.opener->uid, held, cap);
    }
  }
  return Status::Ok();
}

Status SessionManager::Open(const OpenSessionParams& p, std::shared_ptr<Session>* out) {
  if (p.protocol_version != v1::kProtocolVersion) {
    return Status::Rejected(Reason::kVersionMismatch, "the client speaks protocol version ", p.protocol_version,
                            ", this daemon (cache-dit-opd) speaks protocol version ", v1::kProtocolVersion,
                            ": install matching versions of the client and the daemon");
  }
  if (!p.gpu_uuid.empty() && p.gpu_uuid != gpu_uuid_) {
    return Status::Rejected(Reason::kWrongDevice, "client expects GPU ", p.gpu_uuid, "; this daemon serves ",
                            gpu_uuid_.empty() ? "no GPU" : gpu_uuid_);
  }
  if (device_ops_ == nullptr || opener_ == nullptr) {
    return Status::Rejected(Reason::kNotServing, "the daemon has no usable GPU");
  }
  if (p.client_pid <= 0) return Status::Rejected(Reason::kBadArgument, "client_pid ", p.client_pid, " is not a pid");
  if (p.client_name.size() > kMaxClientNameBytes) {
    return Status::Rejected(Reason::kBadArgument, "client_name is ", p.client_name.size(), " bytes, at most ",
                            kMaxClientNameBytes);
  }
  if (p.opener) {
    // Before any memory is made: who may open, and that it is the process
    // it claims to be (the bind must then come from that process too).
    OPD_RETURN_IF_ERROR(policy_.Admit(*p.opener));
    OPD_RETURN_IF_ERROR(IsClaimedProcess(*p.opener, p.client_pid, "a new session"));
  }
  SessionConfig config;
  config.client_pid = p.client_pid;
  config.opener_uid = p.opener ? std::optional<uid_t>(p.opener->uid) : std::nullopt;
  config.client_name = p.client_name;
  config.lanes = std::min(std::max<uint32_t>(p.lanes, 1), limits_.max_lanes);
  config.device = device_;
  config.region_limits = limits_.regions;
  config.ring_capacity = p.want_ring ? limits_.ring_capacity : 0;
  OPD_RETURN_IF_ERROR(RandomToken(&config.token));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!accepting_) return not_accepting_;
    OPD_RETURN_IF_ERROR(RoomFor(p));
    config.id = next_id_++;
  }
  std::shared_ptr<Session> s;
  Status st = Session::Create(config, device_ops_, opener_, &s);
  if (!st.ok()) {
    spdlog::error("session {}: creation failed: {}", config.id, st.ToString());
    return st;
  }
  s->set_bind_deadline(Clock::now() + std::chrono::milliseconds(limits_.bind_timeout_ms));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!accepting_) return not_accepting_;
    OPD_RETURN_IF_ERROR(RoomFor(p));  // again: the lock was let go while the session was made
    sessions_[config.id] = s;
  }
  // A client can open and close sessions in a loop: each kind of lifecycle
  // line is logged a bounded number of times per interval (a burst far
  // above what clients starting up produce).
  static LogThrottle opened(50, std::chrono::seconds(10));
  if (const auto v = opened.Next(); v.log) {
    spdlog::info("session {}: opened for pid {} ({}), {} lane(s), {} bytes of shared memory{}; bind within {} ms{}",
                 config.id, config.client_pid, config.client_name.empty() ? "unnamed" : config.client_name,
                 config.lanes, s->memory().bytes(),
                 config.ring_capacity ? fmt::format(", call ring of {} slots", config.ring_capacity) : "",
                 limits_.bind_timeout_ms, SuppressedNote(v.suppressed));
  }
  *out = std::move(s);
  return Status::Ok();
}

Status SessionManager::Bind(std::string_view bytes, const PeerCred& peer, std::shared_ptr<Session>* out) {
  if (bytes.size() != sizeof(v1::BindRequest)) {
    return Status::Rejected(Reason::kMalformed, "bind request is ", bytes.size(), " bytes, expected ",
                            sizeof(v1::BindRequest));
  }
  v1::BindRequest req;
  std::memcpy(&req, bytes.data(), sizeof(req));
  if (req.magic != v1::kBindRequestMagic) {
    return Status::Rejected(Reason::kMalformed, "bind request magic 0x", std::hex, req.magic, " is not 0x",
                            v1::kBindRequestMagic);
  }
  if (req.protocol_version != v1::kProtocolVersion) {
    return Status::Rejected(Reason::kVersionMismatch, "the client's bind request speaks protocol version ",
                            req.protocol_version, ", this daemon (cache-dit-opd) speaks protocol version ",
                            v1::kProtocolVersion, ": install matching versions of the client and the daemon");
  }
  OPD_RETURN_IF_ERROR(policy_.Admit(peer));
  // On the channel thread, before the token is checked: a peer of another
  // uid (--allowed-gid) must not be able to block it, so only the name of
  // its process (peer_policy.h).
  std::string command =
      peer.uid == policy_.own_uid() ? ReadCommandLine(peer.pid) : ReadCommandName(peer.pid);
  std::shared_ptr<Session> s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(req.session_id);
    if (it == sessions_.end()) return Status::Rejected(Reason::kSessionUnknown, "session ", req.session_id, " not found");
    s = it->second;
    if (!TokenEquals(s->token(), std::string_view(reinterpret_cast<const char*>(req.token), sizeof(req.token)))) {
      return Status::Rejected(Reason::kBadToken, "wrong token for session ", req.session_id);
    }
    OPD_RETURN_IF_ERROR(IsClaimedProcess(peer, s->client_pid(), "session " + std::to_string(req.session_id)));
    if (s->state() != SessionState::kUnbound) {
      return Status::Rejected(Reason::kMalformed, "session ", req.session_id, " is already bound");
    }
    if (const uint32_t cap = limits_.max_sessions_per_uid; cap > 0) {
      if (const uint32_t held = HeldBy(peer.uid, s.get()); held >= cap) return PerUidExhausted(peer.uid, held, cap);
    }
    s->set_peer(peer);
    s->set_command(std::move(command));
    s->set_state(SessionState::kBound);
  }
  static LogThrottle bound(50, std::chrono::seconds(10));
  if (const auto v = bound.Next(); v.log) {
    spdlog::info("session {}: bound to pid {} uid {} gid {}{}", s->id(), peer.pid, peer.uid, peer.gid,
                 SuppressedNote(v.suppressed));
  }
  if (on_bound_) on_bound_(s);
  *out = std::move(s);
  return Status::Ok();
}

Status SessionManager::Authorize(uint64_t session_id, std::string_view token, bool require_bound,
                                 std::shared_ptr<Session>* out) const {
  OPD_RETURN_IF_ERROR(CheckTokenSize(token));
  std::shared_ptr<Session> s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) return Status::Rejected(Reason::kSessionUnknown, "session ", session_id, " not found");
    s = it->second;
  }
  if (!TokenEquals(s->token(), token)) return Status::Rejected(Reason::kBadToken, "wrong token for session ", session_id);
  if (require_bound && !s->bound()) {
    return Status::Rejected(Reason::kSessionUnbound, "session ", session_id,
                            " is not bound yet: present its token on the session channel first");
  }
  *out = std::move(s);
  return Status::Ok();
}

Status SessionManager::AdmitAttach(std::string_view bytes, const PeerCred& peer, std::shared_ptr<Session>* out,
                                   std::string* name) const {
  if (bytes.size() != sizeof(v1::StoreAttachRequest)) {
    return Status::Rejected(Reason::kMalformed, "store attach request is ", bytes.size(), " bytes, expected ",
                            sizeof(v1::StoreAttachRequest));
  }
  v1::StoreAttachRequest req;
  std::memcpy(&req, bytes.data(), sizeof(req));
  if (req.magic != v1::kStoreAttachMagic) {
    return Status::Rejected(Reason::kMalformed, "a ", sizeof(req), "-byte message that is not a store attach request (magic 0x",
                            std::hex, req.magic, ")");
  }
  if (req.protocol_version != v1::kProtocolVersion) {
    return Status::Rejected(Reason::kVersionMismatch, "store attach request of protocol version ", req.protocol_version,
                            ", this daemon speaks ", v1::kProtocolVersion);
  }
  if (req.name_bytes == 0 || req.name_bytes > v1::kMaxStoreNameBytes || req.reserved != 0) {
    return Status::Rejected(Reason::kMalformed, "store attach request with a name of ", req.name_bytes,
                            " bytes (1 to ", v1::kMaxStoreNameBytes, ") and reserved ", req.reserved);
  }
  std::shared_ptr<Session> s;
  OPD_RETURN_IF_ERROR(AdmitBoundPeer(req.session_id, req.token, peer, &s));
  name->assign(req.name, req.name_bytes);
  *out = std::move(s);
  return Status::Ok();
}

Status SessionManager::AdmitVmmRegion(std::string_view bytes, size_t fds, const PeerCred& peer,
                                      std::shared_ptr<Session>* out, v1::VmmRegionRequest* req) const {
  if (bytes.size() != sizeof(v1::VmmRegionRequest)) {
    return Status::Rejected(Reason::kMalformed, "region request is ", bytes.size(), " bytes, expected ",
                            sizeof(v1::VmmRegionRequest));
  }
  std::memcpy(req, bytes.data(), sizeof(*req));
  if (req->magic != v1::kVmmRegionMagic) {
    return Status::Rejected(Reason::kMalformed, "a ", sizeof(*req), "-byte message that is not a region request (magic 0x",
                            std::hex, req->magic, ")");
  }
  if (req->protocol_version != v1::kProtocolVersion) {
    return Status::Rejected(Reason::kVersionMismatch, "region request of protocol version ", req->protocol_version,
                            ", this daemon speaks ", v1::kProtocolVersion);
  }
  if (req->chunk_count == 0 || req->chunk_count > v1::kMaxVmmChunks || req->chunk_count != fds || req->reserved != 0) {
    return Status::Rejected(Reason::kMalformed, "region request of ", req->chunk_count, " chunks (1 to ",
                            v1::kMaxVmmChunks, ") with ", fds, " descriptors and reserved ", req->reserved);
  }
  uint64_t total = 0;
  for (uint32_t i = 0; i < req->chunk_count; ++i) {
    if (req->chunk_bytes[i] == 0 || __builtin_add_overflow(total, req->chunk_bytes[i], &total)) {
      return Status::Rejected(Reason::kMalformed, "region request: chunk ", i, " of ", req->chunk_bytes[i],
                              " bytes (0, or the run's total overflows)");
    }
  }
  return AdmitBoundPeer(req->session_id, req->token, peer, out);
}

Status SessionManager::AdmitBoundPeer(uint64_t session_id, const uint8_t (&token)[v1::kTokenBytes],
                                      const PeerCred& peer, std::shared_ptr<Session>* out) const {
  std::shared_ptr<Session> s;
  OPD_RETURN_IF_ERROR(Authorize(session_id, std::string_view(reinterpret_cast<const char*>(token), sizeof(token)),
                                /*require_bound=*/true, &s));
  // The token alone is not enough: only the process that bound the session.
  if (peer.pid != s->peer().pid || peer.uid != s->peer().uid) {
    return Status::Rejected(Reason::kPeerRefused, "session ", session_id, " was bound by pid ", s->peer().pid, " uid ",
                            s->peer().uid, "; pid ", peer.pid, " uid ", peer.uid, " may not use it");
  }
  *out = std::move(s);
  return Status::Ok();
}

Status SessionManager::Close(uint64_t session_id, std::string_view token) {
  OPD_RETURN_IF_ERROR(CheckTokenSize(token));
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) {
      if (session_id != 0 && session_id < next_id_) return Status::Ok();  // already ended
      return Status::Rejected(Reason::kSessionUnknown, "session ", session_id, " not found");
    }
    if (!TokenEquals(it->second->token(), token)) {
      return Status::Rejected(Reason::kBadToken, "wrong token for session ", session_id);
    }
  }
  End(session_id, Status::Rejected(Reason::kClosed, "session ", session_id, " closed by its client"));
  return Status::Ok();
}

void SessionManager::End(uint64_t session_id, const Status& reason) {
  std::shared_ptr<Session> s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) return;
    s = std::move(it->second);
    sessions_.erase(it);
    s->set_state(SessionState::kClosed);
  }
  static LogThrottle ending(50, std::chrono::seconds(10));
  if (const auto v = ending.Next(); v.log) {
    spdlog::info("session {}: ending (pid {}, uid {}): {}{}", s->id(),
                 s->peer().pid ? s->peer().pid : s->client_pid(), s->peer().uid, reason.message(),
                 SuppressedNote(v.suppressed));
  }
  if (on_end_) on_end_(s, reason);
}

void SessionManager::EndAll(const Status& reason) {
  std::vector<uint64_t> ids;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, s] : sessions_) ids.push_back(id);
  }
  for (uint64_t id : ids) End(id, reason);
}

void SessionManager::Tick(Clock::time_point now) {
  std::vector<std::shared_ptr<Session>> expired;
  {
    // Expiry is decided and applied under one lock, so a Bind that wins the
    // race keeps its session.
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = sessions_.begin(); it != sessions_.end();) {
      std::shared_ptr<Session>& s = it->second;
      if (s->state() == SessionState::kUnbound && now >= s->bind_deadline()) {
        s->set_state(SessionState::kClosed);
        expired.push_back(std::move(s));
        it = sessions_.erase(it);
      } else {
        s->memory().Heartbeat();
        ++it;
      }
    }
  }
  for (auto& s : expired) {
    Status reason = Status::Rejected(Reason::kBindTimeout, "session ", s->id(),
                                     " was not bound on the session channel within ", limits_.bind_timeout_ms, " ms");
    static LogThrottle dropped(50, std::chrono::seconds(10));
    if (const auto v = dropped.Next(); v.log) {
      spdlog::warn("session {}: dropped (pid {}): {}{}", s->id(), s->client_pid(), reason.message(),
                   SuppressedNote(v.suppressed));
    }
    if (on_end_) on_end_(s, reason);
  }
}

void SessionManager::StopAccepting(const Status& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  accepting_ = false;
  not_accepting_ = reason;
}

std::vector<std::shared_ptr<Session>> SessionManager::Snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<Session>> out;
  for (auto& [id, s] : sessions_) out.push_back(s);
  return out;
}

size_t SessionManager::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sessions_.size();
}

}  // namespace cache_dit_opd
