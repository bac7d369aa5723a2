// bind_reply_fuzz: the client's side of the session channel, the BindReply
// (and the descriptors attached to it) that client/core/session_channel.h
// BindSession receives, and the StoreAttachReply AttachStoreEntry receives.
// Both read from a socket only, so the input travels through a real
// SOCK_SEQPACKET socketpair: the fuzzer is the daemon's end.
//
// Input: byte 0: bits 0-3 how many descriptors (a memfd) to attach, in one
// SCM_RIGHTS message or (bit 6) split over two; bit 4: send nothing and shut
// the daemon's end (EOF); bit 5: expect a size (bytes 1-8, else 0: any);
// bit 7: the exchange is a store attach, not a bind. Bytes 9.. are the reply
// message as sent (any length, 0 included).
//
// Checks: BindSession's answer is exactly what session_channel.h promises
// for that reply, recomputed here: UNAVAILABLE on EOF or an empty message,
// INTERNAL for any size but sizeof(BindReply) or truncated descriptors
// (more than it takes), the daemon's refusal with its code (UNKNOWN for one
// outside google.rpc.Code), reason and message (up to the first NUL),
// FAILED_PRECONDITION for another layout version, INTERNAL for other than
// one descriptor or a size other than the expected one; success hands back
// the attached memfd and the announced size. For an attach: UNAVAILABLE on
// EOF or an empty message; a BindReply-sized refusal relayed (INTERNAL when
// it refuses nothing); INTERNAL for any other size but
// sizeof(StoreAttachReply) or truncated descriptors; the refusal relayed;
// INTERNAL for a descriptor count other than one with memory (none for
// region kNoRegion), more than kMaxTensorDims dims, or an entry outside its
// block; success hands back exactly the attached memfd (or none) and the
// reply. The request it sent is a well-formed BindRequest or
// StoreAttachRequest, and no received descriptor stays open in the process
// on any path.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bitset>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cache_dit_opd/v1/session_memory.h"
#include "client/core/session_channel.h"
#include "tests/fuzz/fuzz_util.h"

