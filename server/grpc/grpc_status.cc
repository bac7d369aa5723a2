#include "server/grpc/grpc_status.h"

#include <string>

namespace cache_dit_opd {

grpc::Status ToGrpcStatus(const Status& status) {
  if (status.ok()) return grpc::Status::OK;
  int code = static_cast<int>(status.code());
  // Out-of-range values cannot come from our builders; keep the wire valid anyway.
  if (code <= 0 || code > static_cast<int>(grpc::StatusCode::UNAUTHENTICATED)) {
    return grpc::Status(grpc::StatusCode::UNKNOWN, status.message());
  }
  return grpc::Status(static_cast<grpc::StatusCode>(code), status.message());
}

void Finish(grpc::CallbackServerContext* ctx, grpc::ServerUnaryReactor* reactor, const Status& status) {
  if (!status.ok() && status.reason() != Reason::kUnspecified) {
    ctx->AddTrailingMetadata(v1::kReasonMetadataKey, std::to_string(static_cast<uint32_t>(status.reason())));
  }
  reactor->Finish(ToGrpcStatus(status));
}

}  // namespace cache_dit_opd
