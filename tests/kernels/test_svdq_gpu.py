"""The svdq CUDA kernels against kernels/svdq_reference.py.

Bit-exact where the arithmetic is the reference's step for step: both quantizers (fp32 divisions and
multiplications, one rounding to the model dtype, round half to even), the packed checkpoint bytes, and
the GEMM without LoRA (exact int32 group dots, then per group one fp32 product and one fp32 sum, in group
order, then the bias). LoRA sums over K (down) and R (up) in fp32 in an order torch does not share: they
are compared within K (or R) fp32 roundings of the sum of the absolute products.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

import svdq_reference as sq
from conftest import library_path

pytestmark = pytest.mark.gpu

DEV = "cuda"
BF16, F16, F32, FP8 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn
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


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("n,k", [(128, 128), (256, 384), (384, 3072)])
def test_weight_quantizer_is_bit_exact(ops, dtype, n, k):
    w = rand(n, k, dtype=dtype, scale=0.05, seed=n + k)
    w[0, :64] = 0  # an all-zero group: scale 1, q 0
    qweight, wscales = ops.svdq_quantize_w4a4_wgt(w)
    q, s = sq.quantize_weight(w.cpu(), dtype)
    assert_bitwise(wscales, sq.pack_wscales(s).to(DEV))
    assert_bitwise(qweight, sq.pack_qweight(q).to(DEV))


@pytest.mark.parametrize("dtype", [BF16, F16])
# (300, 384, 32): one K split, LoRA written directly; (37, 1024, 80, pad 1): M_pad not a multiple of the
# 16-row tile, ranks past the 64 one launch holds; (1024 | 4608, 3072, 32): K split across blocks, the
# partial LoRA sums added in split order.
@pytest.mark.parametrize("m,k,r,smooth,pad", [(1, 128, 0, False, 256), (300, 384, 32, True, 256),
                                              (37, 1024, 80, True, 1), (1024, 3072, 32, True, 256),
                                              (4608, 3072, 32, True, 256)])
def test_activation_quantizer_is_bit_exact_and_lora_down_close(ops, dtype, m, k, r, smooth, pad):
    x = rand(m, k, dtype=dtype, scale=2.0, seed=m)
    s = (torch.rand(k, device=DEV) + 0.5).to(dtype) if smooth else None
    down = rand(r, k, dtype=dtype, scale=0.1, seed=k) if r else None
    packed_s = sq.pack_channel_vector(s.cpu()).to(DEV) if smooth else None
    packed_down = sq.pack_lowrank(down.cpu(), down=True).to(DEV) if r else None
    want_q, want_s = sq.quantized_act_outputs(x.cpu(), None if s is None else s.cpu(), pad)
    m_pad = want_q.shape[0]
    outs = {"output": poisoned((m_pad, k), FP8), "oscales": poisoned((k // 64, m_pad), dtype),
            "lora_act_out": poisoned((m_pad, r), F32)}
    ops.svdq_quantize_w4a4_act_fuse_lora.out(x, packed_down, packed_s, False, False, pad, **outs)
    assert_bitwise(outs["output"], want_q.to(DEV))
    assert_bitwise(outs["oscales"], want_s.to(DEV))
    if r:
        la = outs["lora_act_out"].cpu()
        ref = x.cpu().double() @ down.cpu().double().t()
        bound = k * EPS32 * (x.cpu().double().abs() @ down.cpu().double().abs().t())
        assert torch.all((la[:m].double() - ref).abs() <= bound + 1e-30)
        assert torch.all(la[m:] == 0)


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_activation_quantizer_ties_round_to_even_and_non_finite_values_give_nan_codes(ops, dtype):
    # Group 0: amax 7, so scale = 7 * fp32(1/7) = 1 and every x * (1 / scale) is x: the halves are
    # ties (0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -2.5 -> -2, 6.5 -> 6), exactly representable in both dtypes.
    k = 256
    x = torch.zeros(2, k, dtype=dtype)
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 6.5, 7.0, -7.0, -6.5], dtype=dtype)
    x[0, :ties.numel()] = ties
    x[1] = rand(k, dtype=dtype, seed=3).cpu()
    x[1, 70] = float("nan")  # group 1: a NaN element
    x[1, 130] = float("inf")  # group 2: an inf element (scale inf, reciprocal 0)
    want_q, want_s = sq.quantized_act_outputs(x[:1], None, 16)
    outs = {"output": poisoned((16, k), FP8), "oscales": poisoned((k // 64, 16), dtype),
            "lora_act_out": poisoned((16, 0), F32)}
    ops.svdq_quantize_w4a4_act_fuse_lora.out(x.to(DEV), None, None, False, False, 16, **outs)
    q = outs["output"].cpu()
    assert_bitwise(q[0], want_q[0])
    assert q[0, :ties.numel()].float().tolist() == [0, 2, 2, 0, -2, -2, 4, 6, 7, -7, -6]
    # The NaN and the inf element get NaN codes (their row's outputs are NaN, as a float linear's);
    # every other element of those groups quantizes as usual (finite ones of the inf group to 0).
    assert torch.isnan(q[1].float()).nonzero().flatten().tolist() == [70, 130]
    assert torch.all(q[1, 128:192].float().nan_to_num(0) == 0)
    assert torch.isinf(outs["oscales"][2, 1].float())
    # The NaN takes no part in its group's amax (the other 63 elements' codes are the reference's
    # with the NaN read as 0, an amax-neutral value here since the group has nonzero elements).
    clean = x[1:, :128].clone()
    clean[0, 70] = 0
    finite_q, finite_s = sq.quantized_act_outputs(clean, None, 16)
    keep = [i for i in range(128) if i != 70]
    assert_bitwise(q[1, keep], finite_q[0, keep])
    assert_bitwise(outs["oscales"][:2, 1].cpu(), finite_s[:, 0])


def test_activation_quantizer_subnormal_scales_divide_and_saturate(ops):
    # Only bf16 reaches them: a group's scale amax / 7 is subnormal in fp32 below amax ~8e-38. Such rows
    # divide by the scale instead of multiplying by its reciprocal (which loses bits or overflows: 0 * inf
    # would make a finite group NaN) and saturate, while the rows beside them in the same 16-row tile take
    # the multiply without saturation.
    k = 256
    x = rand(16, k, seed=5).cpu()
    tiny = torch.finfo(BF16).smallest_normal
    x[1] = rand(k, seed=6).cpu() * tiny * 0.5  # scales subnormal, reciprocals finite
    x[2] = 0
    x[2, 3], x[2, 64], x[2, 65] = 2.0 ** -133, -3 * 2.0 ** -133, 2.0 ** -133  # reciprocals overflow
    x[3, 64:128] = x[1, 64:128]  # one subnormal group in an otherwise normal row
    want_q, want_s = sq.quantized_act_outputs(x, None, 16)
    outs = {"output": poisoned((16, k), FP8), "oscales": poisoned((k // 64, 16), BF16),
            "lora_act_out": poisoned((16, 0), F32)}
    ops.svdq_quantize_w4a4_act_fuse_lora.out(x.to(DEV), None, None, False, False, 16, **outs)
    q = outs["output"].cpu()
    assert not torch.isnan(q.float()).any()
    assert q[2, [3, 64, 65, 66]].float().tolist() == [7, -7, 2, 0]
    assert_bitwise(q, want_q)
    assert_bitwise(outs["oscales"], want_s.to(DEV))


def _layer(dtype, m, n, k, r, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) * 0.1
    x = (torch.randn(m, k, generator=g) * 2).to(dtype)
    ckpt = sq.quantize_linear(w, b, rank=r, dtype=dtype, act_amax=x.float().abs().amax(dim=0))
    return x, ckpt


def _gemm(ops, x, dev, out_dtype, lora, pad_size=256):
    act, ascales, lora_act = ops.svdq_quantize_w4a4_act_fuse_lora(
        x.to(DEV), dev["proj_down"] if lora else None, dev["smooth_factor"], False, False, pad_size)
    return ops.svdq_gemm_w4a4(act, dev["qweight"], ascales, dev["wscales"], lora_act if lora else None,
                              dev["proj_up"] if lora else None, dev["bias"], False, 1.0, None, False,
                              {F16: 0, BF16: 1, F32: 2}[out_dtype])


# pad_size 8 leaves a partial 128-row tile (TMA reads zeros past M_pad, the stores stop there); pad_size 1
# gives M_pad % 8 != 0, which the tensor-core path does not take (the portable kernel runs).
@pytest.mark.parametrize("out_dtype", [F32, BF16, F16])
@pytest.mark.parametrize("m,n,k,pad", [(1, 128, 128, 256), (300, 256, 384, 8), (301, 128, 256, 1),
                                       (1024, 384, 3072, 256)])
def test_gemm_without_lora_is_bit_exact(ops, out_dtype, m, n, k, pad):
    x, ckpt = _layer(BF16, m, n, k, r=0, seed=m + n)
    y = _gemm(ops, x, {key: t.to(DEV) for key, t in ckpt.items()}, out_dtype, lora=False, pad_size=pad)
    t = sq.unpack_linear(ckpt)
    want = sq.linear_faithful(x, t["q_w"], t["wscales"], t["smooth"], bias=t["bias"], out_dtype=out_dtype)
    assert_bitwise(y[:m], want.to(DEV))


def _gemms_in_child(tmp_path, path, cases):
    """_gemm of each (x, ckpt, out_dtype, lora, pad_size) in a child process with CACHE_DIT_SVDQ_GEMM=path (read
    once per process), outputs on the CPU."""
    torch.save(cases, tmp_path / "in.pt")
    child = f"""
