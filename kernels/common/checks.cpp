#include "kernels/common/checks.h"

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <sstream>
#include <string>

namespace cache_dit::checks {

namespace {

std::string to_str(int64_t v) { return std::to_string(v); }

std::string to_str(const c10::SymInt& v) {
  if (auto i = v.maybe_as_int()) return std::to_string(*i);
  return v.toSymNode()->str();
}

template <typename Sizes>
std::string join_sizes(Sizes sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + to_str(sizes[i]);
  return s + "]";
}

}  // namespace

std::string shape_str(c10::SymIntArrayRef sizes) { return join_sizes(sizes); }
std::string dtype_str(at::ScalarType dtype) { return std::string("torch.") + c10::getDtypeNames(dtype).first; }
std::string shape_str(c10::IntArrayRef sizes) { return join_sizes(sizes); }

void check_dims(const char* op, const char* name, const at::Tensor& t, int64_t dims,
                const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == dims, op, ": ", name, " must have ", dims, " dims ", layout,
                    ", got shape ", shape_str(t.sym_sizes()));
}

void check_min_dims(const char* op, const char* name, const at::Tensor& t, int64_t min_dims,
                    const char* layout) {
  TORCH_CHECK_VALUE(t.dim() >= min_dims, op, ": ", name, " must have at least ", min_dims,
                    " dims ", layout, ", got shape ", shape_str(t.sym_sizes()));
}

void check_dtype(const char* op, const char* name, const at::Tensor& t, at::ScalarType expected) {
  TORCH_CHECK_VALUE(t.scalar_type() == expected, op, ": ", name, " must be ", dtype_str(expected), ", got ",
                    dtype_str(t.scalar_type()));
}

void check_dtype_in(const char* op, const char* name, const at::Tensor& t,
                    std::initializer_list<at::ScalarType> allowed) {
  for (auto dtype : allowed) {
    if (t.scalar_type() == dtype) return;
  }
  std::ostringstream os;
  const char* sep = "";
  for (auto dtype : allowed) {
    os << sep << dtype_str(dtype);
    sep = ", ";
  }
  TORCH_CHECK_VALUE(false, op, ": ", name, " must be one of {", os.str(), "}, got ",
                    dtype_str(t.scalar_type()));
}

void check_contiguous(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous, got shape ",
                    shape_str(t.sym_sizes()), " with strides ", shape_str(t.sym_strides()),
                    " (call .contiguous() first)");
}

void check_device(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.is_cuda() || t.is_meta(), op, ": ", name, " must be a CUDA tensor, got device ", t.device());
}

void check_aligned(const char* op, const char* name, const at::Tensor& t, int64_t bytes) {
  if (!t.is_cuda()) return;
  const auto past = static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) % static_cast<uintptr_t>(bytes));
  TORCH_CHECK_VALUE(past == 0, op, ": ", name, " must start at a ", bytes, "-byte aligned address, got one ", past,
                    " bytes past (storage_offset ", t.storage_offset(), ")");
}

void check_same_device(const char* op, const at::Tensor& ref, const char* ref_name,
                       std::initializer_list<std::pair<const char*, const at::Tensor*>> others) {
  check_device(op, ref_name, ref);
  for (const auto& [name, t] : others) {
    TORCH_CHECK_VALUE(t->device() == ref.device(), op, ": ", name, " is on ", t->device(),
                      " but ", ref_name, " is on ", ref.device());
  }
}

ByteRange byte_range(const at::Tensor& t) {
  if (t.numel() == 0) return {};
  // Strides are never negative in torch, so the view spans from data_ptr to
  // its last element.
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  return {begin, begin + static_cast<uintptr_t>((last + 1) * t.element_size())};
}

void check_output(const char* op, const char* name, const at::Tensor& out,
                  c10::SymIntArrayRef sizes, at::ScalarType dtype, const at::Tensor& device_ref,
                  std::initializer_list<const at::Tensor*> inputs) {
  TORCH_CHECK_VALUE(out.sym_sizes() == sizes, op, ": output ", name, " must have shape ",
                    shape_str(sizes), ", got ", shape_str(out.sym_sizes()));
  TORCH_CHECK_VALUE(out.scalar_type() == dtype, op, ": output ", name, " must be ", dtype_str(dtype),
                    ", got ", dtype_str(out.scalar_type()));
  TORCH_CHECK_VALUE(out.device() == device_ref.device(), op, ": output ", name, " is on ",
                    out.device(), " but the inputs are on ", device_ref.device());
  TORCH_CHECK_VALUE(out.is_contiguous(), op, ": output ", name,
                    " must be contiguous and non-overlapping, got strides ",
                    shape_str(out.sym_strides()), " for shape ", shape_str(out.sym_sizes()));
  if (out.is_meta()) return;  // meta tensors have no addresses to compare
  const ByteRange o = byte_range(out);
  if (o.begin == o.end) return;
  for (const at::Tensor* in : inputs) {
    const ByteRange r = byte_range(*in);
    TORCH_CHECK_VALUE(r.begin == r.end || o.end <= r.begin || r.end <= o.begin, op, ": output ",
                      name, " overlaps another operand in memory (bytes [", o.begin, ", ", o.end,
                      ") vs [", r.begin, ", ", r.end, "))");
  }
}

}  // namespace cache_dit::checks
