// bind_request_fuzz: the daemon's side of the session channel, the
// BindRequest and StoreAttachRequest a connecting peer sends
// (server/session/session_manager.h SessionManager::Bind(bytes, peer) and
// AdmitAttach(bytes, peer)), on a real SessionManager over fake device
// operations (tests/fake_daemon/fakes.h).
//
// Input: byte 0: bit 0 gives the policy an --allowed-gid; byte 1: how many
// sessions to open (1-3, session i for pid 100 + i). Then a script of steps,
// each led by one byte:
//   % 4 == 0        a bind: a control byte, a peer byte, a length byte, then
//                   that many message bytes (zero-padded at the input's end).
//                   Control bit 0 makes the message a 48-byte BindRequest,
//                   bit 1 writes a live session's id into it (session
//                   control >> 4), bit 2 that session's real token (a
//                   fuzzer cannot guess 32 random bytes), bit 3 the right
//                   magic and protocol version. The peer byte's bits 0-1
//                   pick pid 100-103, bit 2 the daemon's uid (else another),
//                   bit 3 the allowed gid (else another);
//   % 4 == 1        an attach: the same bytes, control bit 0 making the
//                   message a 568-byte StoreAttachRequest, then a byte of
//                   name length that (with control bit 3) becomes
//                   name_bytes with reserved 0; with control bit 5 a
//                   region request instead (a 3904-byte VmmRegionRequest),
//                   that byte the count of descriptors said to come with it
//                   and, with bit 3, its chunk_count (reserved 0);
//   % 4 == 2        End the session (next byte) as CloseSession would;
//   % 4 == 3        Tick past the bind deadline (drops unbound sessions).
//
// Checks: every Bind answers exactly what session_manager.h's rules say,
// in their order (size, magic, version, peer policy, session, token, pid,
// not bound yet), with the reason each rule names, recomputed here from a
// model of the sessions; a bind succeeds at most once per session, hands
// back that session bound to that peer, and runs the bind hook once. Every
// AdmitAttach answers what its rules say (size, magic, version, name length
// and reserved, session, token, bound, the bound peer's pid and uid) and,
// admitted, hands back that session and the name's bytes; AdmitVmmRegion
// likewise (chunk count against the descriptors, 1 .. kMaxVmmChunks, chunk
// sizes non-zero without overflow, reserved) and hands back the request.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <spdlog/spdlog.h>

#include "cache_dit_opd/v1/session_memory.h"
#include "server/session/session_manager.h"
#include "tests/fake_daemon/fakes.h"
#include "tests/fuzz/fuzz_util.h"

