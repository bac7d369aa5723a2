// File: common/hex.h
//
// Hex(v): "0x7f3a00000000", how messages print addresses and handles.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>

namespace cache_dit_opd {

inline std::string Hex(uint64_t v) {
  std::ostringstream os;
  os << "0x" << std::hex << v;
  return os.str();
}

}  // namespace cache_dit_opd
