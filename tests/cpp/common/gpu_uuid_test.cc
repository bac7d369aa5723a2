#include "common/gpu_uuid.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace cache_dit_opd {
namespace {

struct Vector {
  std::string kind, a, b;
};

// tests/data/gpu_uuid_vectors.txt, which the Python client's test reads too.
std::vector<Vector> Vectors() {
  std::ifstream in(OPD_GPU_UUID_VECTORS);
  std::vector<Vector> out;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    Vector v;
    fields >> v.kind >> v.a >> v.b;
    if (v.a == "-") v.a.clear();
    out.push_back(v);
  }
  return out;
}

TEST(GpuUuid, FormatsTheVectors) {
  int n = 0;
  for (const Vector& v : Vectors()) {
    if (v.kind != "format") continue;
    ASSERT_EQ(v.a.size(), 32u) << v.a;
    uint8_t bytes[16];
    for (int i = 0; i < 16; ++i) bytes[i] = static_cast<uint8_t>(std::stoi(v.a.substr(2 * i, 2), nullptr, 16));
    EXPECT_EQ(FormatGpuUuid(bytes), v.b);
    EXPECT_TRUE(IsGpuUuid(FormatGpuUuid(bytes)));
    ++n;
  }
  EXPECT_GE(n, 3);
}

TEST(GpuUuid, AcceptsOnlyTheKeyForm) {
  int valid = 0, invalid = 0;
  for (const Vector& v : Vectors()) {
    if (v.kind == "valid") {
      EXPECT_TRUE(IsGpuUuid(v.a)) << v.a;
      ++valid;
    } else if (v.kind == "invalid") {
      EXPECT_FALSE(IsGpuUuid(v.a)) << v.a;
      ++invalid;
    }
  }
  EXPECT_GE(valid, 2);
  EXPECT_GE(invalid, 8);  // MIG spellings, short, long, bad digits, path tricks
}

}  // namespace
}  // namespace cache_dit_opd
