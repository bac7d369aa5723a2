#include "server/grpc/grpc_server.h"

#include <sys/stat.h>
#include <unistd.h>

#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include <algorithm>
#include <cstdint>

namespace cache_dit_opd {

uint64_t GrpcSendLimit(uint64_t max_message_bytes) { return std::max<uint64_t>(max_message_bytes, 4ull << 20); }

uint64_t GrpcMemoryQuota(uint64_t max_message_bytes) {
  // Legitimate traffic is a few requests of at most ~24 KiB in flight per
  // session (options.h), far below 64 MiB; the factor keeps room for
  // several messages at the limit when --max-message-bytes is raised.
  return std::max<uint64_t>(64ull << 20, 16 * max_message_bytes);
}

GrpcServer::~GrpcServer() { Shutdown(std::chrono::milliseconds(0)); }

Status GrpcServer::Start(const std::string& socket_path, uint64_t max_message_bytes, grpc::Service* service,
                         bool serving) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + socket_path, grpc::InsecureServerCredentials());
  builder.RegisterService(service);
  builder.SetMaxReceiveMessageSize(static_cast<int>(max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(std::min<uint64_t>(GrpcSendLimit(max_message_bytes), INT32_MAX)));
  // Without a quota gRPC buffers whatever size a message declares before
  // the limit above rejects it (measured: a 1 GiB request raised the fake
  // daemon's peak RSS by 1 GiB); with it, buffering stops at the quota.
  quota_.Resize(static_cast<size_t>(GrpcMemoryQuota(max_message_bytes)));
  builder.SetResourceQuota(quota_);
  // gRPC binds inside BuildAndStart; the umask gives the file mode 0660
  // from its first moment (chmod afterwards would leave a window).
  mode_t old = umask(0117);
  server_ = builder.BuildAndStart();
  umask(old);
  if (!server_) return Status::Unavailable("gRPC could not listen on unix:", socket_path);
  socket_path_ = socket_path;
  chmod(socket_path.c_str(), 0660);
  SetServing(serving);
  return Status::Ok();
}

void GrpcServer::SetServing(bool serving) {
  if (!server_) return;
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  if (health == nullptr) return;
  health->SetServingStatus(serving);
  health->SetServingStatus(kServiceName, serving);
}

void GrpcServer::Shutdown(std::chrono::milliseconds grace) {
  if (!server_) return;
  server_->Shutdown(std::chrono::system_clock::now() + grace);
  server_->Wait();
  server_.reset();
  unlink(socket_path_.c_str());
}

}  // namespace cache_dit_opd
