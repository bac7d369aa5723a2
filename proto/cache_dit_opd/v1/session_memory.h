// File: proto/cache_dit_opd/v1/session_memory.h
//
// Session channel messages and the session shared-memory layout, version 2.
// Part of the protocol (like opd.proto): the Python client mirrors these
// offsets in python/cache_dit_opd/_layout.py and a test keeps them equal.
//
// Session channel (`<GPU-UUID>.session.sock`, SOCK_SEQPACKET, mode 0660):
//   client -> daemon, one message:  BindRequest (48 bytes)
//   daemon -> client, one message:  BindReply (16 + 256 bytes) with, on
//                                   success, the session memfd attached as
//                                   SCM_RIGHTS ancillary data
//   or, instead of a bind (an operator, not a client):
//   client -> daemon, one message:  AdminRequest (16 bytes)
//   daemon -> client, one message:  BindReply (no memfd); then the daemon
//                                   closes the connection
// The daemon admits the peer only when SO_PEERCRED's uid equals its own (or
// its gid equals --allowed-gid) and its pid equals OpenSession's client_pid
// (the pid the peer has in its own PID namespace: /proc/<pid>/status NSpid).
// An AdminRequest is admitted from root and the daemon's own uid only.
// The connection then stays open for the life of the session: when either
// side closes it, the session ends at once (client death is noticed here).
//
// Shared memory (the memfd; never a named /dev/shm object):
//   [0, 4096)             SessionMemoryHeader
//   [lanes_offset, ...)   lane_count x LaneSemaphores (128 bytes each)
//   [ring_offset, ...)    the call ring (ring_bytes; 0 when not enabled)
// Both processes map it shared and register it with CUDA
// (cuMemHostRegister, DEVICEMAP), so streams on either side can write and
// wait on the semaphores with cuStreamWriteValue64_v2 / cuStreamWaitValue64_v2.
//
// Semaphores are monotonic 64-bit timeline values, one per cache line:
//   inputs_ready: written by the client's stream after the work that produces
//                 a call's inputs ("inputs for seq <= n are ready"); read by
//                 the daemon on the host before it enqueues call n.
//   done:         written by the daemon's lane stream after call n's kernel
//                 (or in order for a rejected call); waited on by the client's
//                 stream (GEQ n). If the daemon dies the client writes it from
//                 the host to release its own waits.
// The memory is hostile input for the daemon: it reads values, never
// pointers or sizes, from it.
#pragma once

#include <cstdint>

#include "cache_dit_opd/v1/wire.h"

namespace cache_dit_opd::v1 {

// 2: every error carries a Reason (wire.h) on gRPC, in ring completions and
//    in bind replies; host-ordered calls.
inline constexpr uint32_t kProtocolVersion = 2;
// 2: BindReply::reason, CompletionRecord::reason (ring.h).
inline constexpr uint32_t kLayoutVersion = 2;
inline constexpr uint32_t kSessionMemoryMagic = 0x504F4443u;  // "CDOP" little-endian
inline constexpr uint32_t kBindRequestMagic = 0x444E4942u;    // "BIND"
inline constexpr uint32_t kTokenBytes = 32;

struct BindRequest {
  uint32_t magic;            // kBindRequestMagic
  uint32_t protocol_version; // kProtocolVersion
  uint64_t session_id;       // from OpenSessionReply
  uint8_t token[kTokenBytes];
};
static_assert(sizeof(BindRequest) == 48);

inline constexpr uint32_t kAdminRequestMagic = 0x4E4D4441u;   // "ADMN"

enum class AdminCommand : uint32_t {
  // Stop accepting sessions, let queued calls finish (--drain-deadline-ms),
  // end every session and exit 0: what SIGTERM does, for a peer that cannot
  // signal the daemon (another PID namespace) or should not need its pid.
  kDrain = 1,
};

struct AdminRequest {
  uint32_t magic;             // kAdminRequestMagic
  uint32_t protocol_version;  // kProtocolVersion
  uint32_t command;           // AdminCommand
  uint32_t reserved;          // 0
};
static_assert(sizeof(AdminRequest) == 16);

struct BindReply {
  int32_t status_code;       // google.rpc.Code; 0 = bound, memfd attached
  uint32_t layout_version;   // kLayoutVersion
  uint64_t shared_memory_bytes;  // size of the attached memfd
  uint32_t reason;           // wire.h Reason when status_code != 0 (what the client does)
  char message[252];         // NUL-terminated, for people, when status_code != 0
};
static_assert(sizeof(BindReply) == 272);

struct SessionMemoryHeader {
  uint32_t magic;            // kSessionMemoryMagic
  uint32_t layout_version;   // kLayoutVersion
  uint64_t total_bytes;      // size of the memfd
  uint64_t session_id;
  uint32_t lane_count;
  uint32_t lane_stride;      // sizeof(LaneSemaphores)
  uint64_t lanes_offset;     // byte offset of lane 0 (multiple of 4096)
  uint64_t ring_offset;      // byte offset of the call ring; 0 when none
  uint64_t ring_bytes;       // bytes of the call ring; 0 when none
  uint64_t daemon_pid;
  uint64_t daemon_heartbeat; // incremented by the daemon while it lives (host write, ~100 ms)
  uint8_t reserved[4096 - 72];
};
static_assert(sizeof(SessionMemoryHeader) == 4096);

struct alignas(64) LaneSemaphores {
  uint64_t inputs_ready;     // client stream -> daemon
  uint8_t pad0[56];
  uint64_t done;             // daemon lane stream -> client
  uint8_t pad1[56];
};
static_assert(sizeof(LaneSemaphores) == 128);

inline constexpr uint64_t kLanesOffset = 4096;

}  // namespace cache_dit_opd::v1
