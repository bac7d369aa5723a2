#include "server/grpc/grpc_service.h"

#include <spdlog/spdlog.h>

#include "common/log_throttle.h"
#include "common/call_proto.h"
#include "server/grpc/grpc_status.h"
#include "server/grpc/proto_convert.h"

namespace cache_dit_opd {
namespace {

grpc::ServerUnaryReactor* FinishNow(grpc::CallbackServerContext* ctx, const Status& status) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  Finish(ctx, reactor, status);
  return reactor;
}

// Answers a publish RPC with the set it made.
std::function<void(const Status&, const StoreListing&)> AnswerPublish(grpc::CallbackServerContext* ctx,
                                                                      grpc::ServerUnaryReactor* reactor,
                                                                      v1::PublishReply* reply) {
  return [ctx, reactor, reply](const Status& s, const StoreListing& l) {
    if (s.ok()) {
      for (const auto& e : l.entries) ToProto(e, reply->add_entries());
      reply->set_store_bytes(l.used_bytes);
    }
    Finish(ctx, reactor, s);
  };
}

}  // namespace

grpc::ServerUnaryReactor* OperatorDaemonService::GetVersion(grpc::CallbackServerContext* ctx,
                                                            const v1::VersionRequest*, v1::VersionReply* reply) {
  ToProto(daemon_->Version(), reply);
  return FinishNow(ctx, Status::Ok());
}

grpc::ServerUnaryReactor* OperatorDaemonService::OpenSession(grpc::CallbackServerContext* ctx,
                                                             const v1::OpenSessionRequest* request,
                                                             v1::OpenSessionReply* reply) {
  OpenSessionParams params = FromProto(*request);
  params.opener = peers_->Lookup(ctx->peer());
  OpenSessionResult result;
  // Every connection comes through PeerAcceptor: one it did not record is
  // refused rather than treated as an in-process caller.
  Status s = params.opener ? daemon_->OpenSession(params, &result)
                           : Status::Rejected(Reason::kPeerRefused, "the daemon cannot tell which process is on gRPC "
                                                                    "connection '", ctx->peer(), "'");
  if (s.ok()) {
    ToProto(result, reply);
  } else {
    // A peer can cause this at will: a bounded number of lines per interval.
    static LogThrottle refused(10, std::chrono::seconds(10));
    if (const auto v = refused.Next(); v.log) {
      spdlog::warn("OpenSession from pid {} refused: {}{}", request->client_pid(), s.ToString(),
                   SuppressedNote(v.suppressed));
    }
  }
  return FinishNow(ctx, s);
}

grpc::ServerUnaryReactor* OperatorDaemonService::CloseSession(grpc::CallbackServerContext* ctx,
                                                              const v1::CloseSessionRequest* request,
                                                              v1::CloseSessionReply*) {
  return FinishNow(ctx, daemon_->CloseSession(request->session_id(), request->token()));
}

grpc::ServerUnaryReactor* OperatorDaemonService::RegisterRegion(grpc::CallbackServerContext* ctx,
                                                                const v1::RegisterRegionRequest* request,
                                                                v1::RegisterRegionReply* reply) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  daemon_->RegisterRegion(request->session_id(), request->token(), request->ipc_handle(), request->size(),
                          [ctx, reactor, reply](const Status& s, const RegionRegistry::Registered& r) {
                            if (s.ok()) {
                              reply->set_region_id(r.region_id);
                              reply->set_mapped_size(r.mapped_size);
                              reply->set_reused(r.reused);
                            }
                            Finish(ctx, reactor, s);
                          });
  return reactor;
}

grpc::ServerUnaryReactor* OperatorDaemonService::UnregisterRegion(grpc::CallbackServerContext* ctx,
                                                                  const v1::UnregisterRegionRequest* request,
                                                                  v1::UnregisterRegionReply* reply) {
  bool deferred = false;
  Status s = daemon_->UnregisterRegion(request->session_id(), request->token(), request->region_id(), &deferred);
  if (s.ok()) reply->set_deferred(deferred);
  return FinishNow(ctx, s);
}

