// File: common/status.h
//
// The daemon's one internal status type. Every layer (dispatch, regions,
// sessions, the call ring, the gRPC service) returns `Status`; the gRPC layer
// turns it into a grpc::Status in exactly one function (server/grpc/grpc_status.h).
// Plain C++: no gRPC, protobuf, spdlog or torch headers, so torch-facing and
// gRPC-facing targets can both use it.
//
//   Status s = registry.Register(...);
//   if (!s.ok()) return s;
//   return Status::InvalidArgument("offset ", off, " past region of ", size, " bytes");
#pragma once

#include <sstream>
#include <string>
#include <utility>

namespace cache_dit_opd {

// StatusCode values mirror google.rpc.Code so the mapping to gRPC is 1:1.
enum class StatusCode : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  // Builders: the arguments are streamed into the message, so a call names
  // the offending values: Status::InvalidArgument("dtype ", d, " is not ...").
  template <typename... A> static Status Cancelled(A&&... a) { return Make(StatusCode::kCancelled, a...); }
  template <typename... A> static Status InvalidArgument(A&&... a) { return Make(StatusCode::kInvalidArgument, a...); }
  template <typename... A> static Status NotFound(A&&... a) { return Make(StatusCode::kNotFound, a...); }
  template <typename... A> static Status AlreadyExists(A&&... a) { return Make(StatusCode::kAlreadyExists, a...); }
  template <typename... A> static Status PermissionDenied(A&&... a) { return Make(StatusCode::kPermissionDenied, a...); }
  template <typename... A> static Status ResourceExhausted(A&&... a) { return Make(StatusCode::kResourceExhausted, a...); }
  template <typename... A> static Status FailedPrecondition(A&&... a) { return Make(StatusCode::kFailedPrecondition, a...); }
  template <typename... A> static Status OutOfRange(A&&... a) { return Make(StatusCode::kOutOfRange, a...); }
  template <typename... A> static Status Unimplemented(A&&... a) { return Make(StatusCode::kUnimplemented, a...); }
  template <typename... A> static Status Internal(A&&... a) { return Make(StatusCode::kInternal, a...); }
  template <typename... A> static Status Unavailable(A&&... a) { return Make(StatusCode::kUnavailable, a...); }
  template <typename... A> static Status DeadlineExceeded(A&&... a) { return Make(StatusCode::kDeadlineExceeded, a...); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "INVALID_ARGUMENT: message"
  std::string ToString() const;

 private:
  template <typename... A>
  static Status Make(StatusCode code, A&&... a) {
    std::ostringstream os;
    (os << ... << a);
    return Status(code, os.str());
  }

  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

}  // namespace cache_dit_opd

// Returns the status from the enclosing function when it is not OK.
#define OPD_RETURN_IF_ERROR(expr)                          \
  do {                                                     \
    ::cache_dit_opd::Status _opd_status = (expr);          \
    if (!_opd_status.ok()) return _opd_status;             \
  } while (0)
