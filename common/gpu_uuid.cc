#include "common/gpu_uuid.h"

#include <cstdio>

namespace cache_dit_opd {
namespace {

bool IsHex(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

}  // namespace

std::string FormatGpuUuid(const uint8_t b[16]) {
  char buf[64];
  std::snprintf(buf, sizeof(buf),
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                b[14], b[15]);
  return buf;
}

bool IsGpuUuid(std::string_view s) {
  static constexpr int kGroups[] = {8, 4, 4, 4, 12};
  if (s.size() != 4 + 8 + 4 + 4 + 4 + 12 + 4 || s.substr(0, 4) != "GPU-") return false;
  size_t i = 4;
  for (int g = 0; g < 5; ++g) {
    for (int k = 0; k < kGroups[g]; ++k, ++i) {
      if (!IsHex(s[i])) return false;
    }
    if (g < 4) {
      if (s[i] != '-') return false;
      ++i;
    }
  }
  return i == s.size();
}

}  // namespace cache_dit_opd
