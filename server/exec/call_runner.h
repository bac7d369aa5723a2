// File: server/exec/call_runner.h
//
// The executor's view of the dispatch layer (server/dispatch/torch_call_runner.h):
// decode + validate, then run on a stream. The daemon binary plugs in
// DispatchCallRunner (server/dispatch_call_runner.h), which forwards to
// PrepareCall/RunCall; executor tests plug in a fake, so the executor's
// ordering logic is tested without torch or a GPU.
#pragma once

#include <memory>

#include "common/call.h"
#include "server/dispatch/torch_call_runner.h"
#include "common/status.h"

namespace cache_dit_opd {

class CallRunner {
 public:
  virtual ~CallRunner() = default;
  // Decodes and bounds-checks `req` against the op's schema. Region lookups
  // go through `regions` (which records their use by this call).
  virtual Status Prepare(const CallRequest& req, const RegionResolver& regions,
                         std::unique_ptr<PreparedCall>* out) = 0;
  // Runs the op's own argument checks without the GPU (see ValidateCall).
  virtual Status Validate(PreparedCall& /*call*/) { return Status::Ok(); }
  // Enqueues the prepared call on `stream`; never synchronizes the device.
  // Sets `*sticky` when the CUDA context is no longer usable.
  virtual Status Run(PreparedCall& call, void* stream, bool* sticky) = 0;
};

}  // namespace cache_dit_opd
