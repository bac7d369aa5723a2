// File: server/store/safetensors.h
//
// The daemon's reader of .safetensors files (the format of
// github.com/huggingface/safetensors): what the weight store loads when a
// client asks it to publish tensors from a file the client may read. The file
// is the client's choice, so every byte of it is hostile input.
//
// Format:
//   bytes [0, 8)        N, a little-endian uint64: the header's length
//   bytes [8, 8 + N)    the header, a JSON object:
//                         "<tensor name>": {"dtype": "<D>", "shape": [d0, ...],
//                                           "data_offsets": [begin, end]}
//                       and at most one "__metadata__": {"<key>": "<value>"}
//                       (trailing spaces allowed: writers pad to 8 bytes)
//   bytes [8 + N, size) the data: tensor bytes at [begin, end) of this range,
//                       row-major, little-endian
//
// Contract of ParseSafetensorsHeader / SafetensorsFile::Open (an OK result
// guarantees all of it; anything else, a file that cannot be opened or read
// included, is INVALID_ARGUMENT [BAD_ARGUMENT] naming the offending tensor
// and value after the file's path: the file is the client's argument):
//   - N <= kMaxSafetensorsHeaderBytes (safetensors' own limit) and the file
//     holds the whole header; the header is one JSON object of exactly the
//     shape above: no unknown key in a tensor, each of its three keys once,
//     no tensor name or metadata key twice, metadata values strings,
//     numbers non-negative integers;
//   - a tensor's dtype is one the wire carries (kSafetensorsDTypes below);
//     its rank is at most v1::kMaxTensorDims (a stored tensor must fit a
//     call's view); its byte count prod(shape) * element size is computed
//     without overflow and equals end - begin;
//   - the tensors, in offset order, tile the data exactly: the first begins
//     at 0, each begins where the one before ends, the last ends at the end
//     of the file (no hole, no overlap, no trailing byte), as safetensors'
//     own validation demands;
//   - names are 1 .. kMaxSafetensorsNameBytes bytes.
// Parsing is iterative (a SAX pass with a fixed nesting depth of 3): no input
// makes it recurse, and memory is bounded by the header's size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/call.h"
#include "common/status.h"

namespace cache_dit_opd::server {

inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;
inline constexpr size_t kMaxSafetensorsNameBytes = 1024;

// The safetensors dtype names the reader accepts, with the wire dtype each
// is stored as: X(safetensors name, DType enumerator).
#define CACHE_DIT_OPD_SAFETENSORS_DTYPES(X) \
  X("BOOL", kBool)                          \
  X("U8", kUInt8)                           \
  X("I8", kInt8)                            \
  X("I32", kInt32)                          \
  X("I64", kInt64)                          \
  X("F16", kFloat16)                        \
  X("BF16", kBFloat16)                      \
  X("F32", kFloat32)                        \
  X("F64", kFloat64)                        \
  X("F8_E4M3", kFloat8E4M3FN)               \
  X("F8_E5M2", kFloat8E5M2)

// The DType of a safetensors dtype name; kUnspecified for any other name.
DType SafetensorsDType(std::string_view name);

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kUnspecified;
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // of its first byte, from the start of the file
  uint64_t bytes = 0;
};

struct SafetensorsIndex {
  uint64_t data_offset = 0;  // 8 + N: where the data begins in the file
  uint64_t data_bytes = 0;   // file size - data_offset
  std::vector<SafetensorsTensor> tensors;  // in offset order
  std::vector<std::pair<std::string, std::string>> metadata;  // in file order
};

// Checks `header` (the N header bytes) against a data section of
// `data_bytes` bytes, the file's data starting at `data_offset`; fills `out`.
Status ParseSafetensorsHeader(std::string_view header, uint64_t data_offset, uint64_t data_bytes,
                              SafetensorsIndex* out);

// An open .safetensors file whose index has been read and checked.
class SafetensorsFile {
 public:
  // Opens `path` read-only (a regular file only: never blocks on a FIFO or a
  // device), reads and checks its header; every error names the path and
  // why (missing, not readable by the daemon, truncated, ...).
  static Status Open(const std::string& path, std::unique_ptr<SafetensorsFile>* out);
  // The same on `fd`, a descriptor of `path` opened read-only by the caller
  // (who decided whose rights open it: server/store/publish_file.h). Takes
  // `fd` in every case: it is closed on failure and by the file.
  static Status Open(int fd, const std::string& path, std::unique_ptr<SafetensorsFile>* out);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const SafetensorsIndex& index() const { return index_; }
  // The tensor named `name`, or nullptr (a binary search: a publish that
  // names thousands of a file's tensors stays linear in them).
  const SafetensorsTensor* Find(std::string_view name) const;

  // Reads `tensor` (one of index().tensors) into `dst` (exactly tensor.bytes
  // long). A file that shrank since Open is INVALID_ARGUMENT naming the
  // tensor and how many bytes were missing.
  Status Read(const SafetensorsTensor& tensor, std::span<std::byte> dst) const;

 private:
  SafetensorsFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_ = -1;
  SafetensorsIndex index_;
  std::vector<const SafetensorsTensor*> by_name_;  // index_.tensors sorted by name
};

}  // namespace cache_dit_opd::server