namespace cache_dit_opd {
namespace {

namespace v1 = ::cache_dit_opd::v1;
constexpr size_t kFdScan = 128;  // received descriptors take the lowest free numbers
constexpr uint64_t kSessionId = 7;
constexpr int kClientMaxFds = 8;  // what BindSession makes room for (session_channel.cc)

std::bitset<kFdScan> OpenFds() {
  std::bitset<kFdScan> open;
  for (size_t fd = 0; fd < kFdScan; ++fd) open[fd] = ::fcntl(static_cast<int>(fd), F_GETFD) != -1;
  return open;
}

int SharedMemory() {
  static const int fd = [] {
    const int f = ::memfd_create("bind-reply-fuzz", MFD_CLOEXEC);
    OPD_FUZZ_CHECK(f >= 0 && ::ftruncate(f, 4096) == 0, "memfd_create");
    return f;
  }();
  return fd;
}

ino_t InodeOf(int fd) {
  struct stat st {};
  OPD_FUZZ_CHECK(::fstat(fd, &st) == 0, "fstat");
  return st.st_ino;
}

void SendReply(int fd, const std::string& msg, int fds, bool split) {
  const int shm = SharedMemory();
  iovec iov{const_cast<char*>(msg.data()), msg.size()};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  alignas(cmsghdr) char control[2 * CMSG_SPACE(sizeof(int) * 16)];
  if (fds > 0) {
    const int first = split ? fds / 2 : fds;
    const int second = fds - first;
    size_t len = 0;
    m.msg_control = control;
    m.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    for (const int n : {first, second}) {
      if (n == 0) continue;
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * n);
      for (int i = 0; i < n; ++i) std::memcpy(CMSG_DATA(c) + i * sizeof(int), &shm, sizeof(int));
      len += CMSG_SPACE(sizeof(int) * n);
      c = CMSG_NXTHDR(&m, c);
    }
    m.msg_controllen = len;
  }
  const ssize_t n = ::sendmsg(fd, &m, MSG_NOSIGNAL);
  OPD_FUZZ_CHECK(n == static_cast<ssize_t>(msg.size()), "sendmsg of ", msg.size(), " bytes: ", std::strerror(errno));
}

// The daemon's refusal as the client relays it: its code (UNKNOWN outside
// google.rpc.Code), reason and message (up to the first NUL) after `what`.
template <typename R>
void ExpectRefusal(const Status& s, const R& reply, const std::string& what) {
  const StatusCode code = reply.status_code > 0 && reply.status_code <= static_cast<int>(StatusCode::kUnavailable)
                              ? static_cast<StatusCode>(reply.status_code)
                              : StatusCode::kUnknown;
  const std::string message = what + " refused by the daemon: " +
                              std::string(reply.message, strnlen(reply.message, sizeof(reply.message)));
  OPD_FUZZ_CHECK(s.code() == code && s.reason() == ReasonFromWire(reply.reason) && s.message() == message,
                 "refusal relayed as ", s.ToString());
}

// A bind exchange: what session_channel.h promises BindSession answers.
void RunBind(int client, int daemon, const std::string& msg, int fds, bool eof, uint64_t expected_bytes) {
  const std::string token(v1::kTokenBytes, 'k');
  client::UniqueFd memfd;
  uint64_t shm_bytes = 0xDEAD;
  const Status s = client::BindSession(client, kSessionId, token, 1000, expected_bytes, &memfd, &shm_bytes);

  // The request, as the daemon would read it.
  v1::BindRequest req{};
  const ssize_t got = ::recv(daemon, &req, sizeof(req), MSG_DONTWAIT);
  OPD_FUZZ_CHECK(got == static_cast<ssize_t>(sizeof(req)) && req.magic == v1::kBindRequestMagic &&
                     req.protocol_version == v1::kProtocolVersion && req.session_id == kSessionId &&
                     std::memcmp(req.token, token.data(), v1::kTokenBytes) == 0,
                 "the client sent a malformed BindRequest");

  // What session_channel.h promises for this reply.
  v1::BindReply reply{};
  if (msg.size() == sizeof(reply)) std::memcpy(&reply, msg.data(), sizeof(reply));
  StatusCode want = StatusCode::kOk;
  if (eof || msg.empty()) {
    want = StatusCode::kUnavailable;
  } else if (msg.size() != sizeof(reply) || fds > kClientMaxFds) {
    want = StatusCode::kInternal;
  } else if (reply.status_code != 0) {
    ExpectRefusal(s, reply, "session bind");
    want = s.code();
  } else if (reply.layout_version != v1::kLayoutVersion) {
    want = StatusCode::kFailedPrecondition;
  } else if (fds != 1 || (expected_bytes != 0 && reply.shared_memory_bytes != expected_bytes)) {
    want = StatusCode::kInternal;
  }
  OPD_FUZZ_CHECK(s.code() == want, "BindSession answered ", s.ToString(), "; the contract says code ",
                 static_cast<int>(want));
  if (s.ok()) {
    OPD_FUZZ_CHECK(memfd.valid() && InodeOf(memfd.get()) == InodeOf(SharedMemory()),
                   "success without the attached memfd");
    OPD_FUZZ_CHECK(shm_bytes == reply.shared_memory_bytes, "announced size not handed back");
    memfd.reset();
  } else {
    OPD_FUZZ_CHECK(!memfd.valid(), "a failed bind handed out a descriptor");
  }
}

// An attach exchange: what session_channel.h promises AttachStoreEntry answers.
void RunAttach(int client, int daemon, const std::string& msg, int fds, bool eof) {
  const std::string token(v1::kTokenBytes, 'k');
  const std::string name = "flux/blocks.0.qweight";
  client::StoreAttachment got;
  const Status s = client::AttachStoreEntry(client, kSessionId, token, name, 1000, &got);

  v1::StoreAttachRequest req{};
  const ssize_t n = ::recv(daemon, &req, sizeof(req), MSG_DONTWAIT);
  OPD_FUZZ_CHECK(n == static_cast<ssize_t>(sizeof(req)) && req.magic == v1::kStoreAttachMagic &&
                     req.protocol_version == v1::kProtocolVersion && req.session_id == kSessionId &&
                     std::memcmp(req.token, token.data(), v1::kTokenBytes) == 0 && req.reserved == 0 &&
                     std::string_view(req.name, req.name_bytes) == name,
                 "the client sent a malformed StoreAttachRequest");

  const bool truncated = fds > kClientMaxFds;
  if (eof || msg.empty()) {
    OPD_FUZZ_CHECK(s.code() == StatusCode::kUnavailable, "AttachStoreEntry answered ", s.ToString());
  } else if (msg.size() == sizeof(v1::BindReply) && !truncated) {
    v1::BindReply refused{};
    std::memcpy(&refused, msg.data(), sizeof(refused));
    if (refused.status_code != 0) {
      ExpectRefusal(s, refused, "store attach");
    } else {
      OPD_FUZZ_CHECK(s.code() == StatusCode::kInternal, "a bind reply refusing nothing answered ", s.ToString());
    }
  } else if (msg.size() != sizeof(v1::StoreAttachReply) || truncated) {
    OPD_FUZZ_CHECK(s.code() == StatusCode::kInternal, "a malformed attach reply answered ", s.ToString());
  } else {
    v1::StoreAttachReply reply{};
    std::memcpy(&reply, msg.data(), sizeof(reply));
    const int want_fds = reply.region_id == v1::kNoRegion ? 0 : 1;
    const bool outside = want_fds == 1 && (reply.offset > reply.block_bytes || reply.bytes > reply.block_bytes - reply.offset);
    if (reply.status_code != 0) {
      ExpectRefusal(s, reply, "store attach");
    } else if (fds != want_fds || reply.ndim > static_cast<uint32_t>(v1::kMaxTensorDims) || outside) {
      OPD_FUZZ_CHECK(s.code() == StatusCode::kInternal, "an inconsistent attach reply answered ", s.ToString());
    } else {
      OPD_FUZZ_CHECK(s.ok(), "AttachStoreEntry refused a good reply: ", s.ToString());
      OPD_FUZZ_CHECK(std::memcmp(&got.reply, &reply, sizeof(reply)) == 0, "the reply was not handed back as sent");
      OPD_FUZZ_CHECK(got.fd.valid() == (want_fds == 1), "the block's descriptor was not handed back");
      if (got.fd.valid()) {
        OPD_FUZZ_CHECK(InodeOf(got.fd.get()) == InodeOf(SharedMemory()), "another descriptor than the one sent");
      }
    }
  }
  if (!s.ok()) OPD_FUZZ_CHECK(!got.fd.valid(), "a failed attach handed out a descriptor");
  got.fd.reset();
}

void Run(const uint8_t* data, size_t size) {
  if (size < 9) return;
  const uint8_t flags = data[0];
  const int fds = flags & 15;
  const bool eof = flags & 16;
  uint64_t expected_bytes = 0;
  if (flags & 32) std::memcpy(&expected_bytes, data + 1, 8);
  const bool split = flags & 64;
  const bool attach = flags & 128;
  const std::string msg(reinterpret_cast<const char*>(data) + 9, size - 9);
  if (msg.size() > 4096) return;  // beyond the socket's message limit

  (void)SharedMemory();  // opened once, before the descriptor snapshot
  int sv[2];
  OPD_FUZZ_CHECK(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) == 0, "socketpair");
  const std::bitset<kFdScan> before = OpenFds();
  if (eof) {
    OPD_FUZZ_CHECK(::shutdown(sv[1], SHUT_WR) == 0);
  } else {
    SendReply(sv[1], msg, fds, split);
  }
  if (attach) {
    RunAttach(sv[0], sv[1], msg, fds, eof);
  } else {
    RunBind(sv[0], sv[1], msg, fds, eof, expected_bytes);
  }
  const std::bitset<kFdScan> after = OpenFds();
  OPD_FUZZ_CHECK(after == before, "a received descriptor stayed open (", after.count(), " open, ", before.count(),
                 " before)");
  ::close(sv[0]);
  ::close(sv[1]);
}

