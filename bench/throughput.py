"""Case 2: pipelined throughput: N back-to-back calls on one stream, no host sync, then one synchronize.

calls/s = N / (time from the first call until the synchronize returns), the
median of a few repetitions, per op and shape, in one child per mode
(in-process, ring async, ring sync, gRPC). When the kernel is long the GPU is
the bottleneck and a remote mode should match in-process; when it is short the
figure is the per-call host cost. The in-process time per call is the
kernel's time for the ops that the target names (kernel >= 100 us).
"""

from __future__ import annotations

import statistics
import time

from bench.common import GRPC, INPROC, RING_ASYNC, RING_SYNC

MODES = (INPROC, RING_ASYNC, RING_SYNC, GRPC)


def params(quick: bool) -> dict:
    return {"shapes": ["flux_rank", "wan"] if quick else ["flux_rank", "wan_rank", "wan"],
            "n": 300 if quick else 1000, "reps": 1 if quick else 3, "warmup": 16}


def run(r) -> dict:
    p = params(r.s.quick)
    return {"params": p, "modes": {mode: r.child("pipelined", mode, p, timeout=150) for mode in MODES}}


# -- child side ------------------------------------------------------------------------------


def pipelined(f, sync, n: int, reps: int, warmup: int) -> dict:
    for _ in range(warmup):
        f()
    sync()
    clock = time.perf_counter
    rates, enqueue = [], []
    for _ in range(reps):
        sync()
        t0 = clock()
        for _ in range(n):
            f()
        t1 = clock()
        sync()
        t2 = clock()
        rates.append(n / (t2 - t0))
        enqueue.append((t1 - t0) / n * 1e6)
    rate = statistics.median(rates)
    return {"calls_per_s": rate, "us_per_call": 1e6 / rate, "enqueue_us_per_call": statistics.median(enqueue),
            "reps_calls_per_s": rates, "n": n}


def child(ctx, p: dict) -> dict:
    from bench.opcases import measure_each_op

    return {"shapes": measure_each_op(ctx.ops(), p["shapes"],
                                      lambda f: pipelined(f, ctx.sync, p["n"], p["reps"], p["warmup"]))}
