// File: common/flags.h
//
// The command-line conventions every binary of the project shares (the
// daemon, cache-dit-opdctl, the launcher): `--flag VALUE` or `--flag=VALUE`,
// and decimal values checked against a range, with errors that name the flag
// and the value.
//
//   FlagArgs args(argc, argv);
//   while (args.Next()) {
//     if (args.flag() == "--device") {
//       std::string v;
//       OPD_RETURN_IF_ERROR(args.Value(&v));
//       OPD_RETURN_IF_ERROR(ParseUnsigned(args.flag(), v, 0, 1023, &opts->device));
//     }
//   }
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace cache_dit_opd {

class FlagArgs {
 public:
  FlagArgs(int argc, const char* const* argv) : argc_(argc), argv_(argv) {}

  // Moves to the next argument (the first is argv[1]); false past the end.
  bool Next();
  // The whole argument ("--device=3") and its name ("--device"; the whole
  // argument when it has no '=').
  const std::string& arg() const { return arg_; }
  const std::string& flag() const { return flag_; }
  // The argument carried its value after '=' ("--ring=1" for a flag that
  // takes none is an error its parser reports).
  bool has_inline_value() const { return has_inline_value_; }
  // The flag's value: what follows '=', else the next argument (consumed).
  // INVALID_ARGUMENT "<flag> needs a value" when there is none.
  Status Value(std::string* out);

 private:
  const int argc_;
  const char* const* const argv_;
  int i_ = 0;
  std::string arg_;
  std::string flag_;
  std::string inline_value_;
  bool has_inline_value_ = false;
};

// A decimal in [lo, hi]. INVALID_ARGUMENT "<flag>: '<text>' is not a
// non-negative integer" or "<flag>: <v> is out of range [lo, hi]".
Status ParseUnsigned(std::string_view flag, const std::string& text, uint64_t lo, uint64_t hi, uint64_t* out);

template <typename T>
Status ParseUnsigned(std::string_view flag, const std::string& text, uint64_t lo, uint64_t hi, T* out) {
  uint64_t v = 0;
  OPD_RETURN_IF_ERROR(ParseUnsigned(flag, text, lo, hi, &v));
  *out = static_cast<T>(v);
  return Status::Ok();
}

}  // namespace cache_dit_opd
