// File: server/grpc/grpc_server.h
//
// The gRPC server on a Unix socket: the OperatorDaemon service plus the
// standard grpc.health.v1 service (gRPC's default implementation), whose
// status ("" and "cache_dit_opd.v1.OperatorDaemon") follows the daemon's
// serving state. The socket file is created with mode 0660.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include <grpcpp/server.h>

#include "common/status.h"

namespace cache_dit_opd {

inline constexpr char kServiceName[] = "cache_dit_opd.v1.OperatorDaemon";

class GrpcServer {
 public:
  GrpcServer() = default;
  ~GrpcServer();

  // GrpcServer::Start
  //
  // Listens on unix:`socket_path` (the path must be free: see
  // PrepareSocketPath). UNAVAILABLE when gRPC cannot bind it.
  Status Start(const std::string& socket_path, uint64_t max_message_bytes, grpc::Service* service, bool serving);
  // Sets the health status of the whole server and of the service.
  void SetServing(bool serving);
  // Stops accepting, cancels what is still running after `grace`, and
  // removes the socket file.
  void Shutdown(std::chrono::milliseconds grace);

 private:
  std::unique_ptr<grpc::Server> server_;
  std::string socket_path_;
};

}  // namespace cache_dit_opd
