"""Markdown tables, the PNG plot and the target verdicts of a benchmark result JSON.

    python bench/report.py bench/results/<date>-<gpu>.json [--readme]

Writes <same name>.md and <same name>.png beside the JSON and prints the
markdown. Reads both the full run of ``bench/run.sh`` (``"cases"`` is an
object: latency, cpp_client, pipelined, regions, kernels, scaling, svdq) and the
older kernels-only JSON of ``bench/kernels.py`` (``"cases"`` is a list).
``--readme`` also puts the run's target table and plot into bench/README.md
(between the ``bench:latest`` markers). Needs matplotlib, not torch.

Verdicts are computed here from the raw figures (one place, so re-rendering
an old JSON applies the same rules): met, missed, incomplete (no miss, but
some figures the target covers are missing), reported (no numeric target),
n/a (nothing the target applies to), no data (the case failed or did not
run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import GRPC, INPROC, OPS, RING_ASYNC, RING_SYNC, SHORT, shape_label  # noqa: E402

# Issue 7's targets.
SYNC_OVERHEAD_US = 20.0
ASYNC_OVERHEAD_US = 10.0
FUNCTIONAL_SYNC_OVER_US = 12.0  # issue 14: a functional call through the ring, sync, over the in-process one
CPP_OVERHEAD_US = 100.0
PIPELINED_KERNEL_US = 100.0
PIPELINED_FRACTION = 0.90
SCALING_PROCS = "8"
SCALING_FRACTION = 0.90
IDLE_CPU_PCT = 2.0  # issue 14: the daemon with sessions open and no calls, % of one core
# Issue 14: 8 launch-bound client processes, twice the 50-63k calls/s it measured (the upper end), with the
# daemon at most 200% of a core.
LAUNCH_CLIENTS_CALLS_PER_S = 2 * 63_000
LAUNCH_CLIENTS_CPU_PCT = 200.0
KERNEL_FRACTION = 0.80

REMOTE = (RING_SYNC, RING_ASYNC, GRPC)
MODE_NAMES = {INPROC: "in-process", RING_SYNC: "ring sync", RING_ASYNC: "ring async", GRPC: "gRPC",
              "cpp": "C++ client (gRPC)"}
README = Path(__file__).resolve().parent / "README.md"
BEGIN, END = "<!-- bench:latest:begin -->", "<!-- bench:latest:end -->"


# -- reading the JSON ------------------------------------------------------------------------


def _get(d, *keys):
    """d[k0][k1]... or None when a level is missing or not a dict."""
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _measured(entry) -> bool:
    return isinstance(entry, dict) and "error" not in entry and entry.get("n", 1) > 0


def is_kernels_only(res: dict) -> bool:
    return isinstance(res.get("cases"), list)


def latency_cell(res, mode, shape, op):
    e = _get(res, "cases", "latency", "modes", mode, "shapes", shape, op)
    return e if _measured(e) else None


def functional_cell(res, mode, shape, op):
    e = _get(res, "cases", "latency", "modes", mode, "functional", shape, op)
    return e if _measured(e) else None


def latency_shapes(res) -> list[str]:
    return list(_get(res, "cases", "latency", "params", "shapes") or [])


def overheads(res) -> dict:
    """(mode, shape, op) -> (p50 overhead, p99 overhead) in us: remote minus in-process."""
    out = {}
    for shape in latency_shapes(res):
        for op in OPS:
            base = latency_cell(res, INPROC, shape, op)
            for mode in REMOTE:
                cell = latency_cell(res, mode, shape, op)
                if base and cell:
                    out[(mode, shape, op)] = (cell["p50_us"] - base["p50_us"], cell["p99_us"] - base["p99_us"])
    return out


def raw_grpc(res):
    e = _get(res, "cases", "latency", "modes", GRPC, "raw_grpc_rtt")
    return e if _measured(e) else None


def cpp_transport(run: dict) -> str:
    """The C++ client's transport of a run (runs before the ring was an option are gRPC)."""
    return run.get("transport", "grpc")


def cpp_runs(res, transport: str = "grpc") -> list[dict]:
    return [e for e in (_get(res, "cases", "cpp_client", "runs") or [])
            if e.get("status") == "ok" and cpp_transport(e) == transport]


def cpp_overhead(run: dict):
    """(remote CallPrepared p50, in-process p50, overhead p50, overhead p99) or None without a reference."""
    r = run["result"]
    remote, inproc, ov = _get(r, "remote", "prepared_host_us"), _get(r, "in_process", "host_us"), r.get("overhead_us")
    if not (remote and inproc and ov):
        return None
    return remote["p50"], inproc["p50"], ov["host_p50"], ov["host_p99"]


def pipe_cell(res, mode, shape, op):
    e = _get(res, "cases", "pipelined", "modes", mode, "shapes", shape, op)
    return e if isinstance(e, dict) and "calls_per_s" in e else None


def pipe_shapes(res) -> list[str]:
    return list(_get(res, "cases", "pipelined", "params", "shapes") or [])


def pipe_ratios(res) -> dict:
    """(mode, shape, op) -> (remote / in-process calls/s, in-process us per call)."""
    out = {}
    for shape in pipe_shapes(res):
        for op in OPS:
            base = pipe_cell(res, INPROC, shape, op)
            for mode in REMOTE:
                cell = pipe_cell(res, mode, shape, op)
                if base and cell:
                    out[(mode, shape, op)] = (cell["calls_per_s"] / base["calls_per_s"], base["us_per_call"])
    return out


def scaling_baseline(res, bound):
    for ph in _get(res, "cases", "scaling", "inproc", "phases") or []:
        if ph.get("bound") == bound and "calls_per_s" in ph:
            return ph
    return None


def scaling_points(res) -> list[dict]:
    """Every measured remote phase with its ratio to one in-process caller (None without a baseline)."""
    out = []
    for n, group in (_get(res, "cases", "scaling", "remote") or {}).items():
        for ph in (group or {}).get("phases", []):
            if "calls_per_s" not in ph:
                continue
            base = scaling_baseline(res, ph["bound"])
            out.append(dict(ph, procs=int(n), ratio=ph["calls_per_s"] / base["calls_per_s"] if base else None))
    return sorted(out, key=lambda p: (p["bound"], p["mode"], p["procs"]))