namespace cache_dit_opd {
namespace {

constexpr uid_t kOwnUid = 1000;
constexpr gid_t kAllowedGid = 2000;

// Reads the script; past the end every byte is 0.
class Script {
 public:
  Script(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool done() const { return at_ >= size_; }
  uint8_t Byte() { return at_ < size_ ? data_[at_++] : 0; }
  std::string Bytes(size_t n) {
    std::string out(n, '\0');
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<char>(Byte());
    return out;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
};

enum class Model { kUnbound, kBound, kGone };

struct Known {
  std::shared_ptr<Session> session;
  Model state = Model::kUnbound;
  PeerCred bound_by;  // the peer of the successful bind
};

// The session rules AdmitAttach and AdmitVmmRegion share, after their message's own.
std::optional<Reason> ExpectedBoundPeer(uint64_t session_id, const uint8_t* token_bytes, const PeerCred& peer,
                                        const std::map<uint64_t, Known>& sessions) {
  auto it = sessions.find(session_id);
  if (it == sessions.end() || it->second.state == Model::kGone) return Reason::kSessionUnknown;
  const SessionToken& token = it->second.session->token();
  if (std::memcmp(token.data(), token_bytes, token.size()) != 0) return Reason::kBadToken;
  if (it->second.state != Model::kBound) return Reason::kSessionUnbound;
  if (peer.pid != it->second.bound_by.pid || peer.uid != it->second.bound_by.uid) return Reason::kPeerRefused;
  return std::nullopt;
}

// What session_manager.h says AdmitVmmRegion answers; nullopt for admission.
std::optional<Reason> ExpectedRegion(std::string_view bytes, size_t fds, const PeerCred& peer,
                                     const std::map<uint64_t, Known>& sessions) {
  if (bytes.size() != sizeof(v1::VmmRegionRequest)) return Reason::kMalformed;
  v1::VmmRegionRequest req;
  std::memcpy(&req, bytes.data(), sizeof(req));
  if (req.magic != v1::kVmmRegionMagic) return Reason::kMalformed;
  if (req.protocol_version != v1::kProtocolVersion) return Reason::kVersionMismatch;
  if (req.chunk_count == 0 || req.chunk_count > v1::kMaxVmmChunks || req.chunk_count != fds || req.reserved != 0) {
    return Reason::kMalformed;
  }
  unsigned __int128 total = 0;
  for (uint32_t i = 0; i < req.chunk_count; ++i) {
    if (req.chunk_bytes[i] == 0) return Reason::kMalformed;
    total += req.chunk_bytes[i];
  }
  if (total > UINT64_MAX) return Reason::kMalformed;
  return ExpectedBoundPeer(req.session_id, req.token, peer, sessions);
}

// What session_manager.h says AdmitAttach answers; nullopt for admission.
std::optional<Reason> ExpectedAttach(std::string_view bytes, const PeerCred& peer,
                                     const std::map<uint64_t, Known>& sessions) {
  if (bytes.size() != sizeof(v1::StoreAttachRequest)) return Reason::kMalformed;
  v1::StoreAttachRequest req;
  std::memcpy(&req, bytes.data(), sizeof(req));
  if (req.magic != v1::kStoreAttachMagic) return Reason::kMalformed;
  if (req.protocol_version != v1::kProtocolVersion) return Reason::kVersionMismatch;
  if (req.name_bytes == 0 || req.name_bytes > v1::kMaxStoreNameBytes || req.reserved != 0) return Reason::kMalformed;
  return ExpectedBoundPeer(req.session_id, req.token, peer, sessions);
}

// What session_manager.h says Bind answers; nullopt for success.
std::optional<Reason> Expected(std::string_view bytes, const PeerCred& peer, bool allowed_gid,
                               const std::map<uint64_t, Known>& sessions) {
  if (bytes.size() != sizeof(v1::BindRequest)) return Reason::kMalformed;
  v1::BindRequest req;
  std::memcpy(&req, bytes.data(), sizeof(req));
  if (req.magic != v1::kBindRequestMagic) return Reason::kMalformed;
  if (req.protocol_version != v1::kProtocolVersion) return Reason::kVersionMismatch;
  const bool in_group = peer.gid == kAllowedGid ||
                        std::find(peer.groups.begin(), peer.groups.end(), kAllowedGid) != peer.groups.end();
  if (peer.uid != kOwnUid && !(allowed_gid && in_group)) return Reason::kPeerRefused;
  auto it = sessions.find(req.session_id);
  if (it == sessions.end() || it->second.state == Model::kGone) return Reason::kSessionUnknown;
  const SessionToken& token = it->second.session->token();
  if (std::memcmp(token.data(), req.token, token.size()) != 0) return Reason::kBadToken;
  if (peer.pid != it->second.session->client_pid()) return Reason::kPeerRefused;
  if (it->second.state != Model::kUnbound) return Reason::kMalformed;
  return std::nullopt;
}

void Run(const uint8_t* data, size_t size) {
  static testing::FakeDeviceOps* device = new testing::FakeDeviceOps();
  static testing::FakeRegionOpener* opener = new testing::FakeRegionOpener();
  Script in(data, size);
  const bool allowed_gid = in.Byte() & 1;
  const unsigned count = 1 + in.Byte() % 3;

  int bound_hooks = 0;
  SessionLimits limits;
  limits.max_sessions = 4;
  limits.max_lanes = 2;
  limits.bind_timeout_ms = 5000;
  SessionManager manager(
      limits, 0, "GPU-fuzz", device, opener,
      PeerPolicy(kOwnUid, allowed_gid ? std::optional<gid_t>(kAllowedGid) : std::nullopt),
      [](const std::shared_ptr<Session>&, const Status&) {}, [&](const std::shared_ptr<Session>&) { ++bound_hooks; });

  std::map<uint64_t, Known> sessions;
  std::vector<uint64_t> ids;
  for (unsigned i = 0; i < count; ++i) {
    OpenSessionParams p;
    p.protocol_version = v1::kProtocolVersion;
    p.client_pid = static_cast<int32_t>(100 + i);
    p.lanes = 1;
    std::shared_ptr<Session> s;
    const Status st = manager.Open(p, &s);
    OPD_FUZZ_CHECK(st.ok(), "Open: ", st.ToString());
    sessions[s->id()] = Known{s, Model::kUnbound, {}};
    ids.push_back(s->id());
  }

  int successes = 0;
  for (int step = 0; step < 16 && !in.done(); ++step) {
    const uint8_t op = in.Byte();
    if (op % 4 == 2) {
      const uint64_t id = ids[in.Byte() % ids.size()];
      manager.End(id, Status::Rejected(Reason::kClosed, "fuzz"));
      sessions[id].state = Model::kGone;
      continue;
    }
    if (op % 4 == 3) {
      manager.Tick(SessionManager::Clock::now() + std::chrono::milliseconds(limits.bind_timeout_ms + 1000));
      for (auto& [id, k] : sessions) {
        if (k.state == Model::kUnbound) k.state = Model::kGone;
      }
      continue;
    }
    const uint8_t control = in.Byte();
    const uint8_t who = in.Byte();
    const uint8_t length = in.Byte();
    // Bit 16: the allowed group among the supplementary ones.
    const PeerCred peer{static_cast<pid_t>(100 + (who & 3)), (who & 4) ? kOwnUid : kOwnUid + 1,
                        (who & 8) ? kAllowedGid : kAllowedGid + 1,
                        (who & 16) ? std::vector<gid_t>{kAllowedGid + 7, kAllowedGid} : std::vector<gid_t>{}};
    if (op % 4 == 1 && (control & 32)) {
      std::string msg = in.Bytes((control & 1) ? sizeof(v1::VmmRegionRequest) : length % 97);
      const uint8_t fds = in.Byte();
      if (msg.size() == sizeof(v1::VmmRegionRequest)) {
        v1::VmmRegionRequest req;
        std::memcpy(&req, msg.data(), sizeof(req));
        const Known& target = sessions[ids[(control >> 6) % ids.size()]];
        if (control & 2) req.session_id = target.session->id();
        if (control & 4) std::memcpy(req.token, target.session->token().data(), sizeof(req.token));
        if (control & 8) {
          req.magic = v1::kVmmRegionMagic;
          req.protocol_version = v1::kProtocolVersion;
          req.chunk_count = fds;
          req.reserved = 0;
        }
        std::memcpy(msg.data(), &req, sizeof(req));
      }
      const std::optional<Reason> expected = ExpectedRegion(msg, fds, peer, sessions);
      std::shared_ptr<Session> out;
      v1::VmmRegionRequest got{};
      const Status s = manager.AdmitVmmRegion(msg, fds, peer, &out, &got);
      if (expected) {
        OPD_FUZZ_CHECK(!s.ok() && s.reason() == *expected, "AdmitVmmRegion answered ", s.ToString(),
                       "; the rules say ", ReasonName(*expected));
        OPD_FUZZ_CHECK(out == nullptr, "a refused region request handed out a session");
        continue;
      }
      OPD_FUZZ_CHECK(s.ok(), "AdmitVmmRegion refused a request the rules admit: ", s.ToString());
      OPD_FUZZ_CHECK(std::memcmp(&got, msg.data(), sizeof(got)) == 0, "AdmitVmmRegion handed back another request");
      OPD_FUZZ_CHECK(out == sessions[got.session_id].session, "AdmitVmmRegion handed back another session");
      continue;
    }
    if (op % 4 == 1) {
      std::string msg = in.Bytes((control & 1) ? sizeof(v1::StoreAttachRequest) : length % 97);
      const uint8_t name_length = in.Byte();
      if (msg.size() == sizeof(v1::StoreAttachRequest)) {
        v1::StoreAttachRequest req;
        std::memcpy(&req, msg.data(), sizeof(req));
        const Known& target = sessions[ids[(control >> 4) % ids.size()]];
        if (control & 2) req.session_id = target.session->id();
        if (control & 4) std::memcpy(req.token, target.session->token().data(), sizeof(req.token));
        if (control & 8) {
          req.magic = v1::kStoreAttachMagic;
          req.protocol_version = v1::kProtocolVersion;
          req.name_bytes = name_length;
          req.reserved = 0;
        }
        std::memcpy(msg.data(), &req, sizeof(req));
      }
      const std::optional<Reason> expected = ExpectedAttach(msg, peer, sessions);
      std::shared_ptr<Session> out;
      std::string name;
      const Status s = manager.AdmitAttach(msg, peer, &out, &name);
      if (expected) {
        OPD_FUZZ_CHECK(!s.ok() && s.reason() == *expected, "AdmitAttach answered ", s.ToString(), "; the rules say ",
                       ReasonName(*expected));
        OPD_FUZZ_CHECK(out == nullptr, "a refused attach handed out a session");
        continue;
      }
      OPD_FUZZ_CHECK(s.ok(), "AdmitAttach refused an attach the rules admit: ", s.ToString());
      v1::StoreAttachRequest req;
      std::memcpy(&req, msg.data(), sizeof(req));
      OPD_FUZZ_CHECK(out == sessions[req.session_id].session, "AdmitAttach handed back another session");
      OPD_FUZZ_CHECK(name == std::string_view(req.name, req.name_bytes), "AdmitAttach named another entry");
      continue;
    }
    std::string msg = in.Bytes((control & 1) ? sizeof(v1::BindRequest) : length % 97);
    if (msg.size() == sizeof(v1::BindRequest)) {
      v1::BindRequest req;
      std::memcpy(&req, msg.data(), sizeof(req));
      const Known& target = sessions[ids[(control >> 4) % ids.size()]];
      if (control & 2) req.session_id = target.session->id();
      if (control & 4) std::memcpy(req.token, target.session->token().data(), sizeof(req.token));
      if (control & 8) {
        req.magic = v1::kBindRequestMagic;
        req.protocol_version = v1::kProtocolVersion;
      }
      std::memcpy(msg.data(), &req, sizeof(req));
    }
    const std::optional<Reason> expected = Expected(msg, peer, allowed_gid, sessions);
    std::shared_ptr<Session> out;
    const Status s = manager.Bind(msg, peer, &out);
    if (expected) {
      OPD_FUZZ_CHECK(!s.ok() && s.reason() == *expected, "Bind answered ", s.ToString(), "; the rules say ",
                     ReasonName(*expected));
      OPD_FUZZ_CHECK(s.code() == ReasonCode(*expected), s.ToString());
      OPD_FUZZ_CHECK(out == nullptr, "a refused bind handed out a session");
      continue;
    }
    OPD_FUZZ_CHECK(s.ok(), "Bind refused a bind the rules admit: ", s.ToString());
    v1::BindRequest req;
    std::memcpy(&req, msg.data(), sizeof(req));
    Known& k = sessions[req.session_id];
    OPD_FUZZ_CHECK(out == k.session && out->bound() && out->peer().pid == peer.pid && out->peer().uid == peer.uid &&
                       out->peer().gid == peer.gid,
                   "Bind handed back another session, or one not bound to the peer");
    k.state = Model::kBound;
    k.bound_by = peer;
    ++successes;
    OPD_FUZZ_CHECK(bound_hooks == successes, "the bind hook ran ", bound_hooks, " times for ", successes, " binds");
  }
  // Every session the model has live is the manager's, and bound as modelled.
  size_t live = 0;
  for (const auto& [id, k] : sessions) {
    if (k.state == Model::kGone) continue;
    ++live;
    OPD_FUZZ_CHECK(k.session->bound() == (k.state == Model::kBound), "session ", id, " bound state");
  }
  OPD_FUZZ_CHECK(manager.size() == live, "the manager holds ", manager.size(), " sessions, the model ", live);
}

// Scripts: a good bind, a second bind of the same session, a wrong pid, a
// bind after the session ended and after the deadline, raw messages.
std::vector<std::string> Seeds() {
  auto bind = [](uint8_t session, uint8_t peer) {
    return std::string{'\0', static_cast<char>(0x0F | (session << 4)), static_cast<char>(peer), '\0'} +
           std::string(sizeof(v1::BindRequest), '\0');
  };
  const char own_pid0 = 0x04, own_pid1 = 0x05, foreign_uid_gid_ok = 0x08;
  std::vector<std::string> out;
  out.push_back(std::string{'\0', '\0'} + bind(0, own_pid0));
  out.push_back(std::string{'\0', '\1'} + bind(1, own_pid1) + bind(1, own_pid1) + bind(0, own_pid1));
  out.push_back(std::string{'\1', '\2'} + bind(2, 0x02 | foreign_uid_gid_ok) + bind(0, foreign_uid_gid_ok));
  out.push_back(std::string{'\0', '\1'} + std::string("\x02\x00", 2) + bind(0, own_pid0) + bind(1, own_pid1));
  out.push_back(std::string{'\0', '\1'} + bind(0, own_pid0) + "\x03" + bind(1, own_pid1));
  v1::BindRequest raw{};
  raw.magic = v1::kBindRequestMagic;
  raw.protocol_version = v1::kProtocolVersion;
  raw.session_id = 1;
  std::string msg(reinterpret_cast<const char*>(&raw), sizeof(raw));
  out.push_back(std::string{'\0', '\0', '\0', '\x01', own_pid0, static_cast<char>(sizeof(raw))} + msg);
  out.push_back(std::string{'\0', '\0', '\0', '\x00', own_pid0, '\x31'} + msg);  // 49 bytes: too long
  // Binds, then attaches: by the binding process, by another pid, with no name, before binding.
  auto attach = [](uint8_t session, uint8_t peer, uint8_t name_length) {
    return std::string{'\1', static_cast<char>(0x0F | (session << 4)), static_cast<char>(peer), '\0'} +
           std::string(sizeof(v1::StoreAttachRequest), 'n') + std::string(1, static_cast<char>(name_length));
  };
  out.push_back(std::string{'\0', '\1'} + bind(0, own_pid0) + attach(0, own_pid0, 12) + attach(0, own_pid1, 12) +
                attach(0, own_pid0, 0) + attach(1, own_pid1, 3));
  // Region requests: admitted, a descriptor short, too many chunks.
  auto region = [](uint8_t peer, uint8_t fds) {
    return std::string{'\1', static_cast<char>(0x2F), static_cast<char>(peer), '\0'} +
           std::string(sizeof(v1::VmmRegionRequest), '\x01') + std::string(1, static_cast<char>(fds));
  };
  out.push_back(std::string{'\0', '\0'} + bind(0, own_pid0) + region(own_pid0, 3) + region(own_pid0, 241) +
                region(own_pid1, 2));
  return out;
}

void RunQuiet(const uint8_t* data, size_t size) {
  static const bool quiet = [] {
    spdlog::set_level(spdlog::level::off);  // Open and Bind log every session
    return true;
  }();
  (void)quiet;
  Run(data, size);
}

}  // namespace
}  // namespace cache_dit_opd

OPD_FUZZ_TARGET(cache_dit_opd::Seeds, cache_dit_opd::RunQuiet)
