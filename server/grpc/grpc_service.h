// File: server/grpc/grpc_service.h
//
// cache_dit_opd.v1.OperatorDaemon on the gRPC callback API. Each handler
// converts the request (server/grpc/proto_convert.h), calls the transport-neutral
// Daemon, and finishes its reactor with ToGrpcStatus (server/grpc/grpc_status.h).
// OpenSession takes its opener from the call's connection (PeerTable).
// Handlers never block: Call finishes when the executor has enqueued (or
// rejected) the call, RegisterRegion when the reaper has opened the handle.
#pragma once

#include "cache_dit_opd/v1/opd.grpc.pb.h"
#include "server/daemon.h"
#include "server/grpc/peer_acceptor.h"

namespace cache_dit_opd {

// The largest ListStore answer: gRPC clients' default receive limit (4 MiB),
// less room for the framing. A larger listing is RESOURCE_EXHAUSTED.
inline constexpr size_t kMaxListingBytes = (4u << 20) - 4096;

class OperatorDaemonService final : public v1::OperatorDaemon::CallbackService {
 public:
  // `peers`: the connections PeerAcceptor handed to gRPC (outlives this).
  OperatorDaemonService(Daemon* daemon, const PeerTable* peers) : daemon_(daemon), peers_(peers) {}

  grpc::ServerUnaryReactor* GetVersion(grpc::CallbackServerContext* ctx, const v1::VersionRequest* request,
                                       v1::VersionReply* reply) override;
  grpc::ServerUnaryReactor* OpenSession(grpc::CallbackServerContext* ctx, const v1::OpenSessionRequest* request,
                                        v1::OpenSessionReply* reply) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* ctx, const v1::CloseSessionRequest* request,
                                         v1::CloseSessionReply* reply) override;
  grpc::ServerUnaryReactor* RegisterRegion(grpc::CallbackServerContext* ctx,
                                           const v1::RegisterRegionRequest* request,
                                           v1::RegisterRegionReply* reply) override;
  grpc::ServerUnaryReactor* UnregisterRegion(grpc::CallbackServerContext* ctx,
                                             const v1::UnregisterRegionRequest* request,
                                             v1::UnregisterRegionReply* reply) override;
  grpc::ServerUnaryReactor* Call(grpc::CallbackServerContext* ctx, const v1::CallRequest* request,
                                 v1::CallReply* reply) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* ctx, const v1::StatsRequest* request,
                                     v1::StatsReply* reply) override;
  grpc::ServerUnaryReactor* PublishFile(grpc::CallbackServerContext* ctx, const v1::PublishFileRequest* request,
                                        v1::PublishReply* reply) override;
  grpc::ServerUnaryReactor* PublishTensors(grpc::CallbackServerContext* ctx, const v1::PublishTensorsRequest* request,
                                           v1::PublishReply* reply) override;
  grpc::ServerUnaryReactor* ListStore(grpc::CallbackServerContext* ctx, const v1::ListStoreRequest* request,
                                      v1::ListStoreReply* reply) override;
  grpc::ServerUnaryReactor* DeleteStore(grpc::CallbackServerContext* ctx, const v1::DeleteStoreRequest* request,
                                        v1::DeleteStoreReply* reply) override;

 private:
  Daemon* const daemon_;
  const PeerTable* const peers_;
};

}  // namespace cache_dit_opd
