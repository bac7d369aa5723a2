// session_header_fuzz: what the client checks in the session memory the
// daemon hands it before trusting any of it: the header
// (client/core/session_mapping.h ValidateSessionMemoryHeader, through
// SessionMapping::Wrap) and, when there is a ring, its control block
// (client/core/ring_producer.h RingProducer::Open).
//
// Input: byte 0: flags that tie values together, so that the fuzzer reaches
// the checks past the first ones (bit 0: the memfd's size is the header's
// total_bytes; bit 1: OpenSession announced total_bytes; bit 2: ... and this
// session id; bit 3: ... and this lane count; bit 4: the right magic and
// layout version; bit 5: the right ring version and slot sizes). Bytes 1-28:
// memfd size (u64), the announced size, session id (u64) and lanes (u32);
// then the header's 72 bytes of fields and the ring control's first 16
// bytes. Missing bytes are 0.
//
// Checks: Validate accepts exactly the headers session_mapping.h describes,
// recomputed here in 128-bit arithmetic (every lane and the ring inside the
// mapping, no overlap, lanes and ring page-aligned), with FAILED_PRECONDITION for
// another layout and INTERNAL for the rest. An accepted header is then
// wrapped over a heap buffer of exactly the memfd's size (memfds up to
// 1 MiB): every lane's semaphores are read and raised through the
// mapping's accessors (AddressSanitizer sees any byte outside), and the
// ring control block is accepted by RingProducer::Open exactly when its
// version, sizes and power-of-two capacity are right and its slots fit
// the ring's bytes.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cache_dit_opd/v1/ring.h"
#include "cache_dit_opd/v1/session_memory.h"
#include "client/core/ring_producer.h"
#include "client/core/session_mapping.h"
#include "server/session/session_memory.h"
#include "tests/fuzz/fuzz_util.h"

