#include "tests/cpp/client/support/call_file.h"

#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>

namespace cache_dit_opd::testing {
namespace {

constexpr uint32_t kMagic = 0x4C4C4143u;  // "CALL"
constexpr uint32_t kVersion = 1;

struct FileCloser {
  void operator()(FILE* f) const { if (f) std::fclose(f); }
};
using File = std::unique_ptr<FILE, FileCloser>;

class Writer {
 public:
  explicit Writer(FILE* f) : f_(f) {}
  void Bytes(const void* p, size_t n) { ok_ = ok_ && std::fwrite(p, 1, n, f_) == n; }
  template <typename T> void Pod(T v) { Bytes(&v, sizeof(v)); }
  void Str(const std::string& s) { Pod<uint64_t>(s.size()); Bytes(s.data(), s.size()); }
  void Vec(const std::vector<int64_t>& v) { Pod<uint64_t>(v.size()); Bytes(v.data(), v.size() * 8); }
  bool ok() const { return ok_; }
 private:
  FILE* f_;
  bool ok_ = true;
};

class Reader {
 public:
  explicit Reader(FILE* f) : f_(f) {}
  void Bytes(void* p, size_t n) { ok_ = ok_ && std::fread(p, 1, n, f_) == n; }
  template <typename T> T Pod() { T v{}; Bytes(&v, sizeof(v)); return v; }
  uint64_t Count(uint64_t limit) {
    uint64_t n = Pod<uint64_t>();
    if (n > limit) ok_ = false;
    return ok_ ? n : 0;
  }
  std::string Str() { std::string s(Count(1 << 20), '\0'); Bytes(s.data(), s.size()); return s; }
  std::vector<int64_t> Vec() { std::vector<int64_t> v(Count(64)); Bytes(v.data(), v.size() * 8); return v; }
  bool ok() const { return ok_; }
 private:
  FILE* f_;
  bool ok_ = true;
};

}  // namespace

HostTensor HostTensor::Contiguous(DType dtype, std::vector<int64_t> sizes) {
  HostTensor t;
  t.dtype = dtype;
  t.sizes = std::move(sizes);
  t.strides.assign(t.sizes.size(), 1);
  int64_t s = 1;
  for (size_t i = t.sizes.size(); i-- > 0;) {
    t.strides[i] = s;
    s *= t.sizes[i];
  }
  t.storage.assign(static_cast<size_t>(s * DTypeSize(dtype)), 0);
  return t;
}

int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

bool HostTensor::contiguous() const {
  int64_t expect = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    if (sizes[i] != 1 && strides[i] != expect) return false;
    expect *= sizes[i];
  }
  return true;
}

std::vector<uint8_t> HostTensor::DenseBytes() const {
  const int64_t item = itemsize();
  const int64_t n = numel();
  std::vector<uint8_t> out(static_cast<size_t>(n * item));
  std::vector<int64_t> idx(sizes.size(), 0);
  for (int64_t k = 0; k < n; ++k) {
    int64_t off = 0;
    for (size_t d = 0; d < sizes.size(); ++d) off += idx[d] * strides[d];
    std::memcpy(out.data() + k * item, storage.data() + byte_offset + off * item, static_cast<size_t>(item));
    for (size_t d = sizes.size(); d-- > 0;) {
      if (++idx[d] < sizes[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

Status WriteCallFile(const std::string& path, const CallFile& file) {
  File f(std::fopen(path.c_str(), "wb"));
  if (!f) return Status::Internal("cannot write ", path);
  Writer w(f.get());
  w.Pod(kMagic);
  w.Pod(kVersion);
  w.Pod<uint64_t>(file.calls.size());
  for (const CallRecord& c : file.calls) {
    w.Str(c.op);
    w.Str(c.overload);
    w.Str(c.error);
    w.Str(c.label);
    w.Pod<uint64_t>(c.tensors.size());
    for (const HostTensor& t : c.tensors) {
      w.Pod<int32_t>(static_cast<int32_t>(t.dtype));
      w.Vec(t.sizes);
      w.Vec(t.strides);
      w.Pod<uint64_t>(t.byte_offset);
      w.Pod<uint64_t>(t.storage.size());
      w.Bytes(t.storage.data(), t.storage.size());
    }
  }
  if (!w.ok()) return Status::Internal("short write to ", path);
  return Status::Ok();
}

Status ReadCallFile(const std::string& path, CallFile* file) {
  File f(std::fopen(path.c_str(), "rb"));
  if (!f) return Status::NotFound("cannot read ", path);
  Reader r(f.get());
  if (r.Pod<uint32_t>() != kMagic || r.Pod<uint32_t>() != kVersion) {
    return Status::InvalidArgument(path, " is not a call file of version ", kVersion);
  }
  file->calls.resize(r.Count(1 << 16));
  for (CallRecord& c : file->calls) {
    c.op = r.Str();
    c.overload = r.Str();
    c.error = r.Str();
    c.label = r.Str();
    c.tensors.resize(r.Count(64));
    for (HostTensor& t : c.tensors) {
      t.dtype = static_cast<DType>(r.Pod<int32_t>());
      t.sizes = r.Vec();
      t.strides = r.Vec();
      t.byte_offset = r.Pod<uint64_t>();
      t.storage.resize(r.Count(uint64_t{1} << 34));
      r.Bytes(t.storage.data(), t.storage.size());
    }
  }
  if (!r.ok()) return Status::InvalidArgument(path, " is truncated or malformed");
  return Status::Ok();
}

std::string DimsString(const std::vector<int64_t>& v) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
}

}  // namespace cache_dit_opd::testing
