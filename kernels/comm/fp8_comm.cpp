// Checks, output shapes and Meta kernels of the FP8 communication ops
// (host-only), so validation and shape logic run without a GPU.
#include "kernels/comm/fp8_comm.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "kernels/common/checks.h"
#include "kernels/ops.h"

namespace cache_dit::comm {

using checks::shape_str;

namespace {

constexpr const char* kPerTokenQuant = "fp8_comm_per_token_quant";
constexpr const char* kPerTokenDequant = "fp8_comm_per_token_dequant";
constexpr const char* kQkvQuant = "fp8_comm_qkv_permute_quant";
constexpr const char* kQkvDequant = "fp8_comm_qkv_permute_dequant";

}  // namespace

std::vector<c10::SymInt> per_token_quant_shape(const at::Tensor& x) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = shape.back() + kPerTokenScaleBytes;
  return shape;
}

std::vector<c10::SymInt> per_token_dequant_shape(const at::Tensor& x) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = shape.back() - kPerTokenScaleBytes;
  return shape;
}

std::vector<c10::SymInt> qkv_permute_quant_shape(const at::Tensor& x) {
  const auto s = x.sym_sizes();  // [B, S, P, N, D]
  return {s[2], s[1], s[0], s[3], s[4] + kQkvScaleBytes};
}

std::vector<c10::SymInt> qkv_permute_dequant_shape(const at::Tensor& quant_x) {
  const auto s = quant_x.sym_sizes();  // [S, B, N, D + 4]
  return {s[1], s[0], s[2], s[3] - kQkvScaleBytes};
}

void check_per_token_quant(const at::Tensor& x, const at::Tensor* out) {
  const char* op = kPerTokenQuant;
  checks::check_device(op, "x", x);
  checks::check_min_dims(op, "x", x, 1, "[..., D]");
  checks::check_dtype(op, "x", x, at::kBFloat16);
  TORCH_CHECK_VALUE(x.sym_size(-1) >= 1, op, ": the last dim D must be >= 1, got shape ",
                    shape_str(x.sym_sizes()));
  checks::check_contiguous(op, "x", x);
  if (out) {
    checks::check_output(op, "out", *out, per_token_quant_shape(x), at::kFloat8_e4m3fn, x, {&x});
  }
}

void check_per_token_dequant(const at::Tensor& x, const at::Tensor* out) {
  const char* op = kPerTokenDequant;
  checks::check_device(op, "x", x);
  checks::check_min_dims(op, "x", x, 1, "[..., D + 2]");
  checks::check_dtype(op, "x", x, at::kFloat8_e4m3fn);
  TORCH_CHECK_VALUE(x.sym_size(-1) >= 1 + kPerTokenScaleBytes, op,
                    ": the last dim must be D + 2 with D >= 1, got shape ", shape_str(x.sym_sizes()));
  checks::check_contiguous(op, "x", x);
  if (out) {
    checks::check_output(op, "out", *out, per_token_dequant_shape(x), at::kBFloat16, x, {&x});
  }
}

void check_qkv_permute_quant(const at::Tensor& x, const at::Tensor* out) {
  const char* op = kQkvQuant;
  checks::check_device(op, "x", x);
  checks::check_dims(op, "x", x, 5, "[B, S, P, N, D]");
  checks::check_dtype(op, "x", x, at::kBFloat16);
  TORCH_CHECK_VALUE(x.sym_size(4) >= 1, op, ": head dim D must be >= 1, got shape ",
                    shape_str(x.sym_sizes()));
  // The row map keeps B, S and N as 32-bit divisors (fp8_comm.cu QkvSendRows).
  TORCH_CHECK_VALUE(x.sym_size(0) <= kMaxQkvDim && x.sym_size(1) <= kMaxQkvDim && x.sym_size(3) <= kMaxQkvDim,
                    op, ": B, S and N must each be at most ", kMaxQkvDim, ", got shape ", shape_str(x.sym_sizes()));
  // Each [N, D] block is read as N * D consecutive values; B, S and P may be
  // strided (a reshape of [B, S, H, D] slices, or a transposed B/S view).
  TORCH_CHECK_VALUE((x.sym_size(4) == 1 || x.sym_stride(4) == 1) &&
                        (x.sym_size(3) == 1 || x.sym_stride(3) == x.sym_size(4)),
                    op, ": each [N, D] block of x must be contiguous (strides [.., .., .., D, 1]), "
                    "got shape ", shape_str(x.sym_sizes()), " with strides ", shape_str(x.sym_strides()));
  if (out) {
    checks::check_output(op, "out", *out, qkv_permute_quant_shape(x), at::kFloat8_e4m3fn, x, {&x});
  }
}

