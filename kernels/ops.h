// File: kernels/ops.h
//
// Host entry points of every op in namespace cache_dit_cuda_ops. The schemas
// live in kernels/torch_bindings.cpp, the only file that writes them; the
// C++ types here mirror them. Every op comes as
//   <op>(...)      functional: allocates contiguous outputs, then runs <op>_out
//   <op>_out(...)  writes into caller-supplied outputs (what the daemon serves)
// and each has a Meta kernel running the same check function, so shape logic
// and validation work without a GPU. Kernels run on the current CUDA stream.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace cache_dit {

namespace attn {

// prev_out, suff_out: [B, S, H, D] fp16/bf16/fp32, last dim contiguous, other
// strides arbitrary. prev_lse, suff_lse: [B, S, H, 1] fp16/bf16/fp32, any
// strides (flash-attn's [B, H, S] permuted view is read in place).
// out: [B, S, H, D] in suff_out's dtype; lse: [B, S, H, 1] in suff_lse's
// dtype; both contiguous.
std::tuple<at::Tensor, at::Tensor> fused_merge_attn_states(const at::Tensor& prev_out,
                                                           const at::Tensor& prev_lse,
                                                           const at::Tensor& suff_out,
                                                           const at::Tensor& suff_lse);
std::tuple<at::Tensor, at::Tensor> fused_merge_attn_states_out(
    const at::Tensor& prev_out, const at::Tensor& prev_lse, const at::Tensor& suff_out,
    const at::Tensor& suff_lse, at::Tensor& out, at::Tensor& lse);
std::tuple<at::Tensor, at::Tensor> fused_merge_attn_states_meta(const at::Tensor& prev_out,
                                                                const at::Tensor& prev_lse,
                                                                const at::Tensor& suff_out,
                                                                const at::Tensor& suff_lse);
std::tuple<at::Tensor, at::Tensor> fused_merge_attn_states_out_meta(
    const at::Tensor& prev_out, const at::Tensor& prev_lse, const at::Tensor& suff_out,
    const at::Tensor& suff_lse, at::Tensor& out, at::Tensor& lse);

}  // namespace attn

namespace comm {

// x: [..., D] bf16 contiguous -> [..., D + 2] float8_e4m3fn records.
at::Tensor fp8_comm_per_token_quant(const at::Tensor& x);
at::Tensor fp8_comm_per_token_quant_out(const at::Tensor& x, at::Tensor& out);
// x: [..., D + 2] float8_e4m3fn records, contiguous -> [..., D] bf16.
at::Tensor fp8_comm_per_token_dequant(const at::Tensor& x);
at::Tensor fp8_comm_per_token_dequant_out(const at::Tensor& x, at::Tensor& out);
// x: [B, S, P, N, D] bf16, B/S/P strided, [N, D] contiguous -> [P, S, B, N, D + 4].
at::Tensor fp8_comm_qkv_permute_quant(const at::Tensor& x);
at::Tensor fp8_comm_qkv_permute_quant_out(const at::Tensor& x, at::Tensor& out);
// quant_x: [S, B, N, D + 4] float8_e4m3fn, contiguous -> [B, S, N, D] bf16.
at::Tensor fp8_comm_qkv_permute_dequant(const at::Tensor& quant_x);
at::Tensor fp8_comm_qkv_permute_dequant_out(const at::Tensor& quant_x, at::Tensor& out);

// Meta kernels (same checks, no launch).
at::Tensor fp8_comm_per_token_quant_meta(const at::Tensor& x);
at::Tensor fp8_comm_per_token_quant_out_meta(const at::Tensor& x, at::Tensor& out);
at::Tensor fp8_comm_per_token_dequant_meta(const at::Tensor& x);
at::Tensor fp8_comm_per_token_dequant_out_meta(const at::Tensor& x, at::Tensor& out);
at::Tensor fp8_comm_qkv_permute_quant_meta(const at::Tensor& x);
at::Tensor fp8_comm_qkv_permute_quant_out_meta(const at::Tensor& x, at::Tensor& out);
at::Tensor fp8_comm_qkv_permute_dequant_meta(const at::Tensor& quant_x);
at::Tensor fp8_comm_qkv_permute_dequant_out_meta(const at::Tensor& quant_x, at::Tensor& out);

}  // namespace comm