import sys, torch
sys.path[:0] = {sys.path!r}
torch.ops.load_library({str(library_path())!r})
import test_svdq_gpu as t
ops = torch.ops.cache_dit_cuda_ops
ys = [t._gemm(ops, x, {{k: v.to("cuda") for k, v in ckpt.items()}}, out_dtype, lora, pad).cpu()
      for x, ckpt, out_dtype, lora, pad in torch.load({str(tmp_path / "in.pt")!r})]
torch.save(ys, {str(tmp_path / "out.pt")!r})
"""
    env = dict(os.environ, CACHE_DIT_SVDQ_GEMM=path, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", child], check=True, env=env, cwd=os.path.dirname(__file__))
    return torch.load(tmp_path / "out.pt")


def _gemms_here(ops, cases):
    return [_gemm(ops, x, {key: t.to(DEV) for key, t in ckpt.items()}, out_dtype, lora, pad).cpu()
            for x, ckpt, out_dtype, lora, pad in cases]


@pytest.mark.parametrize("path", ["portable", "int4"])
def test_the_other_gemm_paths_equal_this_one(ops, tmp_path, path):
    """CACHE_DIT_SVDQ_GEMM=portable | int4 (in a child process: the CUDA-core kernel, or the INT4 mma.sync one,
    which sm_90 emulates) against this process's sm_90a path: equal bits without LoRA, within the LoRA sums'
    rounding with it (the paths sum R in different orders)."""
    torch.manual_seed(0)
    x, ckpt = _layer(BF16, 640, 256, 1024, r=32, seed=5)
    cases = [(x, ckpt, F32, lora, 256) for lora in (False, True)]
    other = _gemms_in_child(tmp_path, path, cases)
    mine = _gemms_here(ops, cases)
    assert_bitwise(mine[0], other[0])
    t = sq.unpack_linear(ckpt)
    lora_mag = (x.double().abs() @ t["down"].double().abs().t()) @ t["up"].double().abs().t()
    bound = lora_mag * 64 * EPS32 + 1e-6
    assert torch.all((mine[1][:640].double() - other[1][:640].double()).abs() <= bound)


@pytest.mark.parametrize("schedule", ["sm90-tile", "sm90-multicast", "sm90-persistent", "sm90-serial", "sm90-overlap"])
def test_the_sm90_schedules_equal_the_default_bit_for_bit(ops, tmp_path, schedule):
    """The sm_90a kernel launched with another schedule than the default's (kernels/svdq/gemm_sm90.h: the
    default has two-CTA clusters sharing the activation tile, persistent CTAs walking the tiles, and a main
    loop whose tensor cores also form the scale products; the others drop one or both of the first two, or
    rescale with FMUL and FFMA, one group waited for at a time or a stage's first group under its second's
    MMAs) gives the default's bits, LoRA included (same epilogue; the groups are summed in the same order,
    each with one rounding of the same exact product: the scales here are normal numbers). Shapes: 2048 x 2048 is 256 tiles (128 two-CTA units), more than the H200 holds
    at once, so a persistent CTA takes several and its ring runs on from one tile into the next; 300 rows
    padded to 304 end in a partial row tile; N = 384 is an odd number of column tiles, where multicast falls
    back to single CTAs (and the scale-MMA loop takes its groups as a loop)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the schedules are the sm_90a kernel's")
    cases = []
    for m, n, k, pad, out_dtype, seed in [(2048, 2048, 256, 256, F32, 1), (300, 256, 384, 8, BF16, 2),
                                          (640, 384, 1024, 256, F32, 3)]:
        x, ckpt = _layer(BF16, m, n, k, r=32, seed=seed)
        cases += [(x, ckpt, out_dtype, lora, pad) for lora in (False, True)]
    other = _gemms_in_child(tmp_path, schedule, cases)
    mine = _gemms_here(ops, cases)
    for a, b in zip(mine, other):
        assert_bitwise(b, a)


