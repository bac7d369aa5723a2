// File: tests/cpp/client/support/call_file.h
//
// A tiny binary file format that carries op calls and tensors between the
// GPU tests (which must not see torch) and opd_ref_tool (which links torch
// and the kernel library and computes the in-process reference). Plain C++:
// usable on both sides of the torch / gRPC divide.
//
// A tensor is stored as its whole storage plus the view on it (byte offset,
// sizes, strides), so strided inputs reach the reference exactly as they
// reach the daemon.
//
//   CallFile f;
//   f.calls.push_back({"fp8_comm_per_token_quant", "", {x}});
//   OPD_RETURN_IF_ERROR(WriteCallFile("/tmp/in.bin", f));
//   // opd_ref_tool run --in /tmp/in.bin --out /tmp/out.bin
//   CallFile out;
//   OPD_RETURN_IF_ERROR(ReadCallFile("/tmp/out.bin", &out));  // out.calls[i].tensors = outputs
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/call.h"
#include "common/status.h"

namespace cache_dit_opd::testing {

struct HostTensor {
  DType dtype = DType::kUnspecified;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;   // elements
  uint64_t byte_offset = 0;       // of element [0,...,0] inside storage
  std::vector<uint8_t> storage;   // every byte the view may address (and maybe more)

  // A contiguous tensor of `sizes` with zeroed storage.
  static HostTensor Contiguous(DType dtype, std::vector<int64_t> sizes);
  int64_t numel() const;
  int64_t itemsize() const { return DTypeSize(dtype); }
  bool contiguous() const;
  // The view's elements in row-major order, itemsize bytes each.
  std::vector<uint8_t> DenseBytes() const;
};

struct CallRecord {
  std::string op;         // "fp8_comm_per_token_quant"
  std::string overload;   // "" = functional
  std::vector<HostTensor> tensors;  // inputs (request) or outputs (reply)
  std::string error;      // reply: the op's error message when it rejected the inputs
  std::string label;      // free text for messages ("quant [3, 13]")
};

struct CallFile {
  std::vector<CallRecord> calls;
};

Status WriteCallFile(const std::string& path, const CallFile& file);
Status ReadCallFile(const std::string& path, CallFile* file);

// "[2, 3, 4]"
std::string DimsString(const std::vector<int64_t>& v);

}  // namespace cache_dit_opd::testing
