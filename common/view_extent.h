// File: common/view_extent.h
//
// ViewExtentBytes: how many bytes a strided view spans, the one
// overflow-checked formula behind the daemon's bounds check
// (server/dispatch/torch_call_runner.cc), the C++ client's early check
// (client/core/regions.cc) and the native proxy kernels
// (client/python/proxy_kernel.cpp); HasNoElements: which views travel
// without a region (wire.h kNoRegion); DenseBytes: the bytes of a dense
// tensor (the weight store and its safetensors reader). Plain C++,
// header-only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace cache_dit_opd {

// HasNoElements
//
// True when some size is 0: the view has no element, addresses no byte and
// travels in region kNoRegion (wire.h). A 0-dim view (no sizes) has one
// element.
inline bool HasNoElements(std::span<const int64_t> sizes) {
  for (const int64_t s : sizes) {
    if (s == 0) return true;
  }
  return false;
}

// ViewExtentBytes
//
// Bytes from element [0, ..., 0] to one past the last element the view can
// address: (1 + sum_i (size_i - 1) * stride_i) * itemsize, or 0 when any size
// is 0 (an empty view addresses nothing). False, leaving `*bytes` alone, when
// the ranks differ, a size or stride is negative, or the arithmetic overflows
// 64 bits.
inline bool ViewExtentBytes(std::span<const int64_t> sizes, std::span<const int64_t> strides, uint64_t itemsize,
                            uint64_t* bytes) {
  if (sizes.size() != strides.size()) return false;
  bool empty = false;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 0 || strides[i] < 0) return false;
    empty = empty || sizes[i] == 0;
  }
  if (empty) {
    *bytes = 0;
    return true;
  }
  uint64_t last = 0;  // element index of the last addressable element
  for (size_t i = 0; i < sizes.size(); ++i) {
    uint64_t term = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(sizes[i] - 1), static_cast<uint64_t>(strides[i]), &term) ||
        __builtin_add_overflow(last, term, &last)) {
      return false;
    }
  }
  uint64_t b = 0;
  if (__builtin_add_overflow(last, uint64_t{1}, &b) || __builtin_mul_overflow(b, itemsize, &b)) return false;
  *bytes = b;
  return true;
}

// DenseBytes
//
// prod(shape) * itemsize, multiplied left to right with every product
// overflow-checked (as safetensors' own reader does: a shape whose partial
// product overflows before a 0 size is refused too). False, leaving `*bytes`
// alone, for a negative size or an overflow.
inline bool DenseBytes(std::span<const int64_t> shape, uint64_t itemsize, uint64_t* bytes) {
  uint64_t b = itemsize;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(b, static_cast<uint64_t>(d), &b)) return false;
  }
  *bytes = b;
  return true;
}

// FirstNonContiguousDim
//
// -1 when the view is row-major dense (each dim of size > 1 has the product
// of the sizes after it as its stride; a dim of size 1 may have any stride,
// as torch allows), else the last dim that breaks it, with the stride it
// would need in `*expected`. Sizes and strides have the same rank; the
// product cannot overflow for a view whose extent was checked.
inline int FirstNonContiguousDim(std::span<const int64_t> sizes, std::span<const int64_t> strides,
                                 int64_t* expected = nullptr) {
  int64_t want = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    if (sizes[i] == 1) continue;
    if (strides[i] != want) {
      if (expected != nullptr) *expected = want;
      return static_cast<int>(i);
    }
    want *= sizes[i];
  }
  return -1;
}

}  // namespace cache_dit_opd