namespace svdq {

// kernels/svdq/svdq.h states the layouts; optional tensors may be absent.
using OptTensor = std::optional<at::Tensor>;
using ActQuant = std::tuple<at::Tensor, at::Tensor, at::Tensor>;  // output, oscales, lora_act_out

ActQuant svdq_quantize_w4a4_act_fuse_lora(const at::Tensor& input, const OptTensor& lora_down,
                                          const OptTensor& smooth, bool fuse_glu, bool fp4, int64_t pad_size);
ActQuant svdq_quantize_w4a4_act_fuse_lora_out(const at::Tensor& input, const OptTensor& lora_down,
                                              const OptTensor& smooth, bool fuse_glu, bool fp4, int64_t pad_size,
                                              at::Tensor& output, at::Tensor& oscales, at::Tensor& lora_act_out);
at::Tensor svdq_gemm_w4a4(const at::Tensor& act, const at::Tensor& wgt, const at::Tensor& ascales,
                          const at::Tensor& wscales, const OptTensor& lora_act_in, const OptTensor& lora_up,
                          const OptTensor& bias, bool fp4, double alpha, const OptTensor& wcscales,
                          bool act_unsigned, int64_t out_dtype_id);
at::Tensor svdq_gemm_w4a4_out(const at::Tensor& act, const at::Tensor& wgt, const at::Tensor& ascales,
                              const at::Tensor& wscales, const OptTensor& lora_act_in, const OptTensor& lora_up,
                              const OptTensor& bias, bool fp4, double alpha, const OptTensor& wcscales,
                              bool act_unsigned, int64_t out_dtype_id, at::Tensor& out);
std::tuple<at::Tensor, at::Tensor> svdq_quantize_w4a4_wgt(const at::Tensor& input);
std::tuple<at::Tensor, at::Tensor> svdq_quantize_w4a4_wgt_out(const at::Tensor& input, at::Tensor& output,
                                                              at::Tensor& oscales);

// Meta kernels (same checks, no launch).
ActQuant svdq_quantize_w4a4_act_fuse_lora_meta(const at::Tensor& input, const OptTensor& lora_down,
                                               const OptTensor& smooth, bool fuse_glu, bool fp4,
                                               int64_t pad_size);
ActQuant svdq_quantize_w4a4_act_fuse_lora_out_meta(const at::Tensor& input, const OptTensor& lora_down,
                                                   const OptTensor& smooth, bool fuse_glu, bool fp4,
                                                   int64_t pad_size, at::Tensor& output, at::Tensor& oscales,
                                                   at::Tensor& lora_act_out);
at::Tensor svdq_gemm_w4a4_meta(const at::Tensor& act, const at::Tensor& wgt, const at::Tensor& ascales,
                               const at::Tensor& wscales, const OptTensor& lora_act_in, const OptTensor& lora_up,
                               const OptTensor& bias, bool fp4, double alpha, const OptTensor& wcscales,
                               bool act_unsigned, int64_t out_dtype_id);
at::Tensor svdq_gemm_w4a4_out_meta(const at::Tensor& act, const at::Tensor& wgt, const at::Tensor& ascales,
                                   const at::Tensor& wscales, const OptTensor& lora_act_in,
                                   const OptTensor& lora_up, const OptTensor& bias, bool fp4, double alpha,
                                   const OptTensor& wcscales, bool act_unsigned, int64_t out_dtype_id,
                                   at::Tensor& out);
std::tuple<at::Tensor, at::Tensor> svdq_quantize_w4a4_wgt_meta(const at::Tensor& input);
std::tuple<at::Tensor, at::Tensor> svdq_quantize_w4a4_wgt_out_meta(const at::Tensor& input, at::Tensor& output,
                                                                   at::Tensor& oscales);

}  // namespace svdq

}  // namespace cache_dit