def test_a_second_gpu_of_the_process_runs_them_with_the_same_bits(ops):
    """The quantizer and the GEMM opt in to more than 48 KB of dynamic shared memory per device
    (kernels/common/cuda_utils.cuh allow_dynamic_smem: the attribute lives in one device's context). After
    running on GPU 0, the same process runs them on GPU 1, LoRA included, with GPU 0's bits."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    x, ckpt = _layer(BF16, 640, 256, 1024, r=32, seed=7)
    ys = []
    for device in (0, 1):
        with torch.cuda.device(device):
            ys.append(_gemm(ops, x, {key: t.to(DEV) for key, t in ckpt.items()}, BF16, lora=True).cpu())
    assert_bitwise(ys[1], ys[0])


def test_accuracy_against_the_float_linear_improves_with_rank(ops):
    """A linear whose weight has a strong low-rank part plus noise and whose input has outlier channels (what
    SVDQuant is for): the kernels' output against the float linear, at ranks 0, 16, 32."""
    g = torch.Generator().manual_seed(3)
    m, n, k = 512, 512, 1024
    low_rank = torch.randn(n, 24, generator=g) @ torch.randn(24, k, generator=g)
    w = low_rank * 0.02 + torch.randn(n, k, generator=g) * 0.01
    b = torch.randn(n, generator=g) * 0.1
    x = torch.randn(m, k, generator=g)
    x[:, :8] *= 20  # outlier channels
    x = x.to(BF16)
    want = x.double() @ w.double().t() + b.double()
    errs = []
    for r in (0, 16, 32):
        ckpt = sq.quantize_linear(w, b, rank=r, dtype=BF16, act_amax=x.float().abs().amax(dim=0))
        y = _gemm(ops, x, {key: v.to(DEV) for key, v in ckpt.items()}, F32, lora=r > 0)[:m].cpu().double()
        rel = ((y - want).norm() / want.norm()).item()
        cos = torch.nn.functional.cosine_similarity(y.flatten(), want.flatten(), dim=0).item()
        errs.append(rel)
        assert cos > 0.99, (r, cos)
    assert errs[0] > errs[1] > errs[2], errs
    assert errs[2] < 0.1, errs


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