def executor_points(res) -> list[dict]:
    """The launch-bound ring-async load of SCALING_PROCS processes per executor-thread count: the run's daemon
    (1 thread unless the run set it) and the scaling case's sweep; sorted by threads."""
    sc = _get(res, "cases", "scaling") or {}
    ex = sc.get("executor_threads") or {}
    groups = [(ex.get("run_daemon", 1), (sc.get("remote") or {}).get(SCALING_PROCS))]
    groups += [(int(t), g) for t, g in (ex.get("sweep") or {}).items()]
    base = scaling_baseline(res, "launch")
    out = []
    for threads, g in groups:
        for ph in (g or {}).get("phases", []):
            if ph.get("bound") == "launch" and ph.get("mode") == RING_ASYNC and "calls_per_s" in ph:
                out.append(dict(ph, threads=threads,
                                ratio=ph["calls_per_s"] / base["calls_per_s"] if base else None))
    return sorted(out, key=lambda p: p["threads"])


SVDQ_MODES = (INPROC, RING_ASYNC, RING_SYNC, GRPC)


def svdq_cell(res, mode, key):
    e = _get(res, "cases", "svdq", "modes", mode, "shapes", key)
    return e if isinstance(e, dict) and "isolated_us" in e else None


def svdq_keys(res) -> list[str]:
    """The svdq case's shapes ("MxKxN"), in the order the children measured them."""
    keys: list[str] = []
    for mode in SVDQ_MODES:
        for key in _get(res, "cases", "svdq", "modes", mode, "shapes") or {}:
            if key not in keys:
                keys.append(key)
    return keys


def svdq_ratios(res, figure: str) -> dict:
    """(mode, shape) -> in-process time / remote time of the svdq linear ("isolated_us" or "pipelined_us")."""
    out = {}
    for key in svdq_keys(res):
        base = svdq_cell(res, INPROC, key)
        for mode in REMOTE:
            cell = svdq_cell(res, mode, key)
            if base and cell:
                out[(mode, key)] = base[figure] / cell[figure]
    return out


def svdq_same_bytes(res) -> dict:
    """(mode, shape) -> whether the remote child's outputs have the in-process child's bytes."""
    out = {}
    for key in svdq_keys(res):
        base = svdq_cell(res, INPROC, key)
        for mode in REMOTE:
            cell = svdq_cell(res, mode, key)
            if base and cell and base.get("sha256") and cell.get("sha256"):
                out[(mode, key)] = base["sha256"] == cell["sha256"]
    return out


def kernel_result(res) -> dict | None:
    k = res if is_kernels_only(res) else _get(res, "cases", "kernels")
    return k if isinstance(k, dict) and isinstance(k.get("cases"), list) and k["cases"] else None


# -- verdicts --------------------------------------------------------------------------------


def _row(tid, target, goal, achieved, verdict) -> dict:
    return {"id": tid, "target": target, "goal": goal, "achieved": achieved, "verdict": verdict}


def _where(shape, op) -> str:
    return f"{SHORT.get(op, op)}, {shape}"


def _verdict(ok: bool, measured: int, expected: int) -> str:
    """A miss is a miss; no miss with figures missing is not a pass."""
    if not ok:
        return "missed"
    return "met" if measured >= expected else "incomplete"


def _latency_targets(res) -> list[dict]:
    ov = overheads(res)
    expected = len(latency_shapes(res)) * len(OPS)
    rows = []
    for mode, limit in ((RING_SYNC, SYNC_OVERHEAD_US), (RING_ASYNC, ASYNC_OVERHEAD_US)):
        vals = sorted((v[0], s, op) for (m, s, op), v in ov.items() if m == mode)
        goal = f"p50 overhead <= {limit:.0f} us, every op"
        name = f"Python client overhead, {MODE_NAMES[mode]}"
        if not vals:
            rows.append(_row(f"latency.{mode}", name, goal, "-", "no data"))
            continue
        worst = vals[-1]
        achieved = (f"worst {worst[0]:.1f} us ({_where(worst[1], worst[2])}); "
                    f"median {statistics.median(v[0] for v in vals):.1f} us; {len(vals)} of {expected} op/shapes")
        rows.append(_row(f"latency.{mode}", name, goal, achieved, _verdict(worst[0] <= limit, len(vals), expected)))
    vals = sorted(v[0] for (m, _, _), v in ov.items() if m == GRPC)
    rtt = raw_grpc(res)
    goal = "reported against the raw gRPC round trip (GetVersion) of the same run"
    if not vals:
        rows.append(_row("latency.grpc", "Python client overhead, gRPC", goal, "-", "no data"))
    else:
        achieved = f"p50 overhead {vals[0]:.0f} to {vals[-1]:.0f} us"
        achieved += f"; raw round trip p50 {rtt['p50_us']:.0f} us" if rtt else "; raw round trip not measured"
        rows.append(_row("latency.grpc", "Python client overhead, gRPC", goal, achieved, "reported"))
    return rows


def _functional_targets(res) -> list[dict]:
    """The functional-overload row, for runs whose latency case timed functional calls (later than 2026-12-04)."""
    if not any(_get(res, "cases", "latency", "modes", m, "functional") is not None for m in (INPROC, *REMOTE)):
        return []
    goal = (f"p50 over in-process functional <= {FUNCTIONAL_SYNC_OVER_US:.0f} us ring sync, < 0 ring async, "
            "every op (issue 14)")
    name = "Functional overloads (allocating calls)"
    worst = {}
    measured, expected = 0, 0
    for shape in latency_shapes(res):
        for op in OPS:
            base = functional_cell(res, INPROC, shape, op)
            for mode in (RING_SYNC, RING_ASYNC):
                expected += 1
                cell = functional_cell(res, mode, shape, op)
                if base and cell:
                    measured += 1
                    d = cell["p50_us"] - base["p50_us"]
                    if mode not in worst or d > worst[mode][0]:
                        worst[mode] = (d, shape, op)
    if not worst:
        return [_row("latency.functional", name, goal, "-", "no data")]
    achieved = "; ".join(f"{MODE_NAMES[m]} worst {d:+.1f} us ({_where(sh, op)})" for m, (d, sh, op) in worst.items())
    ok = (worst.get(RING_SYNC, (0,))[0] <= FUNCTIONAL_SYNC_OVER_US and worst.get(RING_ASYNC, (-1,))[0] < 0)
    return [_row("latency.functional", name, goal, achieved, _verdict(ok, measured, expected))]


