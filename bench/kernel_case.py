"""Case 4: kernel device time, bytes moved, GB/s, % of copy bandwidth and speed-up over PyTorch.

The measurement is bench/kernels.py's (CUDA graphs over input sets larger
than L2, the device-to-device copy bandwidth measured in the same process);
it runs in an in-process child, never next to the client. --quick keeps the
Wan shapes only (the 80%-of-copy target is set there).
"""

from __future__ import annotations

from bench.common import INPROC


def params(quick: bool) -> dict:
    return {"shapes": ["wan", "wan_rank"] if quick else ["flux", "flux_rank", "wan", "wan_rank"]}


def run(r) -> dict:
    p = params(r.s.quick)
    return {"params": p, **r.child("kernels", INPROC, p, timeout=240)}


def child(ctx, p: dict) -> dict:
    import torch

    from bench import kernels

    torch.cuda.set_device(ctx.device)
    res = kernels.run(ctx.lib, shapes=p["shapes"])
    res["timing"] = "CUDA graphs of back-to-back calls over input sets > 4x L2, median of 7 replays"
    return res
