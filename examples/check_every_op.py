"""Calls every served op through the daemon and checks it against the PyTorch reference.

Used by deploy/quickstart.sh (the README's main job); runnable by hand against
any running daemon:

    CACHE_DIT_OPD_ADDRESS=unix:/tmp/opd/gpu0.sock python examples/check_every_op.py

Prints one row per op: shape, whether the FP8 records / dequantized values are
bit-identical to kernels/reference.py (the merge: max error against a float64
reference), and the median time per call through the daemon. Exits non-zero
if any op disagrees.
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
import reference as ref  # noqa: E402

import cache_dit_opd  # noqa: E402
from cache_dit_opd import kernels  # noqa: E402

BF16 = torch.bfloat16


def time_call(fn, reps=200):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def main():
    if not torch.cuda.is_available():
        print("check_every_op: a CUDA GPU is needed", file=sys.stderr)
        return 2
    err = kernels.comm_get_load_error() or kernels.attn_get_load_error()
    if err is not None:
        print(f"check_every_op: {err}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dev = "cuda"
    rows, ok = [], True

    # The reference runs on the CPU, as in tests/kernels: IEEE arithmetic and c10's e4m3 conversion, which
    # the kernels match bit for bit. PyTorch's own CUDA kernels for the same formulas do not always (their
    # division and FP8 casts may round differently), so they are no reference for bit-exactness.
    def bitwise(a, b):
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))

    x = torch.randn(1, 4608, 6, 128, device=dev).to(BF16)
    q = kernels.fp8_comm_per_token_quant(x)
    same = bitwise(q.cpu(), ref.per_token_quant(x.cpu()))
    rows.append(("fp8_comm_per_token_quant", tuple(x.shape), "bit-exact" if same else "MISMATCH",
                 time_call(lambda: kernels.fp8_comm_per_token_quant(x))))
    y = kernels.fp8_comm_per_token_dequant(q)
    same2 = bitwise(y.cpu(), ref.per_token_dequant(q.cpu()))
    rows.append(("fp8_comm_per_token_dequant", tuple(q.shape), "bit-exact" if same2 else "MISMATCH",
                 time_call(lambda: kernels.fp8_comm_per_token_dequant(q))))
    xq = torch.randn(2, 1152, 4, 6, 128, device=dev).to(BF16)
    qq = kernels.fp8_comm_qkv_permute_quant(xq)
    same3 = bitwise(qq.cpu(), ref.qkv_permute_quant(xq.cpu()))
    rows.append(("fp8_comm_qkv_permute_quant", tuple(xq.shape), "bit-exact" if same3 else "MISMATCH",
                 time_call(lambda: kernels.fp8_comm_qkv_permute_quant(xq))))
    r = qq.flatten(0, 1)
    yq = kernels.fp8_comm_qkv_permute_dequant(r)
    same4 = bitwise(yq.cpu(), ref.qkv_permute_dequant(r.cpu()))
    rows.append(("fp8_comm_qkv_permute_dequant", tuple(r.shape), "bit-exact" if same4 else "MISMATCH",
                 time_call(lambda: kernels.fp8_comm_qkv_permute_dequant(r))))
    ok = same and same2 and same3 and same4

    p, s = torch.randn(1, 4608, 6, 128, device=dev).to(BF16), torch.randn(1, 4608, 6, 128, device=dev).to(BF16)
    lp = torch.randn(1, 6, 4608, device=dev).permute(0, 2, 1).unsqueeze(-1)  # flash-attn layout, read in place
    ls = torch.randn(1, 4608, 6, 1, device=dev)
    out, lse = kernels.fused_merge_attn_states(p, lp, s, ls)
    want_out, want_lse = ref.merge_attn_states(p, lp, s, ls)
    err_out = (out.double() - want_out).abs().max().item()
    err_lse = (lse.double() - want_lse).abs().max().item()
    merge_ok = err_out <= 2.0**-8 * want_out.abs().max().item() and err_lse <= 1e-5 * (1 + want_lse.abs().max().item())
    ok = ok and merge_ok
    rows.append(("fused_merge_attn_states", tuple(p.shape),
                 f"max err out {err_out:.1e}, lse {err_lse:.1e}" + ("" if merge_ok else " MISMATCH"),
                 time_call(lambda: kernels.fused_merge_attn_states(p, lp, s, ls))))
    cache_dit_opd.synchronize()

    print(f"{'op':30} {'input shape':24} {'vs PyTorch reference':34} {'us/call (daemon)':>16}")
    for name, shape, verdict, us in rows:
        print(f"{name:30} {str(shape):24} {verdict:34} {us:16.1f}")
    print("all ops agree with the reference" if ok else "SOME OPS DISAGREE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
