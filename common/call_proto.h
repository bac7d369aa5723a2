// File: common/call_proto.h
//
// A call as a gRPC message (opd.proto's CallRequest) <-> the plain
// CallRequest (common/call.h): the daemon decodes what the C++ client
// encodes, with one pair of functions. Decoding checks only what the plain
// types cannot represent or what bounds the work (argument count, dims, list
// lengths, known dtypes, a set oneof); schema checks and bounds against
// regions are the daemon's dispatch layer's, shared by every transport.
// gRPC side (protobuf headers).
#pragma once

#include <string_view>

#include "cache_dit_opd/v1/opd.pb.h"
#include "common/call.h"
#include "common/status.h"

namespace cache_dit_opd {

// CallFromProto
//
// BAD_ARGUMENT naming the argument index and the value on: more than
// kMaxArgs arguments, an argument with no value, a tensor with more than
// kMaxTensorDims dims or sizes/strides of different ranks, an unknown or
// unspecified dtype, a list longer than kMaxListLength.
Status CallFromProto(const v1::CallRequest& in, CallRequest* out);

// TensorFromProto
//
// One tensor reference (a call's argument, a tensor to publish); errors are
// CallFromProto's, each starting with `what` ("argument 3").
Status TensorFromProto(std::string_view what, const v1::TensorRef& in, TensorRef* out);

// CallToProto
//
// Fills every field of `out` but session_id and token.
void CallToProto(const CallRequest& in, v1::CallRequest* out);

}  // namespace cache_dit_opd
