"""One table of bad inputs for every op, each with one defect and the value its error must name.

Read by the client's fake tests (tests/python/test_client_fakes.py) and by the parity test
(tests/python/test_client_parity.py), which also runs it, in a child process, through the kernel
library's Meta kernels. Importing this module defines no op: only torch is imported.
"""

import torch

BF16, FP8, F16, F32 = torch.bfloat16, torch.float8_e4m3fn, torch.float16, torch.float32


def m(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _merge(po=(2, 3, 4, 8), pl=(2, 3, 4, 1), so=(2, 3, 4, 8), sl=(2, 3, 4, 1), dtypes=(BF16, F32, BF16, F32)):
    shapes = (po, pl, so, sl)
    return tuple(m(*s, dtype=d) for s, d in zip(shapes, dtypes))


I8 = torch.int8


def _act(x=(4, 256), down=(256, 32), smooth=(256,), fuse_glu=False, fp4=False, pad=256, dtype=BF16):
    return (m(*x, dtype=dtype), None if down is None else m(*down), None if smooth is None else m(*smooth),
            fuse_glu, fp4, pad)


def _gemm(act=(256, 256), wgt=(128, 128), asc=(4, 256), wsc=(4, 128), la=(256, 32), up=(128, 32), bias=(128,),
          fp4=False, alpha=1.0, wcscales=None, unsigned=False, out_id=1, act_dtype=FP8, wsc_dtype=BF16):
    return (m(*act, dtype=act_dtype), m(*wgt, dtype=I8), m(*asc), m(*wsc, dtype=wsc_dtype),
            None if la is None else m(*la, dtype=F32), None if up is None else m(*up),
            None if bias is None else m(*bias), fp4, alpha, wcscales, unsigned, out_id)


# (case id, "op" or "op.out", () -> (args, kwargs), the value the message names)
CASES = [
    ("svdq-act-fp4", "svdq_quantize_w4a4_act_fuse_lora", lambda: (_act(fp4=True), {}), "fp4=True"),
    ("svdq-act-glu", "svdq_quantize_w4a4_act_fuse_lora", lambda: (_act(fuse_glu=True), {}), "fuse_glu=True"),
    ("svdq-act-dtype", "svdq_quantize_w4a4_act_fuse_lora", lambda: (_act(dtype=F32), {}), "torch.float32"),
    ("svdq-act-k", "svdq_quantize_w4a4_act_fuse_lora", lambda: (_act(x=(4, 192), down=None, smooth=None), {}),
     "got 192"),
    ("svdq-act-pad", "svdq_quantize_w4a4_act_fuse_lora", lambda: (_act(pad=0), {}), "got 0"),
    # Past the grids' reach (meta tensors: no memory): 65535 row blocks of 16, 65535 K splits of 128 groups.
    ("svdq-act-pad-huge", "svdq_quantize_w4a4_act_fuse_lora", lambda: (_act(pad=2**62), {}), "got 4611686018427387904"),
    ("svdq-act-rows", "svdq_quantize_w4a4_act_fuse_lora", lambda: (_act(x=(2**20, 256), pad=32), {}),
     "got 1048576"),
    ("svdq-act-k-huge", "svdq_quantize_w4a4_act_fuse_lora",
     lambda: (_act(x=(1, 65536 * 128 * 64), down=None, smooth=None), {}), "got 536870912"),
    ("svdq-act-down-k", "svdq_quantize_w4a4_act_fuse_lora", lambda: (_act(down=(128, 32)), {}), "[128, 32]"),
    ("svdq-act-rank", "svdq_quantize_w4a4_act_fuse_lora", lambda: (_act(down=(256, 24)), {}), "got 24"),
    ("svdq-act-smooth", "svdq_quantize_w4a4_act_fuse_lora", lambda: (_act(smooth=(128,)), {}), "[128]"),
    ("svdq-act-out-rows", "svdq_quantize_w4a4_act_fuse_lora.out",
     lambda: (_act(), {"output": m(4, 256, dtype=FP8), "oscales": m(4, 256), "lora_act_out": m(256, 32, dtype=F32)}),
     "[256, 256]"),
    ("svdq-gemm-alpha", "svdq_gemm_w4a4", lambda: (_gemm(alpha=0.5), {}), "got 0.5"),
    ("svdq-gemm-unsigned", "svdq_gemm_w4a4", lambda: (_gemm(unsigned=True), {}), "act_unsigned=True"),
    ("svdq-gemm-out-id", "svdq_gemm_w4a4", lambda: (_gemm(out_id=3), {}), "got 3"),
    ("svdq-gemm-act-dtype", "svdq_gemm_w4a4", lambda: (_gemm(act_dtype=I8), {}), "torch.int8"),
    ("svdq-gemm-k", "svdq_gemm_w4a4", lambda: (_gemm(wgt=(128, 96)), {}), "[128, 96]"),
    ("svdq-gemm-n", "svdq_gemm_w4a4", lambda: (_gemm(wgt=(96, 128), wsc=(4, 96), up=(96, 32), bias=(96,)), {}),
     "got 96"),
    ("svdq-gemm-ascales", "svdq_gemm_w4a4", lambda: (_gemm(asc=(4, 255)), {}), "[4, 255]"),
    ("svdq-gemm-rows", "svdq_gemm_w4a4",
     lambda: (_gemm(act=(2**20 + 8, 256), asc=(4, 2**20 + 8), la=None, up=None), {}), "got 1048584"),
    ("svdq-gemm-lora-pair", "svdq_gemm_w4a4", lambda: (_gemm(la=None), {}), "lora_up without lora_act_in"),
    ("svdq-gemm-lora-act", "svdq_gemm_w4a4", lambda: (_gemm(la=(256, 16)), {}), "[256, 16]"),
    ("svdq-gemm-bias", "svdq_gemm_w4a4", lambda: (_gemm(bias=(64,)), {}), "[64]"),
    ("svdq-gemm-out", "svdq_gemm_w4a4.out", lambda: (_gemm(), {"out": m(256, 128, dtype=F16)}), "torch.float16"),
    ("svdq-wgt-n", "svdq_quantize_w4a4_wgt", lambda: ((m(96, 128),), {}), "got 96"),
    ("svdq-wgt-k", "svdq_quantize_w4a4_wgt", lambda: ((m(128, 96),), {}), "got 96"),
    ("svdq-wgt-out", "svdq_quantize_w4a4_wgt.out",
     lambda: ((m(128, 128),), {"output": m(128, 64, dtype=I8), "oscales": m(2, 128, dtype=F16)}), "torch.float16"),
    ("merge-rank", "fused_merge_attn_states", lambda: (_merge(po=(2, 3, 8)), {}), "[2, 3, 8]"),
    ("merge-lse-rank", "fused_merge_attn_states", lambda: (_merge(sl=(2, 3, 4)), {}), "[2, 3, 4]"),
    ("merge-dtype", "fused_merge_attn_states", lambda: (_merge(dtypes=(torch.float64, F32, BF16, F32)), {}),
     "torch.float64"),
    ("merge-lse-dtype", "fused_merge_attn_states", lambda: (_merge(dtypes=(BF16, torch.int32, BF16, F32)), {}),
     "torch.int32"),
    ("merge-shape", "fused_merge_attn_states", lambda: (_merge(so=(2, 3, 4, 9)), {}), "[2, 3, 4, 9]"),
    ("merge-lse-shape", "fused_merge_attn_states", lambda: (_merge(pl=(2, 3, 4, 2)), {}), "[2, 3, 4, 2]"),
    ("merge-head-dim", "fused_merge_attn_states", lambda: (_merge(po=(2, 3, 4, 0), so=(2, 3, 4, 0)), {}),
     "[2, 3, 4, 0]"),
    ("merge-stride", "fused_merge_attn_states",
     lambda: ((m(2, 3, 8, 4).transpose(2, 3), m(2, 3, 4, 1, dtype=F32), m(2, 3, 4, 8), m(2, 3, 4, 1, dtype=F32)),
              {}), "[96, 32, 1, 4]"),
    ("merge-out-shape", "fused_merge_attn_states.out",
     lambda: (_merge(), {"out": m(2, 3, 4, 7), "lse": m(2, 3, 4, 1, dtype=F32)}), "[2, 3, 4, 7]"),
    ("merge-lse-out-dtype", "fused_merge_attn_states.out",
     lambda: (_merge(), {"out": m(2, 3, 4, 8), "lse": m(2, 3, 4, 1, dtype=F16)}), "torch.float16"),
    ("merge-out-strides", "fused_merge_attn_states.out",
     lambda: (_merge(), {"out": m(2, 3, 8, 4).transpose(2, 3), "lse": m(2, 3, 4, 1, dtype=F32)}), "[96, 32, 1, 4]"),
    ("ptq-dtype", "fp8_comm_per_token_quant", lambda: ((m(4, 8, dtype=F16),), {}), "torch.float16"),
    ("ptq-rank", "fp8_comm_per_token_quant", lambda: ((torch.empty((), dtype=BF16, device="meta"),), {}), "[]"),
    ("ptq-d", "fp8_comm_per_token_quant", lambda: ((m(4, 0),), {}), "[4, 0]"),
    ("ptq-strides", "fp8_comm_per_token_quant", lambda: ((m(8, 4).t(),), {}), "[1, 4]"),
    ("ptq-out-shape", "fp8_comm_per_token_quant.out", lambda: ((m(4, 8),), {"out": m(4, 9, dtype=FP8)}), "[4, 9]"),
    ("ptq-out-dtype", "fp8_comm_per_token_quant.out", lambda: ((m(4, 8),), {"out": m(4, 10)}), "torch.bfloat16"),
    ("ptd-dtype", "fp8_comm_per_token_dequant", lambda: ((m(4, 10),), {}), "torch.bfloat16"),
    ("ptd-d", "fp8_comm_per_token_dequant", lambda: ((m(4, 2, dtype=FP8),), {}), "[4, 2]"),
    ("ptd-strides", "fp8_comm_per_token_dequant", lambda: ((m(10, 4, dtype=FP8).t(),), {}), "[1, 4]"),
    ("ptd-out-dtype", "fp8_comm_per_token_dequant.out", lambda: ((m(4, 10, dtype=FP8),), {"out": m(4, 8, dtype=F16)}),
     "torch.float16"),
    ("qkvq-rank", "fp8_comm_qkv_permute_quant", lambda: ((m(2, 3, 4, 8),), {}), "[2, 3, 4, 8]"),
    ("qkvq-dtype", "fp8_comm_qkv_permute_quant", lambda: ((m(2, 3, 4, 8, 16, dtype=F32),), {}), "torch.float32"),
    ("qkvq-block", "fp8_comm_qkv_permute_quant", lambda: ((m(2, 3, 4, 16, 8).transpose(3, 4),), {}),
     "[1536, 512, 128, 1, 8]"),
    ("qkvq-d", "fp8_comm_qkv_permute_quant", lambda: ((m(2, 3, 4, 8, 0),), {}), "[2, 3, 4, 8, 0]"),
    # B, S, N past 2^31 - 1 (meta tensors: no memory): the row map's 32-bit divisors would wrap.
    ("qkvq-huge", "fp8_comm_qkv_permute_quant", lambda: ((m(1, 1, 1, 2**32 + 1, 1),), {}), "at most 2147483647"),
    ("qkvq-out-shape", "fp8_comm_qkv_permute_quant.out",
     lambda: ((m(2, 3, 4, 5, 8),), {"out": m(4, 3, 2, 5, 8, dtype=FP8)}), "[4, 3, 2, 5, 8]"),
    ("qkvd-rank", "fp8_comm_qkv_permute_dequant", lambda: ((m(3, 2, 4, 8, 12, dtype=FP8),), {}), "[3, 2, 4, 8, 12]"),
    ("qkvd-d", "fp8_comm_qkv_permute_dequant", lambda: ((m(3, 2, 4, 4, dtype=FP8),), {}), "[3, 2, 4, 4]"),
    ("qkvd-huge", "fp8_comm_qkv_permute_dequant", lambda: ((m(1, 2**32, 1, 5, dtype=FP8),), {}), "at most 2147483647"),
    ("qkvd-dtype", "fp8_comm_qkv_permute_dequant", lambda: ((m(3, 2, 4, 12),), {}), "torch.bfloat16"),
    ("qkvd-strides", "fp8_comm_qkv_permute_dequant", lambda: ((m(2, 3, 4, 12, dtype=FP8).transpose(0, 1),), {}),
     "[48, 144, 12, 1]"),
]


def run(ops, case):
    """Runs one case through ``torch.ops.cache_dit_cuda_ops`` (``ops``): (exception type name, message)."""
    _, full, build, _ = case
    name, _, overload = full.partition(".")
    fn = getattr(getattr(ops, name), overload or "default")
    args, kwargs = build()
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001  (the type is what is compared)
        return type(e).__name__, str(e).split("\n")[0]
    return None, None