def test_k_zero_gives_zero_lora_act_and_the_bias(ops):
    """K = 0 is a multiple of 128: nothing to quantize, lora_act = x @ proj_down over no channels = 0, and
    the GEMM's output is the bias (plus a LoRA of zeros) in every row."""
    r, n = 32, 128
    outs = {"output": poisoned((256, 0), FP8), "oscales": poisoned((0, 256), BF16),
            "lora_act_out": poisoned((256, r), F32)}
    x, down, smooth = rand(5, 0), rand(0, r), rand(0)
    ops.svdq_quantize_w4a4_act_fuse_lora.out(x, down, smooth, False, False, 256, **outs)
    assert torch.all(outs["lora_act_out"] == 0)
    bias = rand(n, seed=1)
    up = sq.pack_lowrank(rand(n, r, seed=2).cpu(), down=False).to(DEV)
    y = ops.svdq_gemm_w4a4(outs["output"], torch.empty(n, 0, dtype=torch.int8, device=DEV), outs["oscales"],
                           torch.empty(0, n, dtype=BF16, device=DEV), outs["lora_act_out"], up, bias, False, 1.0,
                           None, False, 1)
    assert_bitwise(y, sq.unpack_channel_vector(bias.cpu()).expand(256, n).contiguous().to(DEV))


