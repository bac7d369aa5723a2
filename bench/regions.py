"""Case 5: region registration: the first call on a fresh allocation against the steady-state call.

In one client child (ring, synchronous): a per-token quant whose output stays
put and whose input is, each round, a new CUDA allocation. Each round frees
the previous input and empties torch's cache (the client's wrapper of
``empty_cache`` then unregisters the freed region), allocates the input alone
in a new segment (bench.opcases.own_segment: >= 10 MiB, so a fresh
``cudaMalloc``), and times the first call (pointer lookup, IPC handle export,
the RegisterRegion RPC in which the daemon opens the handle, then the call)
and a few more calls on the same tensors (steady state). The RegisterRegion
RPC is timed too, by wrapping the session's registration callable, and the
registrations per first call are counted (1 when the allocation was new).
"""

from __future__ import annotations

import time

from bench.common import D, RING_SYNC, SHAPES, error_text, summarize_ns


def params(quick: bool) -> dict:
    return {"shapes": ["flux_rank"] if quick else ["flux_rank", "wan_rank"], "rounds": 20 if quick else 50,
            "steady_per_round": 5}


def run(r) -> dict:
    p = params(r.s.quick)
    return {"params": p, **r.child("regions", RING_SYNC, p, timeout=120)}


# -- child side ------------------------------------------------------------------------------


class _TimedRegister:
    """Wraps the region table's RegisterRegion callable: counts and times each registration."""

    def __init__(self, table):
        self.table = table
        self.inner = getattr(table, "_register", None)
        self.samples_ns: list[int] = []
        if self.inner is not None:
            table._register = self

    @property
    def available(self) -> bool:
        return self.inner is not None

    def restore(self) -> None:
        if self.inner is not None:
            self.table._register = self.inner

    def __call__(self, *a, **k):
        t0 = time.perf_counter_ns()
        try:
            return self.inner(*a, **k)
        finally:
            self.samples_ns.append(time.perf_counter_ns() - t0)


def _rounds(ops, ctx, reg: _TimedRegister, shape: str, p: dict) -> dict:
    import torch

    from bench.opcases import own_segment

    _, s, h, _ = SHAPES[shape]
    quant = ops.fp8_comm_per_token_quant.out
    q = own_segment((1, s, h, D + 2), torch.float8_e4m3fn)
    x = own_segment((1, s, h, D), torch.bfloat16).normal_()
    for _ in range(3):  # the session, q's region and the kernel are warm before the first round
        quant(x, out=q)
    ctx.sync()
    warm_registrations = len(reg.samples_ns)  # q's and the first input's: not part of the rounds
    first, steady, registrations = [], [], []
    clock = time.perf_counter_ns
    for _ in range(p["rounds"]):
        del x
        torch.cuda.empty_cache()  # returns the old input's segment (and unregisters it): not timed
        x = own_segment((1, s, h, D), torch.bfloat16).normal_()
        ctx.sync()
        before = len(reg.samples_ns)
        t0 = clock()
        quant(x, out=q)
        first.append(clock() - t0)
        registrations.append(len(reg.samples_ns) - before)
        for _ in range(p["steady_per_round"]):
            t0 = clock()
            quant(x, out=q)
            steady.append(clock() - t0)
        ctx.sync()
    return {"first_call": summarize_ns(first), "steady_call": summarize_ns(steady),
            "register_rpc": summarize_ns(reg.samples_ns[warm_registrations:]) if reg.available else None,
            "registrations_per_first_call": sorted(set(registrations)),
            "input_bytes": s * h * D * 2}


def child(ctx, p: dict) -> dict:
    from cache_dit_opd import _session

    from bench.opcases import free_memory

    ops = ctx.ops()
    table = _session.get_session(ctx.device).regions
    shapes = {}
    for shape in p["shapes"]:
        reg = _TimedRegister(table)
        try:
            shapes[shape] = _rounds(ops, ctx, reg, shape, p)
        except Exception as e:  # noqa: BLE001
            shapes[shape] = {"error": error_text(e)}
        finally:
            reg.restore()
        free_memory()
    return {"shapes": shapes}
