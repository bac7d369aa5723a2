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
}