def _cpp_target(res) -> dict:
    goal = f"p50 overhead <= {CPP_OVERHEAD_US:.0f} us"
    name = "C++ client overhead, gRPC"
    vals = [(o[2], run["op"], run["shape"]) for run in cpp_runs(res) if (o := cpp_overhead(run))]
    if not vals:
        return _row("latency.cpp", name, goal, "-", "no data")
    worst = max(vals)
    expected = len([e for e in _get(res, "cases", "cpp_client", "runs") or [] if cpp_transport(e) == "grpc"])
    return _row("latency.cpp", name, goal,
                f"worst {worst[0]:.1f} us ({_where(worst[2], worst[1])}); {len(vals)} of {expected} runs",
                _verdict(worst[0] <= CPP_OVERHEAD_US, len(vals), expected))


def _cpp_ring_rows(res) -> list[dict]:
    """The C++ client through the call ring: reported beside the gRPC target (none when not measured)."""
    runs = [e for e in _get(res, "cases", "cpp_client", "runs") or [] if cpp_transport(e) == "ring"]
    if not runs:
        return []
    vals = [(o[2], run["op"], run["shape"]) for run in cpp_runs(res, "ring") if (o := cpp_overhead(run))]
    achieved = (f"p50 overhead {min(vals)[0]:.1f} to {max(vals)[0]:.1f} us; {len(vals)} of {len(runs)} runs"
                if vals else "-")
    return [_row("latency.cpp_ring", "C++ client overhead, ring", "reported beside the gRPC target", achieved,
                 "reported" if vals else "no data")]


def _pipelined_targets(res) -> list[dict]:
    ratios = pipe_ratios(res)
    rows = []
    goal = f">= {PIPELINED_FRACTION:.0%} of in-process calls/s, ops with kernel >= {PIPELINED_KERNEL_US:.0f} us"
    # Op/shapes the target covers: in-process time per call >= 100 us; unknown when in-process failed.
    cells = [(s, op, pipe_cell(res, INPROC, s, op)) for s in pipe_shapes(res) for op in OPS]
    covered = [(s, op) for s, op, c in cells if c is None or c["us_per_call"] >= PIPELINED_KERNEL_US]
    for mode in (RING_ASYNC, RING_SYNC, GRPC):
        name = f"Pipelined throughput, {MODE_NAMES[mode]}"
        mine = [(r, s, op) for (m, s, op), (r, us) in ratios.items() if m == mode]
        long = sorted((r, s, op) for (m, s, op), (r, us) in ratios.items() if m == mode and us >= PIPELINED_KERNEL_US)
        if not mine:
            rows.append(_row(f"pipelined.{mode}", name, goal, "-", "no data"))
        elif not long:
            rows.append(_row(f"pipelined.{mode}", name, goal, "no measured op takes >= 100 us in-process",
                             "n/a" if len(covered) == 0 else "incomplete"))
        else:
            worst = long[0]
            achieved = (f"worst {worst[0]:.0%} ({_where(worst[1], worst[2])}); "
                        f"{len(long)} of {len(covered)} op/shapes")
            rows.append(_row(f"pipelined.{mode}", name, goal, achieved,
                             _verdict(worst[0] >= PIPELINED_FRACTION, len(long), len(covered))))
    return rows


def _scaling_targets(res) -> list[dict]:
    rows = []
    goal = f"{SCALING_PROCS} processes >= {SCALING_FRACTION:.0%} of one in-process caller's calls/s, kernel-bound"
    points = [p for p in scaling_points(res) if p["bound"] == "kernel" and str(p["procs"]) == SCALING_PROCS]
    planned = _get(res, "cases", "scaling", "params", "phases") or []
    modes = sorted({ph["mode"] for ph in planned if ph.get("bound") == "kernel"} | {p["mode"] for p in points})
    modes = modes or [RING_ASYNC]
    for mode in modes:
        name = f"{SCALING_PROCS} client processes, {MODE_NAMES.get(mode, mode)}"
        p = next((p for p in points if p["mode"] == mode and p["ratio"] is not None), None)
        if p is None:
            rows.append(_row(f"scaling.{mode}", name, goal, "-", "no data"))
            continue
        achieved = (f"{p['ratio']:.0%} ({p['calls_per_s']:.0f} calls/s; {SHORT.get(p['op'], p['op'])}, {p['shape']}; "
                    f"daemon CPU {p['daemon_cpu_pct']:.0f}% of a core)" if p.get("daemon_cpu_pct") is not None
                    else f"{p['ratio']:.0%} ({p['calls_per_s']:.0f} calls/s)")
        verdict = "met" if p["ratio"] >= SCALING_FRACTION else "missed"
        rows.append(_row(f"scaling.{mode}", name, goal, achieved, verdict))
    return rows


def _idle_target(res) -> dict | None:
    """Issue 14's idle cost: daemon CPU while the most client processes of the run keep sessions open."""
    planned = _get(res, "cases", "scaling", "params", "phases") or []
    if not any(ph.get("bound") == "idle" for ph in planned):
        return None  # a run from before the idle phase existed
    goal = f"<= {IDLE_CPU_PCT:.0f}% of a core, client processes' sessions open, no calls (issue 14)"
    points = [p for p in scaling_points(res) if p["bound"] == "idle" and p.get("daemon_cpu_pct") is not None]
    if not points:
        return _row("scaling.idle", "Daemon CPU, idle sessions", goal, "-", "no data")
    p = max(points, key=lambda q: q["procs"])
    achieved = f"{p['daemon_cpu_pct']:.1f}% with {p['procs']} processes' sessions open"
    return _row("scaling.idle", "Daemon CPU, idle sessions", goal, achieved,
                "met" if p["daemon_cpu_pct"] <= IDLE_CPU_PCT else "missed")


