// File: server/dispatch_call_runner.h
//
// CallRunner (server/exec/call_runner.h) backed by the dispatch layer
// (server/dispatch/torch_call_runner.h): PrepareCall with CUDA tensors, RunCall on
// the lane's stream. Lives in the daemon executable, the only target that
// links both opd_core and opd_dispatch.
#pragma once

#include "server/exec/call_runner.h"

namespace cache_dit_opd {

class DispatchCallRunner final : public CallRunner {
 public:
  Status Prepare(const CallRequest& req, const RegionResolver& regions,
                 std::unique_ptr<PreparedCall>* out) override {
    return PrepareCall(req, regions, /*device_type_meta=*/false, out);
  }
  Status Validate(PreparedCall& call) override { return ValidateCall(call); }
  Status Run(PreparedCall& call, void* stream, bool* sticky) override {
    return RunCall(call, stream, sticky);
  }
};

}  // namespace cache_dit_opd
