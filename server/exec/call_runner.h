// File: server/exec/call_runner.h
//
// The executor's seam to whatever turns a CallRequest into work on a stream:
// decode and bounds-check (Prepare), run the op's own checks without the GPU
// (Validate), enqueue (Run). The daemon binary plugs in the torch dispatcher
// (server/dispatch/torch_call_runner.h); executor tests plug in a fake, so the
// executor's ordering logic is tested without torch or a GPU. Plain C++.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/call.h"
#include "common/status.h"
#include "server/session/mapped_region.h"

namespace cache_dit_opd {

// A decoded, bounds-checked call, ready to run; made by one CallRunner's
// Prepare and handed back only to that runner.
class PreparedCall {
 public:
  virtual ~PreparedCall() = default;
  // "cache_dit_cuda_ops::op.overload"
  virtual const std::string& op_name() const = 0;
  // Region ids the call reads or writes (each once), for region lifetime
  // tracking by the caller.
  virtual const std::vector<uint64_t>& regions() const = 0;
};

class CallRunner {
 public:
  virtual ~CallRunner() = default;
  // Decodes and bounds-checks `req` against the op's schema. Region lookups
  // go through `regions` (which records their use by this call).
  virtual Status Prepare(const CallRequest& req, const RegionResolver& regions,
                         std::unique_ptr<PreparedCall>* out) = 0;
  // Prepare for a call whose op, overload and arguments equal those of
  // `previous`, a call this runner prepared and Validate accepted: resolves
  // and bounds-checks its regions again through `regions` (recording them for
  // this call), and where each resolves to the mapping `previous` was made
  // with, hands back `previous` itself with *reused = true (nothing decoded
  // again; Validate's verdict stands, since it read only those arguments and
  // addresses). Otherwise prepares afresh (*reused = false). The default
  // always prepares afresh.
  virtual Status PrepareAgain(const CallRequest& req, const RegionResolver& regions,
                              const std::shared_ptr<PreparedCall>& /*previous*/, std::shared_ptr<PreparedCall>* out,
                              bool* reused) {
    *reused = false;
    return PrepareShared(req, regions, out);
  }
  // Prepare, into the shared pointer the executor keeps a lane's calls in.
  Status PrepareShared(const CallRequest& req, const RegionResolver& regions, std::shared_ptr<PreparedCall>* out) {
    std::unique_ptr<PreparedCall> fresh;
    Status s = Prepare(req, regions, &fresh);
    *out = std::move(fresh);
    return s;
  }
  // Runs the op's own argument checks without the GPU, so a call can be
  // accepted or rejected before its inputs are ready.
  virtual Status Validate(PreparedCall& /*call*/) { return Status::Ok(); }
  // Enqueues the prepared call on `stream`; never synchronizes the device.
  // Sets `*sticky` when the CUDA context is no longer usable.
  virtual Status Run(PreparedCall& call, void* stream, bool* sticky) = 0;
};

}  // namespace cache_dit_opd
