"""The SVDQuant W4A4 references (kernels/svdq_reference.py) on the CPU.

Layouts: every packer and unpacker are exact inverses, and the packed positions are the ones the kernel
contract states (docs/DESIGN.md section 8: lane 4 j + i of a 128-column block holds columns
16 j + 2 i + {0, 1, 8, 9}; a qweight word holds 8 consecutive k of one n). Interoperability: the same
logical tensors packed by PyPI cache-dit 1.5.3's own packer (pure PyTorch, loaded from its wheel without
importing cache_dit) give byte-identical checkpoint tensors. Numerics: the quantizers' rounding rules,
the faithful linear against an exact rational evaluation, and the ideal reference's accuracy improving
with rank as upstream's tests require.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest
import torch

import svdq_reference as sq

BF16, FP16 = torch.bfloat16, torch.float16


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _q(n, k, seed=0):
    return torch.randint(-8, 8, (n, k), generator=_gen(seed), dtype=torch.int32)


# ---- layouts ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,k", [(128, 128), (256, 384), (384, 256)])
def test_qweight_pack_and_unpack_are_exact_inverses(n, k):
    q = _q(n, k)
    packed = sq.pack_qweight(q)
    assert packed.dtype == torch.int8 and packed.shape == (n, k // 2)
    assert torch.equal(sq.unpack_qweight(packed).to(torch.int32), q)
    # ...and packing is a bijection on bytes: unpack then pack gives the same bytes back.
    raw = torch.randint(-128, 128, (n, k // 2), generator=_gen(1), dtype=torch.int8)
    assert torch.equal(sq.pack_qweight(sq.unpack_qweight(raw)), raw)


def test_qweight_words_hold_eight_consecutive_k_of_one_n_low_nibble_first():
    n, k = 128, 128
    q = torch.zeros(n, k, dtype=torch.int32)
    # n = 16 n_pack + 8 n_half + n_lane, k = 32 k_half + 8 k_lane + nibble (tile 0, k-tile 1)
    n_pack, n_half, n_lane, k_half, k_lane = 3, 1, 5, 1, 2
    row = 16 * n_pack + 8 * n_half + n_lane
    col0 = 64 + 32 * k_half + 8 * k_lane
    q[row, col0:col0 + 8] = torch.tensor([1, 2, 3, 4, 5, 6, 7, -8])
    words = sq.pack_qweight(q).view(torch.int32).reshape(-1)
    # word index in [n_tile][k_tile][n_pack][n_lane][k_lane][n_half][k_half]
    index = ((((1 * 8 + n_pack) * 8 + n_lane) * 4 + k_lane) * 2 + n_half) * 2 + k_half
    assert int(words[index]) & 0xFFFFFFFF == 0x87654321
    assert int(torch.count_nonzero(words)) == 1


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_wscales_and_vectors_pack_and_unpack_are_exact_inverses(dtype):
    s = torch.randn(256, 6, generator=_gen(2)).to(dtype)
    packed = sq.pack_wscales(s)
    assert packed.shape == (6, 256) and packed.dtype == dtype
    assert torch.equal(sq.unpack_wscales(packed), s)
    v = torch.randn(384, generator=_gen(3)).to(dtype)
    assert torch.equal(sq.unpack_channel_vector(sq.pack_channel_vector(v)), v)
    assert not torch.equal(sq.pack_channel_vector(v), v)  # a flat [N] tensor would be silently wrong


def test_wscale_lane_order_is_the_kernels():
    n, groups = 256, 2
    cols = torch.arange(n, dtype=torch.float32).repeat(groups, 1).t()  # value = column index
    packed = sq.pack_wscales(cols.to(BF16)).float().reshape(-1)
    # block b, group g, lane 4 j + i, slot t -> column 128 b + 16 j + 2 i + (0, 1, 8, 9)[t]
    for b in range(2):
        for g in range(groups):
            for lane in (0, 5, 31):
                j, i = divmod(lane, 4)
                base = ((b * groups + g) * 32 + lane) * 4
                want = [128 * b + 16 * j + 2 * i + d for d in (0, 1, 8, 9)]
                assert packed[base:base + 4].tolist() == want


@pytest.mark.parametrize("down", [True, False])
def test_lowrank_pack_and_unpack_are_exact_inverses(down):
    w = torch.randn((32, 256) if down else (256, 32), generator=_gen(4)).to(BF16)
    packed = sq.pack_lowrank(w, down=down)
    assert packed.shape == ((256, 32) if down else (256, 32))
    assert torch.equal(sq.unpack_lowrank(packed, down=down), w)


def test_lowrank_tiles_are_mma_b_fragments():
    # proj_up [N, R]: tile (0, 0); lane n_lane * 4 + k_lane holds, as its 8 values,
    # rows n_lane (+8) and columns 2 k_lane (+1) (+8): [n_half][k_half][e].
    up = torch.arange(16 * 16, dtype=torch.float32).reshape(16, 16).to(BF16)  # value = 16 row + col
    frag = sq.pack_lowrank(up, down=False).float().reshape(32, 8)
    lane = 3 * 4 + 2  # n_lane 3, k_lane 2
    want = [16 * (8 * nh + 3) + 8 * kh + 4 + e for nh in (0, 1) for kh in (0, 1) for e in (0, 1)]
    assert frag[lane].tolist() == want


def _mma_m16n8k64_s4(a_regs, b_regs):
    """mma.sync.m16n8k64.row.col.s32.s4.s4.s32 as PTX defines its fragments: per lane 4 g + t, A a0 / a1
    rows g / g + 8 with k 8 t .. 8 t + 7 (nibble i is k 8 t + i, low nibble first), a2 / a3 the same at
    k + 32; B b0 column g, k 8 t + i, b1 k + 32; D d0, d1 row g, columns 2 t, 2 t + 1; d2, d3 row g + 8.
    a_regs [32, 4], b_regs [32, 2] uint32 words -> d [32, 4] int64."""
    def nibbles(word):  # 8 signed nibbles of a 32-bit word, low first
        v = [(int(word) >> (4 * i)) & 0xF for i in range(8)]
        return [x - 16 if x >= 8 else x for x in v]

    a = torch.zeros(16, 64, dtype=torch.int64)
    b = torch.zeros(64, 8, dtype=torch.int64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for reg, (row, k0) in enumerate([(g, 8 * t), (g + 8, 8 * t), (g, 32 + 8 * t), (g + 8, 32 + 8 * t)]):
            a[row, k0:k0 + 8] = torch.tensor(nibbles(a_regs[lane][reg]))
        for reg, k0 in enumerate([8 * t, 32 + 8 * t]):
            b[k0:k0 + 8, g] = torch.tensor(nibbles(b_regs[lane][reg]))
    d = a @ b
    return [[d[lane // 4, 2 * (lane % 4)], d[lane // 4, 2 * (lane % 4) + 1], d[lane // 4 + 8, 2 * (lane % 4)],
             d[lane // 4 + 8, 2 * (lane % 4) + 1]] for lane in range(32)]


def test_int4_gemm_fragment_order_gives_every_exact_group_dot():
    """kernels/svdq/gemm_int4.cu's indexing replayed on the CPU for one 64 x 128 tile and one 64-group of a
    [128, 128] weight (group 1, so the k-tile offset counts): the activation's e4m3 codes turned into the
    shared nibble tile as the block does, each warp's A fragments read from it, B fragments read straight
    from the packed qweight (uint4 per lane of each 16-column block), the PTX MMA above, and the results
    placed where the kernel accumulates them (acc[(2 p + h) * 4 + r] at row 16 w + g + 8 (r / 2), column
    16 p + 8 h + 2 t + r % 2), with the wscales it reads there. Equals q_x @ q_w^T exactly, and the scales
    are the columns'."""
    m, n, k, gi = 64, 128, 128, 1
    q_x, q_w = _q(m, k, seed=1), _q(n, k, seed=2)
    codes = q_x[:, 64 * gi:64 * gi + 64].to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)
    words = sq.pack_qweight(q_w).contiguous().view(torch.int32).flatten().to(torch.int64) & 0xFFFFFFFF
    # logical [N, K/64] scales numbered g * N + column (exact in bf16: at most 255)
    wsc = sq.pack_wscales(torch.arange(k // 64 * n, dtype=torch.float32).reshape(k // 64, n).t().to(BF16))
    wsc = wsc.flatten().float()
    int4_of_code = {int(c): int(v) for v, c in zip(range(-8, 8), torch.arange(-8, 8).to(torch.float8_e4m3fn)
                                                   .view(torch.uint8))}
    nib = torch.zeros(m, 32, dtype=torch.int64)  # bytes: k 2 c (low nibble), 2 c + 1
    for row in range(m):
        for c in range(32):
            lo, hi = int4_of_code[int(codes[row, 2 * c])], int4_of_code[int(codes[row, 2 * c + 1])]
            nib[row, c] = (lo & 0xF) | ((hi & 0xF) << 4)

    def u32(row, byte):  # little-endian word of nib
        return sum(int(nib[row, byte + i]) << (8 * i) for i in range(4))

    groups, out = k // 64, torch.zeros(m, n, dtype=torch.int64)
    for w in range(4):
        a_regs = [[u32(16 * w + l // 4, 4 * (l % 4)), u32(16 * w + l // 4 + 8, 4 * (l % 4)),
                   u32(16 * w + l // 4, 16 + 4 * (l % 4)), u32(16 * w + l // 4 + 8, 16 + 4 * (l % 4))]
                  for l in range(32)]
        for p in range(8):
            quad = [[int(words[(((0 * groups + gi) * 8 + p) * 32 + l) * 4 + j]) for j in range(4)] for l in range(32)]
            for h in range(2):
                d = _mma_m16n8k64_s4(a_regs, [[q[2 * h], q[2 * h + 1]] for q in quad])
                for l in range(32):
                    g, t = l // 4, l % 4
                    ws_base = ((0 * groups + gi) * 32 + p * 4 + t) * 4
                    for r in range(4):
                        row, col = 16 * w + g + 8 * (r // 2), 16 * p + 8 * h + 2 * t + r % 2
                        out[row, col] = d[l][r]
                        assert wsc[ws_base + h * 2 + r % 2] == gi * n + col  # the wscale the kernel reads
    want = q_x[:, 64 * gi:64 * gi + 64].to(torch.int64) @ q_w[:, 64 * gi:64 * gi + 64].to(torch.int64).t()
    assert torch.equal(out, want)


def test_shape_rules_are_enforced_with_the_value_named():
    with pytest.raises(ValueError, match="K=96"):
        sq.pack_qweight(_q(128, 96))
    with pytest.raises(ValueError, match="N=100"):
        sq.pack_wscales(torch.ones(100, 2, dtype=BF16))
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        sq.pack_qweight(torch.full((128, 128), 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="rank 24"):
        sq.quantize_linear(torch.randn(128, 128), None, rank=24)


# ---- interoperability with a packer nobody here wrote ---------------------------------------------------

def _cache_dit_packing():
    """cache-dit 1.5.3's packing module, loaded from its installed files (plain torch, no cache_dit import)."""
    try:
        dist = importlib.metadata.distribution("cache-dit")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("cache-dit==1.5.3 is a test dependency (deploy/install.sh installs it)")
    assert dist.version == "1.5.3", f"tested against cache-dit 1.5.3, found {dist.version}"
    path = next(f for f in dist.files if str(f).endswith("quantization/svdquant/packing.py"))
    spec = importlib.util.spec_from_file_location("_cache_dit_svdq_packing", dist.locate_file(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("rank", [0, 32])
def test_checkpoint_tensors_equal_cache_dits_packer_byte_for_byte(rank):
    packing = _cache_dit_packing()
    n, k, dtype = 256, 384, BF16
    q = _q(n, k, seed=5)
    # Power-of-two scales: weight = q * scale is exact in bf16, so cache-dit's own
    # quantization of it recovers q exactly.
    scales = torch.pow(2.0, torch.randint(-6, 0, (n, k // 64), generator=_gen(6)).float()).to(dtype)
    weight = (q.float().reshape(n, k // 64, 64) * scales.float().unsqueeze(-1)).reshape(n, k).to(dtype)
    bias = torch.randn(n, generator=_gen(7)).to(dtype)
    smooth = (torch.rand(k, generator=_gen(8)) + 0.5).to(dtype)
    lora = None
    if rank:
        lora = (torch.randn(rank, k, generator=_gen(9)).to(dtype), torch.randn(n, rank, generator=_gen(10)).to(dtype))
    raw = packing.export_raw_svdq_w4a4_state_dict(weight, scale=scales.view(n, 1, k // 64, 1), bias=bias,
                                                   smooth=smooth, lora=lora)
    theirs = packing.adapt_svdq_module_state_dict(raw, in_features=k, out_features=n, rank=rank,
                                                  precision="int4", torch_dtype=dtype, device="cpu",
                                                  has_bias=True)
    ours = {
        "qweight": sq.pack_qweight(q),
        "wscales": sq.pack_wscales(scales),
        "bias": sq.pack_channel_vector(bias),
        "smooth_factor": sq.pack_channel_vector(smooth),
        "smooth_factor_orig": sq.pack_channel_vector(smooth),
    }
    if rank:
        down = (lora[0].double() / smooth.double()).to(dtype)  # stored LoRA-down is down / s
        ours["proj_down"] = sq.pack_lowrank(down, down=True)
        ours["proj_up"] = sq.pack_lowrank(lora[1], down=False)
    for key, ours_t in ours.items():
        assert theirs[key].dtype == ours_t.dtype, key
        assert torch.equal(theirs[key].reshape(-1).view(torch.uint8), ours_t.reshape(-1).view(torch.uint8)), key
    # And our unpackers read their checkpoint back to the logical tensors.
    assert torch.equal(sq.unpack_qweight(theirs["qweight"]).to(torch.int32), q)
    assert torch.equal(sq.unpack_wscales(theirs["wscales"]), scales)


# ---- numerics ---------------------------------------------------------------------------------------------

def test_weight_quantizer_rounds_half_to_even_with_the_rounded_scale():
    w = torch.zeros(128, 128)
    w[0, :64] = torch.linspace(-7, 7, 64)
    w[0, 0] = -7.0  # amax 7: scale exactly 1
    w[0, 1], w[0, 2], w[0, 3] = 2.5, 3.5, -0.5
    q, s = sq.quantize_weight(w, BF16)
    assert s[0, 0].item() == 1.0 and s[1, 0].item() == 1.0  # an all-zero group gets scale 1
    assert q[0, 1].item() == 2 and q[0, 2].item() == 4 and q[0, 3].item() == 0
    assert int(q.abs().max()) <= 7


def test_activation_quantizer_numerics():
    x = torch.zeros(2, 128, dtype=BF16)
    x[0, :64] = torch.linspace(-3.5, 3.5, 64).to(BF16)
    x[1, 64] = 1.0  # group 1 of row 1: one value; group 0 of row 1 all zero
    smooth = torch.full((128,), 0.5, dtype=BF16)
    q, s = sq.quantize_act(x, smooth)
    assert s.dtype == BF16
    assert s[1, 0].item() == 0.0 and int(q[1, :64].abs().sum()) == 0  # all-zero group: scale 0, q 0
    assert q[1, 64].item() == 7  # x_s = 2: amax / 7 * 7
    scale_f32 = torch.tensor(7.0) * torch.tensor(1.0 / 7.0, dtype=torch.float32)
    assert s[0, 0].item() == scale_f32.to(BF16).item()
    assert int(q.min()) >= -8 and int(q.max()) <= 7


def test_faithful_linear_equals_its_definition_evaluated_exactly():
    # Exactly representable operands: the fp32 sum over groups of (int dot) * (as * ws) has no rounding
    # error here, so the faithful linear equals the rational value.
    m, n, k = 4, 128, 256
    x = torch.randint(-7, 8, (m, k), generator=_gen(11)).to(BF16)
    q_w = _q(n, k, seed=12).to(torch.int8)
    ws = torch.full((n, k // 64), 0.25, dtype=BF16)
    y = sq.linear_faithful(x, q_w, ws, out_dtype=torch.float32)
    q_x, as_ = sq.quantize_act(x, None)
    exact = torch.zeros(m, n, dtype=torch.float64)
    for g in range(k // 64):
        sl = slice(64 * g, 64 * g + 64)
        exact += (q_x[:, sl].double() @ q_w[:, sl].double().t()) * as_[:, g].double().unsqueeze(1) * 0.25
    assert torch.allclose(y.double(), exact, rtol=2e-7, atol=0)


def _spectral_linear(n, k, seed):
    """A linear with decaying singular values (the case low-rank branches are for)."""
    g = _gen(seed)
    u, _ = torch.linalg.qr(torch.randn(n, n, generator=g))
    v, _ = torch.linalg.qr(torch.randn(k, k, generator=g))
    sigma = torch.pow(torch.arange(1, min(n, k) + 1, dtype=torch.float32), -1.0)
    return (u[:, : len(sigma)] * sigma) @ v[:, : len(sigma)].t() * 10


def _metrics(y, ref):
    y, ref = y.double().reshape(-1), ref.double().reshape(-1)
    rel_l2 = (y - ref).norm() / ref.norm()
    cos = torch.nn.functional.cosine_similarity(y, ref, dim=0)
    return float(rel_l2), float(cos)


def test_accuracy_improves_with_rank_and_the_references_agree():
    n, k, m = 256, 256, 64
    w = _spectral_linear(n, k, seed=13)
    b = torch.randn(n, generator=_gen(14)) * 0.1
    x = torch.randn(m, k, generator=_gen(15)).to(BF16)
    ref = x.float() @ w.t() + b
    rel = {}
    for rank in (0, 16, 32):
        ckpt = sq.quantize_linear(w, b, rank=rank, dtype=BF16, act_amax=x.float().abs().amax(dim=0))
        t = sq.unpack_linear(ckpt)
        ideal = sq.linear_ideal(x, **t)
        faithful = sq.linear_faithful(x, **t, out_dtype=torch.float32)
        rel[rank], cos = _metrics(ideal, ref)
        assert cos > 0.99, (rank, cos)
        # The faithful linear differs from the ideal one by its roundings (x * (1 / s) and the scales stored in
        # bf16, bf16 lora_act). The largest effect: rounding x_s to bf16 moves about 0.5% of the q across
        # a rounding boundary by one step, and one step is sqrt(12) times the RMS quantization error, so
        # the difference is about sqrt(0.005 * 12) ~ 0.25 of the quantization error; bound it at twice that.
        assert _metrics(faithful, ideal)[0] < 0.5 * rel[rank] + 1e-3, rank
    # Upstream's rule (cache-dit test_svdquant_runtime): non-increasing with rank, slack max(5e-4, 3%).
    assert rel[16] <= rel[0] * 1.03 + 5e-4 and rel[32] <= rel[16] * 1.03 + 5e-4
    assert rel[32] < rel[0]
