"""CUDA kernels against the pure-PyTorch reference (kernels/reference.py).

FP8 records (payload and scale bytes) and dequantized values must be
bit-identical to the reference formulas: every step is an IEEE fp32 operation
(division, multiplication, max) or a round-to-nearest-even conversion, so the
CUDA code and torch agree exactly. The merge is compared with a float64
reference within a bound derived below.
"""

from __future__ import annotations

import math

import pytest
import torch

import reference as ref

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
DEV = "cuda"
D_VALUES = [1, 3, 64, 80, 96, 127, 128, 256]


def rand(*shape, dtype=BF16, scale=3.0, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor):
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype
    a = actual.contiguous().view(torch.uint8).cpu()
    e = expected.contiguous().view(torch.uint8).cpu()
    diff = (a != e).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, first at {diff[:5].tolist()}"


def poisoned(shape, dtype):
    # Outputs start as 0xFF bytes (NaN in every float format) so an element the
    # kernel never writes cannot pass.
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.full((nbytes,), 255, dtype=torch.uint8, device=DEV).view(dtype).view(shape)


# ---- per-token records ---------------------------------------------------------------


@pytest.mark.parametrize("D", D_VALUES)
@pytest.mark.parametrize("lead", [(1,), (2, 37), (2, 3, 5)])
def test_per_token_quant_bit_exact(ops, D, lead):
    x = rand(*lead, D, seed=D)
    out = ops.fp8_comm_per_token_quant(x)
    assert out.is_contiguous()
    assert_bitwise(out, ref.per_token_quant(x.cpu()).to(DEV))


@pytest.mark.parametrize("D", D_VALUES)
def test_per_token_dequant_bit_exact(ops, D):
    x = rand(2, 41, D, seed=D + 1)
    records = ref.per_token_quant(x.cpu()).to(DEV)
    assert_bitwise(ops.fp8_comm_per_token_dequant(records), ref.per_token_dequant(records.cpu()).to(DEV))


def test_per_token_dequant_arbitrary_bytes(ops):
    # Any bytes are a valid input: finite, inf and NaN scales and payloads.
    g = torch.Generator(device=DEV).manual_seed(7)
    raw = torch.randint(0, 256, (64, 130), generator=g, device=DEV, dtype=torch.uint8)
    records = raw.view(FP8)
    got = ops.fp8_comm_per_token_dequant(records)
    want = ref.per_token_dequant(records.cpu()).to(DEV)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_per_token_scale_floor_and_saturation(ops):
    x = torch.zeros(4, 64, dtype=BF16, device=DEV)
    x[1] = 1e-6
    x[2, 0] = 3e38  # saturates the others to 0, itself to 448
    x[3] = torch.linspace(-1000, 1000, 64)
    out = ops.fp8_comm_per_token_quant(x)
    assert_bitwise(out, ref.per_token_quant(x.cpu()).to(DEV))
    scale = out.view(torch.uint8)[:, 64:].contiguous().view(BF16).float().cpu()
    assert scale[0].item() == torch.tensor(1e-4 / 448).to(BF16).item()


def test_per_token_nan_propagates(ops):
    x = rand(3, 64)
    x[1, 5] = float("nan")
    out = ops.fp8_comm_per_token_quant(x)
    scale = out.view(torch.uint8)[:, 64:].contiguous().view(BF16).float()
    assert torch.isnan(scale[1]).all() and not torch.isnan(scale[[0, 2]]).any()
    assert torch.isnan(out[1, :64].float()).all()
    assert_bitwise(out[[0, 2]], ref.per_token_quant(x[[0, 2]].cpu()).to(DEV))


@pytest.mark.parametrize("D", [4097, 6000])
def test_per_token_long_rows(ops, D):
    x = rand(5, D, seed=D)
    records = ops.fp8_comm_per_token_quant(x)
    assert_bitwise(records, ref.per_token_quant(x.cpu()).to(DEV))
    assert_bitwise(ops.fp8_comm_per_token_dequant(records), ref.per_token_dequant(records.cpu()).to(DEV))


