// File: kernels/comm/fp8_comm.h
//
// Layout contracts of the four FP8 communication ops, one check function each,
// shared by the CUDA launchers and the Meta kernels. Record formats
// (byte-identical to upstream cache-dit, so ranks can interoperate):
//   per-token record, D + 2 bytes: D e4m3fn values, then the row scale as a
//     little-endian bf16: scale = max(amax, 1e-4) / 448, q = e4m3(x * (1/scale))
//   QKV record, D + 4 bytes: D e4m3fn values, then the fp32 scale, little-
//     endian: scale = max(amax / 448, 1e-6), q = e4m3(x / scale)
// e4m3 conversion saturates to +-448 (same as clamping first); NaN stays NaN.
//
//   fp8_comm_per_token_quant     x [..., D] bf16, contiguous, D >= 1
//                                -> out [..., D + 2] float8_e4m3fn
//   fp8_comm_per_token_dequant   x [..., D + 2] float8_e4m3fn, contiguous, D >= 1
//                                -> out [..., D] bf16
//   fp8_comm_qkv_permute_quant   x [B, S, P, N, D] bf16; B/S/P strides arbitrary,
//                                each [N, D] block contiguous
//                                -> out [P, S, B, N, D + 4] float8_e4m3fn
//   fp8_comm_qkv_permute_dequant quant_x [S, B, N, D + 4] float8_e4m3fn, contiguous
//                                -> out [B, S, N, D] bf16 (true [B, S] order)
// Outputs are contiguous and overlap no operand.
#pragma once

#include <ATen/core/Tensor.h>

namespace cache_dit::comm {

inline constexpr int64_t kPerTokenScaleBytes = 2;
inline constexpr int64_t kQkvScaleBytes = 4;
// The QKV ops' B, S and N (their row maps divide by them in 32 bits).
inline constexpr int64_t kMaxQkvDim = 2147483647;

void check_per_token_quant(const at::Tensor& x, const at::Tensor* out);
void check_per_token_dequant(const at::Tensor& x, const at::Tensor* out);
void check_qkv_permute_quant(const at::Tensor& x, const at::Tensor* out);
void check_qkv_permute_dequant(const at::Tensor& quant_x, const at::Tensor* out);

// Output shapes (inputs already checked).
std::vector<c10::SymInt> per_token_quant_shape(const at::Tensor& x);
std::vector<c10::SymInt> per_token_dequant_shape(const at::Tensor& x);
std::vector<c10::SymInt> qkv_permute_quant_shape(const at::Tensor& x);
std::vector<c10::SymInt> qkv_permute_dequant_shape(const at::Tensor& quant_x);

}  // namespace cache_dit::comm
