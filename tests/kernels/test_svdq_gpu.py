"""The svdq CUDA kernels against kernels/svdq_reference.py.

Bit-exact where the arithmetic is the reference's step for step: both quantizers (fp32 divisions and
multiplications, one rounding to the model dtype, round half to even), the packed checkpoint bytes, and
the GEMM without LoRA (exact int32 group dots, then per group one fp32 product and one fp32 sum, in group
order, then the bias). LoRA sums over K (down) and R (up) in fp32 in an order torch does not share: they
are compared within K (or R) fp32 roundings of the sum of the absolute products.
"""

from __future__ import annotations

import math

import pytest
import torch

import svdq_reference as sq

pytestmark = pytest.mark.gpu

DEV = "cuda"
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
EPS32 = torch.finfo(torch.float32).eps


def rand(*shape, dtype=BF16, scale=1.0, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)


def poisoned(shape, dtype):
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.full((nbytes,), 255, dtype=torch.uint8, device=DEV).view(dtype).view(shape)


def assert_bitwise(actual, expected):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual.shape, expected.shape)
    a, e = actual.contiguous().view(torch.uint8).cpu(), expected.contiguous().view(torch.uint8).cpu()
    diff = (a != e).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, first at {diff[:5].tolist()}"


def _nibbles_row_major(q):
    """[M, K] int8 in [-8, 7] -> the act layout: [M, K/2] uint8, even k in the low nibble."""
    u = q.to(torch.int16).bitwise_and(0xF)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).to(torch.uint8)


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("n,k", [(128, 64), (256, 384), (384, 3072)])
def test_weight_quantizer_is_bit_exact(ops, dtype, n, k):
    w = rand(n, k, dtype=dtype, scale=0.05, seed=n + k)
    w[0, :64] = 0  # an all-zero group: scale 1, q 0
    qweight, wscales = ops.svdq_quantize_w4a4_wgt(w)
    q, s = sq.quantize_weight(w.cpu(), dtype)
    assert_bitwise(wscales, sq.pack_wscales(s).to(DEV))
    assert_bitwise(qweight, sq.pack_qweight(q).to(DEV))


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("m,k,r,smooth", [(1, 128, 0, False), (300, 384, 32, True), (4608, 3072, 32, True)])
def test_activation_quantizer_is_bit_exact_and_lora_down_close(ops, dtype, m, k, r, smooth):
    x = rand(m, k, dtype=dtype, scale=2.0, seed=m)
    s = (torch.rand(k, device=DEV) + 0.5).to(dtype) if smooth else None
    down = rand(r, k, dtype=dtype, scale=0.1, seed=k) if r else None
    packed_s = sq.pack_channel_vector(s.cpu()).to(DEV) if smooth else None
    packed_down = sq.pack_lowrank(down.cpu(), down=True).to(DEV) if r else None
    m_pad = (m + 255) // 256 * 256
    outs = {"output": poisoned((m_pad, k // 2), torch.uint8), "oscales": poisoned((k // 64, m_pad), dtype),
            "lora_act_out": poisoned((m_pad, r), F32)}
    ops.svdq_quantize_w4a4_act_fuse_lora.out(x, packed_down, packed_s, False, False, 256, **outs)
    q, scales = sq.quantize_act(x.cpu(), None if s is None else s.cpu())
    want_q = torch.zeros(m_pad, k // 2, dtype=torch.uint8)
    want_q[:m] = _nibbles_row_major(q)
    want_s = torch.zeros(k // 64, m_pad, dtype=dtype)
    want_s[:, :m] = scales.t()
    assert_bitwise(outs["output"], want_q.to(DEV))
    assert_bitwise(outs["oscales"], want_s.to(DEV))
    if r:
        la = outs["lora_act_out"].cpu()
        ref = x.cpu().double() @ down.cpu().double().t()
        bound = k * EPS32 * (x.cpu().double().abs() @ down.cpu().double().abs().t())
        assert torch.all((la[:m].double() - ref).abs() <= bound + 1e-30)
        assert torch.all(la[m:] == 0)


def _layer(dtype, m, n, k, r, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) * 0.1
    x = (torch.randn(m, k, generator=g) * 2).to(dtype)
    ckpt = sq.quantize_linear(w, b, rank=r, dtype=dtype, act_amax=x.float().abs().amax(dim=0))
    return x, ckpt


@pytest.mark.parametrize("out_dtype", [F32, BF16])
@pytest.mark.parametrize("m,n,k", [(1, 128, 128), (300, 256, 384), (1024, 384, 3072)])
def test_gemm_without_lora_is_bit_exact(ops, out_dtype, m, n, k):
    dtype = BF16
    x, ckpt = _layer(dtype, m, n, k, r=0, seed=m + n)
    dev = {key: t.to(DEV) for key, t in ckpt.items()}
    act, ascales, _ = ops.svdq_quantize_w4a4_act_fuse_lora(x.to(DEV), None, dev["smooth_factor"], False, False, 256)
    y = ops.svdq_gemm_w4a4(act, dev["qweight"], ascales, dev["wscales"], None, None, dev["bias"], False, 1.0, None,
                           False, {F16: 0, BF16: 1, F32: 2}[out_dtype])
    t = sq.unpack_linear(ckpt)
    want = sq.linear_faithful(x, t["q_w"], t["wscales"], t["smooth"], bias=t["bias"], out_dtype=out_dtype)
    assert_bitwise(y[:m], want.to(DEV))


@pytest.mark.parametrize("m,n,k,r", [(300, 256, 384, 16), (4608, 384, 3072, 32)])
def test_gemm_with_lora_matches_the_faithful_reference(ops, m, n, k, r):
    dtype = BF16
    x, ckpt = _layer(dtype, m, n, k, r=r, seed=r)
    dev = {key: t.to(DEV) for key, t in ckpt.items()}
    act, ascales, lora_act = ops.svdq_quantize_w4a4_act_fuse_lora(x.to(DEV), dev["proj_down"],
                                                                  dev["smooth_factor"], False, False, 256)
    y = ops.svdq_gemm_w4a4(act, dev["qweight"], ascales, dev["wscales"], lora_act, dev["proj_up"], dev["bias"],
                           False, 1.0, None, False, 2)[:m].cpu()
    t = sq.unpack_linear(ckpt)
    want = sq.linear_faithful(x, **t, out_dtype=F32)
    # Both sides differ only in the LoRA sums: lora_act (fp32 over K, then rounded to bf16, which can move a
    # value by one bf16 ulp) and the fp32 sum over R.
    lora_mag = (x.double().abs() @ t["down"].double().abs().t()) @ t["up"].double().abs().t()
    bound = lora_mag * (2 * torch.finfo(BF16).eps + (k + r) * EPS32) + 1e-6
    assert torch.all((y.double() - want.double()).abs() <= bound)


def test_bad_input_is_rejected_before_launch_with_the_value_named(ops):
    x = rand(4, 192)
    with pytest.raises(ValueError, match="got 192"):
        ops.svdq_quantize_w4a4_act_fuse_lora(x, None, None, False, False, 256)
    with pytest.raises(ValueError, match="fp4=True"):
        ops.svdq_quantize_w4a4_act_fuse_lora(rand(4, 128), None, None, False, True, 256)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        ops.svdq_quantize_w4a4_wgt(torch.zeros(128, 128, dtype=BF16))
    torch.cuda.synchronize()  # nothing faulted
