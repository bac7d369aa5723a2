// File: client/opd_client.h
//
// The C++ client of the cache-dit-opd operator daemon (docs/DESIGN.md sections 1,
// 4 and 5). A Client talks to the one daemon that serves a CUDA device of
// this process: it finds the daemon by the GPU's UUID, opens a session
// (token, op catalog, shared-memory lane semaphores bound over the session
// channel), exports the caller's allocations once each with legacy CUDA IPC
// handles, and runs ops' `out` overloads on the daemon's GPU with their
// ordering carried by the caller's CUDA streams, without host
// synchronization:
//
//   ClientOptions opts;                       // device 0, discovery by UUID
//   std::unique_ptr<Client> client;
//   OPD_RETURN_IF_ERROR(Client::Connect(opts, &client));
//   TensorView x{x_ptr, {rows, 128}, {}, DType::kBFloat16};
//   TensorView q{q_ptr, {rows, 130}, {}, DType::kFloat8E4M3FN};
//   OPD_RETURN_IF_ERROR(client->Call("fp8_comm_per_token_quant", "out", {x, q}, stream));
//   // work enqueued on `stream` after this point sees q written.
//
// Ordering contract of Call (per stream):
//   - before the call, `stream` signals "inputs ready" for it: everything the
//     caller enqueued on `stream` before Call is finished before the daemon's
//     kernel starts;
//   - after the call, `stream` waits for "done": everything enqueued on
//     `stream` after Call starts only after the daemon's kernel finished.
//   Call returns when the daemon has accepted the call (decoded it, checked
//   every view against its region and run the op's own checks) or rejected
//   it; it never waits for `stream`'s earlier work or for the kernel.
//   Outputs are caller-allocated: a Call never allocates or frees GPU memory.
//
// Memory contract:
//   - Tensors must be device memory of the client's device allocated with
//     cudaMalloc (or an allocator built on it, e.g. torch's caching allocator
//     without expandable segments). VMM memory (cuMemCreate,
//     expandable_segments:True), memory pools (cudaMallocAsync) and managed
//     or host memory cannot be exported with legacy IPC handles; Call fails
//     with INVALID_ARGUMENT saying which.
//   - Each allocation is registered once per session and cached by (base,
//     buffer id). Freeing memory is the caller's business: call
//     ForgetAllocation(ptr) (or PruneRegions()) after freeing so the daemon's
//     mapping stops pinning it.
//   - An empty tensor (a size of 0) touches no memory: its data pointer is
//     ignored (null is fine), nothing is registered, and it travels as
//     region 0 (wire.h kNoRegion). The call still runs when another of its
//     outputs has elements; a call none of whose outputs has an element is
//     checked by the daemon and writes nothing.
//
// Failure contract:
//   - Errors are Status values (common/status.h), never exceptions, each
//     with the daemon's Reason; what the client does about one is
//     Status::action() (proto/cache_dit_opd/v1/wire.h), the same rule as the
//     Python client's: kRaiseValue / kRaise come back to the caller and leave
//     the session usable; kReregister (a region the daemon no longer knows)
//     re-registers the call's allocations and runs it once more; kReconnect
//     fails the session and runs the call once more on a new one (it did not
//     run); kFail fails the session and comes back.
//   - When the daemon dies (its process exits), the client raises every
//     lane's "done" to the last number it issued from the host, so no
//     stream of this process waits forever, and fails the session: calls in
//     flight return UNAVAILABLE. When the daemon only ends the session (its
//     end of the session channel closes), the session fails at once and the
//     daemon completes the numbers it received; the client releases the rest
//     from the host after a grace period (client/core/monitor.h). The next
//     call opens a new session (ClientOptions::reconnect); LastSessionError()
//     says why the previous one failed.
//   - Destroy a Client only when no call on it is in flight.
//   - A session's shared memory stays mapped until every stream that waited
//     on it has passed those waits (tracked with events, freed by a
//     background thread), so destroying a Client never faults a stream.
//
// Threading: Client is thread-safe. A PreparedCall must not be used by two
// threads at once. Calls on one stream are ordered; calls on different
// streams use different lanes and run concurrently in the daemon.
//
// This header includes CUDA runtime and generated protobuf headers, never
// torch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "cache_dit_opd/v1/opd.pb.h"
#include "client/core/regions.h"
#include "common/call.h"
#include "common/ring_encode.h"
#include "common/status.h"

