"""Runs one rejected call of the kernel library (debugging aid for the GPU host)."""
import sys, torch
torch.ops.load_library(sys.argv[1])
ops = torch.ops.cache_dit_cuda_ops
m = lambda *s, dtype=torch.bfloat16: torch.empty(*s, dtype=dtype, device="meta")
case = sys.argv[2]
try:
    if case == "d0": ops.fp8_comm_per_token_quant(m(2, 0))
    if case == "contig": ops.fp8_comm_per_token_quant(m(4, 8).t())
    if case == "dims": ops.fp8_comm_per_token_quant(m(()))
    if case == "dtype": ops.fp8_comm_per_token_quant(m(2, 8, dtype=torch.float16))
except Exception as e:
    print(case, "OK raised", type(e).__name__, str(e).splitlines()[0])
