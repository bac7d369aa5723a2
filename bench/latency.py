"""Case 1: per-call host latency of every op's ``.out`` call and of its functional call, p50/p99.

One child per mode measures every op at the per-rank shapes (kernel time
small, so the host cost shows): in-process (kernel library loaded), the
Python client over the ring synchronously and asynchronously, and over gRPC.
Each call is timed alone with ``perf_counter_ns`` around the call. Every 32
calls the child synchronizes, outside the timed region (the functional
calls, which allocate their outputs, are timed the same way after the
``.out`` calls): the ring has 64 slots,
and with more calls outstanding an asynchronous call would wait for a free
slot, measuring the daemon's throughput instead of the client's cost. The
gRPC child also times the daemon's GetVersion unary RPC: the raw round trip a
gRPC call cannot beat. Overhead (remote minus in-process) is computed by the
report.
"""

from __future__ import annotations

import time

from bench.common import GRPC, INPROC, RING_ASYNC, RING_SYNC, error_text, summarize_ns

MODES = (INPROC, RING_SYNC, RING_ASYNC, GRPC)
SYNC_EVERY = 32  # < half the ring's 64 slots


def params(quick: bool) -> dict:
    return {"shapes": ["flux_rank"] if quick else ["flux_rank", "wan_rank"],
            "n": 300 if quick else 2000, "warmup": 100 if quick else 200, "sync_every": SYNC_EVERY}


def run(r) -> dict:
    p = params(r.s.quick)
    out = {"params": p, "modes": {}}
    for mode in MODES:
        mp = dict(p, raw_grpc=mode == GRPC)
        out["modes"][mode] = r.child("latency", mode, mp, timeout=150)
    return out


# -- child side ------------------------------------------------------------------------------


def time_calls(f, sync, n: int, warmup: int, sync_every: int) -> dict:
    for i in range(warmup):
        f()
        if (i + 1) % sync_every == 0:
            sync()
    sync()
    clock = time.perf_counter_ns
    samples = []
    for i in range(n):
        t0 = clock()
        f()
        samples.append(clock() - t0)
        if (i + 1) % sync_every == 0:
            sync()  # not timed: keeps fewer calls outstanding than the ring has slots
    sync()
    return summarize_ns(samples)


def raw_grpc_rtt(n: int, warmup: int) -> dict:
    """GetVersion round trips on one channel to the daemon: the floor under any gRPC call from Python."""
    import os

    import grpc

    from cache_dit_opd._proto import opd_grpc
    from cache_dit_opd._proto import opd_pb2 as pb

    with grpc.insecure_channel(os.environ["CACHE_DIT_OPD_ADDRESS"]) as ch:
        stub = opd_grpc.OperatorDaemonStub(ch)
        req = pb.VersionRequest()
        for _ in range(warmup):
            stub.GetVersion(req, timeout=10)
        clock = time.perf_counter_ns
        samples = []
        for _ in range(n):
            t0 = clock()
            stub.GetVersion(req, timeout=10)
            samples.append(clock() - t0)
    return summarize_ns(samples)


def daemon_stages() -> dict | list:
    """Where the daemon's time per call went (accept, inputs_wait, run) over its recent calls, if it says."""
    try:
        import cache_dit_opd

        return cache_dit_opd.daemon_stats().get("stages", [])
    except Exception as e:  # noqa: BLE001  (an older daemon or client: not fatal)
        return {"error": str(e)[:300]}


def child(ctx, p: dict) -> dict:
    from bench.opcases import measure_each_op

    ops = ctx.ops()
    capacity = ctx.info.get("ring_capacity") or 0
    if capacity:  # a daemon started with a smaller --ring-capacity: stay under half of it
        p = dict(p, sync_every=max(1, min(p["sync_every"], capacity // 2)))
    shapes = measure_each_op(ops, p["shapes"],
                             lambda f: time_calls(f, ctx.sync, p["n"], p["warmup"], p["sync_every"]))
    functional = measure_each_op(ops, p["shapes"],
                                 lambda f: time_calls(f, ctx.sync, p["n"], p["warmup"], p["sync_every"]),
                                 functional=True)
    out = {"shapes": shapes, "functional": functional, "sync_every": p["sync_every"]}
    if ctx.mode != INPROC:
        out["daemon_stages"] = daemon_stages()
    if p.get("raw_grpc"):
        try:
            out["raw_grpc_rtt"] = raw_grpc_rtt(p["n"], p["warmup"])
        except Exception as e:  # noqa: BLE001
            out["raw_grpc_rtt"] = {"error": error_text(e)}
    return out
