// File: server/dispatch/torch_call_runner.h
//
// Schema-driven dispatch: the torch-facing half of the daemon's call path.
// Given a transport-neutral CallRequest (common/call.h) it
//   1. finds the op `cache_dit_cuda_ops::<op>.<overload>` in the c10
//      dispatcher (whatever libraries this process loaded registered it),
//   2. decodes every argument against the op's c10 schema (arity, types,
//      optional/None, lists), one generic path with no per-op code,
//   3. checks every tensor view against its region: dims <= kMaxTensorDims,
//      sizes >= 0, strides >= 0, overflow-checked
//      offset + extent(sizes, strides) * itemsize <= region size; tensors the
//      schema marks as written (Tensor(a!)) must be contiguous (a zero or
//      overlapping stride is rejected: a dense write through it would leave
//      the view),
//   4. wraps each view with at::from_blob on the region's device (no copy),
//   5. calls the overload through the boxed dispatcher with the given CUDA
//      stream current, so the kernel library's own per-op checks (layout
//      contract, shapes, dtypes) run before any launch.
//
// Contract: this header includes no torch, gRPC, protobuf or spdlog headers;
// its implementation includes torch only. It does not synchronize the device.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/call.h"
#include "common/status.h"

namespace cache_dit_opd {

// A region as mapped in the daemon: device pointer of the allocation's base
// and the allocation size the driver reported (never the client's claim).
struct MappedRegion {
  void* base = nullptr;
  uint64_t size = 0;
  int device = -1;  // CUDA ordinal in the daemon's process
};

// Looks up a session's region by id. Implemented by the region registry.
class RegionResolver {
 public:
  virtual ~RegionResolver() = default;
  // NOT_FOUND when the id is unknown to this session.
  virtual Status Resolve(uint64_t region_id, MappedRegion* out) const = 0;
};

// One entry of the op catalog served to clients at session open.
struct OpInfo {
  std::string name;      // "fused_merge_attn_states"
  std::string overload;  // "out" or "" (functional)
  std::string schema;    // c10 schema string, e.g. "cache_dit_cuda_ops::fp8_comm_per_token_quant.out(Tensor x, *, Tensor(a!) out) -> Tensor(a!)"
};

// Every op registered in namespace cache_dit_cuda_ops in this process, both
// overloads, sorted by (name, overload).
std::vector<OpInfo> ListOps();

// Loads an extra op library (dlopen with RTLD_GLOBAL, so its TORCH_LIBRARY
// registrations run). INVALID_ARGUMENT with dlerror() text on failure.
Status LoadOpLibrary(const std::string& path);

// A decoded, bounds-checked call, ready to run. Owns its IValues.
class PreparedCall {
 public:
  virtual ~PreparedCall() = default;
  // "cache_dit_cuda_ops::op.overload"
  virtual const std::string& op_name() const = 0;
  // Region ids the call reads or writes (each once), for region lifetime
  // tracking by the caller.
  virtual const std::vector<uint64_t>& regions() const = 0;
};

// Decodes and validates `req` (steps 1-4 above). `device_type_meta` = true
// wraps the views as meta tensors instead of CUDA tensors (used by tests on
// machines without a GPU; pointers are then never dereferenced).
// Errors: NOT_FOUND (unknown op/overload or region), INVALID_ARGUMENT (arity,
// types, dims, negative sizes/strides, overflow, view past the region end,
// non-contiguous written tensor, dtype unknown), each naming the argument and
// the offending value.
Status PrepareCall(const CallRequest& req, const RegionResolver& regions, bool device_type_meta,
                   std::unique_ptr<PreparedCall>* out);

// Runs the op's own checks (its Meta kernel, which calls the same check
// function as its CUDA launcher) on the prepared arguments, without touching
// the GPU, so a call can be accepted or rejected before its inputs are ready.
// OK when the op has no Meta kernel (its checks then run in RunCall).
// INVALID_ARGUMENT with the op's message when a check fails.
Status ValidateCall(PreparedCall& call);

// Runs a prepared call on `cuda_stream` (a cudaStream_t of the region's
// device; ignored for meta calls): sets the device and the current stream,
// calls the overload through the boxed dispatcher. A c10::Error from the
// op's checks becomes INVALID_ARGUMENT with the op's message. A CUDA error
// after the launch becomes INTERNAL; `*sticky_cuda_error` (if non-null) is
// set when the CUDA context is unusable (cudaErrorIllegalAddress and the
// other sticky errors), which the daemon must treat as fatal.
Status RunCall(PreparedCall& call, void* cuda_stream, bool* sticky_cuda_error);

}  // namespace cache_dit_opd