void check_qkv_permute_dequant(const at::Tensor& quant_x, const at::Tensor* out) {
  const char* op = kQkvDequant;
  checks::check_device(op, "quant_x", quant_x);
  checks::check_dims(op, "quant_x", quant_x, 4, "[S, B, N, D + 4]");
  checks::check_dtype(op, "quant_x", quant_x, at::kFloat8_e4m3fn);
  TORCH_CHECK_VALUE(quant_x.sym_size(3) >= 1 + kQkvScaleBytes, op,
                    ": the last dim must be D + 4 with D >= 1, got shape ",
                    shape_str(quant_x.sym_sizes()));
  // The row map keeps S, B and N as 32-bit divisors (fp8_comm.cu QkvRecvRows).
  TORCH_CHECK_VALUE(quant_x.sym_size(0) <= kMaxQkvDim && quant_x.sym_size(1) <= kMaxQkvDim &&
                        quant_x.sym_size(2) <= kMaxQkvDim,
                    op, ": S, B and N must each be at most ", kMaxQkvDim, ", got shape ",
                    shape_str(quant_x.sym_sizes()));
  checks::check_contiguous(op, "quant_x", quant_x);
  if (out) {
    checks::check_output(op, "out", *out, qkv_permute_dequant_shape(quant_x), at::kBFloat16,
                         quant_x, {&quant_x});
  }
}

// Meta kernels: the same checks, contiguous outputs, no launch.

at::Tensor fp8_comm_per_token_quant_meta(const at::Tensor& x) {
  check_per_token_quant(x, nullptr);
  return at::empty_symint(per_token_quant_shape(x), x.options().dtype(at::kFloat8_e4m3fn));
}

at::Tensor fp8_comm_per_token_quant_out_meta(const at::Tensor& x, at::Tensor& out) {
  check_per_token_quant(x, &out);
  return out;
}

at::Tensor fp8_comm_per_token_dequant_meta(const at::Tensor& x) {
  check_per_token_dequant(x, nullptr);
  return at::empty_symint(per_token_dequant_shape(x), x.options().dtype(at::kBFloat16));
}

at::Tensor fp8_comm_per_token_dequant_out_meta(const at::Tensor& x, at::Tensor& out) {
  check_per_token_dequant(x, &out);
  return out;
}

at::Tensor fp8_comm_qkv_permute_quant_meta(const at::Tensor& x) {
  check_qkv_permute_quant(x, nullptr);
  return at::empty_symint(qkv_permute_quant_shape(x), x.options().dtype(at::kFloat8_e4m3fn));
}

at::Tensor fp8_comm_qkv_permute_quant_out_meta(const at::Tensor& x, at::Tensor& out) {
  check_qkv_permute_quant(x, &out);
  return out;
}

at::Tensor fp8_comm_qkv_permute_dequant_meta(const at::Tensor& quant_x) {
  check_qkv_permute_dequant(quant_x, nullptr);
  return at::empty_symint(qkv_permute_dequant_shape(quant_x), quant_x.options().dtype(at::kBFloat16));
}

at::Tensor fp8_comm_qkv_permute_dequant_out_meta(const at::Tensor& quant_x, at::Tensor& out) {
  check_qkv_permute_dequant(quant_x, &out);
  return out;
}

}  // namespace cache_dit::comm
