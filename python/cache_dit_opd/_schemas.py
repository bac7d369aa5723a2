"""The op schemas of namespace cache_dit_cuda_ops, by family: GENERATED, do not edit.

Written by kernels/tools/schemas_py.cc from kernels/ops.def (the one table of schemas);
tests/python/test_client_schemas.py checks that this file is fresh and that it equals what the
kernel library registers. Keys are "name" or "name.overload"; values follow the name.
"""

NAMESPACE = "cache_dit_cuda_ops"

SCHEMAS = {
    "attn": {
        "fused_merge_attn_states": "(Tensor prev_out, Tensor prev_lse, Tensor suff_out, Tensor suff_lse) -> (Tensor out, Tensor lse)",
        "fused_merge_attn_states.out": "(Tensor prev_out, Tensor prev_lse, Tensor suff_out, Tensor suff_lse, *, Tensor(a!) out, Tensor(b!) lse) -> (Tensor(a!) out, Tensor(b!) lse)",
    },
    "comm": {
        "fp8_comm_per_token_quant": "(Tensor x) -> Tensor",
        "fp8_comm_per_token_quant.out": "(Tensor x, *, Tensor(a!) out) -> Tensor(a!)",
        "fp8_comm_per_token_dequant": "(Tensor x) -> Tensor",
        "fp8_comm_per_token_dequant.out": "(Tensor x, *, Tensor(a!) out) -> Tensor(a!)",
        "fp8_comm_qkv_permute_quant": "(Tensor x) -> Tensor",
        "fp8_comm_qkv_permute_quant.out": "(Tensor x, *, Tensor(a!) out) -> Tensor(a!)",
        "fp8_comm_qkv_permute_dequant": "(Tensor quant_x) -> Tensor",
        "fp8_comm_qkv_permute_dequant.out": "(Tensor quant_x, *, Tensor(a!) out) -> Tensor(a!)",
    },
    "svdq": {
        "svdq_quantize_w4a4_act_fuse_lora": "(Tensor input, Tensor? lora_down, Tensor? smooth, bool fuse_glu, bool fp4, int pad_size) -> (Tensor output, Tensor oscales, Tensor lora_act_out)",
        "svdq_quantize_w4a4_act_fuse_lora.out": "(Tensor input, Tensor? lora_down, Tensor? smooth, bool fuse_glu, bool fp4, int pad_size, *, Tensor(a!) output, Tensor(b!) oscales, Tensor(c!) lora_act_out) -> (Tensor(a!) output, Tensor(b!) oscales, Tensor(c!) lora_act_out)",
        "svdq_gemm_w4a4": "(Tensor act, Tensor wgt, Tensor ascales, Tensor wscales, Tensor? lora_act_in, Tensor? lora_up, Tensor? bias, bool fp4, float alpha, Tensor? wcscales, bool act_unsigned, int out_dtype_id) -> Tensor",
        "svdq_gemm_w4a4.out": "(Tensor act, Tensor wgt, Tensor ascales, Tensor wscales, Tensor? lora_act_in, Tensor? lora_up, Tensor? bias, bool fp4, float alpha, Tensor? wcscales, bool act_unsigned, int out_dtype_id, *, Tensor(a!) out) -> Tensor(a!)",
        "svdq_quantize_w4a4_wgt": "(Tensor input) -> (Tensor output, Tensor oscales)",
        "svdq_quantize_w4a4_wgt.out": "(Tensor input, *, Tensor(a!) output, Tensor(b!) oscales) -> (Tensor(a!) output, Tensor(b!) oscales)",
    },
}
