"""Pure-PyTorch reference semantics of every op in ``kernels/``.

The executable form of docs/DESIGN.md section 3: the GPU tests compare the CUDA
kernels against these functions (bit for bit where the math is exact, within a
stated bound for the merge), and the benchmarks time them as the "PyTorch
reference" baseline. Plain torch only; works on any device.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def _records(payload: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    return torch.cat([payload.view(torch.uint8), scale_bytes], dim=-1).view(FP8)


def _bytes_as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterprets the trailing bytes of each record (a strided slice) as dtype."""
    # A fresh tensor has offset 0 and row-major strides, which view(dtype)
    # needs; clone() or contiguous() of a slice can keep its offset or strides.
    buf = torch.empty(raw.shape, dtype=torch.uint8, device=raw.device)
    buf.copy_(raw)
    return buf.view(dtype)


def per_token_quant(x: torch.Tensor) -> torch.Tensor:
    """[..., D] bf16 -> [..., D + 2] e4m3fn records with a bf16 scale."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-4)
    scale = amax / FP8_MAX
    q = (xf * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return _records(q, scale.to(torch.bfloat16).view(torch.uint8))


def per_token_dequant(records: torch.Tensor) -> torch.Tensor:
    """[..., D + 2] e4m3fn records -> [..., D] bf16."""
    raw = records.view(torch.uint8)
    d = raw.shape[-1] - 2
    scale = _bytes_as(raw[..., d:], torch.bfloat16).float()
    return (records[..., :d].float() * scale).to(torch.bfloat16)


def qkv_permute_quant(x: torch.Tensor) -> torch.Tensor:
    """[B, S, P, N, D] bf16 -> [P, S, B, N, D + 4] e4m3fn records with an fp32 scale."""
    xf = x.float().permute(2, 1, 0, 3, 4)
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-6)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return _records(q, scale.contiguous().view(torch.uint8)).contiguous()


def qkv_permute_dequant(records: torch.Tensor) -> torch.Tensor:
    """[S, B, N, D + 4] e4m3fn records -> [B, S, N, D] bf16 in true [B, S] order."""
    raw = records.view(torch.uint8)
    d = raw.shape[-1] - 4
    scale = _bytes_as(raw[..., d:], torch.float32)
    y = (records[..., :d].float() * scale).to(torch.bfloat16)
    return y.permute(1, 0, 2, 3).contiguous()


def merge_attn_states(prev_out, prev_lse, suff_out, suff_lse, compute_dtype=torch.float64):
    """Max-form LSE merge; returns (out, lse) in compute_dtype (not rounded).

    +inf LSE means empty (treated as -inf); both empty gives out = prev_out and
    lse = -inf; NaN propagates; a side of weight 0 contributes nothing.
    """
    p = prev_lse.to(compute_dtype)
    s = suff_lse.to(compute_dtype)
    p = torch.where(p == float("inf"), float("-inf"), p)
    s = torch.where(s == float("inf"), float("-inf"), s)
    m = torch.maximum(p, s)  # NaN-propagating
    empty = m == float("-inf")
    m_safe = torch.where(empty, torch.zeros_like(m), m)
    ep = torch.exp(p - m_safe)
    es = torch.exp(s - m_safe)
    denom = ep + es
    wp = torch.where(empty, torch.ones_like(ep), ep / denom)
    ws = torch.where(empty, torch.zeros_like(es), es / denom)
    lse = torch.where(empty, torch.full_like(m, float("-inf")), m + torch.log(denom))
    P = prev_out.to(compute_dtype)
    S = suff_out.to(compute_dtype)
    out = torch.where(wp != 0, wp * P, torch.zeros_like(P)) + torch.where(ws != 0, ws * S, torch.zeros_like(S))
    return out, lse
