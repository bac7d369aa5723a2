// File: common/ring_encode.h
//
// The client's encoder of one shared-memory ring record's arguments
// (proto/cache_dit_opd/v1/ring.h, layout 1): what the Python client's
// _ring.encode_args writes, in C++, into a fixed buffer (no allocation on
// the call path). The daemon decodes it with common/ring_decode.h; the CPU
// tests round-trip every kind through that decoder.
//
// Every Add* returns false, leaving the arguments unchanged, when the value
// does not fit layout 1 (more than kMaxArgs arguments, a tensor of more than
// kMaxTensorDims dims, a list of more than kMaxListLength values, or more
// than kSlotBytes - 64 bytes in all). A caller that gets false sends the
// call another way or reports it; it never publishes a partial record.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cache_dit_opd/v1/ring.h"
#include "common/call.h"

namespace cache_dit_opd::client {

class RecordArgs {
 public:
  static constexpr size_t kCapacity = v1::kSlotBytes - sizeof(v1::RecordHeader);

  // sizes/strides: `ndim` values each, strides in elements.
  bool AddTensor(uint64_t region_id, uint64_t byte_offset, DType dtype, size_t ndim, const int64_t* sizes,
                 const int64_t* strides);
  bool AddNone();
  bool AddInt(int64_t v);
  bool AddFloat(double v);
  bool AddBool(bool v);
  bool AddIntList(const int64_t* v, size_t n);
  bool AddFloatList(const double* v, size_t n);
  bool AddBoolList(const bool* v, size_t n);

  // Takes arguments another encoder produced (the Python client's
  // _ring.encode_args); false when they cannot fit one record. The bytes are
  // the daemon's to validate, as every record's are.
  bool AssignEncoded(const uint8_t* bytes, size_t n, uint32_t count);

  // Every argument of a call, in order; false (and cleared) when they do not
  // fit one record. (Tensors as they are: region, offset, view, dtype.)
  bool AssignCall(const std::vector<Arg>& args);

  void Clear() { size_ = 0; count_ = 0; }
  const uint8_t* data() const { return buf_; }
  size_t size() const { return size_; }
  uint32_t count() const { return count_; }

 private:
  // Room for one more argument of `payload` bytes after its header.
  bool Reserve(size_t payload) const;
  void Header(v1::RingArgKind kind, uint32_t count);
  void Put(const void* p, size_t n);

  alignas(8) uint8_t buf_[kCapacity];
  size_t size_ = 0;
  uint32_t count_ = 0;
};

}  // namespace cache_dit_opd::client