def _launch_clients_target(res) -> dict | None:
    """Issue 14's many-client throughput, at the best executor-thread count that keeps the CPU bound."""
    if _get(res, "cases", "scaling", "params", "executor_threads") is None:
        return None  # a run from before the executor sweep existed
    points = executor_points(res)
    name = f"{SCALING_PROCS} launch-bound client processes, ring async"
    goal = (f">= {LAUNCH_CLIENTS_CALLS_PER_S:,} calls/s (2x issue 14's 50-63k) with the daemon at <= "
            f"{LAUNCH_CLIENTS_CPU_PCT:.0f}% of a core")
    if not points:
        return _row("scaling.executors", name, goal, "-", "no data")
    parts = [f"{p['threads']} thread{'s' if p['threads'] > 1 else ''}: {p['calls_per_s']:,.0f}"
             + (f" ({p['daemon_cpu_pct']:.0f}%)" if p.get("daemon_cpu_pct") is not None else "") for p in points]
    met = any(p["calls_per_s"] >= LAUNCH_CLIENTS_CALLS_PER_S and p.get("daemon_cpu_pct") is not None
              and p["daemon_cpu_pct"] <= LAUNCH_CLIENTS_CPU_PCT for p in points)
    return _row("scaling.executors", name, goal, "; ".join(parts), "met" if met else "missed")


def _kernel_target(res) -> dict:
    goal = f">= {KERNEL_FRACTION:.0%} of device-to-device copy bandwidth, every op at the Wan shapes"
    k = kernel_result(res)
    wan = [c for c in (k or {}).get("cases", []) if c["shape"].lower().startswith("wan")]
    if not wan:
        return _row("kernels", "Kernel bandwidth", goal, "-", "no data")
    worst = min(wan, key=lambda c: c["fraction_of_copy"])
    met = sum(c["fraction_of_copy"] >= KERNEL_FRACTION for c in wan)
    achieved = (f"{met} of {len(wan)} op/shapes; worst {worst['fraction_of_copy']:.0%} "
                f"({SHORT.get(worst['op'], worst['op'])}, {worst['shape']})")
    return _row("kernels", "Kernel bandwidth", goal, achieved, "met" if met == len(wan) else "missed")


def _svdq_rows(res) -> list[dict]:
    """The W4A4 linear through the daemon (no issue-7 target; none when the case is not in the run): its
    speed reported against in-process, its outputs expected to have the in-process bytes."""
    if not isinstance(_get(res, "cases", "svdq"), dict):
        return []
    name, goal = "SVDQuant W4A4 linear", "outputs equal to in-process bit for bit; speed reported (% of in-process)"
    same, pipe = svdq_same_bytes(res), svdq_ratios(res, "pipelined_us")
    if not pipe:
        return [_row("svdq", name, goal, "-", "no data")]
    parts = []
    for mode in REMOTE:
        vals = sorted(r for (m, _), r in pipe.items() if m == mode)
        if vals:
            parts.append(f"{MODE_NAMES[mode]} {vals[0]:.0%}" + (f"-{vals[-1]:.0%}" if len(vals) > 1 else ""))
    differ = sorted(f"{MODE_NAMES[m]} {k}" for (m, k), ok in same.items() if not ok)
    achieved = (f"pipelined {', '.join(parts)}; outputs equal in {sum(same.values())} of {len(same)} mode/shapes"
                + (f" (differ: {', '.join(differ)})" if differ else ""))
    return [_row("svdq", name, goal, achieved, "missed" if differ else "reported")]


def evaluate(res: dict) -> list[dict]:
    """One row per issue-7 target: what was achieved and whether it met the target (and the svdq case's row,
    and issue 14's idle daemon CPU where the run measured it)."""
    if is_kernels_only(res):
        return [_kernel_target(res)]
    optional = [r for r in (_idle_target(res), _launch_clients_target(res)) if r]
    return [*_latency_targets(res), *_functional_targets(res), _cpp_target(res), *_cpp_ring_rows(res), *_pipelined_targets(res),
            *_scaling_targets(res), *optional, _kernel_target(res), *_svdq_rows(res)]


# -- markdown --------------------------------------------------------------------------------


def _f(v, fmt="{:.1f}", none="-"):
    return none if v is None else fmt.format(v)


def _table(header: list[str], rows: list[list[str]], align: str | None = None) -> list[str]:
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---" if a == "l" else "---:" for a in align]
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |",
            *("| " + " | ".join(r) + " |" for r in rows)]


def targets_table(rows: list[dict]) -> list[str]:
    mark = {"met": "met", "missed": "**missed**", "no data": "*no data*", "n/a": "n/a", "reported": "reported",
            "incomplete": "*incomplete*"}
    return _table(["target", "goal", "achieved", "verdict"],
                  [[r["target"], r["goal"], r["achieved"], mark.get(r["verdict"], r["verdict"])] for r in rows],
                  "llll")


