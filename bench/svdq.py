"""SVDQuant W4A4 benchmark: the whole linear at FLUX.1 shapes against cuBLAS in the same run.

For each (M, K, N) at rank 32: device time of the activation quantizer with LoRA-down
(``svdq_quantize_w4a4_act_fuse_lora``), of the GEMM with LoRA-up and bias (``svdq_gemm_w4a4``, which
on sm_90a includes expanding the packed weight to e4m3), and of both; against the BF16 linear
(``F.linear`` with bias), FP8 row-wise ``torch._scaled_mm`` and INT8 ``torch._int_mm`` of the same
shape. Rates are 2 M N K per second of each; the ratio column divides the BF16 linear's time by the
W4A4 linear's. Operands are random (packed bytes, scales): times do not depend on values.

    python bench/svdq.py --lib build/kernels/libcache_dit_cuda_ops.so [--json out.json] [--quick]
                         [--schedules sm90-tile,sm90-multicast,sm90-persistent,sm90-serial,sm90-overlap]

On sm 9.0 it also times the GEMM under each other launch schedule of the sm_90a kernel
(``CACHE_DIT_SVDQ_GEMM``, read once per process: one child process each, same inputs by seed) and prints
each one's speed over the default schedule's, timed the same way in this run (a child before the others
and one after: schedule_rows).

The kernel library is loaded in this process (in-process numbers). The same linear through the daemon,
against in-process in the same run: the ``svdq`` case of the orchestrated suite (``bench/run.sh --only
svdq``, bench/svdq_case.py), which takes its shapes (``shapes``) and tensors (``inputs``, ``linear_calls``)
from here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
FLUX = [(3072, 3072), (3072, 12288), (12288, 3072), (3072, 9216), (15360, 3072)]
RANK = 32
PAD = 256  # pad_size: rows are padded to a multiple of it
OUT_BF16 = 1  # out_dtype_id of bfloat16 (kernels/svdq/svdq.h)


def shapes(quick: bool) -> list[tuple[int, int, int]]:
    """(M, K, N) of the benchmark: FLUX.1's linears at 4608 tokens, then smaller M."""
    out = [(4608, k, n) for k, n in FLUX]
    out += [(m, 3072, 3072) for m in (1024, 256)]
    return out[:3] if quick else out


def shape_key(m: int, k: int, n: int) -> str:
    return f"{m}x{k}x{n}"


