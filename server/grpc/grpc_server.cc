#include "server/grpc/grpc_server.h"

#include <grpcpp/health_check_service_interface.h>
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
                         bool serving, PeerTable* peers) {
  grpc::EnableDefaultHealthCheckService(true);
  // No listening port: PeerAcceptor accepts and hands gRPC each
  // connection, so that a call's peer is known (peer_acceptor.h).
  grpc::ServerBuilder builder;
  builder.RegisterService(service);
  builder.SetMaxReceiveMessageSize(static_cast<int>(max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(std::min<uint64_t>(GrpcSendLimit(max_message_bytes), INT32_MAX)));
  // Without a quota gRPC buffers whatever size a message declares before
  // the limit above rejects it (measured: a 1 GiB request raised the fake
  // daemon's peak RSS by 1 GiB); with it, buffering stops at the quota.
  quota_.Resize(static_cast<size_t>(GrpcMemoryQuota(max_message_bytes)));
  builder.SetResourceQuota(quota_);
  server_ = builder.BuildAndStart();
  if (!server_) return Status::Unavailable("gRPC could not start its server for unix:", socket_path);
  SetServing(serving);
  if (Status s = acceptor_.Start(socket_path, server_.get(), peers); !s.ok()) {
    server_->Shutdown();
    server_->Wait();
    server_.reset();
    return Status::Unavailable("gRPC could not listen on unix:", socket_path, ": ", s.message());
  }
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
  acceptor_.Stop();
  if (!server_) return;
  server_->Shutdown(std::chrono::system_clock::now() + grace);
  server_->Wait();
  server_.reset();
}

}  // namespace cache_dit_opd