namespace cache_dit_opd::client {

class Session;

// Arg
//
// One argument of an op, in schema order (keyword-only arguments included,
// e.g. the `out` tensors of an `.out` overload). Integers are int64_t,
// floats double; NoneArg is None.
using Arg = std::variant<NoneArg, TensorView, int64_t, double, bool, std::vector<int64_t>,
                         std::vector<double>, std::vector<bool>>;

// ClientOptions
struct ClientOptions {
  int device = 0;          // CUDA ordinal in this process; the daemon is found by its UUID
  std::string address;     // "" = discovery (client/discovery.h); else a socket path or unix: URI
  uint32_t lanes = 4;      // lanes requested (one per stream); the daemon may grant fewer
  std::string client_name = "cache-dit-opd C++ client";  // for the daemon's logs (<= 128 bytes)
  int connect_timeout_ms = 10000;  // connecting, OpenSession and the bind
  int rpc_timeout_ms = 30000;      // control RPCs: regions, stats, close
  // A call's deadline, gRPC or ring (600 s, as the Python client's
  // CACHE_DIT_OPD_CALL_TIMEOUT_S): a hung daemon ends a call with
  // DEADLINE_EXCEEDED instead of holding its thread and lane for good.
  // 0 = none on gRPC (the ring keeps its 600 s).
  int call_timeout_ms = 600000;
  bool reconnect = true;           // a failed session is replaced by the next call
  // Calls go through the session's shared-memory call ring when the daemon
  // offers one (and CACHE_DIT_OPD_RING is not 0), over gRPC otherwise. Same
  // semantics either way: a call returns once the daemon accepted or
  // rejected it.
  bool use_ring = true;
};

// CallOptions
//
// Per-call switches. The defaults are what every real caller wants;
// signal_inputs_ready = false makes a call that the daemon must never run
// (a client that never signals: tests prove it stalls no other session);
// wait_done = false leaves the stream unordered with the call's completion.
struct CallOptions {
  bool signal_inputs_ready = true;
  bool wait_done = true;
  int timeout_ms = -1;  // Call deadline; -1 = ClientOptions::call_timeout_ms; 0 = none on gRPC (ring: 600 s)
};

// OpEntry: one entry of the daemon's op catalog.
struct OpEntry {
  std::string name;      // "fp8_comm_per_token_quant"
  std::string overload;  // "out" or ""
  std::string schema;    // full c10 schema string
};

// SessionInfo: the current session, as OpenSession returned it.
struct SessionInfo {
  uint64_t session_id = 0;
  uint32_t lanes = 0;
  std::string gpu_uuid;       // the daemon's GPU
  int daemon_device = -1;     // the daemon's ordinal for it (informational)
  std::string target;         // gRPC target used
  std::string found_by;       // which discovery rule found it
  std::string transport;      // "ring" or "grpc": how calls travel
  std::vector<OpEntry> catalog;
};

// LaneState: a lane's bookkeeping and semaphores as the host sees them now.
struct LaneState {
  uint64_t issued = 0;        // last sequence number issued
  uint64_t inputs_ready = 0;  // shared semaphore values (may lag the GPU)
  uint64_t done = 0;
};

// PreparedCall
//
// A call whose arguments were resolved (regions registered) and encoded
// once, for the session's transport (a ring record, or the gRPC message),
// for callers that repeat the same call: CallPrepared only fills in the lane
// and sequence number. Bound to the session it was prepared in; after a
// reconnect it fails FAILED_PRECONDITION and must be prepared again.
class PreparedCall {
 public:
  PreparedCall();
  ~PreparedCall();
  PreparedCall(PreparedCall&&) noexcept;
  PreparedCall& operator=(PreparedCall&&) noexcept;

  const std::string& op() const { return call_.op; }
  const std::string& overload() const { return call_.overload; }
  uint64_t session_id() const { return session_id_; }

 private:
  friend class Client;
  friend class Session;
  CallRequest call_;                       // what travels, as every transport carries it
  RecordArgs record_;                      // its ring record, when the call goes through the ring
  uint32_t op_index_ = 0;                  // its catalog index (ring)
  bool ring_ = false;
  cache_dit_opd::v1::CallRequest request_;  // its gRPC message, when it goes over gRPC
  uint64_t session_id_ = 0;
  std::weak_ptr<Session> session_;
};

class Client {
 public:
  // Client::Connect
  //
  // Finds the daemon of `options.device` and opens a session. UNAVAILABLE
  // (no device, no driver, daemon not answering), NOT_FOUND (no daemon
  // socket; the message lists the paths tried), FAILED_PRECONDITION
  // (protocol, layout or GPU mismatch), PERMISSION_DENIED (the daemon does
  // not admit this uid), with the daemon's message.
  static Status Connect(const ClientOptions& options, std::unique_ptr<Client>* out);

