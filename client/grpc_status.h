// File: client/grpc_status.h
//
// A gRPC answer of the daemon as this project's Status (common/status.h):
// its code, `what` + its message, and the Reason the daemon put in the
// trailing metadata (wire.h kReasonMetadataKey; Reason::kUnspecified for
// errors of gRPC itself). The one mapping back from the daemon's
// server/grpc/grpc_status mapping, for the C++ client and cache-dit-opdctl.
#pragma once

#include <string_view>

#include <grpcpp/grpcpp.h>

#include "common/status.h"

namespace cache_dit_opd::client {

Status FromGrpc(const grpc::Status& g, const grpc::ClientContext& ctx, std::string_view what);

}  // namespace cache_dit_opd::client
