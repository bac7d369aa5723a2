#include "common/flags.h"

#include <cerrno>
#include <cstdlib>

namespace cache_dit_opd {

bool FlagArgs::Next() {
  if (++i_ >= argc_) return false;
  arg_ = argv_[i_];
  const size_t eq = arg_.rfind("--", 0) == 0 ? arg_.find('=') : std::string::npos;
  has_inline_value_ = eq != std::string::npos;
  flag_ = has_inline_value_ ? arg_.substr(0, eq) : arg_;
  inline_value_ = has_inline_value_ ? arg_.substr(eq + 1) : "";
  return true;
}

Status FlagArgs::Value(std::string* out) {
  if (has_inline_value_) {
    *out = inline_value_;
    return Status::Ok();
  }
  if (i_ + 1 >= argc_) return Status::InvalidArgument(flag_, " needs a value");
  *out = argv_[++i_];
  return Status::Ok();
}

Status ParseUnsigned(std::string_view flag, const std::string& text, uint64_t lo, uint64_t hi, uint64_t* out) {
  if (text.empty() || text[0] == '-' || text[0] == '+') {
    return Status::InvalidArgument(flag, ": '", text, "' is not a non-negative integer");
  }
  errno = 0;
  char* end = nullptr;
  unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  if (errno != 0 || end == text.c_str() || *end != '\0') {
    return Status::InvalidArgument(flag, ": '", text, "' is not a non-negative integer");
  }
  if (v < lo || v > hi) {
    return Status::InvalidArgument(flag, ": ", v, " is out of range [", lo, ", ", hi, "]");
  }
  *out = v;
  return Status::Ok();
}

}  // namespace cache_dit_opd
