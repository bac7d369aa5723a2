// File: server/dispatch/torch_call_runner.h
//
// TorchCallRunner: the daemon's CallRunner (server/exec/call_runner.h), the
// torch-facing half of its call path. Given a transport-neutral CallRequest
// (common/call.h) it
//   1. finds the op `cache_dit_cuda_ops::<op>.<overload>` in the c10
//      dispatcher (whatever libraries this process loaded registered it),
//   2. decodes every argument against the op's c10 schema (arity, types,
//      optional/None, lists), one generic path with no per-op code,
//   3. checks every tensor view against its region: dims <= kMaxTensorDims,
//      sizes >= 0, strides >= 0, overflow-checked
//      offset + extent(sizes, strides) * itemsize <= region size
//      (common/view_extent.h); tensors the schema marks as written
//      (Tensor(a!)) must be contiguous (a zero or overlapping stride is
//      rejected: a dense write through it would leave the view) and lie in
//      a writable region (never weight-store memory). A view in
//      region kNoRegion (0, wire.h) has no memory: it must have no element
//      (a size of 0) and byte offset 0, and is checked for rank, dtype,
//      sizes and strides only,
//   4. wraps each view with at::from_blob on the region's device (no copy);
//      a view without a region becomes an empty tensor (no storage) of its
//      sizes, strides and dtype on the device of the call's other tensors,
//      or the runner's `cuda_device` when none has a region,
//   5. Validate: runs the op's Meta kernel, which calls the same check
//      function as its CUDA launcher (layout contract, shapes, dtypes),
//   6. Run: calls the overload through the boxed dispatcher with the given
//      CUDA stream current. A call none of whose written tensors
//      (Tensor(a!)) has an element has nothing to write: when the op has a
//      Meta kernel (Validate checked the call) Run launches nothing and
//      succeeds. This is the one place of that rule: every client sends such
//      calls like any other.
//
// Contract: this header includes no torch, gRPC, protobuf or spdlog headers;
// its implementation includes torch only. It never synchronizes the device.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/call.h"
#include "common/status.h"
#include "server/exec/call_runner.h"

namespace cache_dit_opd {

class TorchCallRunner final : public CallRunner {
 public:
  // kCuda wraps views as CUDA tensors and launches; kMeta wraps them as meta
  // tensors (pointers never dereferenced) and runs only the checks: the
  // daemon on fake device ops (tests/fake_daemon/) and the CPU dispatch tests.
  enum class Device { kCuda, kMeta };
  // `cuda_device` (>= 0): the daemon's CUDA ordinal, where a call none of
  // whose tensors is in a region runs (its empty tensors live there).
  explicit TorchCallRunner(Device device = Device::kCuda, int cuda_device = 0);
  ~TorchCallRunner() override;

  // Every op registered in namespace cache_dit_cuda_ops in this process, both
  // overloads, sorted by (name, overload).
  static std::vector<OpInfo> ListOps();

  // Loads an extra op library (dlopen with RTLD_GLOBAL, so its TORCH_LIBRARY
  // registrations run). INVALID_ARGUMENT with dlerror() text on failure.
  static Status LoadOpLibrary(const std::string& path);

  // Steps 1-4. Reasons: OP_UNKNOWN (op or overload), REGION_UNKNOWN (from
  // `regions`), UNSUPPORTED (an overload that returns a new tensor, a schema
  // type the daemon cannot decode), BAD_ARGUMENT (arity, types, dims,
  // negative sizes/strides, overflow, view past the region end,
  // non-contiguous written tensor, unknown dtype, an element or an offset
  // in region kNoRegion), each naming the argument and the value.
  Status Prepare(const CallRequest& req, const RegionResolver& regions,
                 std::unique_ptr<PreparedCall>* out) override;

  // Steps 1 and 3 only, for a call equal to `previous` (CallRunner's
  // contract): each region view resolved and checked against its region as
  // in step 3 (same reasons); `previous` itself when every view's region has
  // the base and device it had then, else a full Prepare.
  Status PrepareAgain(const CallRequest& req, const RegionResolver& regions,
                      const std::shared_ptr<PreparedCall>& previous, std::shared_ptr<PreparedCall>* out,
                      bool* reused) override;

  // Step 5. OK when the op has no Meta kernel (its checks then run in Run).
  // INVALID_ARGUMENT with the op's message when a check fails.
  Status Validate(PreparedCall& call) override;

  // Step 6 on `stream` (a cudaStream_t of the region's device; a meta call
  // or one with nothing to write does nothing more). A c10::Error from the op's checks becomes
  // INVALID_ARGUMENT with the op's message; a CUDA error after the launch
  // becomes INTERNAL, and `*sticky` is set when the CUDA context is unusable
  // (common/cuda/driver_api.h's table), which the daemon treats as fatal.
  Status Run(PreparedCall& call, void* stream, bool* sticky) override;

 private:
  // What step 1 learns about an op once: its handle, its name, whether the
  // daemon serves it and whether it has a Meta kernel. Taken at the first
  // Prepare, when the daemon has loaded its libraries; an op registered
  // later is looked up on each call instead. The handles stay valid because
  // the daemon never unloads a library (LoadOpLibrary).
  struct OpTable;

  Status PrepareUnclassified(const CallRequest& req, const RegionResolver& regions,
                             std::unique_ptr<PreparedCall>* out);

  const Device device_;
  const int cuda_device_;
  std::once_flag ops_once_;
  std::unique_ptr<const OpTable> ops_;
};

}  // namespace cache_dit_opd