def kernels_table(res: dict) -> str:
    """The kernel benchmark's table (the same as bench/kernels.py prints)."""
    lines = [f"copy bandwidth (device-to-device, read + write): {res['copy_gb_per_s']:.0f} GB/s", "",
             "| op | shape | time (us) | GB/s | of copy BW | torch ref (us) | speed-up |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for c in res["cases"]:
        lines.append(f"| {c['op']} | {c['shape']} | {c['time_us']:.1f} | {c['gb_per_s']:.0f} | "
                     f"{100 * c['fraction_of_copy']:.0f}% | {c['torch_ref_time_us']:.1f} | "
                     f"{c['speedup_vs_torch']:.1f}x |")
    return "\n".join(lines)


def _lat(cell, base=None) -> str:
    if cell is None:
        return "-"
    s = f"{cell['p50_us']:.1f} / {cell['p99_us']:.1f}"
    if base is not None:
        s += f" ({cell['p50_us'] - base['p50_us']:+.1f} / {cell['p99_us'] - base['p99_us']:+.1f})"
    return s


def latency_section(res) -> list[str]:
    lat = _get(res, "cases", "latency")
    if not isinstance(lat, dict):
        cpp = _get(res, "cases", "cpp_client")
        return ["Python client: *not run*", "", *cpp_section(res)] if isinstance(cpp, dict) else ["*not run*"]
    p = lat.get("params", {})
    out = [f"Host time of one `.out` call, microseconds, p50 / p99 over {p.get('n', '?')} calls after "
           f"{p.get('warmup', '?')} warm-up calls (synchronized every {p.get('sync_every', '?')} calls, outside "
           "the timing); in parentheses the overhead over in-process (remote minus in-process, p50 / p99).", ""]

    def tables(cell) -> list[str]:  # one table per shape: each op in every mode, overhead over in-process
        lines = []
        for shape in latency_shapes(res):
            rows = []
            for op in OPS:
                base = cell(res, INPROC, shape, op)
                rows.append([op, _lat(base), *(_lat(cell(res, m, shape, op), base) for m in REMOTE)])
            lines += [f"**{shape_label(shape)}**", "",
                      *_table(["op", "in-process", "ring sync", "ring async", "gRPC"], rows, "lllll"), ""]
        return lines

    out += tables(latency_cell)
    if any(functional_cell(res, INPROC, shape, op) for shape in latency_shapes(res) for op in OPS):
        out += ["Functional overloads (each call allocates its outputs), timed the same way:", "",
                *tables(functional_cell)]
    transports = {m: _get(lat, "modes", m, "info", "transport") for m in REMOTE}
    out.append("Transports used: " + ", ".join(f"{MODE_NAMES[m]} = {t or '?'}" for m, t in transports.items())
               + (" (**not as intended**)" if transports != {RING_SYNC: "ring", RING_ASYNC: "ring", GRPC: "grpc"}
                  else ""))
    native = {m: _get(lat, "modes", m, "info", "native") for m in (RING_SYNC, RING_ASYNC)}
    out.append("Client: " + ", ".join(f"{MODE_NAMES[m]} = {'native engine' if n else 'pure Python'}"
                                      for m, n in native.items()) + ".")
    rtt = raw_grpc(res)
    if rtt:
        out += ["", "Raw gRPC round trip from Python (the daemon's GetVersion, one channel): "
                    f"p50 {rtt['p50_us']:.1f} us, p99 {rtt['p99_us']:.1f} us."]
    out += [*stages_lines(lat), "", *cpp_section(res)]
    return out


def stages_lines(lat: dict) -> list[str]:
    """The daemon's own account (GetStats stages) after each remote mode's child, where the daemon gives one."""
    rows, names = [], []
    for mode in REMOTE:
        stages = _get(lat, "modes", mode, "daemon_stages")
        if not isinstance(stages, list) or not stages:
            continue
        by = {st.get("name"): st for st in stages if isinstance(st, dict)}
        names = names or list(by)
        rows.append([MODE_NAMES[mode], *(f"{by[n]['p50_us']:.1f} / {by[n]['p99_us']:.1f}" if n in by else "-"
                                         for n in names)])
    if not rows:
        return []
    return ["", "Daemon-side stages (GetStats, its most recent calls when each mode's child ended), us p50 / p99:", "",
            *_table(["mode", *names], rows, "l" + "r" * len(names))]


def cpp_section(res) -> list[str]:
    c = _get(res, "cases", "cpp_client")
    if not isinstance(c, dict):
        return ["C++ client: *not run*"]
    if c.get("status") == "skipped":
        return [f"C++ client: skipped ({c.get('error')})"]
    rows = []
    for run in c.get("runs", []):
        if run.get("status") != "ok":
            rows.append([cpp_transport(run), run["op"], shape_label(run["shape"]), "error", "-", "-", "-"])
            continue
        r = run["result"]
        remote, full, inproc = (_get(r, "remote", "prepared_host_us"), _get(r, "remote", "call_host_us"),
                                _get(r, "in_process", "host_us"))
        ov = r.get("overhead_us") or {}
        rows.append([cpp_transport(run), run["op"], shape_label(run["shape"]),
                     f"{remote['p50']:.1f} / {remote['p99']:.1f}" if remote else "-",
                     f"{full['p50']:.1f} / {full['p99']:.1f}" if full else "-",
                     f"{inproc['p50']:.1f} / {inproc['p99']:.1f}" if inproc else "-",
                     f"{ov['host_p50']:+.1f} / {ov['host_p99']:+.1f}" if ov else "-"])
    p = c.get("params", {})
    return [f"C++ client (`opd_client_bench`, {p.get('iters', '?')} calls), microseconds p50 / p99:", "",
            *_table(["transport", "op", "shape", "CallPrepared", "Call (encode each time)", "in-process (c10 boxed)",
                     "overhead"], rows, "lllllll")]


def pipelined_section(res) -> list[str]:
    pl = _get(res, "cases", "pipelined")
    if not isinstance(pl, dict):
        return ["*not run*"]
    p = pl.get("params", {})
    out = [f"{p.get('n', '?')} back-to-back calls on one stream, then one synchronize (median of "
           f"{p.get('reps', '?')}): in-process time per call and calls/s; remote modes as % of in-process "
           f"calls/s. `*`: in-process time per call >= {PIPELINED_KERNEL_US:.0f} us (the target applies).", ""]
    for shape in pipe_shapes(res):
        rows = []
        for op in OPS:
            base = pipe_cell(res, INPROC, shape, op)
            if base is None:
                rows.append([op, "-", *("-" for _ in REMOTE)])
                continue
            star = "*" if base["us_per_call"] >= PIPELINED_KERNEL_US else ""
            cells = []
            for m in (RING_ASYNC, RING_SYNC, GRPC):
                c = pipe_cell(res, m, shape, op)
                cells.append(f"{c['calls_per_s'] / base['calls_per_s']:.0%} ({c['us_per_call']:.1f} us)" if c else "-")
            rows.append([op + star, f"{base['us_per_call']:.1f} us ({base['calls_per_s']:.0f}/s)", *cells])
        out += [f"**{shape_label(shape)}**", "",
                *_table(["op", "in-process", "ring async", "ring sync", "gRPC"], rows, "lrrrr"), ""]
    return out


def scaling_section(res) -> list[str]:
    sc = _get(res, "cases", "scaling")
    if not isinstance(sc, dict):
        return ["*not run*"]
    p = sc.get("params", {})
    # Runs before GetStats had executor_busy_ns render as they did.
    busy = any(q.get("executor_busy_pct") for q in scaling_points(res) + executor_points(res))
    out = [f"Each process calls one op in a loop for {p.get('window_s', '?')} s (all start together), then "
           "synchronizes; calls/s = all calls / time until the last synchronize returned. Daemon CPU: utime + stime "
           "over the window, % of one core." + (
               " Executor busy: each executor thread's time in passes that did work (GetStats), % of the window "
               "(near 100%: the executor thread is the bound), all executors' busy time per call, and where measured the "
               "run stage's p50 (GetStats, the window's last calls: the launch through the enqueued \"done\", the "
               "driver's and torch's part of a call)." if busy else ""),
           ""]
    rows = []
    for bound in ("kernel", "launch"):
        base = scaling_baseline(res, bound)
        if base:
            rows.append([f"{bound}-bound ({SHORT.get(base['op'], base['op'])}, {base['shape']})", "in-process", "1",
                         f"{base['calls_per_s']:.0f}", "100%", "-", *_busy({}, busy)])
        for pt in (q for q in scaling_points(res) if q["bound"] == bound):
            rows.append([f"{bound}-bound ({SHORT.get(pt['op'], pt['op'])}, {pt['shape']})",
                         MODE_NAMES.get(pt["mode"], pt["mode"]), str(pt["procs"]), f"{pt['calls_per_s']:.0f}",
                         _f(pt["ratio"], "{:.0%}"), _f(pt.get("daemon_cpu_pct"), "{:.0f}%"), *_busy(pt, busy)])
    for pt in (q for q in scaling_points(res) if q["bound"] == "idle"):
        rows.append(["idle (sessions open, no calls)", MODE_NAMES.get(pt["mode"], pt["mode"]), str(pt["procs"]), "0",
                     "-", _f(pt.get("daemon_cpu_pct"), "{:.1f}%"), *_busy(pt, busy)])
    out += _table(["load", "mode", "processes", "calls/s", "vs 1 in-process", "daemon CPU",
                   *(["executor busy"] if busy else [])], rows, "llrrrr" + "r" * busy)
    points = executor_points(res)
    if len(points) > 1:
        p0 = points[0]
        out += ["", f"Executor threads (`--executor-threads`): the launch-bound load of {p0['procs']} processes, "
                "ring async, on a daemon with each count (the run's own daemon and one started for each other "
                "count, in the same run).", ""]
        out += _table(["executor threads", "calls/s", "vs 1 in-process", "daemon CPU",
                       *(["executor busy"] if busy else [])],
                      [[str(p["threads"]), f"{p['calls_per_s']:.0f}", _f(p["ratio"], "{:.0%}"),
                        _f(p.get("daemon_cpu_pct"), "{:.0f}%"), *_busy(p, busy)] for p in points], "rrrr" + "r" * busy)
    return out


def _busy(point: dict, column: bool) -> list[str]:
    """The executor-busy cell when the table has that column: each executor thread's busy share of the window,
    "97%" or "95% / 91%", "-" when not measured."""
    if not column:
        return []
    pct = point.get("executor_busy_pct")
    if not pct:
        return ["-"]
    notes = []
    if per_call := point.get("executor_busy_us_per_call"):
        notes.append(f"{per_call:.1f} us a call")
    if (run := (point.get("stage_p50_us") or {}).get("run")) is not None:
        notes.append(f"run p50 {run:.1f} us")
    return [" / ".join(f"{b:.0f}%" for b in pct) + (f" ({'; '.join(notes)})" if notes else "")]


def regions_section(res) -> list[str]:
    rg = _get(res, "cases", "regions")
    if not isinstance(rg, dict):
        return ["*not run*"]
    p = rg.get("params", {})
    rows = []
    for shape, e in (rg.get("shapes") or {}).items():
        if not isinstance(e, dict) or "error" in e:
            rows.append([shape_label(shape), "error", "-", "-", "-", "-"])
            continue
        first, steady, rpc = e["first_call"], e["steady_call"], e.get("register_rpc") or {}
        rows.append([shape_label(shape), f"{first['p50_us']:.1f} / {first['p99_us']:.1f}",
                     f"{steady['p50_us']:.1f} / {steady['p99_us']:.1f}",
                     f"{first['p50_us'] - steady['p50_us']:+.1f}",
                     f"{rpc['p50_us']:.1f} / {rpc['p99_us']:.1f}" if rpc.get("n") else "-",
                     ", ".join(map(str, e.get("registrations_per_first_call", [])))])
    return [f"Per-token quant through the ring (sync); each of {p.get('rounds', '?')} rounds puts the input in a "
            "new CUDA allocation; microseconds p50 / p99.", "",
            *_table(["shape", "first call", "steady call", "first - steady (p50)", "RegisterRegion RPC",
                     "registrations per first call"], rows, "lrrrrr")]


def svdq_section(res) -> list[str]:
    sv = _get(res, "cases", "svdq")
    if not isinstance(sv, dict):
        return ["*not run*"]
    if sv.get("status") == "skipped":
        return [f"skipped ({sv.get('error')})"]
    p = sv.get("params", {})
    out = ["bench/svdq.py's W4A4 linear (bf16, rank 32, LoRA-down/-up and bias; `svdq_quantize_w4a4_act_fuse_lora"
           ".out` then `svdq_gemm_w4a4.out`), microseconds per linear; in parentheses in-process time / this "
           "mode's (100%: as fast as in-process). Isolated: CUDA events on the caller's stream around one linear, "
           f"waited for after each, median of {p.get('iters', '?')}; pipelined: {p.get('n', '?')} linears back to "
           f"back, then one synchronize, median of {p.get('reps', '?')}.", ""]

    def cell(mode, key, figure):
        c, base = svdq_cell(res, mode, key), svdq_cell(res, INPROC, key)
        if c is None:
            return "error" if isinstance(_get(sv, "modes", mode, "shapes", key), dict) else "-"
        if mode == INPROC or base is None:
            return f"{c[figure]:.1f}"
        return f"{c[figure]:.1f} ({base[figure] / c[figure]:.0%})"

    for figure, title in (("isolated_us", "Isolated"), ("pipelined_us", "Pipelined")):
        rows = [[*key.split("x"), *(cell(m, key, figure) for m in SVDQ_MODES)] for key in svdq_keys(res)]
        out += [f"**{title}**", "",
                *_table(["M", "K", "N", *(MODE_NAMES[m] for m in SVDQ_MODES)], rows, "rrrrrrr"), ""]
    same = svdq_same_bytes(res)
    counts = []
    for mode in REMOTE:
        mine = [ok for (m, _), ok in same.items() if m == mode]
        if mine:
            counts.append(f"{MODE_NAMES[mode]} {sum(mine)} of {len(mine)} shapes"
                          + ("" if all(mine) else " (**differ**: " + ", ".join(
                              k for (m, k), ok in same.items() if m == mode and not ok) + ")"))
    out.append("Outputs with the in-process bytes (sha256 of act, ascales, lora_act and out after the last call): "
               + ("; ".join(counts) if counts else "not compared") + ".")
    return out


def errors_section(res) -> list[str]:
    """Every error in the JSON, by where it sits: a miss is reported, never hidden."""
    found = []

    def last_line(text) -> str:
        lines = [ln.strip() for ln in str(text or "").strip().splitlines() if ln.strip()]
        return lines[-1][:300] if lines else ""

    def walk(d, path):
        if isinstance(d, dict):
            if isinstance(d.get("error"), str):
                msg = last_line(d["error"]) or "?"
                why = last_line(d.get("log_tail") or d.get("stderr_tail"))
                found.append((path, msg + (f" (log: {why})" if why and why != msg else "")))
            for k, v in d.items():
                if k in ("error", "log_tail", "stderr_tail") or (k == "children" and "error" in d):
                    continue  # a failed group's processes repeat its error
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(d, list):
            for i, v in enumerate(d):
                walk(v, f"{path}[{i}]")

    walk(res.get("cases", {}), "cases")
    walk(res.get("daemon", {}), "daemon")
    if not found:
        return ["none"]
    return [f"- `{path}`: {msg}" for path, msg in found]


def environment_lines(res) -> list[str]:
    env = dict(res.get("env") or {})
    d = res.get("daemon") or {}
    if d.get("command"):
        env["daemon"] = "`" + " ".join(d["command"]) + "`"
    return [f"- {k}: {v}" for k, v in env.items()]


def markdown(res: dict) -> str:
    if is_kernels_only(res):
        env = res.get("env")
        md = kernels_table(res)
        return ("\n".join(f"- {k}: {v}" for k, v in env.items()) + "\n\n" + md) if env else md
    gpu = _get(res, "env", "gpu") or "?"
    lines = [f"# cache-dit-opd benchmark: {gpu}, {res.get('date', '?')} ({res.get('suite', '?')} suite)", "",
             f"Command: `{res.get('command', '?')}`; wall time {_f(res.get('wall_s'), '{:.0f}')} s.", "",
             "## Environment", "", *environment_lines(res), "",
             "## Targets (issue 7)", "", *targets_table(res.get("targets") or evaluate(res)), "",
             "## 1. Per-call latency", "", *latency_section(res), "",
             "## 2. Pipelined throughput", "", *pipelined_section(res), "",
             "## 3. Many processes", "", *scaling_section(res), "",
             "## 4. Kernels", ""]
    k = kernel_result(res)
    lines += [kernels_table(k) if k else "*no data*", "",
              "## 5. Region registration", "", *regions_section(res), ""]
    if isinstance(_get(res, "cases", "svdq"), dict):  # runs before this case have no such section
        lines += ["## 6. SVDQuant W4A4 linear", "", *svdq_section(res), ""]
    lines += ["## Errors", "", *errors_section(res)]
    return "\n".join(lines)


# -- plot ------------------------------------------------------------------------------------


def _no_data(ax, title):
    ax.set_title(title, fontsize=10)
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def _grouped_bars(ax, groups, series, values, colors):
    """values[(series, group)] -> bar height (missing: no bar)."""
    width = 0.8 / max(1, len(series))
    for i, s in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        hs = [values.get((s, grp)) for grp in groups]
        ax.bar([x for x, h in zip(xs, hs) if h is not None], [h for h in hs if h is not None], width,
               label=MODE_NAMES.get(s, s), color=colors[i % len(colors)])


COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3"]


def plot_latency(ax, res):
    title = "Per-call overhead over in-process, p50 (log scale)"
    ov = overheads(res)
    groups = [(s, op) for s in latency_shapes(res) for op in OPS if any((m, s, op) in ov for m in REMOTE)]
    if not groups:
        return _no_data(ax, title)
    values = {(m, (s, op)): max(0.1, v[0]) for (m, s, op), v in ov.items()}
    series = list(REMOTE)
    for run in cpp_runs(res):
        o = cpp_overhead(run)
        if o and (run["shape"], run["op"]) in groups:
            values[("cpp", (run["shape"], run["op"]))] = max(0.1, o[2])
            if "cpp" not in series:
                series.append("cpp")
    _grouped_bars(ax, groups, series, values, COLORS)
    ax.set_yscale("log")
    for y, label, c in ((ASYNC_OVERHEAD_US, "async target", COLORS[1]), (SYNC_OVERHEAD_US, "sync target", COLORS[0]),
                        (CPP_OVERHEAD_US, "C++ target", COLORS[3])):
        ax.axhline(y, color=c, linestyle="--", linewidth=1)
        ax.text(len(groups) - 0.5, y, label, fontsize=7, va="bottom", ha="right", color=c)
    rtt = raw_grpc(res)
    if rtt:
        ax.axhline(rtt["p50_us"], color=COLORS[2], linestyle=":", linewidth=1)
        ax.text(-0.4, rtt["p50_us"], "raw gRPC round trip", fontsize=7, va="bottom", color=COLORS[2])
    ax.set_xticks(range(len(groups)), [f"{SHORT[op]}\n{s}" for s, op in groups], fontsize=7)
    ax.set_ylabel("us")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left")


def plot_pipelined(ax, res):
    title = f"Pipelined calls/s, % of in-process (* kernel >= {PIPELINED_KERNEL_US:.0f} us)"
    ratios = pipe_ratios(res)
    groups = [(s, op) for s in pipe_shapes(res) for op in OPS if any((m, s, op) in ratios for m in REMOTE)]
    if not groups:
        return _no_data(ax, title)
    series = [RING_ASYNC, RING_SYNC, GRPC]
    values = {(m, (s, op)): 100 * r for (m, s, op), (r, _) in ratios.items()}
    long = {(s, op) for (m, s, op), (_, us) in ratios.items() if us >= PIPELINED_KERNEL_US}
    _grouped_bars(ax, groups, series, values, [COLORS[1], COLORS[0], COLORS[2]])
    ax.axhline(100 * PIPELINED_FRACTION, color="k", linestyle="--", linewidth=1, label="90% target")
    ax.set_xticks(range(len(groups)), [f"{SHORT[op]}{'*' if (s, op) in long else ''}\n{s}" for s, op in groups],
                  fontsize=7)
    ax.set_ylabel("%")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="lower left")


