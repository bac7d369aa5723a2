#include "common/ring_encode.h"

#include <algorithm>
#include <cstring>

namespace cache_dit_opd::client {

bool RecordArgs::Reserve(size_t payload) const {
  return count_ < static_cast<uint32_t>(kMaxArgs) && payload <= kCapacity - sizeof(v1::RingArgHeader) &&
         size_ + sizeof(v1::RingArgHeader) + payload <= kCapacity;
}

void RecordArgs::Header(v1::RingArgKind kind, uint32_t count) {
  const v1::RingArgHeader h{static_cast<uint32_t>(kind), count};
  Put(&h, sizeof(h));
  ++count_;
}

void RecordArgs::Put(const void* p, size_t n) {
  // A 0-dim tensor's sizes or an empty list may come as a null pointer, which
  // memcpy must never see, even for 0 bytes.
  if (n != 0) std::memcpy(buf_ + size_, p, n);
  size_ += n;
}

bool RecordArgs::AssignEncoded(const uint8_t* bytes, size_t n, uint32_t count) {
  if (n > kCapacity || count > static_cast<uint32_t>(kMaxArgs)) return false;
  if (n != 0) std::memcpy(buf_, bytes, n);
  size_ = n;
  count_ = count;
  return true;
}

bool RecordArgs::AssignCall(const std::vector<Arg>& args) {
  Clear();
  for (const Arg& arg : args) {
    bool ok = false;
    if (std::holds_alternative<NoneArg>(arg)) {
      ok = AddNone();
    } else if (const auto* t = std::get_if<TensorRef>(&arg)) {
      ok = t->sizes.size() == t->strides.size() &&
           AddTensor(t->region_id, t->byte_offset, t->dtype, t->sizes.size(), t->sizes.data(), t->strides.data());
    } else if (const auto* v = std::get_if<int64_t>(&arg)) {
      ok = AddInt(*v);
    } else if (const auto* d = std::get_if<double>(&arg)) {
      ok = AddFloat(*d);
    } else if (const auto* b = std::get_if<bool>(&arg)) {
      ok = AddBool(*b);
    } else if (const auto* il = std::get_if<std::vector<int64_t>>(&arg)) {
      ok = AddIntList(il->data(), il->size());
    } else if (const auto* fl = std::get_if<std::vector<double>>(&arg)) {
      ok = AddFloatList(fl->data(), fl->size());
    } else if (const auto* bl = std::get_if<std::vector<bool>>(&arg)) {
      bool b[kMaxListLength];
      ok = bl->size() <= static_cast<size_t>(kMaxListLength);
      if (ok) {
        std::copy(bl->begin(), bl->end(), b);
        ok = AddBoolList(b, bl->size());
      }
    }
    if (!ok) {
      Clear();
      return false;
    }
  }
  return true;
}

bool RecordArgs::AddTensor(uint64_t region_id, uint64_t byte_offset, DType dtype, size_t ndim,
                           const int64_t* sizes, const int64_t* strides) {
  if (ndim > static_cast<size_t>(kMaxTensorDims) || !Reserve(24 + 16 * ndim)) return false;
  Header(v1::RingArgKind::kTensor, static_cast<uint32_t>(ndim));
  const int32_t d[2] = {static_cast<int32_t>(dtype), 0};
  Put(&region_id, 8);
  Put(&byte_offset, 8);
  Put(d, 8);
  Put(sizes, 8 * ndim);
  Put(strides, 8 * ndim);
  return true;
}

bool RecordArgs::AddNone() {
  if (!Reserve(0)) return false;
  Header(v1::RingArgKind::kNone, 0);
  return true;
}

bool RecordArgs::AddInt(int64_t v) {
  if (!Reserve(8)) return false;
  Header(v1::RingArgKind::kInt, 1);
  Put(&v, 8);
  return true;
}

bool RecordArgs::AddFloat(double v) {
  if (!Reserve(8)) return false;
  Header(v1::RingArgKind::kFloat, 1);
  Put(&v, 8);
  return true;
}

bool RecordArgs::AddBool(bool v) {
  if (!Reserve(8)) return false;
  Header(v1::RingArgKind::kBool, 1);
  const int64_t x = v ? 1 : 0;
  Put(&x, 8);
  return true;
}

bool RecordArgs::AddIntList(const int64_t* v, size_t n) {
  if (n > static_cast<size_t>(kMaxListLength) || !Reserve(8 * n)) return false;
  Header(v1::RingArgKind::kIntList, static_cast<uint32_t>(n));
  Put(v, 8 * n);
  return true;
}

bool RecordArgs::AddFloatList(const double* v, size_t n) {
  if (n > static_cast<size_t>(kMaxListLength) || !Reserve(8 * n)) return false;
  Header(v1::RingArgKind::kFloatList, static_cast<uint32_t>(n));
  Put(v, 8 * n);
  return true;
}

bool RecordArgs::AddBoolList(const bool* v, size_t n) {
  if (n > static_cast<size_t>(kMaxListLength) || !Reserve(8 * n)) return false;
  Header(v1::RingArgKind::kBoolList, static_cast<uint32_t>(n));
  for (size_t i = 0; i < n; ++i) {
    const int64_t x = v[i] ? 1 : 0;
    Put(&x, 8);
  }
  return true;
}

}  // namespace cache_dit_opd::client
