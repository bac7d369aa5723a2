// File: server/grpc/grpc_server.h
//
// The gRPC server on a Unix socket: the OperatorDaemon service plus the
// standard grpc.health.v1 service (gRPC's default implementation), whose
// status ("" and "cache_dit_opd.v1.OperatorDaemon") follows the daemon's
// serving state. The socket file is created with mode 0660, and its
// connections are accepted by PeerAcceptor (peer_acceptor.h), so that each
// call's peer is known.
//
// Memory a client can make the server take:
//   - a request larger than `max_message_bytes` (--max-message-bytes) is
//     answered RESOURCE_EXHAUSTED; replies may be up to
//     GrpcSendLimit(max_message_bytes);
//   - gRPC 1.51 checks that limit only once the whole message has arrived
//     (it opens the stream's flow-control window to the size the message
//     declares), so the limit alone bounds nothing: every connection shares
//     a gRPC ResourceQuota of GrpcMemoryQuota(max_message_bytes) bytes.
//     Past it gRPC resets streams (RST_STREAM ENHANCE_YOUR_CALM, seen by the
//     client as RESOURCE_EXHAUSTED without a reason) and closes idle
//     connections (a call starting on one can fail UNAVAILABLE). The stream
//     it resets need not be the one that filled the quota (measured: a
//     host-ordered Call waiting for its kernel was reset while another
//     client sent 200 MiB requests), so a client streaming oversized
//     messages can fail other clients' RPCs in flight, but no longer
//     exhausts the daemon's memory. The ring (the data plane) does not go
//     through gRPC.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include <grpcpp/resource_quota.h>
#include <grpcpp/server.h>

#include "common/status.h"
#include "server/grpc/peer_acceptor.h"

namespace cache_dit_opd {

inline constexpr char kServiceName[] = "cache_dit_opd.v1.OperatorDaemon";

// The largest reply the server sends: max(max_message_bytes, 4 MiB) (a
// GetStats of many sessions, a catalog of extra op libraries).
uint64_t GrpcSendLimit(uint64_t max_message_bytes);
// The gRPC ResourceQuota of the whole server: max(64 MiB, 16 x
// max_message_bytes).
uint64_t GrpcMemoryQuota(uint64_t max_message_bytes);

class GrpcServer {
 public:
  GrpcServer() = default;
  ~GrpcServer();

  // GrpcServer::Start
  //
  // Listens on unix:`socket_path` (the path must be free: see
  // PrepareSocketPath), recording each connection's peer in `peers` (which
  // outlives the server). UNAVAILABLE when the socket cannot be bound.
  Status Start(const std::string& socket_path, uint64_t max_message_bytes, grpc::Service* service, bool serving,
               PeerTable* peers);
  // Sets the health status of the whole server and of the service.
  void SetServing(bool serving);
  // Stops accepting, cancels what is still running after `grace`, and
  // removes the socket file.
  void Shutdown(std::chrono::milliseconds grace);

 private:
  grpc::ResourceQuota quota_{"cache-dit-opd"};
  std::unique_ptr<grpc::Server> server_;
  PeerAcceptor acceptor_;
};

}  // namespace cache_dit_opd
