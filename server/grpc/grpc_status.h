// File: server/grpc/grpc_status.h
//
// The one place where the daemon's Status becomes a grpc::Status. Codes map
// 1:1 (StatusCode mirrors google.rpc.Code); the message is passed through,
// because every message names the offending value and carries no secrets
// (tokens and handles are never put into messages).
#pragma once

#include <grpcpp/support/status.h>

#include "common/status.h"

namespace cache_dit_opd {

grpc::Status ToGrpcStatus(const Status& status);

}  // namespace cache_dit_opd
