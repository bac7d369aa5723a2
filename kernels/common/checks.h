// File: kernels/common/checks.h
//
// Validation helpers shared by every op's check function. Each op has exactly
// one `check_<op>` (in its family's .cpp) that both its CUDA launcher and its
// Meta kernel call, so the same rules run on machines without a GPU, under
// torch.compile's fake tensors, and in the daemon (which calls the ops through
// the dispatcher).
//
// Every failure throws c10::ValueError (Python: ValueError) whose message
// starts with the op name, names the argument and the offending value, with
// dtypes as torch prints them and shapes as lists, as the Python client's
// fakes do (tests/python/test_client_parity.py holds the two to that):
//   "fp8_comm_per_token_quant: x must be torch.bfloat16, got torch.float32"
//
// Shapes are read as SymInts, so the checks also run while torch.compile
// traces with symbolic shapes.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymIntArrayRef.h>

#include <initializer_list>
#include <string>
#include <vector>

namespace cache_dit::checks {

// "[2, 3, 4]"
std::string shape_str(c10::SymIntArrayRef sizes);
// "torch.bfloat16"
std::string dtype_str(at::ScalarType dtype);
std::string shape_str(c10::IntArrayRef sizes);

// t.dim() == dims, else "op: name must have <dims> dims <layout>, got shape [..]".
void check_dims(const char* op, const char* name, const at::Tensor& t, int64_t dims,
                const char* layout);

// t.dim() >= min_dims.
void check_min_dims(const char* op, const char* name, const at::Tensor& t, int64_t min_dims,
                    const char* layout);

void check_dtype(const char* op, const char* name, const at::Tensor& t, at::ScalarType expected);
void check_dtype_in(const char* op, const char* name, const at::Tensor& t,
                    std::initializer_list<at::ScalarType> allowed);

// Dense row-major layout (size-1 dims may carry any stride).
void check_contiguous(const char* op, const char* name, const at::Tensor& t);

// A CUDA (or Meta) tensor, else "op: name must be a CUDA tensor, got device cpu".
void check_device(const char* op, const char* name, const at::Tensor& t);

// A CUDA tensor's first byte at a multiple of `bytes` (vector loads and TMA
// copies want it; the caching allocator's blocks always are, a view with a
// storage offset may not be), else "op: name must start at a 16-byte aligned
// address, got one 2 bytes past (storage_offset 1)". Meta and fake tensors
// have no address and pass.
void check_aligned(const char* op, const char* name, const at::Tensor& t, int64_t bytes);

// Every tensor on `ref`'s device (and CUDA or Meta).
void check_same_device(const char* op, const at::Tensor& ref, const char* ref_name,
                       std::initializer_list<std::pair<const char*, const at::Tensor*>> others);

// An output: exactly `sizes`, `dtype`, the inputs' device, contiguous, and
// (for real tensors) not overlapping any of `inputs` or `other_outputs`. A
// zero or overlapping stride can never pass, so a kernel writing densely
// stays inside the view.
void check_output(const char* op, const char* name, const at::Tensor& out,
                  c10::SymIntArrayRef sizes, at::ScalarType dtype, const at::Tensor& device_ref,
                  std::initializer_list<const at::Tensor*> inputs);

// Memory spanned by a view in bytes [begin, end); empty for numel() == 0.
struct ByteRange {
  uintptr_t begin = 0;
  uintptr_t end = 0;
};
ByteRange byte_range(const at::Tensor& t);

}  // namespace cache_dit::checks