  // Closes the session (Close()).
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Client::Call
  //
  // Runs `op`.`overload` (e.g. "fp8_comm_per_token_quant", "out") with
  // `args` on the daemon, ordered on `stream` (see the ordering contract
  // above). NOT_FOUND when the daemon's catalog has no such overload;
  // INVALID_ARGUMENT for arguments it rejects (a rejected call still
  // completes in order on the stream; its outputs are not written).
  Status Call(std::string_view op, std::string_view overload, const std::vector<Arg>& args,
              cudaStream_t stream, const CallOptions& options = {});

  // Client::Prepare / Client::CallPrepared
  //
  // Call split in two: Prepare resolves and encodes once; CallPrepared is the
  // raw hot path (lane, sequence number, semaphore write, RPC, wait) used by
  // benchmarks and repeated calls.
  Status Prepare(std::string_view op, std::string_view overload, const std::vector<Arg>& args,
                 PreparedCall* out);
  Status CallPrepared(PreparedCall& call, cudaStream_t stream, const CallOptions& options = {});

  // Client::ForgetAllocation
  //
  // Unregisters the cached allocation containing `ptr` (works after the
  // memory was freed). NOT_FOUND when none does.
  Status ForgetAllocation(const void* ptr);

  // Client::PruneRegions
  //
  // Unregisters every cached allocation that was freed or re-allocated.
  Status PruneRegions(size_t* removed = nullptr);

  // Client::ForgetStream
  //
  // Unbinds `stream` from its lane. Call it before destroying a stream that
  // made calls, so a new stream created at the same handle is ordered after
  // it (handles are reused by the runtime).
  void ForgetStream(cudaStream_t stream);

  // Client::GetVersion / Client::GetStats
  //
  // GetStats with this_session_only = false returns daemon-wide figures and
  // every session's (as the daemon allows).
  Status GetVersion(cache_dit_opd::v1::VersionReply* out);
  Status GetStats(bool this_session_only, cache_dit_opd::v1::StatsReply* out);

  // Client::EnsureSession
  //
  // Opens a session when there is none or the current one failed (what the
  // next Call would do).
  Status EnsureSession();

  // Client::Close
  //
  // Ends the session (CloseSession, then the channel). Idempotent; a later
  // Call reconnects when options.reconnect is set.
  Status Close();

  const ClientOptions& options() const { return options_; }
  // The current session; session_id 0 when there is none.
  SessionInfo session_info() const;
  // Regions cached in the current session.
  size_t region_count() const;
  // Lane of `stream` in the current session (binding one), or -1.
  int LaneOfStream(cudaStream_t stream);
  // Client::LastSessionError
  //
  // Why the most recent session failed (OK if none has). A session can fail
  // between calls (the daemon died); calls whose RPC had already returned
  // may then not have run, although their waits were released. The next
  // call reconnects silently, so callers that need to know check this (or
  // session_info().session_id) at their synchronization points.
  Status LastSessionError() const;

  // For tests and diagnostics: a lane's state now.
  Status InspectLane(uint32_t lane, LaneState* out) const;
  // For tests: raises lane `lane`'s inputs_ready to `value` from the host,
  // as a client that signals late would.
  Status RaiseInputsReadyFromHost(uint32_t lane, uint64_t value);

 private:
  explicit Client(const ClientOptions& options);
  Status CurrentSession(std::shared_ptr<Session>* out);
  std::shared_ptr<Session> Peek() const;
  void Drop(const std::shared_ptr<Session>& s);
  // What a failed call's status asks for (wire.h's action): re-register, or
  // drop the session; true when the call may run once more.
  bool Recover(const std::shared_ptr<Session>& s, const PreparedCall& call, const Status& status);

  const ClientOptions options_;
  std::string gpu_uuid_;
  mutable std::mutex mu_;
  std::shared_ptr<Session> session_;  // guarded by mu_
  uint64_t sessions_opened_ = 0;      // guarded by mu_
  Status last_session_error_;         // guarded by mu_
};

}  // namespace cache_dit_opd::client