def test_per_token_unaligned_input_takes_same_values(ops):
    # A view starting 1 element into its storage cannot use 16-byte loads.
    base = rand(2 * 128 * 33 + 1)
    x = base[1:].view(66, 128)
    assert x.data_ptr() % 16 != 0
    assert_bitwise(ops.fp8_comm_per_token_quant(x), ref.per_token_quant(x.cpu()).to(DEV))


def test_per_token_round_trip_error(ops):
    x = rand(4, 1024, 128)
    y = ops.fp8_comm_per_token_dequant(ops.fp8_comm_per_token_quant(x))
    err = (y.float() - x.float()).abs()
    amax = x.float().abs().amax(-1, keepdim=True)
    # e4m3 keeps 3 mantissa bits: half a step is 1/16 of the value's binade.
    assert (err <= amax / 16 + 1e-6).all()


# ---- QKV permute records -------------------------------------------------------------


@pytest.mark.parametrize("D", D_VALUES)
@pytest.mark.parametrize("B,S,P,N", [(1, 7, 4, 6), (2, 5, 3, 2)])
def test_qkv_quant_bit_exact(ops, B, S, P, N, D):
    x = rand(B, S, P, N, D, seed=D)
    out = ops.fp8_comm_qkv_permute_quant(x)
    assert out.shape == (P, S, B, N, D + 4) and out.is_contiguous()
    assert_bitwise(out, ref.qkv_permute_quant(x.cpu()).to(DEV))


@pytest.mark.parametrize("D", [64, 127])
def test_qkv_quant_strided_views(ops, D):
    base = rand(3, 2, 8, 5, D, seed=3)  # [S, B, P2, N, D]
    for x in (base.transpose(0, 1), base.transpose(0, 1)[:, :, ::2], base.transpose(0, 1)[:, 1:]):
        assert not x.is_contiguous()
        assert_bitwise(ops.fp8_comm_qkv_permute_quant(x), ops.fp8_comm_qkv_permute_quant(x.contiguous()))
        assert_bitwise(ops.fp8_comm_qkv_permute_quant(x), ref.qkv_permute_quant(x.cpu()).to(DEV))


