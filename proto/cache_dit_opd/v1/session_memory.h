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
//   or, on a connection of its own, a bound session's process attaching a
//   weight-store entry (server/store/weight_store.h):
//   client -> daemon, one message:  StoreAttachRequest (568 bytes)
//   daemon -> client, one message:  StoreAttachReply (384 bytes) with, on
//                                   success and unless the entry is empty,
//                                   a file descriptor of its set's block
//                                   (SCM_RIGHTS); then the daemon closes
//                                   the connection
//   or, on a connection of its own, a bound session's process registering
//   client memory that legacy IPC cannot export (CUDA virtual memory:
//   PyTorch's expandable segments):
//   client -> daemon, one message:  VmmRegionRequest (3904 bytes) with one
//                                   POSIX descriptor per chunk (SCM_RIGHTS)
//   daemon -> client, one message:  VmmRegionReply (280 bytes); then the
//                                   daemon closes the connection
// A connection refused before its message is read (too many connections
// waiting, no message in time) is answered with a BindReply whatever it was
// going to send: a client reads a BindReply-sized answer as that refusal.
// The daemon admits the peer only when SO_PEERCRED's uid equals its own (or
// its gid equals --allowed-gid) and its pid equals OpenSession's client_pid
// (the pid the peer has in its own PID namespace: /proc/<pid>/status NSpid).
// An AdminRequest is admitted from root and the daemon's own uid only.
// A StoreAttachRequest or VmmRegionRequest is admitted from the process that
// bound the session (the same SO_PEERCRED pid and uid), with the session's
// token.
// The bind's connection then stays open for the life of the session: when
// either side closes it, the session ends at once (client death is noticed
// here).
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
#include <limits>

#include "cache_dit_opd/v1/wire.h"

namespace cache_dit_opd::v1 {

// 2: every error carries a Reason (wire.h) on gRPC, in ring completions and
//    in bind replies; host-ordered calls.
inline constexpr uint32_t kProtocolVersion = 2;
// 2: BindReply::reason, CompletionRecord::reason (ring.h).
inline constexpr uint32_t kLayoutVersion = 2;

// What the daemon raises an ended session's inputs_ready to, so every GPU
// wait it enqueued on them passes. A stream wait's GEQ is cyclic: "wait
// until (int64_t)(*addr - n) >= 0", so 2^64 - 1 would pass no wait at all;
// 2^63 - 1 passes every wait for n in [0, 2^63), and seqs count up from 1.
inline constexpr uint64_t kInputsReadyReleased = std::numeric_limits<int64_t>::max();

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

// Attaching a weight-store entry: the daemon looks it up as the session's
// peer (the store's access rules), lends the session its set's block as a
// read-only region (the calls may read it, never write it), and passes the
// block as a POSIX file descriptor of its CUDA virtual-memory allocation,
// which the client maps read-only (cuMemImportFromShareableHandle,
// cuMemMap, cuMemSetAccess with PROT_READ). The entry's tensor starts at
// `offset` in that mapping; a call names it as (region_id, offset + its own
// offset), like any region. A client that has mapped the block already
// (the same daemon_instance and block_id) may close the new descriptor and
// use its mapping with this session's region_id.
inline constexpr uint32_t kStoreAttachMagic = 0x48435441u;   // "ATCH"

struct StoreAttachRequest {
  uint32_t magic;             // kStoreAttachMagic
  uint32_t protocol_version;  // kProtocolVersion
  uint64_t session_id;
  uint8_t token[kTokenBytes];
  uint32_t name_bytes;        // 1 .. kMaxStoreNameBytes
  uint32_t reserved;          // 0
  char name[kMaxStoreNameBytes];  // the entry's name, name_bytes of it
};
static_assert(sizeof(StoreAttachRequest) == 568);

struct StoreAttachReply {
  int32_t status_code;        // google.rpc.Code; 0 = attached
  uint32_t reason;            // wire.h Reason when status_code != 0 (what the client does)
  uint64_t region_id;         // the block's region in the session; kNoRegion for an empty tensor (no descriptor)
  uint64_t daemon_instance;   // random per daemon process
  uint64_t block_id;          // the set's block, unique in the daemon process
  uint64_t block_bytes;       // the size the descriptor maps
  uint64_t offset;            // the entry's first byte in the block
  uint64_t bytes;             // the entry's bytes
  uint32_t dtype;             // wire DType
  uint32_t ndim;              // 0 .. kMaxTensorDims
  int64_t shape[kMaxTensorDims];
  char message[256];          // NUL-terminated, for people, when status_code != 0
};
static_assert(sizeof(StoreAttachReply) == 384);

// Registering a run of CUDA virtual-memory chunks of the client as one
// region: the client's mapping of consecutive physical allocations (each a
// cuMemCreate allocation exported with cuMemExportToShareableHandle as a
// POSIX descriptor), which the daemon imports and maps contiguously, in
// order, read-write on its device. The region is the run, `client_base` its
// first byte in the client; a tensor in it travels as (region_id, its
// offset from client_base), like any region. Chunks a client has unmapped
// and mapped again are other physical memory: the client keeps each chunk's
// buffer id (CU_POINTER_ATTRIBUTE_BUFFER_ID) to tell, and the ids are the
// run's key in the session with client_base (the same key answers the same
// region).
inline constexpr uint32_t kVmmRegionMagic = 0x4D4D5652u;      // "RVMM"
inline constexpr uint32_t kMaxVmmChunks = 240;                // within one SCM_RIGHTS message's 253

struct VmmRegionRequest {
  uint32_t magic;             // kVmmRegionMagic
  uint32_t protocol_version;  // kProtocolVersion
  uint64_t session_id;
  uint8_t token[kTokenBytes];
  uint64_t client_base;       // the run's first byte in the client
  uint32_t chunk_count;       // 1 .. kMaxVmmChunks: as many descriptors, in order
  uint32_t reserved;          // 0
  uint64_t chunk_bytes[kMaxVmmChunks];  // each chunk's size (a multiple of the device's granularity)
  uint64_t chunk_ids[kMaxVmmChunks];    // each chunk's buffer id in the client
};
static_assert(sizeof(VmmRegionRequest) == 3904);

struct VmmRegionReply {
  int32_t status_code;        // google.rpc.Code; 0 = registered
  uint32_t reason;            // wire.h Reason when status_code != 0
  uint64_t region_id;
  uint64_t mapped_bytes;      // the run's bytes, as mapped
  char message[256];          // NUL-terminated, for people, when status_code != 0
};
static_assert(sizeof(VmmRegionReply) == 280);

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