def test_bad_input_is_rejected_before_launch_with_the_value_named(ops):
    x = rand(4, 192)
    with pytest.raises(ValueError, match="got 192"):
        ops.svdq_quantize_w4a4_act_fuse_lora(x, None, None, False, False, 256)
    with pytest.raises(ValueError, match="fp4=True"):
        ops.svdq_quantize_w4a4_act_fuse_lora(rand(4, 128), None, None, False, True, 256)
    with pytest.raises(ValueError, match="input must be a CUDA tensor, got device cpu"):
        ops.svdq_quantize_w4a4_wgt(torch.zeros(128, 128, dtype=BF16))
    with pytest.raises(ValueError, match=r"got wgt shape \[128, 64\]"):  # a weight of another K
        act, ascales, _ = ops.svdq_quantize_w4a4_act_fuse_lora(rand(4, 256), None, None, False, False, 256)
        w = rand(128, 128)
        qw, ws = ops.svdq_quantize_w4a4_wgt(w)
        ops.svdq_gemm_w4a4(act, qw, ascales, ws, None, None, None, False, 1.0, None, False, 1)
    # A contiguous view one element into its storage: the vector loads would fault, so it is refused.
    shifted = rand(4 * 128 + 1, 1).view(-1)[1:].view(4, 128)
    with pytest.raises(ValueError, match=r"input must start at a 16-byte aligned address, got one 2 bytes past "
                                         r"\(storage_offset 1\)"):
        ops.svdq_quantize_w4a4_act_fuse_lora(shifted, None, None, False, False, 256)
    act, ascales, _ = ops.svdq_quantize_w4a4_act_fuse_lora(rand(4, 128), None, None, False, False, 256)
    qw, ws = ops.svdq_quantize_w4a4_wgt(rand(128, 128))
    out = torch.empty(256 * 128 + 4, dtype=BF16, device=DEV)[4:].view(256, 128)
    with pytest.raises(ValueError, match=r"out must start at a 16-byte aligned address, got one 8 bytes past "
                                         r"\(storage_offset 4\)"):
        ops.svdq_gemm_w4a4.out(act, qw, ascales, ws, None, None, None, False, 1.0, None, False, 1, out=out)
    torch.cuda.synchronize()  # nothing faulted
