#include "common/status.h"

namespace cache_dit_opd {

const char* StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kCancelled: return "CANCELLED";
    case StatusCode::kUnknown: return "UNKNOWN";
    case StatusCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case StatusCode::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case StatusCode::kNotFound: return "NOT_FOUND";
    case StatusCode::kAlreadyExists: return "ALREADY_EXISTS";
    case StatusCode::kPermissionDenied: return "PERMISSION_DENIED";
    case StatusCode::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case StatusCode::kFailedPrecondition: return "FAILED_PRECONDITION";
    case StatusCode::kAborted: return "ABORTED";
    case StatusCode::kOutOfRange: return "OUT_OF_RANGE";
    case StatusCode::kUnimplemented: return "UNIMPLEMENTED";
    case StatusCode::kInternal: return "INTERNAL";
    case StatusCode::kUnavailable: return "UNAVAILABLE";
  }
  return "UNKNOWN";
}

size_t Utf8Prefix(std::string_view message, size_t max) {
  if (message.size() <= max) return message.size();
  size_t n = max;
  while (n > 0 && (static_cast<unsigned char>(message[n]) & 0xC0) == 0x80) --n;  // continuation bytes: 10xxxxxx
  return n;
}

std::string ReasonName(Reason reason) {
  switch (reason) {
    case Reason::kUnspecified: return "UNSPECIFIED";
#define CACHE_DIT_OPD_X(e, v, proto, code, action) \
  case Reason::e: return #proto;
    CACHE_DIT_OPD_REASONS(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
  }
  return "REASON(" + std::to_string(static_cast<uint32_t>(reason)) + ")";
}

StatusCode ReasonCode(Reason reason) {
  switch (reason) {
    case Reason::kUnspecified: return StatusCode::kUnknown;
#define CACHE_DIT_OPD_X(e, v, proto, code, action) \
  case Reason::e: return static_cast<StatusCode>(code);
    CACHE_DIT_OPD_REASONS(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
  }
  return StatusCode::kUnknown;
}

namespace {
// Reason values run 1, 2, ... in table order, so a received value is valid
// exactly when it is below kReasonCount.
constexpr bool ReasonsAreDense() {
  uint32_t next = 1;
#define CACHE_DIT_OPD_X(e, v, proto, code, action) \
  if (v != next++) return false;
  CACHE_DIT_OPD_REASONS(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
  return next == v1::kReasonCount;
}
static_assert(ReasonsAreDense());
}  // namespace

Reason ReasonFromWire(uint32_t value) {
  return value < v1::kReasonCount ? static_cast<Reason>(value) : Reason::kUnspecified;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string s = StatusCodeName(code_);
  if (reason_ != Reason::kUnspecified) s += " [" + ReasonName(reason_) + "]";
  return s + ": " + message_;
}

}  // namespace cache_dit_opd
