"""One Ulysses attention step of a Wan-14B-like layer, its all-to-alls in FP8 records served by cache-dit-opd.

Ulysses sequence parallelism over W ranks (one process per GPU): each rank holds
S/W tokens of every head, swaps them with an all-to-all for all S tokens of H/W
heads, runs attention, and swaps the output back. cache-dit's FP8 path
(upstream notes section 6.1) sends Q and V as FP8 records
(`fp8_comm_qkv_permute_quant` -> all_to_all -> `fp8_comm_qkv_permute_dequant`),
K in BF16 (softmax precision), and O as per-token records
(`fp8_comm_per_token_quant` -> all_to_all -> `fp8_comm_per_token_dequant`): half
the bytes of BF16 on the wire. Attention runs over the keys in two blocks whose
partial results `fused_merge_attn_states` merges, as ring attention inside
Ulysses (USP) does, so every op of the comm and attn families is in the step.

Configurations, each in processes of its own (one op provider per process):

    bf16      BF16 all-to-alls, the merge from the daemon   (a)
    fp8       FP8 all-to-alls, every op from the daemon     (b)
    fp8-lib   FP8 all-to-alls, every op from the kernel library loaded in-process (c)

With --device cpu (gloo) bf16 and fp8 take every op from kernels/reference.py
(plain torch): that checks the step's layouts, not the kernels.

Each is compared against a single-device reference (attention over all heads
and the whole sequence in one call, same inputs), and timed per step (CUDA
events, median over --steps after --warmup).

On two GPUs (start one daemon per GPU first; each client finds its GPU's daemon
by UUID):

    build/server/cache-dit-opd --device 0 &
    build/server/cache-dit-opd --device 1 &
    NCCL_NVLS_ENABLE=0 python examples/ulysses_fp8.py --lib build/kernels/libcache_dit_cuda_ops.so

On CPUs (checks the layouts of the step, not the kernels):

    python examples/ulysses_fp8.py --device cpu --seq 256 --heads 8 --dim 32

Prints a Markdown table; --json writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ("bf16", "fp8", "fp8-lib")
SEED = 20261204


# -- op providers --------------------------------------------------------------------------


class Ops(NamedTuple):
    """The five ops of the step, from one provider."""

    qkv_quant: Callable
    qkv_dequant: Callable
    token_quant: Callable
    token_dequant: Callable
    merge: Callable  # (prev_out, prev_lse, suff_out, suff_lse) -> (out, lse)


def reference_ops() -> Ops:
    """kernels/reference.py: the ops' semantics in plain torch, any device."""
    sys.path.insert(0, str(REPO / "kernels"))
    import reference as ref  # noqa: PLC0415  (kernels/ is not a package)

    def merge(prev_out, prev_lse, suff_out, suff_lse):
        out, lse = ref.merge_attn_states(prev_out, prev_lse, suff_out, suff_lse, torch.float32)
        return out.to(prev_out.dtype), lse.to(prev_lse.dtype)

    return Ops(ref.qkv_permute_quant, ref.qkv_permute_dequant, ref.per_token_quant, ref.per_token_dequant, merge)


def torch_ops(lib: str | None) -> Ops:
    """torch.ops.cache_dit_cuda_ops, defined by the kernel library ``lib`` (the kernels in this process) or, without
    it, by the daemon's client (proxy ops: the calls go to this GPU's daemon)."""
    if lib:
        torch.ops.load_library(lib)
    else:
        import cache_dit_opd  # noqa: F401, PLC0415
    o = torch.ops.cache_dit_cuda_ops
    return Ops(o.fp8_comm_qkv_permute_quant, o.fp8_comm_qkv_permute_dequant, o.fp8_comm_per_token_quant,
               o.fp8_comm_per_token_dequant, o.fused_merge_attn_states)


# -- the step ------------------------------------------------------------------------------