@pytest.mark.parametrize("D", D_VALUES)
@pytest.mark.parametrize("S,B,N", [(37, 2, 3), (1, 1, 1), (8190 // 64, 1, 10)])
def test_qkv_dequant_bit_exact_and_ordered(ops, S, B, N, D):
    # Ragged S (37) and B = 2: upstream's Triton kernel scrambles [B, S] here.
    x = rand(B, S, 1, N, D, seed=S + D)
    records = ref.qkv_permute_quant(x.cpu()).to(DEV)[0]  # [S, B, N, D + 4]
    got = ops.fp8_comm_qkv_permute_dequant(records)
    assert got.shape == (B, S, N, D) and got.is_contiguous()
    assert_bitwise(got, ref.qkv_permute_dequant(records.cpu()).to(DEV))
    err = (got.float() - x[:, :, 0].float()).abs()
    assert (err <= x[:, :, 0].float().abs().amax(-1, keepdim=True) / 16 + 1e-6).all()


def test_qkv_ulysses_round_trip(ops):
    # The all-to-all send/receive pair with W = 4 ranks folded into one process:
    # rank p's chunk is quant[p]; after the exchange, the receiver sees the
    # chunks of all source ranks stacked along S.
    B, S_local, W, H_local, D = 2, 9, 4, 3, 128
    x = rand(B, S_local, W, H_local, D)
    quant = ops.fp8_comm_qkv_permute_quant(x)  # [W, S_local, B, H_local, D + 4]
    received = quant.flatten(0, 1)  # as if every source rank sent the same chunk layout
    y = ops.fp8_comm_qkv_permute_dequant(received)  # [B, W * S_local, H_local, D]
    for p in range(W):
        err = (y[:, p * S_local:(p + 1) * S_local].float() - x[:, :, p].float()).abs()
        assert err.max().item() <= x.float().abs().max().item() / 16


def test_qkv_dequant_arbitrary_bytes(ops):
    g = torch.Generator(device=DEV).manual_seed(11)
    raw = torch.randint(0, 256, (5, 2, 3, 68), generator=g, device=DEV, dtype=torch.uint8)
    got = ops.fp8_comm_qkv_permute_dequant(raw.view(FP8))
    torch.testing.assert_close(got, ref.qkv_permute_dequant(raw.view(FP8).cpu()).to(DEV), rtol=0, atol=0, equal_nan=True)


# ---- merge ---------------------------------------------------------------------------

EPS = {torch.float16: 2.0**-11, BF16: 2.0**-8, torch.float32: 2.0**-24}


def check_merge(ops, prev, plse, suff, slse):
    out, lse = ops.fused_merge_attn_states(prev, plse, suff, slse)
    want_out, want_lse = ref.merge_attn_states(prev, plse, suff, slse)
    assert out.dtype == suff.dtype and lse.dtype == slse.dtype
    assert out.is_contiguous() and lse.is_contiguous()
    # Bound: the kernel evaluates the same expression in fp32 (a few roundings of
    # relative size 2^-24 each on terms bounded by |P| + |S|, plus expf/logf
    # within 2 ulp), then rounds once to the output dtype (half an ulp, i.e.
    # EPS/2 relative for bf16/fp16 with EPS = 2^-(mantissa bits)).
    mag = prev.double().abs() + suff.double().abs()
    tol = EPS[out.dtype] * want_out.abs() + 8 * 2.0**-24 * mag + 1e-30
    finite = torch.isfinite(want_out)
    assert torch.equal(torch.isnan(out.double()), torch.isnan(want_out))
    assert ((out.double() - want_out).abs()[finite] <= tol[finite]).all(), (out.double() - want_out).abs().max()
    lse_tol = EPS[lse.dtype] * want_lse.abs() + 4 * 2.0**-24 * (want_lse.abs() + 1)
    both = torch.isfinite(want_lse)
    assert torch.equal(torch.isnan(lse.double()), torch.isnan(want_lse))
    assert torch.equal(lse.double()[~both & ~torch.isnan(want_lse)], want_lse[~both & ~torch.isnan(want_lse)])
    assert ((lse.double() - want_lse).abs()[both] <= lse_tol[both]).all()
    return out, lse


@pytest.mark.parametrize("D", D_VALUES)
@pytest.mark.parametrize("dtype", [torch.float16, BF16, torch.float32])
def test_merge_matches_reference(ops, D, dtype):
    B, S, H = 2, 37, 3
    check_merge(ops, rand(B, S, H, D, dtype=dtype, scale=1, seed=1), rand(B, S, H, 1, dtype=torch.float32, seed=2),
                rand(B, S, H, D, dtype=dtype, scale=1, seed=3), rand(B, S, H, 1, dtype=torch.float32, seed=4))


def test_merge_mixed_dtypes(ops):
    B, S, H, D = 1, 64, 4, 128
    prev = rand(B, S, H, D, dtype=torch.float32, scale=1)
    suff = rand(B, S, H, D, dtype=BF16, scale=1, seed=5)
    plse = rand(B, S, H, 1, dtype=BF16, seed=6)
    slse = rand(B, S, H, 1, dtype=torch.float32, seed=7)
    check_merge(ops, prev, plse, suff, slse)


def test_merge_reads_flash_attn_lse_view_in_place(ops):
    B, S, H, D = 2, 100, 6, 128
    prev, suff = rand(B, S, H, D, scale=1), rand(B, S, H, D, scale=1, seed=9)
    plse_bhs = rand(B, H, S, dtype=torch.float32, seed=10)
    slse_bhs = rand(B, H, S, dtype=torch.float32, seed=11)
    plse = plse_bhs.permute(0, 2, 1).unsqueeze(-1)
    slse = slse_bhs.permute(0, 2, 1).unsqueeze(-1)
    assert not plse.is_contiguous()
    out, lse = check_merge(ops, prev, plse, suff, slse)
    out_c, lse_c = ops.fused_merge_attn_states(prev, plse.contiguous(), suff, slse.contiguous())
    assert_bitwise(out, out_c)
    assert_bitwise(lse, lse_c)


def test_merge_strided_and_unaligned_outputs_match_dense(ops):
    B, S, H, D = 2, 33, 5, 128
    big_p, big_s = rand(B, S, H, 2 * D, scale=1), rand(B, S, H, 2 * D, scale=1, seed=12)
    prev, suff = big_p[..., D:], big_s[..., :D]  # row strides 2D: vector path
    lp, ls = rand(B, S, H, 1, dtype=torch.float32, seed=13), rand(B, S, H, 1, dtype=torch.float32, seed=14)
    out, lse = ops.fused_merge_attn_states(prev, lp, suff, ls)
    out_c, lse_c = ops.fused_merge_attn_states(prev.contiguous(), lp, suff.contiguous(), ls)
    assert_bitwise(out, out_c)
    # One element off alignment: the scalar path must give the same bits.
    flat = rand(B * S * H * D + 1, scale=1, seed=15)
    prev_u = flat[1:].view(B, S, H, D)
    out_u, _ = ops.fused_merge_attn_states(prev_u, lp, suff, ls)
    out_a, _ = ops.fused_merge_attn_states(prev_u.contiguous(), lp, suff, ls)
    assert_bitwise(out_u, out_a)


INF = float("inf")
NAN = float("nan")


@pytest.mark.parametrize("p,s,want_out,want_lse", [
    (0.0, 0.0, 1.5, math.log(2.0)),
    (-INF, 1.5, 2.0, 1.5),
    (1.5, -INF, 1.0, 1.5),
    (-INF, -INF, 1.0, -INF),
    (INF, 1.5, 2.0, 1.5),
    (1.5, INF, 1.0, 1.5),
    (INF, INF, 1.0, -INF),
    (0.0, 89.0, 2.0, 89.0),
    (0.0, 100.0, 2.0, 100.0),
    (-100.0, 0.0, 2.0, 0.0),
    (100.0, 0.0, 1.0, 100.0),
    (1000.0, -1000.0, 1.0, 1000.0),
])
def test_merge_edge_cases(ops, p, s, want_out, want_lse):
    shape = (1, 3, 2, 64)
    prev = torch.full(shape, 1.0, dtype=torch.float32, device=DEV)
    suff = torch.full(shape, 2.0, dtype=torch.float32, device=DEV)
    plse = torch.full((1, 3, 2, 1), p, device=DEV)
    slse = torch.full((1, 3, 2, 1), s, device=DEV)
    out, lse = ops.fused_merge_attn_states(prev, plse, suff, slse)
    assert torch.allclose(out, torch.full_like(out, want_out), rtol=1e-6, atol=0)
    if want_lse == -INF:
        assert (lse == -INF).all()
    else:
        assert torch.allclose(lse, torch.full_like(lse, want_lse), rtol=1e-6, atol=1e-6)


def test_merge_empty_side_ignores_garbage(ops):
    prev = torch.full((1, 2, 2, 16), NAN, device=DEV)  # an empty side's values are meaningless
    suff = rand(1, 2, 2, 16, dtype=torch.float32)
    out, lse = ops.fused_merge_attn_states(prev, torch.full((1, 2, 2, 1), -INF, device=DEV), suff,
                                           torch.zeros(1, 2, 2, 1, device=DEV))
    assert_bitwise(out, suff)
    assert (lse == 0).all()


def test_merge_nan_lse_propagates(ops):
    prev, suff = rand(1, 2, 2, 8, scale=1), rand(1, 2, 2, 8, scale=1, seed=3)
    plse = torch.zeros(1, 2, 2, 1, device=DEV)
    plse[0, 1, 0, 0] = NAN
    out, lse = ops.fused_merge_attn_states(prev, plse, suff, torch.full_like(plse, -INF))
    assert torch.isnan(lse[0, 1, 0]).all() and torch.isnan(out[0, 1, 0].float()).all()
    assert not torch.isnan(out[0, 0]).any()


# ---- out overloads, empty inputs, overlap, streams -----------------------------------------


def test_out_overloads_fill_poisoned_outputs(ops):
    x = rand(3, 17, 96)
    out = poisoned((3, 17, 98), FP8)
    assert ops.fp8_comm_per_token_quant.out(x, out=out) is out
    assert_bitwise(out, ref.per_token_quant(x.cpu()).to(DEV))
    y = poisoned((3, 17, 96), BF16)
    ops.fp8_comm_per_token_dequant.out(out, out=y)
    assert_bitwise(y, ref.per_token_dequant(out.cpu()).to(DEV))
    xq = rand(2, 5, 3, 4, 80)
    q = poisoned((3, 5, 2, 4, 84), FP8)
    ops.fp8_comm_qkv_permute_quant.out(xq, out=q)
    assert_bitwise(q, ref.qkv_permute_quant(xq.cpu()).to(DEV))
    r = q.flatten(0, 1)
    yq = poisoned((2, 15, 4, 80), BF16)
    ops.fp8_comm_qkv_permute_dequant.out(r, out=yq)
    assert_bitwise(yq, ref.qkv_permute_dequant(r.cpu()).to(DEV))
    prev, suff = rand(2, 5, 3, 80, scale=1), rand(2, 5, 3, 80, scale=1, seed=2)
    lp, ls = rand(2, 5, 3, 1, dtype=torch.float32), rand(2, 5, 3, 1, dtype=torch.float32, seed=4)
    o, l = poisoned((2, 5, 3, 80), BF16), poisoned((2, 5, 3, 1), torch.float32)
    ops.fused_merge_attn_states.out(prev, lp, suff, ls, out=o, lse=l)
    o2, l2 = ops.fused_merge_attn_states(prev, lp, suff, ls)
    assert_bitwise(o, o2)
    assert_bitwise(l, l2)


def test_empty_inputs_launch_nothing(ops):
    assert ops.fp8_comm_per_token_quant(rand(0, 64)).shape == (0, 66)
    assert ops.fp8_comm_qkv_permute_dequant(torch.empty(0, 2, 3, 68, dtype=FP8, device=DEV)).shape == (2, 0, 3, 64)
    out, lse = ops.fused_merge_attn_states(rand(1, 0, 2, 8), rand(1, 0, 2, 1), rand(1, 0, 2, 8), rand(1, 0, 2, 1))
    assert out.shape == (1, 0, 2, 8) and lse.shape == (1, 0, 2, 1)


def test_output_overlapping_input_is_rejected(ops):
    buf = torch.empty(4 * 64 * 2, dtype=torch.uint8, device=DEV)
    x = buf.view(BF16).view(4, 64)
    out = buf[: 4 * 66].view(FP8).view(4, 66)  # the records would overwrite x as it is read
    with pytest.raises(ValueError, match="overlaps another operand"):
        ops.fp8_comm_per_token_quant.out(x, out=out)
    p = rand(1, 2, 2, 8)
    l = rand(1, 2, 2, 1, dtype=torch.float32)
    with pytest.raises(ValueError, match="overlaps another operand"):
        ops.fused_merge_attn_states.out(p, l, p, l, out=p, lse=torch.empty_like(l))


def test_cuda_and_cpu_operands_rejected(ops):
    with pytest.raises(ValueError, match="is on cpu but suff_out is on cuda"):
        ops.fused_merge_attn_states(rand(1, 2, 2, 8).cpu(), rand(1, 2, 2, 1), rand(1, 2, 2, 8), rand(1, 2, 2, 1))


def test_kernels_run_on_the_current_stream(ops):
    # Capture fails if a kernel is launched on the legacy default stream while
    # the current stream is capturing, so a successful capture + replay shows
    # every op uses the current stream.
    x = rand(4, 128)
    xq = rand(1, 8, 2, 3, 128)
    prev, suff = rand(1, 8, 3, 128, scale=1), rand(1, 8, 3, 128, scale=1, seed=1)
    lse = rand(1, 8, 3, 1, dtype=torch.float32)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up off the default stream
        ops.fp8_comm_per_token_quant(x)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = ops.fp8_comm_per_token_quant(x)
        y = ops.fp8_comm_per_token_dequant(q)
        qq = ops.fp8_comm_qkv_permute_quant(xq)
        yq = ops.fp8_comm_qkv_permute_dequant(qq.flatten(0, 1))
        o, l = ops.fused_merge_attn_states(prev, lse, suff, lse)
    x.copy_(rand(4, 128, seed=99))
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise(q, ref.per_token_quant(x.cpu()).to(DEV))
    assert_bitwise(y, ref.per_token_dequant(q.cpu()).to(DEV))
    assert_bitwise(qq, ref.qkv_permute_quant(xq.cpu()).to(DEV))


# ---- opcheck on CUDA ------------------------------------------------------------------


def test_opcheck_cuda(ops):
    x = rand(3, 4, 64)
    q = ops.fp8_comm_per_token_quant(x)
    xq = rand(2, 3, 2, 4, 32)
    qq = ops.fp8_comm_qkv_permute_quant(xq).flatten(0, 1)
    m = (rand(2, 5, 3, 16, scale=1), rand(2, 5, 3, 1, dtype=torch.float32), rand(2, 5, 3, 16, scale=1, seed=1),
         rand(2, 5, 3, 1, dtype=torch.float32, seed=2))
    cases = [
        (ops.fp8_comm_per_token_quant, (x,), {"out": torch.empty(3, 4, 66, dtype=FP8, device=DEV)}),
        (ops.fp8_comm_per_token_dequant, (q,), {"out": torch.empty(3, 4, 64, dtype=BF16, device=DEV)}),
        (ops.fp8_comm_qkv_permute_quant, (xq,), {"out": torch.empty(2, 3, 2, 4, 36, dtype=FP8, device=DEV)}),
        (ops.fp8_comm_qkv_permute_dequant, (qq,), {"out": torch.empty(2, 6, 4, 32, dtype=BF16, device=DEV)}),
        (ops.fused_merge_attn_states, m, {"out": torch.empty(2, 5, 3, 16, dtype=BF16, device=DEV),
                                          "lse": torch.empty(2, 5, 3, 1, device=DEV)}),
    ]
    # test_schema compares values with ops torch does not implement for float8
    # ("mul_cuda not implemented for Float8_e4m3fn"): the FP8 ops skip it here
    # (it passed for every op on the Meta path, test_kernels_cpu.py).
    # test_aot_dispatch_dynamic cannot functionalize a custom op that returns
    # an aliased output (every `out` overload, by torch's convention); it runs
    # on the functional overloads, which are what torch.compile users call.
    all_utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for op, args, outs in cases:
        utils = all_utils if op is ops.fused_merge_attn_states else all_utils[1:]
        torch.library.opcheck(op.default, args, test_utils=utils)
        torch.library.opcheck(op.out, args, outs, test_utils=tuple(u for u in utils if u != "test_aot_dispatch_dynamic"))