grpc::ServerUnaryReactor* OperatorDaemonService::Call(grpc::CallbackServerContext* ctx,
                                                      const v1::CallRequest* request, v1::CallReply*) {
  CallRequest req;
  Status s = CallFromProto(*request, &req);
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  auto finish = [ctx, reactor](const Status& st) { Finish(ctx, reactor, st); };
  if (!s.ok()) {
    // A malformed call still completes its seq in order when it is the
    // lane's next (same rule as a malformed ring record).
    daemon_->CallRejected(request->session_id(), request->token(), request->lane(), request->seq(),
                          CallTransport::kGrpc, std::move(s), std::move(finish));
    return reactor;
  }
  daemon_->Call(request->session_id(), request->token(), std::move(req), std::move(finish));
  return reactor;
}

grpc::ServerUnaryReactor* OperatorDaemonService::GetStats(grpc::CallbackServerContext* ctx,
                                                          const v1::StatsRequest* request, v1::StatsReply* reply) {
  StatsSnapshot snap;
  Status s = daemon_->GetStats(request->session_id(), request->token(), &snap);
  if (s.ok()) ToProto(snap, reply);
  return FinishNow(ctx, s);
}

grpc::ServerUnaryReactor* OperatorDaemonService::PublishFile(grpc::CallbackServerContext* ctx,
                                                             const v1::PublishFileRequest* request,
                                                             v1::PublishReply* reply) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  daemon_->PublishFile(request->session_id(), request->token(), FromProto(*request), AnswerPublish(ctx, reactor, reply));
  return reactor;
}

grpc::ServerUnaryReactor* OperatorDaemonService::PublishTensors(grpc::CallbackServerContext* ctx,
                                                                const v1::PublishTensorsRequest* request,
                                                                v1::PublishReply* reply) {
  std::vector<server::NamedTensor> tensors;
  std::vector<uid_t> readers;
  if (Status s = FromProto(*request, &tensors, &readers); !s.ok()) return FinishNow(ctx, s);
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  daemon_->PublishTensors(request->session_id(), request->token(), std::move(tensors), std::move(readers),
                          AnswerPublish(ctx, reactor, reply));
  return reactor;
}

grpc::ServerUnaryReactor* OperatorDaemonService::ListStore(grpc::CallbackServerContext* ctx,
                                                           const v1::ListStoreRequest* request,
                                                           v1::ListStoreReply* reply) {
  StoreListing l;
  Status s = daemon_->ListStore(request->session_id(), request->token(), request->prefix(), &l);
  if (s.ok()) {
    for (const auto& e : l.entries) ToProto(e, reply->add_entries());
    reply->set_store_bytes(l.used_bytes);
    reply->set_max_store_bytes(l.max_bytes);
    // gRPC clients take at most 4 MiB in one answer by default; past it a
    // client would read gRPC's own RESOURCE_EXHAUSTED, with no reason.
    if (const size_t bytes = reply->ByteSizeLong(); bytes > kMaxListingBytes) {
      reply->Clear();
      s = Status::Rejected(Reason::kResourceExhausted, "the listing of ", l.entries.size(), " entries under '",
                           request->prefix(), "' is ", bytes, " bytes, more than one answer carries (",
                           kMaxListingBytes, "): list by a longer prefix");
    }
  }
  return FinishNow(ctx, s);
}

grpc::ServerUnaryReactor* OperatorDaemonService::DeleteStore(grpc::CallbackServerContext* ctx,
                                                             const v1::DeleteStoreRequest* request,
                                                             v1::DeleteStoreReply*) {
  return FinishNow(ctx, daemon_->DeleteStore(request->session_id(), request->token(), request->name()));
}

}  // namespace cache_dit_opd
