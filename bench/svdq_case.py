"""Case 6: the SVDQuant W4A4 linear in-process and through the daemon, in the same run.

bench/svdq.py's shapes (FLUX.1's linears at M = 4608, then M = 1024 and 256; --quick: the first three)
and tensors (a bf16 rank-32 layer with bias, random packed bytes from a seeded generator), in one child
per mode: in-process (kernel library loaded), ring async, ring sync, gRPC. The linear is
``svdq_quantize_w4a4_act_fuse_lora.out`` then ``svdq_gemm_w4a4.out`` (LoRA-down and -up, bias, bf16
output), timed two ways on the caller's stream:

- isolated: CUDA events around one linear, waited for after each, median of ``iters`` (bench/svdq.py's
  ``device_time`` without its spin kernel): what one layer costs its caller, the host's time to enqueue
  and the hand-offs to and from the daemon included;
- pipelined: ``n`` linears back to back, then one synchronize, median of ``reps`` (the pipelined case's
  ``pipelined``): throughput, the hand-offs overlapping the kernels.

The report gives every remote figure as a percentage of the in-process one of the same run (in-process
time / remote time), and whether the remote child's outputs (act, ascales, lora_act, out after its last
call) have the in-process child's bytes (sha256). No target: reported.
"""

from __future__ import annotations

from bench.common import GRPC, INPROC, RING_ASYNC, RING_SYNC, error_text

MODES = (INPROC, RING_ASYNC, RING_SYNC, GRPC)
OUTPUTS = ("act", "ascales", "lora_act", "out")  # what the digest covers


def params(quick: bool) -> dict:
    return {"quick": quick, "iters": 10 if quick else 30, "n": 20 if quick else 50, "reps": 1 if quick else 3,
            "warmup": 4}


def run(r) -> dict:
    p = params(r.s.quick)
    return {"params": p, "modes": {mode: r.child("svdq", mode, p, timeout=180) for mode in MODES}}


# -- child side ------------------------------------------------------------------------------


def digest(t: dict) -> str:
    """sha256 of the linear's outputs' bytes (OUTPUTS, in order)."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name in OUTPUTS:
        h.update(t[name].contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def measure(ops, sync, m: int, k: int, n: int, p: dict) -> dict:
    from bench import svdq
    from bench.throughput import pipelined

    t = svdq.inputs(m, k, n)
    quant, gemm = svdq.linear_calls(ops, t)

    def linear():
        quant()
        gemm()

    isolated = svdq.device_time(linear, p["iters"], spin=False)
    pipe = pipelined(linear, sync, p["n"], p["reps"], p["warmup"])
    sync()  # and, for the client, any error the daemon reported
    return {"m": m, "k": k, "n": n, "rank": svdq.RANK, "isolated_us": isolated * 1e6,
            "pipelined_us": pipe["us_per_call"], "pipelined": pipe, "sha256": digest(t)}


def child(ctx, p: dict) -> dict:
    from bench import svdq
    from bench.opcases import free_memory

    ops = ctx.ops()
    out = {}
    for m, k, n in svdq.shapes(p["quick"]):
        try:
            out[svdq.shape_key(m, k, n)] = measure(ops, ctx.sync, m, k, n, p)
        except Exception as e:  # noqa: BLE001  (this shape fails; the others are measured)
            out[svdq.shape_key(m, k, n)] = {"error": error_text(e)}
        free_memory()  # the next shape's tensors do not stack on these
    return {"shapes": out}