def attention(q, k, v):
    """[B, S, N, D] q/k/v -> out [B, S, N, D] (q's dtype), lse [B, S, N, 1] fp32."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt)[:2]
    return out.transpose(1, 2), lse.transpose(1, 2).unsqueeze(-1)


def blocked_attention(q, k, v, ops):
    """Attention over the keys in two blocks, merged from their (out, lse): ring attention's inner step."""
    half = k.shape[1] // 2
    prev = attention(q, k[:, :half], v[:, :half])
    suff = attention(q, k[:, half:], v[:, half:])
    return ops.merge(prev[0], prev[1], suff[0], suff[1])[0]


def all_to_all(x: torch.Tensor) -> torch.Tensor:
    """Equal-split all_to_all_single over dim 0, as bytes (NCCL and gloo carry uint8 whatever the dtype)."""
    x = x.contiguous()  # dim 0 outermost in memory: empty_like would keep a permuted order
    out = torch.empty_like(x)
    dist.all_to_all_single(out.view(torch.uint8), x.view(torch.uint8))
    return out


def heads_to_sequence_bf16(x, world):
    """[B, S_l, H, D] -> [B, S, H/W, D]: rank p gets head group p of every rank's tokens."""
    b, s_l, h, d = x.shape
    send = x.reshape(b, s_l, world, h // world, d).permute(2, 1, 0, 3, 4)  # [W, S_l, B, N, D]
    recv = all_to_all(send)  # [W (source rank = sequence block), S_l, B, N, D]
    return recv.reshape(world * s_l, b, h // world, d).permute(1, 0, 2, 3)


def heads_to_sequence_fp8(x, world, ops):
    """The same through FP8 records: [W, S_l, B, N, D+4] out, [S, B, N, D+4] in."""
    b, s_l, h, d = x.shape
    records = ops.qkv_quant(x.reshape(b, s_l, world, h // world, d))
    recv = all_to_all(records)
    return ops.qkv_dequant(recv.reshape(world * s_l, b, h // world, d + 4))


def sequence_to_heads(o, world, ops, fp8):
    """[B, S, N, D] -> [B, S_l, W*N, D]: the output's way back (per-token FP8 records when fp8)."""
    b, s, n, d = o.shape
    send = o.reshape(b, world, s // world, n, d).permute(1, 3, 0, 2, 4).contiguous()  # [W, N, B, S_l, D]
    if fp8:
        recv = ops.token_dequant(all_to_all(ops.token_quant(send)))
    else:
        recv = all_to_all(send)
    # [W (source rank = head group), N, B, S_l, D] -> [B, S_l, W*N, D]
    return recv.flatten(0, 1).permute(1, 2, 0, 3).contiguous()


def ulysses_step(q, k, v, world, ops, fp8):
    """One attention step on this rank's [B, S_l, H, D] shards; returns its [B, S_l, H, D] output."""
    if fp8:
        qs = heads_to_sequence_fp8(q, world, ops)
        vs = heads_to_sequence_fp8(v, world, ops)
    else:
        qs = heads_to_sequence_bf16(q, world)
        vs = heads_to_sequence_bf16(v, world)
    ks = heads_to_sequence_bf16(k, world)  # K stays BF16 (upstream: softmax precision)
    return sequence_to_heads(blocked_attention(qs, ks, vs, ops), world, ops, fp8)


def wire_bytes(b, s_l, h, d, world, fp8) -> int:
    """Bytes one rank sends to the others per step (its own block stays local)."""
    rows = b * s_l * h * (world - 1) // world  # (token, head) rows that leave this rank, per tensor
    if not fp8:
        return 4 * rows * d * 2
    return rows * (2 * (d + 4) + d * 2 + (d + 2))  # Q and V records, K bf16, O records


# -- one configuration, one process per rank -----------------------------------------------


def inputs(args, device):
    """The whole Q, K, V, the same on every rank (one seeded generator per device type)."""
    g = torch.Generator(device=device).manual_seed(SEED)
    shape = (args.batch, args.seq, args.heads, args.dim)
    return [torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16) for _ in range(3)]


def rank_main(rank, args, config, workdir, result_path):
    world = args.world
    on_gpu = args.device == "cuda"
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the GPU host's rule)
    if on_gpu:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    # Rendezvous through a file of this configuration's own: no port to pick (and lose to another process).
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"file://{workdir}/{config}.rendezvous",
                            rank=rank, world_size=world, **({"device_id": device} if on_gpu else {}))
    try:
        provider = ("library" if config == "fp8-lib" else "daemon") if on_gpu else "reference"
        ops = reference_ops() if provider == "reference" else torch_ops(args.lib if provider == "library" else None)
        fp8 = config != "bf16"
        q, k, v = inputs(args, device)
        s_l = args.seq // world
        mine = slice(rank * s_l, (rank + 1) * s_l)
        shards = [t[:, mine].contiguous() for t in (q, k, v)]
        out = ulysses_step(*shards, world, ops, fp8)
        expected = attention(q, k, v)[0][:, mine].float()
        del q, k, v
        diff = out.float() - expected
        err = torch.stack([diff.abs().max(), diff.square().sum(), expected.square().sum()])
        dist.all_reduce(err[:1], op=dist.ReduceOp.MAX)
        dist.all_reduce(err[1:])
        times = []
        for i in range(args.warmup + args.steps):
            dist.barrier()
            if on_gpu:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                ulysses_step(*shards, world, ops, fp8)
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                ulysses_step(*shards, world, ops, fp8)
                ms = (time.perf_counter() - t0) * 1e3
            if i >= args.warmup:
                times.append(ms)
        slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0:
            Path(result_path).write_text(json.dumps({
                "config": config,
                "ops": provider,
                "max_abs_err": err[0].item(),
                "rel_l2": (err[1] / err[2]).sqrt().item(),
                "step_ms": slowest.item(),
                "wire_bytes_per_rank": wire_bytes(args.batch, s_l, args.heads, args.dim, world, fp8),
            }))
    finally:
        dist.destroy_process_group()


def run_config(args, config, workdir: Path) -> dict:
    path = workdir / f"{config}.json"
    mp.spawn(rank_main, args=(args, config, str(workdir), str(path)), nprocs=args.world, join=True)
    return json.loads(path.read_text())


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--world", type=int, default=2, help="ranks (one process and GPU each)")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, help="default: bf16 fp8, and fp8-lib with --lib")
    p.add_argument("--lib", help="libcache_dit_cuda_ops.so for fp8-lib (the kernels in-process)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=32760, help="total tokens (Wan2.1 14B 480p x 81 frames)")
    p.add_argument("--heads", type=int, default=40)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.configs is None:
        args.configs = ["bf16", "fp8"] + (["fp8-lib"] if args.lib else [])
    if args.device == "cpu" and "fp8-lib" in args.configs:
        p.error("fp8-lib needs a GPU (on cpu, bf16 and fp8 take the ops of kernels/reference.py)")
    if "fp8-lib" in args.configs and not args.lib:
        p.error("fp8-lib needs --lib PATH (build/kernels/libcache_dit_cuda_ops.so)")
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        p.error(f"--world {args.world} needs {args.world} GPUs, this process sees {torch.cuda.device_count()}")
    if args.seq % args.world or args.heads % args.world or (args.seq // args.world) % 2:
        p.error(f"--seq ({args.seq}) and --heads ({args.heads}) must divide by --world ({args.world}), "
                "and the keys split into two blocks")
    if args.dim % 4:
        p.error(f"--dim ({args.dim}) must be a multiple of 4 (the FP8 records' fp32 scale)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_config(args, c, Path(tmp)) for c in args.configs]
    bf16 = next((r for r in results if r["config"] == "bf16"), None)
    print(f"Ulysses step, {args.world} ranks on {args.device}: B={args.batch} S={args.seq} H={args.heads} "
          f"D={args.dim} bf16; error against one attention call over everything; time: median of {args.steps} "
          f"steps, slowest rank\n")
    print("| config | ops | max abs error | rel. L2 error | step ms | vs bf16 | bytes sent per rank |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        vs = f"{bf16['step_ms'] / r['step_ms']:.2f}x" if bf16 else "-"
        print(f"| {r['config']} | {r['ops']} | {r['max_abs_err']:.4f} | {r['rel_l2']:.5f} | {r['step_ms']:.3f} | "
              f"{vs} | {r['wire_bytes_per_rank']:,} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