namespace cache_dit_opd {
namespace {

namespace v1 = ::cache_dit_opd::v1;
using u128 = unsigned __int128;

constexpr size_t kHeaderFields = 72;  // the header's bytes before `reserved`
constexpr size_t kControlFields = 16;  // RingControl: version, capacity, slot_bytes, completion_bytes
constexpr size_t kPrefix = 29;
constexpr uint64_t kMaxWrapped = 1 << 20;

struct Input {
  uint8_t flags = 0;
  uint64_t mapped = 0;
  client::ExpectedLayout expect;
  v1::SessionMemoryHeader header{};
  v1::RingControl control{};
};

Input Parse(const uint8_t* data, size_t size) {
  std::vector<uint8_t> buf(kPrefix + kHeaderFields + kControlFields, 0);
  std::memcpy(buf.data(), data, std::min(size, buf.size()));
  Input in;
  in.flags = buf[0];
  std::memcpy(&in.mapped, &buf[1], 8);
  std::memcpy(&in.expect.total_bytes, &buf[9], 8);
  std::memcpy(&in.expect.session_id, &buf[17], 8);
  std::memcpy(&in.expect.lanes, &buf[25], 4);
  std::memcpy(&in.header, &buf[kPrefix], kHeaderFields);
  std::memcpy(&in.control, &buf[kPrefix + kHeaderFields], kControlFields);
  v1::SessionMemoryHeader& h = in.header;
  if (in.flags & 1) in.mapped = h.total_bytes;
  if (in.flags & 2) in.expect.total_bytes = h.total_bytes;
  if (in.flags & 4) in.expect.session_id = h.session_id;
  if (in.flags & 8) in.expect.lanes = h.lane_count;
  if (in.flags & 16) {
    h.magic = v1::kSessionMemoryMagic;
    h.layout_version = v1::kLayoutVersion;
  }
  if (in.flags & 32) {
    in.control.version = v1::kRingVersion;
    in.control.slot_bytes = v1::kSlotBytes;
    in.control.completion_bytes = v1::kCompletionBytes;
  }
  return in;
}

// session_mapping.h's rules, in its order: the code of the first one broken,
// kOk when none is.
StatusCode HeaderVerdict(const v1::SessionMemoryHeader& h, uint64_t mapped, const client::ExpectedLayout& e) {
  if (mapped < sizeof(v1::SessionMemoryHeader)) return StatusCode::kInternal;
  if (h.magic != v1::kSessionMemoryMagic || h.layout_version != v1::kLayoutVersion) {
    return StatusCode::kFailedPrecondition;
  }
  const u128 lanes_end = u128{h.lanes_offset} + u128{h.lane_count} * u128{h.lane_stride};
  const bool ok = h.total_bytes == mapped && (e.total_bytes == 0 || h.total_bytes == e.total_bytes) &&
                  h.session_id == e.session_id && h.lane_count >= 1 && h.lane_count <= client::kMaxLanes &&
                  h.lane_count == e.lanes && h.lane_stride == sizeof(v1::LaneSemaphores) &&
                  h.lanes_offset >= sizeof(v1::SessionMemoryHeader) && h.lanes_offset % 4096 == 0 &&
                  lanes_end <= mapped && (h.ring_offset == 0) == (h.ring_bytes == 0) &&
                  (h.ring_offset == 0 ||
                   (h.ring_offset % 4096 == 0 && h.ring_offset >= lanes_end &&
                    u128{h.ring_offset} + u128{h.ring_bytes} <= mapped));
  return ok ? StatusCode::kOk : StatusCode::kInternal;
}

bool ControlAcceptable(const v1::RingControl& c, uint64_t ring_bytes) {
  return ring_bytes >= v1::kRingControlBytes && c.version == v1::kRingVersion && c.capacity != 0 &&
         (c.capacity & (c.capacity - 1)) == 0 && c.slot_bytes == v1::kSlotBytes &&
         c.completion_bytes == v1::kCompletionBytes &&
         u128{v1::kRingControlBytes} + u128{c.capacity} * (v1::kSlotBytes + v1::kCompletionBytes) <= ring_bytes;
}

void CheckMapping(const Input& in) {
  const v1::SessionMemoryHeader& h = in.header;
  void* raw = nullptr;
  OPD_FUZZ_CHECK(::posix_memalign(&raw, 4096, in.mapped) == 0);
  std::unique_ptr<void, decltype(&std::free)> buf(raw, &std::free);
  auto* base = static_cast<uint8_t*>(raw);
  std::memset(base, 0, in.mapped);
  std::memcpy(base, &h, sizeof(h));
  std::unique_ptr<client::SessionMapping> mapping;
  const Status s = client::SessionMapping::Wrap(base, in.mapped, in.expect, &mapping);
  OPD_FUZZ_CHECK(s.ok(), "Wrap refused a header Validate accepted: ", s.ToString());
  OPD_FUZZ_CHECK(mapping->lane_count() == h.lane_count);
  for (uint32_t i = 0; i < mapping->lane_count(); ++i) {
    OPD_FUZZ_CHECK(u128{mapping->lane_offset(i)} + sizeof(v1::LaneSemaphores) <= in.mapped, "lane ", i,
                   " lies past the mapping");
    v1::LaneSemaphores* lane = mapping->lane(i);
    OPD_FUZZ_CHECK(reinterpret_cast<uint8_t*>(lane) == base + mapping->lane_offset(i));
    client::RaiseSemaphore(&lane->done, client::LoadSemaphore(&lane->inputs_ready) + 1);
  }
  (void)mapping->daemon_heartbeat();
  if (h.ring_offset == 0) return;

  std::memcpy(base + h.ring_offset, &in.control, std::min<uint64_t>(sizeof(in.control), h.ring_bytes));
  std::unique_ptr<client::RingProducer> producer;
  const Status r = client::RingProducer::Open(base + h.ring_offset, h.ring_bytes, client::RingProducer::Options{},
                                              [] { return Status::Ok(); }, &producer);
  v1::RingControl c{};
  std::memcpy(&c, &in.control, std::min<uint64_t>(sizeof(c), h.ring_bytes));
  const bool acceptable = ControlAcceptable(c, h.ring_bytes);
  OPD_FUZZ_CHECK(r.ok() == acceptable, "RingProducer::Open says ", r.ToString(), " for capacity ", c.capacity,
                 " in ", h.ring_bytes, " bytes");
  if (r.ok()) OPD_FUZZ_CHECK(producer->capacity() == c.capacity);
}

void Run(const uint8_t* data, size_t size) {
  const Input in = Parse(data, size);
  const Status s = client::ValidateSessionMemoryHeader(in.header, in.mapped, in.expect);
  const StatusCode want = HeaderVerdict(in.header, in.mapped, in.expect);
  OPD_FUZZ_CHECK(s.code() == want, "Validate answered ", s.ToString(), "; session_mapping.h says code ",
                 static_cast<int>(want));
  if (s.ok() && in.mapped <= kMaxWrapped) CheckMapping(in);
}

// The daemon's own session memory (server/session/session_memory.h), as
// inputs with nothing tied by the flags, and one with everything tied.
std::vector<std::string> Seeds() {
  std::vector<std::string> out;
  const struct {
    uint32_t lanes, ring;
  } shapes[] = {{1, 0}, {2, 4}, {4, 64}, {16, 8}};
  for (const auto& shape : shapes) {
    std::unique_ptr<SessionMemory> memory;
    const Status s = SessionMemory::Create(42, shape.lanes, shape.ring, &memory);
    OPD_FUZZ_CHECK(s.ok(), s.ToString());
    v1::SessionMemoryHeader header = *memory->header();
    header.daemon_pid = 4242;  // the seeds stay the same from one writer process to the next
    const v1::SessionMemoryHeader* h = &header;
    std::string in(1, '\0');
    fuzz::Append(&in, memory->bytes());
    fuzz::Append(&in, memory->bytes());
    fuzz::Append(&in, uint64_t{42});
    fuzz::Append(&in, shape.lanes);
    in.append(reinterpret_cast<const char*>(h), kHeaderFields);
    if (h->ring_offset != 0) {
      in.append(static_cast<const char*>(memory->data()) + h->ring_offset, kControlFields);
    }
    out.push_back(in);
  }
  out.push_back(std::string(1, '\x3F') + std::string(28, '\0') + out[1].substr(kPrefix));
  return out;
}

}  // namespace
}  // namespace cache_dit_opd

OPD_FUZZ_TARGET(cache_dit_opd::Seeds, cache_dit_opd::Run)
