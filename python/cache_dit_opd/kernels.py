"""The public op surface of cache_dit_opd: one flat namespace.

Every name is re-exported from its domain module (``_attn``, ``_comm``,
``_svdquant``) and is
the same object there. Each op is also reachable as
``torch.ops.cache_dit_cuda_ops.<op>`` once this module is imported.
"""

from ._attn import attn_extension_is_available, attn_get_load_error, fused_merge_attn_states
from ._comm import (
    comm_extension_is_available,
    comm_get_load_error,
    fp8_comm_per_token_dequant,
    fp8_comm_per_token_quant,
    fp8_comm_qkv_permute_dequant,
    fp8_comm_qkv_permute_quant,
)
from ._svdquant import (
    svdq_extension_is_available,
    svdq_gemm_w4a4,
    svdq_get_load_error,
    svdq_quantize_w4a4_act_fuse_lora,
    svdq_quantize_w4a4_wgt,
)

__all__ = [
    "attn_extension_is_available",
    "attn_get_load_error",
    "comm_extension_is_available",
    "comm_get_load_error",
    "fp8_comm_per_token_dequant",
    "fp8_comm_per_token_quant",
    "fp8_comm_qkv_permute_dequant",
    "fp8_comm_qkv_permute_quant",
    "fused_merge_attn_states",
    "svdq_extension_is_available",
    "svdq_gemm_w4a4",
    "svdq_get_load_error",
    "svdq_quantize_w4a4_act_fuse_lora",
    "svdq_quantize_w4a4_wgt",
]
