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

}  // namespace cache_dit
