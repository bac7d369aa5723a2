"""Call every cache-dit-opd operator from Python and check it against plain torch.

1. Build and start the daemon for GPU 0 (once per GPU; keep it running):

       cmake -S . -B build && cmake --build build -j
       build/server/cache-dit-opd --device 0

   or, with a socket of your choosing:

       build/server/cache-dit-opd --device 0 --socket /tmp/opd/gpu0.sock
       export CACHE_DIT_OPD_ADDRESS=unix:/tmp/opd/gpu0.sock

2. Install the client (pure Python) and run this script:

       pip install ./python        # offline: pip install --no-build-isolation --no-deps ./python
       python examples/quickstart.py

The ops run in the daemon on this process's GPU memory (CUDA IPC, no copies),
ordered on this process's current CUDA stream. Without a daemon the first op
raises RuntimeError with the command that starts one.
"""

import torch

import cache_dit_opd
from cache_dit_opd.kernels import (
    comm_get_load_error,
    fp8_comm_per_token_dequant,
    fp8_comm_per_token_quant,
    fp8_comm_qkv_permute_dequant,
    fp8_comm_qkv_permute_quant,
    fused_merge_attn_states,
)

FP8 = torch.float8_e4m3fn


def reference_merge(prev_out, prev_lse, suff_out, suff_lse):
    """Merge of two partial attention results, in fp32 (an LSE of +inf counts as empty)."""
    p, s = prev_lse.float(), suff_lse.float()
    p = p.masked_fill(p == float("inf"), -float("inf"))
    s = s.masked_fill(s == float("inf"), -float("inf"))
    m = torch.maximum(p, s)
    empty = m == -float("inf")
    m = m.masked_fill(empty, 0.0)
    wp, ws = torch.exp(p - m), torch.exp(s - m)
    out = (wp * prev_out.float() + ws * suff_out.float()) / (wp + ws)
    lse = (m + torch.log(wp + ws)).masked_fill(empty, -float("inf"))
    out = torch.where(empty, prev_out.float(), out)
    return out.to(suff_out.dtype), lse.to(suff_lse.dtype)


def decode_per_token(records):
    """[..., D+2] float8 records -> [..., D] float32 (values times the row's bf16 scale)."""
    d = records.shape[-1] - 2
    scale = records[..., d:].view(torch.uint8).contiguous().view(torch.bfloat16).float()
    return records[..., :d].float() * scale


def main():
    if not torch.cuda.is_available():
        raise SystemExit("this example needs a CUDA GPU")
    err = comm_get_load_error()
    if err is not None:
        raise SystemExit(str(err))
    print("daemon:", {k: v for k, v in cache_dit_opd.daemon_info().items() if k != "catalog"})
    dev = torch.device("cuda")
    torch.manual_seed(0)

    # Attention-state merge: flash-attn's LSE [B, H, S] is read in place through a permuted view.
    b, s, h, d = 2, 1024, 24, 128
    prev_out = torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16)
    suff_out = torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16)
    prev_lse = torch.randn(b, h, s, device=dev).permute(0, 2, 1).unsqueeze(-1)
    suff_lse = torch.randn(b, s, h, 1, device=dev)
    out, lse = fused_merge_attn_states(prev_out, prev_lse, suff_out, suff_lse)
    ref_out, ref_lse = reference_merge(prev_out, prev_lse, suff_out, suff_lse)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    print(f"fused_merge_attn_states      {tuple(out.shape)} {out.dtype}: ok")

    # Per-token FP8 records: [..., D] bf16 -> [..., D+2] float8 (scale in the last two bytes) -> bf16.
    x = torch.randn(4096, 3072, device=dev, dtype=torch.bfloat16)
    q = fp8_comm_per_token_quant(x)
    y = fp8_comm_per_token_dequant(q)
    assert q.shape == (4096, 3074) and q.dtype == FP8
    torch.testing.assert_close(decode_per_token(q), x.float(), atol=0.25, rtol=0.07)
    torch.testing.assert_close(y.float(), x.float(), atol=0.25, rtol=0.07)
    print(f"fp8_comm_per_token_quant     {tuple(x.shape)} -> {tuple(q.shape)}: ok")
    print(f"fp8_comm_per_token_dequant   {tuple(q.shape)} -> {tuple(y.shape)}: ok")

    # Ulysses all-to-all layout: [B, S, P, N, D] -> [P, S, B, N, D+4]; rank p receives records[p].
    p_ranks, n_heads = 4, 6
    qkv = torch.randn(b, s, p_ranks, n_heads, d, device=dev, dtype=torch.bfloat16)
    records = fp8_comm_qkv_permute_quant(qkv)
    assert records.shape == (p_ranks, s, b, n_heads, d + 4)
    for rank in range(p_ranks):
        back = fp8_comm_qkv_permute_dequant(records[rank])  # [B, S, N, D]
        torch.testing.assert_close(back.float(), qkv[:, :, rank].float(), atol=0.25, rtol=0.07)
    print(f"fp8_comm_qkv_permute_quant   {tuple(qkv.shape)} -> {tuple(records.shape)}: ok")
    print(f"fp8_comm_qkv_permute_dequant {tuple(records[0].shape)} -> {tuple(back.shape)}: ok")

    # torch.compile traces the ops through their fakes; the daemon runs them.
    compiled = torch.compile(lambda t: fp8_comm_per_token_dequant(fp8_comm_per_token_quant(t)) * 2, fullgraph=True)
    torch.testing.assert_close(compiled(x), y * 2)
    print("torch.compile(fullgraph=True): ok")

    cache_dit_opd.synchronize()  # raises any error the daemon could not report at a call site
    print("all ops match the torch reference")


if __name__ == "__main__":
    main()
