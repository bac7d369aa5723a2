// File: common/status.h
//
// The project's one status type, for the daemon and both clients. Every layer
// (dispatch, regions, sessions, the call ring, the gRPC service, the client
// engine) returns `Status`; the daemon's gRPC layer turns it into a
// grpc::Status in exactly one place (server/grpc/grpc_status.h). Plain C++:
// no gRPC, protobuf, spdlog or torch headers, so torch-facing and gRPC-facing
// targets can both use it.
//
// A status carries a code (google.rpc.Code), a message for people, and a
// Reason for programs (proto/cache_dit_opd/v1/wire.h): what a client does
// about an error is decided by the reason, never by the message.
//
//   Status s = registry.Register(...);
//   if (!s.ok()) return s;
//   return Status::InvalidArgument("offset ", off, " past region of ", size, " bytes");
//   return Status::Rejected(Reason::kLaneSequence, "lane ", l, ": expected seq ", n, ", got ", seq);
#pragma once

#include <sstream>
#include <string>
#include <string_view>
#include <utility>

#include "cache_dit_opd/v1/wire.h"

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

// Why a request was refused: wire.h's table (opd.proto's enum Reason).
enum class Reason : uint32_t {
  kUnspecified = 0,
#define CACHE_DIT_OPD_X(e, v, proto, code, action) e = v,
  CACHE_DIT_OPD_REASONS(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
};

// "LANE_SEQUENCE"; "UNSPECIFIED" for 0; "REASON(<n>)" for a value outside the table.
std::string ReasonName(Reason reason);
// How many leading bytes of `message`, at most `max`, a transport with a
// bounded message field keeps: never ending inside a UTF-8 sequence (clients
// decode the message as text).
size_t Utf8Prefix(std::string_view message, size_t max);
// The code a reason is sent with (wire.h); kUnknown for kUnspecified.
StatusCode ReasonCode(Reason reason);
// A received value: the reason, or kUnspecified when the table has no such value.
Reason ReasonFromWire(uint32_t value);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message, Reason reason = Reason::kUnspecified)
      : code_(code), reason_(reason), message_(std::move(message)) {}

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

  // Status::Rejected
  //
  // An error for `reason`, with the code wire.h gives that reason:
  // Status::Rejected(Reason::kRegionUnknown, "region ", id, " is not registered").
  template <typename... A>
  static Status Rejected(Reason reason, A&&... a) {
    Status s = Make(ReasonCode(reason), a...);
    s.reason_ = reason;
    return s;
  }
  // The same status with `reason` (an error that gains the reason its caller
  // knows); unchanged when OK.
  Status WithReason(Reason reason) const {
    Status s = *this;
    if (!s.ok()) s.reason_ = reason;
    return s;
  }

  // The same error (code and reason) with `before` and `after` around its
  // message: context added on the way up. Unchanged when OK.
  Status Annotated(std::string_view before, std::string_view after = {}) const {
    if (ok()) return *this;
    return Status(code_, std::string(before) + message_ + std::string(after), reason_);
  }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  Reason reason() const { return reason_; }
  // What a client does about this status (wire.h's ActionOf).
  v1::ClientAction action() const { return v1::ActionOf(static_cast<int>(code_), static_cast<uint32_t>(reason_)); }
  const std::string& message() const { return message_; }
  // "INVALID_ARGUMENT: message", "INVALID_ARGUMENT [LANE_SEQUENCE]: message"
  std::string ToString() const;

 private:
  template <typename... A>
  static Status Make(StatusCode code, A&&... a) {
    std::ostringstream os;
    (os << ... << a);
    return Status(code, os.str());
  }

  StatusCode code_ = StatusCode::kOk;
  Reason reason_ = Reason::kUnspecified;
  std::string message_;
};

}  // namespace cache_dit_opd

// Returns the status from the enclosing function when it is not OK.
#define OPD_RETURN_IF_ERROR(expr)                          \
  do {                                                     \
    ::cache_dit_opd::Status _opd_status = (expr);          \
    if (!_opd_status.ok()) return _opd_status;             \
  } while (0)
