"""SVDQuant W4A4 (INT4) in plain PyTorch: checkpoint layouts, quantizers and the linear, as references.

The executable form of docs/DESIGN.md section 8 for the svdq family, in three parts:

- **Checkpoint layouts** (byte-compatible with nunchaku and cache-dit checkpoints): a packer and an
  exact-inverse unpacker for every checkpoint-visible tensor: ``qweight`` (signed INT4 nibbles in
  128 x 64 tiles), ``wscales`` and the per-channel vectors ``bias`` / ``smooth_factor`` /
  ``wcscales`` (the kernel's per-128-column lane order), ``proj_down`` / ``proj_up`` (16 x 16
  fragment tiles). The activation, its scales and ``lora_act`` are internal to the kernels and have no
  layout here: the references take them logically.
- **Numerics**: signed INT4 in 64-wide groups, scale = amax / 7 stored in the model dtype, round half to
  even. Two references of the whole linear: ``linear_ideal`` (fp32 on dequantized operands, for
  accuracy) and ``linear_faithful`` (what this project's kernels compute: smoothed input rounded to the
  model dtype, scales stored rounded but applied through the fp32 reciprocal, exact int32 group dot
  products, groups accumulated in fp32 in order (one fused multiply-add each), bias, LoRA from the raw
  input in fp32 with ``lora_act`` rounded to the model dtype, one final rounding).
- **An offline quantizer** (``quantize_linear``): smoothing, rank-R SVD split, residual INT4 per 64-group,
  LoRA-down divided by the smoothing, packing, into nunchaku's state-dict keys. The only source of test
  weights here (no model can be downloaded).

Notation: M tokens, K in_features, N out_features, R rank; nn.Linear convention y = x W^T + b, W [N, K].
Plain torch only; works on any device.
"""

from __future__ import annotations

import torch

GROUP = 64          # INT4 quantization group along K
BLOCK_N = 128       # N granularity of qweight / wscales / vectors (one warp's columns)
K_ALIGN = 128       # the GEMM's main loop takes two K-groups at a time
RANK_ALIGN = 16     # LoRA rank granularity (one 16 x 16 fragment tile)
QMIN, QMAX = -8, 7

def _unpermute(t: torch.Tensor, logical: tuple[int, ...], order: tuple[int, ...]) -> torch.Tensor:
    """The inverse of ``x.reshape(logical).permute(order)``: ``t`` holds that layout; returns ``logical``'s."""
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return t.reshape([logical[o] for o in order]).permute(*inverse)


# ---- qweight: [N, K] int in [-8, 7]  <->  [N, K/2] int8 ------------------------------------------------
#
# Tiles of BLOCK_N (n) x GROUP (k), n-tile major. Inside a tile, 32-bit words in the order
# [n_pack 8][n_lane 8][k_lane 4][n_half 2][k_half 2], each holding 8 nibbles along k (low nibble first),
# with n = 16 n_pack + 8 n_half + n_lane and k = 32 k_half + 8 k_lane + nibble: lane n_lane * 4 + k_lane
# holds its two m16n8k64 B fragments in four consecutive words.

_W_SPLIT = (8, 2, 8)      # n within a tile: (n_pack, n_half, n_lane)
_W_KSPLIT = (2, 4, 8)     # k within a group: (k_half, k_lane, nibble)
_W_ORDER = (0, 4, 1, 3, 6, 2, 5, 7)  # [n_tile, k_tile, n_pack, n_lane, k_lane, n_half, k_half, nibble]


def _check_qweight_shape(n: int, k: int) -> None:
    if n % BLOCK_N or k % K_ALIGN:
        raise ValueError(f"qweight: N={n} must be a multiple of {BLOCK_N} and K={k} of {K_ALIGN}")


