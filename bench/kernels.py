"""Kernel benchmark: each op at FLUX.1 1024^2 and Wan-14B 480p shapes.

For every (op, shape): device time per call, bytes moved (each input read
once, each output written once), achieved GB/s, the ratio to the
device-to-device copy bandwidth measured in the same run, and the speed-up
over the pure-PyTorch reference (kernels/reference.py) of the same math.
Times come from CUDA graphs of back-to-back calls over rotating input sets
larger than L2, so they are device times, not launch overhead.

    python bench/kernels.py --lib build/kernels/libcache_dit_cuda_ops.so --json out.json

The kernel library is loaded in this process (never together with the
Python client, which defines the same op namespace).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.report (the table) when run as a file
import reference as ref  # noqa: E402

BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
L2_BYTES = 60 << 20

# (model, S, H, per-rank) at D = 128; per-rank H is Ulysses-4's share.
SHAPES = [
    ("flux", 4608, 24, False),
    ("flux", 4608, 6, True),
    ("wan", 32760, 40, False),
    ("wan", 32760, 10, True),
]
ULYSSES = 4
D = 128


def copy_bandwidth(nbytes=1 << 30, reps=20):
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return 2 * nbytes / statistics.median(times)  # bytes read + written per second


def time_graph(fns, reps=7):
    """Median device time of one call, from graphs replaying every fn once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3 / len(fns))
    del graph
    return statistics.median(times)


def shape_key(model: str, per_rank: bool) -> str:
    """The shape's name in the full benchmark (bench/common.py SHAPES): flux, flux_rank, wan, wan_rank."""
    return model + ("_rank" if per_rank else "")


def cases(ops, shapes=None):
    """Yields (op, label, make_inputs, run_op, run_ref, bytes_moved); shapes: keys (shape_key) to keep, None: all."""
    for model, S, H, per_rank in SHAPES:
        if shapes is not None and shape_key(model, per_rank) not in shapes:
            continue
        tag = f"{model} S={S} H={H}" + (" (per rank)" if per_rank else "")
        rows = S * H

        def merge_inputs(S=S, H=H):
            p = torch.randn(1, S, H, D, device="cuda").to(BF16)
            s = torch.randn(1, S, H, D, device="cuda").to(BF16)
            lp = torch.randn(1, H, S, device="cuda").permute(0, 2, 1).unsqueeze(-1)  # flash-attn view
            ls = torch.randn(1, H, S, device="cuda").permute(0, 2, 1).unsqueeze(-1)
            return p, lp, s, ls

        yield ("fused_merge_attn_states", tag, merge_inputs,
               lambda a: ops.fused_merge_attn_states(*a),
               lambda a: [t.to(d) for t, d in zip(ref.merge_attn_states(*a, compute_dtype=torch.float32), (BF16, torch.float32))],
               rows * D * 2 * 3 + rows * 4 * 3)

        yield ("fp8_comm_per_token_quant", tag,
               lambda S=S, H=H: (torch.randn(1, S, H, D, device="cuda").to(BF16),),
               lambda a: ops.fp8_comm_per_token_quant(*a),
               lambda a: ref.per_token_quant(*a),
               rows * D * 2 + rows * (D + 2))

        yield ("fp8_comm_per_token_dequant", tag,
               lambda S=S, H=H: (ref.per_token_quant(torch.randn(1, S, H, D, device="cuda").to(BF16)),),
               lambda a: ops.fp8_comm_per_token_dequant(*a),
               lambda a: ref.per_token_dequant(*a),
               rows * (D + 2) + rows * D * 2)

        if per_rank:  # the Ulysses all-to-all pair: send [B, S/W, W, H, D], receive [S, B, H, D+4]
            s_local = S // ULYSSES
            qrows = s_local * ULYSSES * H
            yield ("fp8_comm_qkv_permute_quant", f"{model} x=[1,{s_local},{ULYSSES},{H},{D}]",
                   lambda s_local=s_local, H=H: (torch.randn(1, s_local, ULYSSES, H, D, device="cuda").to(BF16),),
                   lambda a: ops.fp8_comm_qkv_permute_quant(*a),
                   lambda a: ref.qkv_permute_quant(*a),
                   qrows * D * 2 + qrows * (D + 4))
            yield ("fp8_comm_qkv_permute_dequant", f"{model} x=[{s_local * ULYSSES},1,{H},{D + 4}]",
                   lambda s_local=s_local, H=H: (ref.qkv_permute_quant(
                       torch.randn(1, s_local * ULYSSES, 1, H, D, device="cuda").to(BF16))[0],),
                   lambda a: ops.fp8_comm_qkv_permute_dequant(*a),
                   lambda a: ref.qkv_permute_dequant(*a),
                   qrows * (D + 4) + qrows * D * 2)


def run(lib: str, only: str | None = None, shapes=None):
    torch.ops.load_library(lib)
    ops = torch.ops.cache_dit_cuda_ops
    bw = copy_bandwidth()
    results = []
    for op, label, make, run_op, run_ref, nbytes in cases(ops, shapes):
        if only and only not in op:
            continue
        sets = [make() for _ in range(max(2, math.ceil(4 * L2_BYTES / nbytes)))]
        t = time_graph([lambda a=a: run_op(a) for a in sets])
        t_ref = time_graph([lambda a=a: run_ref(a) for a in sets[:2]], reps=3)
        gbps = nbytes / t / 1e9
        results.append({
            "op": op, "shape": label, "time_us": t * 1e6, "bytes": nbytes, "gb_per_s": gbps,
            "copy_gb_per_s": bw / 1e9, "fraction_of_copy": gbps * 1e9 / bw,
            "torch_ref_time_us": t_ref * 1e6, "speedup_vs_torch": t_ref / t,
        })
        del sets
        torch.cuda.empty_cache()
    return {"copy_gb_per_s": bw / 1e9, "cases": results}


def table(res) -> str:
    from bench.report import kernels_table  # one renderer for this script and the full report

    return kernels_table(res)


def environment(lib: str) -> dict:
    """GPU, driver, CUDA, torch and git commit of this run."""
    import subprocess

    def out(*cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):  # no nvidia-smi, or it hangs
            return ""

    return {
        "gpu": torch.cuda.get_device_name(),
        "driver": (out("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader").splitlines() or [""])[0],
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "git_commit": out("git", "-C", str(Path(__file__).resolve().parents[1]), "rev-parse", "--short", "HEAD"),
        "library": lib,
        "timing": "CUDA graphs of back-to-back calls over input sets > 4x L2, median of 7 replays",
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", required=True, help="path of libcache_dit_cuda_ops.so")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--only", help="substring of the op names to run")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("kernels.py: no CUDA device is visible; this benchmark runs on a GPU host", file=sys.stderr)
        sys.exit(2)
    res = run(args.lib, args.only)
    res["device"] = torch.cuda.get_device_name()
    res["env"] = environment(args.lib)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    print(table(res))


if __name__ == "__main__":
    main()