def inputs(m: int, k: int, n: int, device: str = "cuda", seed: int = 0) -> dict:
    """A bf16 rank-32 layer with bias, its input and the linear's outputs (allocated, not computed: no op runs
    here). Random packed bytes and scales (times do not depend on values), from a seeded generator on the
    device: every process builds the same bytes. Keys: x, qweight, wscales, smooth, down, up, bias; act,
    ascales, lora_act (the quantizer's outputs, M padded to 256), out [M_pad, N] bf16."""
    g = torch.Generator(device=device).manual_seed(seed)
    m_pad = (m + PAD - 1) // PAD * PAD

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=g) * scale).to(BF16)

    return {
        "x": randn(m, k),
        "qweight": torch.randint(-128, 128, (n, k // 2), device=device, dtype=torch.int8, generator=g),
        "wscales": (torch.rand(k // 64, n, device=device, generator=g) * 0.01 + 1e-3).to(BF16),
        "smooth": (torch.rand(k, device=device, generator=g) + 0.5).to(BF16),
        "down": randn(k, RANK, scale=0.02),
        "up": randn(n, RANK, scale=0.02),
        "bias": randn(n),
        "act": torch.empty(m_pad, k, device=device, dtype=FP8),
        "ascales": torch.empty(k // 64, m_pad, device=device, dtype=BF16),
        "lora_act": torch.empty(m_pad, RANK, device=device, dtype=torch.float32),
        "out": torch.empty(m_pad, n, device=device, dtype=BF16),
    }


# ~100 us at the H200's clocks: more than one call's host time (the functional ops ~20 us).
SPIN_CYCLES = 200_000


def linear_calls(ops, t: dict):
    """(quant, gemm): zero-argument calls of the two ``.out`` overloads the W4A4 linear is made of, on
    ``inputs``' tensors; ``ops`` is the process's ``torch.ops.cache_dit_cuda_ops`` (the kernel library's ops,
    or the client's proxies to the daemon)."""
    def quant():
        ops.svdq_quantize_w4a4_act_fuse_lora.out(t["x"], t["down"], t["smooth"], False, False, PAD,
                                                 output=t["act"], oscales=t["ascales"], lora_act_out=t["lora_act"])

    def gemm():
        ops.svdq_gemm_w4a4.out(t["act"], t["qweight"], t["ascales"], t["wscales"], t["lora_act"], t["up"],
                               t["bias"], False, 1.0, None, False, OUT_BF16, out=t["out"])

    return quant, gemm


def device_time(fn, iters: int, spin: bool = True) -> float:
    """Median seconds per call over `iters` timed calls, after warm-up: CUDA events on the current stream
    around one call, waited for after each. With `spin`, a spin kernel ahead of the first event keeps the GPU
    busy while the host enqueues the call, so the time is the device's, not the host's launch latency (which
    in a model overlaps the previous layer's kernels); without it, the host's time to enqueue is counted."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if spin:
            torch.cuda._sleep(SPIN_CYCLES)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return statistics.median(times)


def case(ops, m: int, k: int, n: int, iters: int) -> dict:
    dev = "cuda"
    t = inputs(m, k, n, dev)
    x, bias = t["x"], t["bias"]
    quant, gemm = linear_calls(ops, t)
    t_quant = device_time(quant, iters)
    t_gemm = device_time(gemm, iters)

    w = torch.randn(n, k, device=dev, dtype=BF16) * 0.02
    t_bf16 = device_time(lambda: F.linear(x, w, bias), iters)
    xq, wq = x.to(FP8), w.to(FP8)
    sa = torch.ones(m, 1, device=dev, dtype=torch.float32)
    sb = torch.ones(1, n, device=dev, dtype=torch.float32)
    t_fp8 = device_time(lambda: torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sb, out_dtype=BF16,
                                                 use_fast_accum=True), iters)
    xi = torch.randint(-8, 8, (m, k), device=dev, dtype=torch.int8)
    wi = torch.randint(-8, 8, (n, k), device=dev, dtype=torch.int8)
    t_int8 = device_time(lambda: torch._int_mm(xi, wi.t()), iters)

    flop = 2 * m * n * k
    t_w4a4 = t_quant + t_gemm
    return {
        "m": m, "k": k, "n": n, "rank": RANK,
        "us": {"quant": t_quant * 1e6, "gemm": t_gemm * 1e6, "w4a4": t_w4a4 * 1e6, "bf16": t_bf16 * 1e6,
               "fp8": t_fp8 * 1e6, "int8": t_int8 * 1e6},
        "tflops": {"w4a4": flop / t_w4a4 / 1e12, "w4a4_gemm": flop / t_gemm / 1e12, "bf16": flop / t_bf16 / 1e12,
                   "fp8": flop / t_fp8 / 1e12, "int8": flop / t_int8 / 1e12},
        "vs_bf16": t_bf16 / t_w4a4, "vs_fp8": t_fp8 / t_w4a4, "quant_share": t_quant / t_w4a4,
    }


SCHEDULES = ["sm90-tile", "sm90-multicast", "sm90-persistent", "sm90-serial", "sm90-overlap"]


def gemm_times(ops, shape_list: list[tuple[int, int, int]], iters: int) -> list[float]:
    """Device seconds of the GEMM alone at each shape (the quantizer runs once first, so the GEMM reads real
    codes)."""
    out = []
    for m, k, n in shape_list:
        quant, gemm = linear_calls(ops, inputs(m, k, n))
        quant()
        out.append(device_time(gemm, iters))
    return out


def child_gemm_times(lib: Path, shape_list: list[tuple[int, int, int]], iters: int, schedule: str) -> list[float]:
    """gemm_times in a child process with CACHE_DIT_SVDQ_GEMM=schedule (read once per process)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        subprocess.run([sys.executable, __file__, "--lib", str(lib), "--iters", str(iters), "--gemm-only",
                        json.dumps(shape_list), "--json", str(out)],
                       check=True, env=dict(os.environ, CACHE_DIT_SVDQ_GEMM=schedule))
        return json.loads(out.read_text())


def schedule_rows(lib: Path, rows: list[dict], iters: int, schedules: list[str]) -> None:
    """Adds r["schedules"][name] = {"gemm_us", "tflops", "vs_default"} to each row, and r["default_child"] =
    {"gemm_us", "drift"}: every GEMM here, the default schedule's included, is timed the same way, in a child
    process with CACHE_DIT_SVDQ_GEMM set; the default's child runs before the others and again after them, and
    each schedule is compared with the mean of those two. Comparing a child with the parent's own GEMM time
    (taken between the cuBLAS runs) favoured whichever ran in the child by up to 8%: the L1 prefetch of the
    epilogue came out ahead as the child and behind as the parent (H100, 2026-12-06,
    bench/results/2026-12-06-h100-svdq-ab-method.md). "drift" is the second default run over the first."""
    if not schedules:
        return
    shape_list = [(r["m"], r["k"], r["n"]) for r in rows]
    first = child_gemm_times(lib, shape_list, iters, "sm90")
    others = {name: child_gemm_times(lib, shape_list, iters, name) for name in schedules}
    last = child_gemm_times(lib, shape_list, iters, "sm90")
    for i, r in enumerate(rows):
        base = (first[i] + last[i]) / 2
        r["default_child"] = {"gemm_us": base * 1e6, "drift": last[i] / first[i]}
        for name, times in others.items():
            t = times[i]
            r.setdefault("schedules", {})[name] = {
                "gemm_us": t * 1e6, "tflops": 2 * r["m"] * r["n"] * r["k"] / t / 1e12, "vs_default": base / t}


def schedule_table(rows: list[dict]) -> str:
    names = sorted({name for r in rows for name in r.get("schedules", {})},
                   key=lambda n: SCHEDULES.index(n) if n in SCHEDULES else -1)  # "sm90": the default against itself
    if not names:
        return ""
    lines = ["| M | K | N | default GEMM us (after / before) | " + " | ".join(f"{n} us (x default)" for n in names)
             + " |", "|" + " --- |" * (4 + len(names))]
    for r in rows:
        d = r["default_child"]
        cells = [f"{r['schedules'][n]['gemm_us']:.1f} ({r['schedules'][n]['vs_default']:.2f})" for n in names]
        lines.append(f"| {r['m']} | {r['k']} | {r['n']} | {d['gemm_us']:.1f} ({d['drift']:.2f}) | " + " | ".join(cells)
                     + " |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    head = ("| M | K | N | W4A4 linear us (quant + GEMM) | W4A4 TFLOP/s | GEMM only TFLOP/s | BF16 TFLOP/s | "
            "FP8 TFLOP/s | INT8 TFLOP/s | x BF16 | x FP8 |")
    lines = [head, "|" + " --- |" * 11]
    for r in rows:
        u, f = r["us"], r["tflops"]
        lines.append(f"| {r['m']} | {r['k']} | {r['n']} | {u['w4a4']:.1f} ({u['quant']:.1f} + {u['gemm']:.1f}) | "
                     f"{f['w4a4']:.0f} | {f['w4a4_gemm']:.0f} | {f['bf16']:.0f} | {f['fp8']:.0f} | {f['int8']:.0f} | "
                     f"{r['vs_bf16']:.2f} | {r['vs_fp8']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lib", required=True, type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--schedules", default=None,
                   help="comma-separated CACHE_DIT_SVDQ_GEMM schedules to time against the default "
                        "(default: all of them on sm 9.0, none elsewhere; '' for none)")
    p.add_argument("--gemm-only", default=None, help=argparse.SUPPRESS)  # a child: JSON [(M, K, N)] -> times
    a = p.parse_args()
    torch.ops.load_library(str(a.lib))
    ops = torch.ops.cache_dit_cuda_ops
    if a.gemm_only is not None:
        a.json.write_text(json.dumps(gemm_times(ops, [tuple(s) for s in json.loads(a.gemm_only)], a.iters)))
        return
    rows = [case(ops, m, k, n, a.iters) for m, k, n in shapes(a.quick)]
    schedules = a.schedules.split(",") if a.schedules is not None else (
        SCHEDULES if torch.cuda.get_device_capability() == (9, 0) else [])
    schedule_rows(a.lib, rows, a.iters, [s for s in schedules if s])
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(table(rows))
    print(schedule_table(rows))
    if a.json:
        a.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
