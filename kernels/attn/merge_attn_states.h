// File: kernels/attn/merge_attn_states.h
//
// The layout contract of fused_merge_attn_states, checked in one place for
// the CUDA launcher and the Meta kernel alike:
//   prev_out, suff_out  [B, S, H, D], fp16/bf16/fp32, same shape, D >= 1,
//                       stride(3) == 1 (other strides arbitrary, >= 0)
//   prev_lse, suff_lse  [B, S, H, 1], fp16/bf16/fp32, any strides
//   out (if given)      [B, S, H, D], suff_out's dtype, contiguous
//   lse (if given)      [B, S, H, 1], suff_lse's dtype, contiguous
// All operands on one CUDA (or meta) device; outputs overlap no operand.
#pragma once

#include <ATen/core/Tensor.h>

namespace cache_dit::attn {

inline constexpr const char* kMergeOp = "fused_merge_attn_states";

void check_merge_attn_states(const at::Tensor& prev_out, const at::Tensor& prev_lse,
                             const at::Tensor& suff_out, const at::Tensor& suff_lse,
                             const at::Tensor* out, const at::Tensor* lse);

}  // namespace cache_dit::attn
