// The one place where the op schemas of namespace cache_dit_cuda_ops are
// written. Each op has a functional form (what users call; names, argument
// names and returns identical to upstream cache-dit's public schemas) and an
// `out` overload (torch's convention: outputs are keyword-only, mutated and
// returned aliased) that the daemon serves. Both have a CUDA kernel and a
// Meta kernel; the Meta kernels run the same checks as the CUDA launchers.
//
// The namespace comes from the build (CACHE_DIT_OPS_NAMESPACE) so the schema
// strings below never repeat it.
#include <torch/library.h>

#include "kernels/ops.h"

#ifndef CACHE_DIT_OPS_NAMESPACE
#error "CACHE_DIT_OPS_NAMESPACE must be defined by the build"
#endif

#define CACHE_DIT_LIBRARY_EXPAND(ns, m) TORCH_LIBRARY(ns, m)
#define CACHE_DIT_LIBRARY_IMPL_EXPAND(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

CACHE_DIT_LIBRARY_EXPAND(CACHE_DIT_OPS_NAMESPACE, m) {
#ifdef CACHE_DIT_WITH_ATTN
  // Merge two partial attention results by log-sum-exp (ring attention).
  m.def("fused_merge_attn_states(Tensor prev_out, Tensor prev_lse, Tensor suff_out, "
        "Tensor suff_lse) -> (Tensor out, Tensor lse)");
  m.def("fused_merge_attn_states.out(Tensor prev_out, Tensor prev_lse, Tensor suff_out, "
        "Tensor suff_lse, *, Tensor(a!) out, Tensor(b!) lse) -> (Tensor(a!) out, Tensor(b!) lse)");
#endif
#ifdef CACHE_DIT_WITH_COMM
  // FP8 per-token records: [..., D] bf16 <-> [..., D + 2] e4m3fn (bf16 scale).
  m.def("fp8_comm_per_token_quant(Tensor x) -> Tensor");
  m.def("fp8_comm_per_token_quant.out(Tensor x, *, Tensor(a!) out) -> Tensor(a!)");
  m.def("fp8_comm_per_token_dequant(Tensor x) -> Tensor");
  m.def("fp8_comm_per_token_dequant.out(Tensor x, *, Tensor(a!) out) -> Tensor(a!)");
  // Ulysses all-to-all records: [B, S, P, N, D] bf16 -> [P, S, B, N, D + 4]
  // e4m3fn (fp32 scale), and [S, B, N, D + 4] -> [B, S, N, D] bf16.
  m.def("fp8_comm_qkv_permute_quant(Tensor x) -> Tensor");
  m.def("fp8_comm_qkv_permute_quant.out(Tensor x, *, Tensor(a!) out) -> Tensor(a!)");
  m.def("fp8_comm_qkv_permute_dequant(Tensor quant_x) -> Tensor");
  m.def("fp8_comm_qkv_permute_dequant.out(Tensor quant_x, *, Tensor(a!) out) -> Tensor(a!)");
#endif
}

CACHE_DIT_LIBRARY_IMPL_EXPAND(CACHE_DIT_OPS_NAMESPACE, CUDA, m) {
#ifdef CACHE_DIT_WITH_ATTN
  m.impl("fused_merge_attn_states", &cache_dit::attn::fused_merge_attn_states);
  m.impl("fused_merge_attn_states.out", &cache_dit::attn::fused_merge_attn_states_out);
#endif
#ifdef CACHE_DIT_WITH_COMM
  m.impl("fp8_comm_per_token_quant", &cache_dit::comm::fp8_comm_per_token_quant);
  m.impl("fp8_comm_per_token_quant.out", &cache_dit::comm::fp8_comm_per_token_quant_out);
  m.impl("fp8_comm_per_token_dequant", &cache_dit::comm::fp8_comm_per_token_dequant);
  m.impl("fp8_comm_per_token_dequant.out", &cache_dit::comm::fp8_comm_per_token_dequant_out);
  m.impl("fp8_comm_qkv_permute_quant", &cache_dit::comm::fp8_comm_qkv_permute_quant);
  m.impl("fp8_comm_qkv_permute_quant.out", &cache_dit::comm::fp8_comm_qkv_permute_quant_out);
  m.impl("fp8_comm_qkv_permute_dequant", &cache_dit::comm::fp8_comm_qkv_permute_dequant);
  m.impl("fp8_comm_qkv_permute_dequant.out", &cache_dit::comm::fp8_comm_qkv_permute_dequant_out);
#endif
}

CACHE_DIT_LIBRARY_IMPL_EXPAND(CACHE_DIT_OPS_NAMESPACE, Meta, m) {
#ifdef CACHE_DIT_WITH_ATTN
  m.impl("fused_merge_attn_states", &cache_dit::attn::fused_merge_attn_states_meta);
  m.impl("fused_merge_attn_states.out", &cache_dit::attn::fused_merge_attn_states_out_meta);
#endif
#ifdef CACHE_DIT_WITH_COMM
  m.impl("fp8_comm_per_token_quant", &cache_dit::comm::fp8_comm_per_token_quant_meta);
  m.impl("fp8_comm_per_token_quant.out", &cache_dit::comm::fp8_comm_per_token_quant_out_meta);
  m.impl("fp8_comm_per_token_dequant", &cache_dit::comm::fp8_comm_per_token_dequant_meta);
  m.impl("fp8_comm_per_token_dequant.out", &cache_dit::comm::fp8_comm_per_token_dequant_out_meta);
  m.impl("fp8_comm_qkv_permute_quant", &cache_dit::comm::fp8_comm_qkv_permute_quant_meta);
  m.impl("fp8_comm_qkv_permute_quant.out", &cache_dit::comm::fp8_comm_qkv_permute_quant_out_meta);
  m.impl("fp8_comm_qkv_permute_dequant", &cache_dit::comm::fp8_comm_qkv_permute_dequant_meta);
  m.impl("fp8_comm_qkv_permute_dequant.out", &cache_dit::comm::fp8_comm_qkv_permute_dequant_out_meta);
#endif
}
