#include "common/view_extent.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace cache_dit_opd {
namespace {

uint64_t Extent(std::vector<int64_t> sizes, std::vector<int64_t> strides, uint64_t item) {
  uint64_t b = 12345;
  EXPECT_TRUE(ViewExtentBytes(sizes, strides, item, &b));
  return b;
}

bool Refused(std::vector<int64_t> sizes, std::vector<int64_t> strides, uint64_t item) {
  uint64_t b = 12345;
  const bool ok = ViewExtentBytes(sizes, strides, item, &b);
  EXPECT_EQ(b, 12345u) << "a refused view must leave the output alone";
  return !ok;
}

TEST(ViewExtent, SpansFromTheFirstToOnePastTheLastElement) {
  EXPECT_EQ(Extent({2, 3}, {3, 1}, 4), 24u);
  EXPECT_EQ(Extent({2, 5, 3, 1}, {15, 1, 5, 1}, 4), 120u);  // permuted
  EXPECT_EQ(Extent({4, 8}, {16, 1}, 2), (3u * 16 + 7 + 1) * 2);  // rows padded: the gap after the last row is not spanned
  EXPECT_EQ(Extent({4, 3}, {0, 1}, 1), 3u);                 // broadcast
  EXPECT_EQ(Extent({}, {}, 8), 8u);                         // 0-dim: one element
}

TEST(ViewExtent, AnEmptyViewSpansNothing) {
  EXPECT_EQ(Extent({4, 0, 7}, {0, 7, 1}, 2), 0u);
  EXPECT_EQ(Extent({0}, {1}, 8), 0u);
}

TEST(ViewExtent, HasNoElementsWhenSomeSizeIsZero) {
  EXPECT_TRUE(HasNoElements(std::vector<int64_t>{256, 0}));
  EXPECT_TRUE(HasNoElements(std::vector<int64_t>{0}));
  EXPECT_FALSE(HasNoElements(std::vector<int64_t>{256, 16}));
  EXPECT_FALSE(HasNoElements(std::vector<int64_t>{}));  // 0-dim: one element
}

TEST(ViewExtent, RefusesNegativesRankMismatchAndOverflow) {
  EXPECT_TRUE(Refused({-1, 3}, {3, 1}, 4));
  EXPECT_TRUE(Refused({2, 3}, {-3, 1}, 4));
  EXPECT_TRUE(Refused({2, 3}, {3}, 4));
  EXPECT_TRUE(Refused({INT64_MAX, 2}, {4, 1}, 1));                         // size x stride
  EXPECT_TRUE(Refused({2, 2, 2}, {INT64_MAX, INT64_MAX, INT64_MAX}, 1));   // sum of spans
  EXPECT_TRUE(Refused({2, 2}, {INT64_MAX, INT64_MAX}, 2));                 // + 1, x itemsize
  EXPECT_EQ(Extent({2, 2}, {INT64_MAX, INT64_MAX}, 1), UINT64_MAX);         // the largest that fits
  EXPECT_TRUE(Refused({1LL << 62}, {1}, 8));                   // x itemsize
  EXPECT_EQ(Extent({2}, {1LL << 62}, 1), (1ull << 62) + 1);   // large, but it fits
}

}  // namespace
}  // namespace cache_dit_opd