def plot_scaling(ax, res):
    title = "Many processes: aggregate calls/s, % of one in-process caller (daemon CPU % at points)"
    points = [p for p in scaling_points(res) if p["ratio"] is not None]
    if not points:
        return _no_data(ax, title)
    lines = sorted({(p["bound"], p["mode"]) for p in points})
    for i, (bound, mode) in enumerate(lines):
        pts = sorted((p for p in points if (p["bound"], p["mode"]) == (bound, mode)), key=lambda p: p["procs"])
        xs, ys = [p["procs"] for p in pts], [100 * p["ratio"] for p in pts]
        ax.plot(xs, ys, marker="o", color=COLORS[i % len(COLORS)], linestyle="-" if bound == "kernel" else ":",
                label=f"{bound}-bound ({SHORT.get(pts[0]['op'])}, {pts[0]['shape']}), {MODE_NAMES.get(mode, mode)}")
        for p, x, y in zip(pts, xs, ys):
            if p.get("daemon_cpu_pct") is not None:
                ax.annotate(f"{p['daemon_cpu_pct']:.0f}%", (x, y), textcoords="offset points", xytext=(4, 4),
                            fontsize=6, color=COLORS[i % len(COLORS)])
    ax.axhline(100 * SCALING_FRACTION, color="k", linestyle="--", linewidth=1, label="90% target (kernel-bound)")
    ax.set_xscale("log", base=2)
    procs = sorted({p["procs"] for p in points})
    ax.set_xticks(procs, [str(p) for p in procs])
    ax.set_xlabel("client processes")
    ax.set_ylabel("%")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)


