// File: kernels/svdq/svdq.h
//
// Layout contracts of the SVDQuant W4A4 (INT4) ops, one check function each,
// shared by the CUDA launchers and the Meta kernels. Checkpoint-visible
// tensors are in nunchaku's packed layouts, written once in Python:
// kernels/svdq_reference.py (its packers are byte-identical to cache-dit's).
// The activation, its scales and lora_act are this family's own (the kernels
// of this file produce and consume them; nothing else reads them).
//
// Notation: M tokens, K in_features, N out_features, R rank, G = K / 64
// groups, M_pad = M rounded up to pad_size. Model dtype T: float16 or
// bfloat16. INT4 only: fp4, fuse_glu and act_unsigned must be false (FP4
// needs FP4 tensor cores, which sm_90 has not). Grid limits: M_pad and
// pad_size at most kMaxRows, K at most kMaxK (a launch past them would fail
// with an invalid configuration instead of naming the value).
//
//   svdq_quantize_w4a4_act_fuse_lora
//     input [M, K] T contiguous, K % 128 == 0
//     lora_down [K, R] T packed (proj_down: already divided by smooth), R % 16 == 0, or None (R = 0)
//     smooth [K] T packed (smooth_factor), or None (1)
//     -> output [M_pad, K] float8_e4m3fn row-major: the e4m3 code of q (every
//        INT4 value is an exact e4m3 number; the sm_90a GEMM feeds them to FP8
//        tensor cores, kernels/svdq/gemm_sm90.h)
//        oscales [G, M_pad] T row-major: scale of (row m, group g) at g * M_pad + m
//        lora_act_out [M_pad, R] float32 row-major: x @ proj_down (raw x)
//     Rows m >= M come out as q 0, scale 0, lora_act 0. Numerics:
//     kernels/svdq_reference.py quantize_act (bit-exact) for finite input. A
//     NaN or infinite element gets the e4m3 NaN code (the reference's int8
//     codes cannot hold it); a NaN takes no part in its group's amax, an inf
//     makes the group's scale inf and its finite elements 0.
//   svdq_gemm_w4a4
//     act, ascales as produced above (M_pad rows); wgt [N, K/2] int8 packed
//     (qweight), N % 128 == 0; wscales [G, N] T packed; lora_act_in [M_pad, R]
//     float32 and lora_up [N, R] T packed, both or neither; bias [N] T packed
//     or None; alpha == 1; wcscales None; out_dtype_id 0 float16, 1 bfloat16,
//     2 float32 -> out [M_pad, N]. Numerics: linear_faithful (exact group dots;
//     per group in order acc = fma(dot * ascale, wscale, acc) in fp32, where
//     dot * ascale is exact; then bias; then LoRA). Without LoRA the result is
//     bit-exact on every path; on sm_90a (gemm_sm90.h) wherever ascale *
//     wscale is a normal fp32 number: always for float16 scales, for bfloat16
//     unless the product is below ~1e-38 or above ~3e38. The LoRA sums'
//     order is the path's own.
//   svdq_quantize_w4a4_wgt
//     input [N, K] T contiguous, N % 128 == 0, K % 128 == 0
//     -> output [N, K/2] int8 packed (qweight), oscales [G, N] T packed
//     (wscales). Numerics: quantize_weight (bit-exact).
// Outputs are contiguous and overlap no operand. Every tensor, input or
// output, starts at a 16-byte aligned address (kTensorAlign; the caching
// allocator's are, a view with an odd storage offset is rejected).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace cache_dit::svdq {

inline constexpr int64_t kGroup = 64;
inline constexpr int64_t kBlockN = 128;
inline constexpr int64_t kKAlign = 128;
inline constexpr int64_t kRankAlign = 16;
inline constexpr int64_t kTensorAlign = 16;  // bytes
// The portable GEMM's grid has one block row per 16 rows, at most 65535.
inline constexpr int64_t kMaxRows = 65535 * 16;
// The activation quantizer splits K over at most 65535 block columns of at
// most 128 groups each (svdq.cu kMaxSplitGroups).
inline constexpr int64_t kMaxK = 65535LL * 128 * kGroup;
inline constexpr at::ScalarType kActDtype = at::kFloat8_e4m3fn;  // act: e4m3 codes of INT4 values

struct ActQuantOutputs {
  const at::Tensor* output;
  const at::Tensor* oscales;
  const at::Tensor* lora_act_out;
};

void check_quantize_act(const at::Tensor& input, const std::optional<at::Tensor>& lora_down,
                        const std::optional<at::Tensor>& smooth, bool fuse_glu, bool fp4, int64_t pad_size,
                        const ActQuantOutputs* outs);
void check_gemm(const at::Tensor& act, const at::Tensor& wgt, const at::Tensor& ascales,
                const at::Tensor& wscales, const std::optional<at::Tensor>& lora_act_in,
                const std::optional<at::Tensor>& lora_up, const std::optional<at::Tensor>& bias, bool fp4,
                double alpha, const std::optional<at::Tensor>& wcscales, bool act_unsigned,
                int64_t out_dtype_id, const at::Tensor* out);
void check_quantize_wgt(const at::Tensor& input, const at::Tensor* output, const at::Tensor* oscales);

// Output geometry (inputs already checked), for the checks, the Meta kernels
// and the functional forms alike.
struct ActQuantShapes {
  std::vector<c10::SymInt> output, oscales, lora_act_out;
};
ActQuantShapes act_quant_shapes(const at::Tensor& input, const std::optional<at::Tensor>& lora_down,
                                int64_t pad_size);
struct WgtQuantShapes {
  std::vector<c10::SymInt> output, oscales;
};
WgtQuantShapes wgt_quant_shapes(const at::Tensor& input);
std::vector<c10::SymInt> gemm_out_shape(const at::Tensor& act, const at::Tensor& wgt);
at::ScalarType gemm_out_dtype(int64_t out_dtype_id);

}  // namespace cache_dit::svdq