def pack_qweight(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integers in [-8, 7] -> the checkpoint's [N, K/2] int8."""
    n, k = q.shape
    _check_qweight_shape(n, k)
    if q.is_floating_point() or int(q.min()) < QMIN or int(q.max()) > QMAX:
        raise ValueError(f"qweight: expected integers in [{QMIN}, {QMAX}]")
    t = q.to(torch.int64).reshape(n // BLOCK_N, *_W_SPLIT, k // GROUP, *_W_KSPLIT).permute(*_W_ORDER)
    nibbles = t.bitwise_and(0xF)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    words = (nibbles << shifts).sum(dim=-1)  # [..., 8 nibbles] -> one 32-bit word (as int64)
    return words.to(torch.int32).contiguous().view(torch.int8).view(n, k // 2)


def unpack_qweight(packed: torch.Tensor) -> torch.Tensor:
    """The checkpoint's [N, K/2] int8 -> [N, K] int8 in [-8, 7]."""
    n, half_k = packed.shape
    k = 2 * half_k
    _check_qweight_shape(n, k)
    words = packed.contiguous().view(torch.int32).to(torch.int64).bitwise_and(0xFFFFFFFF).reshape(-1, 1)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=packed.device)
    nibbles = (words >> shifts).bitwise_and(0xF)
    signed = torch.where(nibbles >= 8, nibbles - 16, nibbles)
    logical = (n // BLOCK_N, *_W_SPLIT, k // GROUP, *_W_KSPLIT)
    return _unpermute(signed, logical, _W_ORDER).reshape(n, k).to(torch.int8)


# ---- wscales [N, K/64] and per-channel vectors [N]  <->  the kernel's lane order -------------------------
#
# Per BLOCK_N columns (block-major, then K-group for wscales): lane 4 j + i holds columns
# 16 j + 2 i + {0, 1, 8, 9}. bias, smooth_factor and wcscales use the same order with one "group".

_S_SPLIT = (8, 2, 4, 2)   # column within a block: (j, a, i, b) -> 16 j + 8 a + 2 i + b
_S_ORDER = (0, 5, 1, 3, 2, 4)  # [block, group, j, i, a, b]


def _check_scale_dtype(t: torch.Tensor, what: str) -> None:
    if t.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{what}: expected float16 or bfloat16, got {t.dtype}")


def pack_wscales(scales: torch.Tensor) -> torch.Tensor:
    """[N, K/64] group scales (model dtype) -> the checkpoint's [K/64, N]."""
    _check_scale_dtype(scales, "wscales")
    n, groups = scales.shape
    if n % BLOCK_N:
        raise ValueError(f"wscales: N={n} must be a multiple of {BLOCK_N}")
    t = scales.reshape(n // BLOCK_N, *_S_SPLIT, groups).permute(*_S_ORDER)
    return t.contiguous().view(groups, n)


def unpack_wscales(packed: torch.Tensor) -> torch.Tensor:
    """The checkpoint's [K/64, N] -> [N, K/64]."""
    groups, n = packed.shape
    if n % BLOCK_N:
        raise ValueError(f"wscales: N={n} must be a multiple of {BLOCK_N}")
    logical = (n // BLOCK_N, *_S_SPLIT, groups)
    return _unpermute(packed.contiguous(), logical, _S_ORDER).reshape(n, groups)


def pack_channel_vector(v: torch.Tensor) -> torch.Tensor:
    """bias / smooth_factor / wcscales [N] -> the checkpoint's [N] (wscales order, one group)."""
    return pack_wscales(v.reshape(-1, 1)).reshape(-1)


def unpack_channel_vector(packed: torch.Tensor) -> torch.Tensor:
    return unpack_wscales(packed.reshape(1, -1)).reshape(-1)


# ---- proj_down [R, K] -> [K, R], proj_up [N, R] -> [N, R]: 16 x 16 fragment tiles -------------------------
#
# Tiles [channels/16][R/16], each 32 lanes x 8 values in mma.m16n8k16 B-fragment order: inside a tile,
# row = 8 n_half + n_lane, col = 8 k_half + 2 k_lane + e, stored [n_lane 8][k_lane 4][n_half 2][k_half 2][e 2].
# Tile rows are ranks for proj_down and channels for proj_up.

_L_SPLIT = (2, 8)          # tile row: (n_half, n_lane)
_L_CSPLIT = (2, 4, 2)      # tile col: (k_half, k_lane, e)
_L_ORDER = (0, 1, 3, 5, 2, 4, 6)  # [c_tile, r_tile, n_lane, k_lane, n_half, k_half, e]


def _tiles_to_fragments(tiles: torch.Tensor) -> torch.Tensor:
    """[ct, rt, 16 rows, 16 cols] -> fragment order, flat per tile."""
    ct, rt = tiles.shape[:2]
    return tiles.reshape(ct, rt, *_L_SPLIT, *_L_CSPLIT).permute(*_L_ORDER).reshape(ct, rt, 256)


def _fragments_to_tiles(frags: torch.Tensor) -> torch.Tensor:
    ct, rt = frags.shape[:2]
    return _unpermute(frags, (ct, rt, *_L_SPLIT, *_L_CSPLIT), _L_ORDER).reshape(ct, rt, 16, 16)


def pack_lowrank(weight: torch.Tensor, down: bool) -> torch.Tensor:
    """proj_down [R, K] (down=True) -> [K, R]; proj_up [N, R] -> [N, R]; model dtype, R % 16 == 0."""
    _check_scale_dtype(weight, "proj_down" if down else "proj_up")
    rank, channels = weight.shape if down else weight.shape[::-1]
    if rank % RANK_ALIGN or channels % 16:
        raise ValueError(f"low-rank factor: rank {rank} and channels {channels} must be multiples of 16")
    if down:
        tiles = weight.reshape(rank // 16, 16, channels // 16, 16).permute(2, 0, 1, 3)  # [ct, rt, r, c]
    else:
        tiles = weight.reshape(channels // 16, 16, rank // 16, 16).permute(0, 2, 1, 3)  # [ct, rt, c, r]
    return _tiles_to_fragments(tiles).contiguous().view(channels, rank)


def unpack_lowrank(packed: torch.Tensor, down: bool) -> torch.Tensor:
    """Inverse of pack_lowrank: [K, R] -> proj_down [R, K]; [N, R] -> proj_up [N, R]."""
    channels, rank = packed.shape
    tiles = _fragments_to_tiles(packed.contiguous().view(channels // 16, rank // 16, 256))
    if down:  # tiles [ct, rt, r, c]
        return tiles.permute(1, 2, 0, 3).reshape(rank, channels)
    return tiles.permute(0, 2, 1, 3).reshape(channels, rank)  # tiles [ct, rt, c, r]


# ---- quantizers --------------------------------------------------------------------------------------------

def quantize_weight(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q [N, K] int8 in [-8, 7], scales [N, K/64] in ``dtype``).

    Offline numerics (deepcompressor / cache-dit): fp32 math, scale = amax / 7 rounded to ``dtype`` (an
    all-zero group gets scale 1), q = round_half_even(w / scale_rounded).
    """
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"quantize_weight: K={k} must be a multiple of {GROUP}")
    g = w.float().reshape(n, k // GROUP, GROUP)
    amax = g.abs().amax(dim=-1)
    scales = torch.where(amax == 0, torch.ones_like(amax), amax / 7.0).to(dtype)
    q = torch.round(g / scales.float().unsqueeze(-1))
    if int(q.min()) < QMIN or int(q.max()) > QMAX:
        raise AssertionError("quantize_weight: a value rounded out of [-8, 7]")
    return q.to(torch.int8).reshape(n, k), scales


def quantize_act(x: torch.Tensor, smooth: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] model dtype -> (q [M, K] int8, scales [M, K/64] model dtype): this project's kernel numerics.

    x_s = x * (1 / smooth) in fp32 (the IEEE fp32 reciprocal, then one rounding of the product: one
    multiply per element in the kernel where a division costs a dozen instructions), rounded to the model
    dtype; per (row, 64-group) amax of x_s; scale_f32 = amax * (1/7)
    in fp32; the stored scale is scale_f32 rounded to the model dtype; q = round_half_even(x_s * r) with
    r = 1 / scale_f32 (IEEE fp32), or x_s / scale_f32 where scale_f32 is subnormal, saturated to [-8, 7]; an
    all-zero group has scale 0 and q 0. Finite x only: the kernels give a NaN or infinite element the e4m3 NaN
    code, which int8 q cannot hold.
    """
    m, k = x.shape
    if k % GROUP:
        raise ValueError(f"quantize_act: K={k} must be a multiple of {GROUP}")
    dtype = x.dtype
    xs = x if smooth is None else (x.float() * (1.0 / smooth.float())).to(dtype)
    g = xs.float().reshape(m, k // GROUP, GROUP)
    scale_f32 = g.abs().amax(dim=-1) * torch.tensor(1.0 / 7.0, dtype=torch.float32)
    recip = torch.where(scale_f32 == 0, torch.zeros_like(scale_f32), 1.0 / scale_f32)
    # A subnormal scale has lost bits and its reciprocal may overflow (0 * inf would turn a finite group
    # NaN): such groups divide instead (x_s / scale_f32, IEEE), then saturate like the others.
    subnormal = ((scale_f32 > 0) & (scale_f32 < torch.finfo(torch.float32).tiny)).unsqueeze(-1)
    t = torch.where(subnormal, g / scale_f32.unsqueeze(-1), g * recip.unsqueeze(-1))
    q = torch.round(t).clamp(QMIN, QMAX)
    return q.to(torch.int8).reshape(m, k), scale_f32.to(dtype)


def quantized_act_outputs(x: torch.Tensor, smooth: torch.Tensor | None,
                          pad_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation quantizer's act and ascales in the kernels' layouts (kernels/svdq/svdq.h): act [M_pad, K]
    float8_e4m3fn codes of q (every INT4 value is an exact e4m3 number), ascales [K/64, M_pad] model dtype;
    rows past M are q 0, scale 0. smooth: logical [K] (unpacked), or None."""
    m, k = x.shape
    m_pad = (m + pad_size - 1) // pad_size * pad_size
    q, scales = quantize_act(x, smooth)
    act = torch.zeros(m_pad, k, dtype=torch.float8_e4m3fn)
    act[:m] = q.to(torch.float8_e4m3fn)
    ascales = torch.zeros(k // GROUP, m_pad, dtype=x.dtype)
    ascales[:, :m] = scales.t()
    return act, ascales


# ---- the linear ----------------------------------------------------------------------------------------------

def lora_scale_vector(rank: int, lora_scales=None) -> torch.Tensor:
    """One multiplier per rank (lora_scales holds one per 16 ranks; default 1)."""
    if lora_scales is None:
        return torch.ones(rank)
    s = torch.tensor(list(lora_scales), dtype=torch.float32)
    return s.repeat_interleave(RANK_ALIGN)[:rank]


def _lora(x, down, up, lora_scales, dtype, faithful):
    """x [M, K] (raw), down [R, K], up [N, R] -> [M, N] fp32 (zeros for rank 0)."""
    if down is None or down.shape[0] == 0:
        return torch.zeros(x.shape[0], up.shape[0] if up is not None else 0)
    act = x.float() @ down.float().t() * lora_scale_vector(down.shape[0], lora_scales)
    if faithful:
        act = act.to(dtype).float()
    return act @ up.float().t()


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c rounded once, as the GPU's FFMA: the product is exact in fp64 (24 + 24 bits), the fp64
    sum's error e comes from TwoSum, and rounding the sum to fp32 is corrected where the sum sits exactly
    halfway between two fp32 values and e breaks the tie the other way."""
    p = a.double() * b.double()
    c64 = c.double().expand_as(p)
    s = p + c64
    bb = s - p
    e = (p - (s - bb)) + (c64 - bb)
    r = s.float()
    up = torch.nextafter(r, torch.full_like(r, float("inf")))
    down = torch.nextafter(r, torch.full_like(r, float("-inf")))
    r = torch.where((s == (r.double() + up.double()) / 2) & (e > 0), up, r)
    r = torch.where((s == (r.double() + down.double()) / 2) & (e < 0), down, r)
    return r


def group_sum_faithful(q_x: torch.Tensor, ascales: torch.Tensor, q_w: torch.Tensor,
                       wscales: torch.Tensor) -> torch.Tensor:
    """The GEMM's main part as the kernels compute it: q_x [M, K] and q_w [N, K] INT4 values, ascales
    [M, K/64] and wscales [N, K/64] as stored -> [M, N] float32. Exact integer dot per 64-group; per group in
    order acc = fma(dot * as, ws, acc), where dot * as is exact in fp32."""
    m, k = q_x.shape
    n = q_w.shape[0]
    gx = q_x.to(torch.int64).reshape(m, k // GROUP, GROUP)
    gw = q_w.to(torch.int64).reshape(n, k // GROUP, GROUP)
    acc = torch.zeros(m, n, dtype=torch.float32)
    for g in range(k // GROUP):
        dot = (gx[:, g, :] @ gw[:, g, :].t()).to(torch.float32)
        acc = fma_f32(dot * ascales[:, g].float().unsqueeze(1), wscales[:, g].float().unsqueeze(0), acc)
    return acc


def linear_faithful(x, q_w, wscales, smooth=None, down=None, up=None, bias=None, lora_scales=None,
                    out_dtype=None) -> torch.Tensor:
    """What the kernels compute, from logical (unpacked) tensors: x [M, K] model dtype, q_w [N, K], wscales
    [N, K/64], smooth [K], down [R, K] (already divided by smooth, as stored), up [N, R], bias [N]."""
    dtype = x.dtype
    out_dtype = out_dtype or dtype
    q_x, ascales = quantize_act(x, smooth)
    acc = group_sum_faithful(q_x, ascales, q_w, wscales)
    if bias is not None:
        acc = acc + bias.float()
    if up is not None:
        acc = acc + _lora(x, down, up, lora_scales, dtype, faithful=True)
    return acc.to(out_dtype)


def linear_ideal(x, q_w, wscales, smooth=None, down=None, up=None, bias=None, lora_scales=None) -> torch.Tensor:
    """fp32 on dequantized operands: (Q(x / s) deq) (Q(W) deq)^T + LoRA(x) + b, for accuracy figures."""
    xs = x.float() if smooth is None else x.float() / smooth.float()
    m, k = xs.shape
    g = xs.reshape(m, k // GROUP, GROUP)
    scale = g.abs().amax(dim=-1, keepdim=True) / 7.0
    deq_x = (torch.round(g / torch.where(scale == 0, torch.ones_like(scale), scale)).clamp(QMIN, QMAX) * scale)
    n = q_w.shape[0]
    deq_w = q_w.float().reshape(n, k // GROUP, GROUP) * wscales.float().unsqueeze(-1)
    y = deq_x.reshape(m, k) @ deq_w.reshape(n, k).t()
    if bias is not None:
        y = y + bias.float()
    if up is not None:
        y = y + _lora(x, down, up, lora_scales, x.dtype, faithful=False)
    return y


# ---- the offline quantizer -------------------------------------------------------------------------------

def smooth_factor(weight: torch.Tensor, act_amax: torch.Tensor | None, alpha: float = 0.5) -> torch.Tensor:
    """SmoothQuant factor per input channel: amax|x|^alpha / amax|W|^(1-alpha); 1 where undefined."""
    if act_amax is None:
        return torch.ones(weight.shape[1], device=weight.device)
    w_amax = weight.float().abs().amax(dim=0)
    s = act_amax.float().pow(alpha) / w_amax.pow(1 - alpha)
    return torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))


def quantize_linear(weight: torch.Tensor, bias: torch.Tensor | None, rank: int, dtype=torch.bfloat16,
                    act_amax: torch.Tensor | None = None, alpha: float = 0.5) -> dict[str, torch.Tensor]:
    """A float nn.Linear (weight [N, K], bias [N]) -> nunchaku's checkpoint tensors, packed:
    qweight [N, K/2] int8, wscales [K/64, N], smooth_factor [K], proj_down [K, R], proj_up [N, R],
    bias [N] (model dtype). N and K must be multiples of 128 (pad first), R of 16 (0: no LoRA).

    Smoothing (from ``act_amax``, the calibration inputs' per-channel amax; none: s = 1), W_hat = W diag(s),
    rank-R SVD W_hat ~ up down, residual quantized per 64-group, proj_down = down diag(1/s) (the kernel
    applies LoRA to the raw input), smooth_factor = s. Runs on the weight's device (the SVD of a large layer
    takes minutes in fp64 on a CPU).
    """
    n, k = weight.shape
    _check_qweight_shape(n, k)
    if rank % RANK_ALIGN:
        raise ValueError(f"quantize_linear: rank {rank} must be a multiple of {RANK_ALIGN}")
    s = smooth_factor(weight, act_amax, alpha).double()
    w_hat = weight.double() * s
    if rank > 0:
        u, sigma, vh = torch.linalg.svd(w_hat, full_matrices=False)
        up = u[:, :rank] * sigma[:rank]
        down = vh[:rank]
        residual = w_hat - up @ down
    else:
        up = w_hat.new_zeros(n, 0)
        down = w_hat.new_zeros(0, k)
        residual = w_hat
    q, scales = quantize_weight(residual, dtype)
    out = {
        "qweight": pack_qweight(q),
        "wscales": pack_wscales(scales),
        "smooth_factor": pack_channel_vector(s.to(dtype)),
        "smooth_factor_orig": pack_channel_vector(s.to(dtype)),
        "proj_down": pack_lowrank((down / s).to(dtype), down=True) if rank else w_hat.new_zeros(k, 0, dtype=dtype),
        "proj_up": pack_lowrank(up.to(dtype), down=False) if rank else w_hat.new_zeros(n, 0, dtype=dtype),
    }
    if bias is not None:
        out["bias"] = pack_channel_vector(bias.to(dtype))
    return out


def unpack_linear(ckpt: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """Checkpoint tensors -> the logical ones linear_faithful / linear_ideal take."""
    rank = ckpt["proj_up"].shape[1]
    return {
        "q_w": unpack_qweight(ckpt["qweight"]),
        "wscales": unpack_wscales(ckpt["wscales"]),
        "smooth": unpack_channel_vector(ckpt["smooth_factor"]),
        "down": unpack_lowrank(ckpt["proj_down"], down=True) if rank else None,
        "up": unpack_lowrank(ckpt["proj_up"], down=False) if rank else None,
        "bias": unpack_channel_vector(ckpt["bias"]) if "bias" in ckpt else None,
    }
