// File: server/grpc/proto_convert.h
//
// Wire messages (cache_dit_opd.v1) <-> the daemon's plain types, for every
// RPC but Call (whose conversion the C++ client shares: common/call_proto.h).
#pragma once

#include "cache_dit_opd/v1/opd.pb.h"
#include "common/call.h"
#include "common/status.h"
#include "server/daemon.h"

namespace cache_dit_opd {

OpenSessionParams FromProto(const v1::OpenSessionRequest& in);

void ToProto(const VersionInfo& in, v1::VersionReply* out);
void ToProto(const OpenSessionResult& in, v1::OpenSessionReply* out);
void ToProto(const StatsSnapshot& in, v1::StatsReply* out);
server::PublishFileParams FromProto(const v1::PublishFileRequest& in);
void ToProto(const server::StoreEntryInfo& in, v1::StoreEntry* out);
// BAD_ARGUMENT as CallFromProto's for a tensor it could not take.
Status FromProto(const v1::PublishTensorsRequest& in, std::vector<server::NamedTensor>* tensors,
                 std::vector<uid_t>* readers);

}  // namespace cache_dit_opd
