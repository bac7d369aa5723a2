// File: server/grpc/grpc_status.h
//
// The one place where the daemon's Status becomes a gRPC answer. Codes map
// 1:1 (StatusCode mirrors google.rpc.Code); the message is passed through
// for people (every message names the offending value and carries no
// secrets: tokens and handles are never put into messages), cut to
// kMaxGrpcMessageBytes on a UTF-8 boundary with a note of what was cut (it
// travels percent-encoded in a header, and a message past gRPC's 16 KiB of
// metadata would replace the answer with gRPC's own RESOURCE_EXHAUSTED and
// no reason: a client echoing a 20 KB name got that); the Reason goes
// in the trailing metadata v1::kReasonMetadataKey as its decimal value, for
// programs (opd.proto, wire.h).
#pragma once

#include <grpcpp/grpcpp.h>

#include "common/status.h"

namespace cache_dit_opd {

inline constexpr size_t kMaxGrpcMessageBytes = 2048;

grpc::Status ToGrpcStatus(const Status& status);

// Finishes `reactor` with `status`, its reason in `ctx`'s trailing metadata.
void Finish(grpc::CallbackServerContext* ctx, grpc::ServerUnaryReactor* reactor, const Status& status);

}  // namespace cache_dit_opd