def plot_kernels(ax, k: dict | None, title_suffix: str = ""):
    title = "Kernels: achieved / copy bandwidth (speed-up over PyTorch at bar ends)" + title_suffix
    if not k:
        return _no_data(ax, title)
    cases = k["cases"]
    labels = [f"{c['op'].replace('fp8_comm_', '').replace('fused_', '')}\n{c['shape']}" for c in cases]
    bars = ax.barh(range(len(cases)), [100 * c["fraction_of_copy"] for c in cases],
                   color=[COLORS[0] if c["shape"].lower().startswith("wan") else COLORS[1] for c in cases])
    ax.set_yticks(range(len(cases)), labels, fontsize=6 if len(cases) > 10 else 7)
    ax.invert_yaxis()
    ax.axvline(100 * KERNEL_FRACTION, color="k", linestyle="--", linewidth=1, label="80% target (Wan shapes)")
    ax.set_xlabel(f"% of device-to-device copy bandwidth ({k['copy_gb_per_s']:.0f} GB/s)")
    for bar, c in zip(bars, cases):
        ax.text(bar.get_width() + 0.5, bar.get_y() + bar.get_height() / 2, f"{c['speedup_vs_torch']:.1f}x",
                va="center", fontsize=6)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=7)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if is_kernels_only(res):
        fig, ax = plt.subplots(figsize=(12, 0.42 * len(res["cases"]) + 1.5))
        plot_kernels(ax, res, f", {(res.get('env') or {}).get('gpu', res.get('device', '?'))}")
    else:
        fig, axes = plt.subplots(2, 2, figsize=(17, 12))
        plot_latency(axes[0][0], res)
        plot_pipelined(axes[0][1], res)
        plot_scaling(axes[1][0], res)
        plot_kernels(axes[1][1], kernel_result(res))
        env = res.get("env") or {}
        fig.suptitle(f"cache-dit-opd on {env.get('gpu', '?')}, {res.get('date', '?')} ({res.get('suite', '?')}), "
                     f"commit {env.get('git_commit', '?')}", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- outputs ---------------------------------------------------------------------------------


def render(json_path: Path) -> str:
    """Writes <json>.md and <json>.png; returns the markdown. A plot failure leaves the markdown in place."""
    json_path = Path(json_path)
    res = json.loads(json_path.read_text())
    md = markdown(res)
    json_path.with_suffix(".md").write_text(md + "\n")
    try:
        plot(res, json_path.with_suffix(".png"))
    except Exception as e:  # noqa: BLE001  (matplotlib missing or a malformed entry: the table still stands)
        print(f"report: no plot ({type(e).__name__}: {e})", file=sys.stderr)
    return md


def update_readme(json_path: Path, readme: Path = README) -> None:
    """Puts the run's target table, plot and links between the bench:latest markers of the README."""
    json_path = Path(json_path)
    res = json.loads(json_path.read_text())
    rel = Path(os.path.relpath(json_path, readme.parent))
    env = res.get("env") or {}
    commit = env.get("code_commit") or (f"{env.get('git_commit', '?')}"
                                        + (" + uncommitted changes" if env.get("git_dirty") else ""))
    block = [BEGIN,
             f"Latest run: {env.get('gpu', '?')}, {res.get('date', '?')}, commit {commit} "
             f"({res.get('suite', '?')} suite): [all tables]({rel.with_suffix('.md')}), [JSON]({rel}).", "",
             *targets_table(res.get("targets") or evaluate(res)), "",
             f"![benchmark plot]({rel.with_suffix('.png')})", END]
    text = readme.read_text() if readme.exists() else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + "\n".join(block) + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n## Latest results\n\n" + "\n".join(block) + "\n"
    readme.write_text(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", type=Path, help="a result JSON of bench/run.sh or bench/kernels.py")
    ap.add_argument("--readme", action="store_true", help="also update bench/README.md's latest-results section")
    args = ap.parse_args(argv)
    try:
        md = render(args.json)
    except (OSError, ValueError) as e:
        print(f"report: cannot read {args.json}: {e}", file=sys.stderr)
        return 2
    if args.readme and not is_kernels_only(json.loads(args.json.read_text())):
        update_readme(args.json)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
