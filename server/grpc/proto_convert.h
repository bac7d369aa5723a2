// File: server/grpc/proto_convert.h
//
// Wire messages (cache_dit_opd.v1) <-> the daemon's plain types. Decoding
// checks only what the plain types cannot represent or what bounds the work
// (argument count, dims, list lengths, known dtypes, a set oneof); schema
// checks and bounds against regions stay in the dispatch layer, shared by
// every transport.
#pragma once

#include "cache_dit_opd/v1/opd.pb.h"
#include "common/call.h"
#include "common/status.h"
#include "server/daemon.h"

namespace cache_dit_opd {

// INVALID_ARGUMENT naming the argument index and the value on: more than
// kMaxArgs arguments, an argument with no value, a tensor with more than
// kMaxTensorDims dims or sizes/strides of different ranks, an unknown or
// unspecified dtype, a list longer than kMaxListLength.
Status FromProto(const v1::CallRequest& in, CallRequest* out);

OpenSessionParams FromProto(const v1::OpenSessionRequest& in);

void ToProto(const VersionInfo& in, v1::VersionReply* out);
void ToProto(const OpenSessionResult& in, v1::OpenSessionReply* out);
void ToProto(const StatsSnapshot& in, v1::StatsReply* out);

}  // namespace cache_dit_opd