std::string Input(uint8_t flags, uint64_t expected, const std::string& msg) {
  std::string out(1, static_cast<char>(flags));
  fuzz::Append(&out, expected);
  return out + msg;
}

std::string Reply(int32_t code, uint32_t layout, uint64_t bytes, uint32_t reason, const char* message) {
  v1::BindReply r{};
  r.status_code = code;
  r.layout_version = layout;
  r.shared_memory_bytes = bytes;
  r.reason = reason;
  std::strncpy(r.message, message, sizeof(r.message) - 1);
  return std::string(reinterpret_cast<const char*>(&r), sizeof(r));
}

std::string Attach(uint64_t region, int32_t code, uint64_t block_bytes, uint64_t offset, uint64_t bytes, uint32_t ndim) {
  v1::StoreAttachReply r{};
  r.status_code = code;
  r.reason = code ? 23 : 0;
  r.region_id = region;
  r.daemon_instance = 0x1234;
  r.block_id = 3;
  r.block_bytes = block_bytes;
  r.offset = offset;
  r.bytes = bytes;
  r.dtype = 6;
  r.ndim = ndim;
  r.shape[0] = 8;
  r.shape[1] = 16;
  return std::string(reinterpret_cast<const char*>(&r), sizeof(r));
}

std::vector<std::string> Seeds() {
  const std::string ok = Reply(0, v1::kLayoutVersion, 8192, 0, "");
  return {
      Input(1, 0, ok),                                   // bound, any size
      Input(1 | 32, 8192, ok),                           // bound, the expected size
      Input(1 | 32, 4096, ok),                           // another size than announced
      Input(0, 0, Reply(7, v1::kLayoutVersion, 0, 8, "wrong token for session 7")),
      Input(0, 0, Reply(99, 0, 0, 999, "an unknown code and reason")),
      Input(1, 0, Reply(0, 1, 8192, 0, "")),             // another layout
      Input(2 | 64, 0, ok),                              // two descriptors in two messages
      Input(9, 0, ok),                                   // more than the client takes
      Input(0, 0, ok),                                   // no descriptor
      Input(1, 0, ok.substr(0, 100)),                    // short
      Input(1, 0, ok + "x"),                             // long
      Input(1, 0, ""),                                   // empty, with a descriptor
      Input(16, 0, ""),                                  // EOF
      Input(128 | 1, 0, Attach(7, 0, 8 << 20, 256, 128, 2)),            // attached: the block's descriptor
      Input(128, 0, Attach(0, 0, 0, 0, 0, 2)),                          // an empty tensor: no descriptor
      Input(128 | 1, 0, Attach(7, 0, 4096, 4000, 128, 2)),              // an entry past its block
      Input(128, 0, Reply(7, v1::kLayoutVersion, 0, 23, "store entry 'x' does not exist")),  // refused early
      Input(128 | 2, 0, Attach(7, 5, 8 << 20, 0, 128, 2)),              // refused, with descriptors
  };
}

}  // namespace
}  // namespace cache_dit_opd

OPD_FUZZ_TARGET(cache_dit_opd::Seeds, cache_dit_opd::Run)
