#include "server/grpc/grpc_status.h"

#include <string>

namespace cache_dit_opd {
namespace {

std::string Bounded(const std::string& message) {
  if (message.size() <= kMaxGrpcMessageBytes) return message;
  const size_t keep = Utf8Prefix(message, kMaxGrpcMessageBytes - 64);  // room for the note
  return message.substr(0, keep) + "... (" + std::to_string(message.size() - keep) + " more bytes cut)";
}

}  // namespace

grpc::Status ToGrpcStatus(const Status& status) {
  if (status.ok()) return grpc::Status::OK;
  int code = static_cast<int>(status.code());
  // Out-of-range values cannot come from our builders; keep the wire valid anyway.
  if (code <= 0 || code > static_cast<int>(grpc::StatusCode::UNAUTHENTICATED)) {
    return grpc::Status(grpc::StatusCode::UNKNOWN, Bounded(status.message()));
  }
  return grpc::Status(static_cast<grpc::StatusCode>(code), Bounded(status.message()));
}

void Finish(grpc::CallbackServerContext* ctx, grpc::ServerUnaryReactor* reactor, const Status& status) {
  if (!status.ok() && status.reason() != Reason::kUnspecified) {
    ctx->AddTrailingMetadata(v1::kReasonMetadataKey, std::to_string(static_cast<uint32_t>(status.reason())));
  }
  reactor->Finish(ToGrpcStatus(status));
}

}  // namespace cache_dit_opd
