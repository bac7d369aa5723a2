"""Clients on PyTorch's expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): their tensors
are runs of virtual-memory chunks the daemon maps from POSIX descriptors (python/cache_dit_opd/_regions.py,
proto/cache_dit_opd/v1/session_memory.h VmmRegionRequest). Every op gives the same bytes as for a client of
the default allocator, through the native engine and without it, with tensors spanning several chunks and
after torch unmapped and mapped chunks again; without descriptors (TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=0) the
error says what to change.

Each client is a child process (its allocator is chosen at CUDA initialization)."""

from __future__ import annotations

import pytest

import _client_fixtures as fx

pytestmark = pytest.mark.gpu

# Every op through the public wrappers on seeded inputs; prints one sha256 per output, then the same again
# after freeing everything, emptying the cache (torch unmaps the chunks) and allocating anew.
EVERY_OP = r"""
import hashlib, sys, torch
sys.path.insert(0, {tests!r})
import _client_fixtures as fx
from cache_dit_opd import kernels

def h(t):
    return hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]

def run():
    g = torch.Generator().manual_seed(0)
    bf16 = torch.bfloat16
    # Wan per rank: [1, 32760, 10, 128] bf16 is 84 MB, several 20 MiB chunks.
    po, so = (torch.randn(1, 32760, 10, 128, generator=g).to("cuda", bf16) for _ in range(2))
    pl, sl = (torch.randn(1, 32760, 10, 1, generator=g).cuda() for _ in range(2))
    out, lse = kernels.fused_merge_attn_states(po, pl, so, sl)
    x = torch.randn(4096, 3, 128, generator=g).to("cuda", bf16)
    q = kernels.fp8_comm_per_token_quant(x)
    d = kernels.fp8_comm_per_token_dequant(q)
    qkv = torch.randn(2, 128, 2, 4, 128, generator=g).to("cuda", bf16)
    pq = kernels.fp8_comm_qkv_permute_quant(qkv)
    pd = kernels.fp8_comm_qkv_permute_dequant(pq[0])
    layer = {{k: (v.cuda() if v is not None else None) for k, v in fx.svdq_layer(g, bf16, 256, 512, 256, 16).items()}}
    act, ascales, lora_act = kernels.svdq_quantize_w4a4_act_fuse_lora(layer["x"], layer["proj_down"],
                                                                     layer["smooth_factor"], pad_size=256)
    y = kernels.svdq_gemm_w4a4(act, layer["qweight"], ascales, layer["wscales"], lora_act, layer["proj_up"],
                               layer["bias"], output_dtype=bf16)
    w, ws = kernels.svdq_quantize_w4a4_wgt(torch.randn(256, 512, generator=g).to("cuda", bf16))
    torch.cuda.synchronize()
    return [h(t) for t in (out, lse, q, d, pq, pd, act, ascales, lora_act, y, w, ws)]

first = run()
torch.cuda.empty_cache()  # the segments shrink: their chunks are unmapped, and mapped again by the next run
second = run()
from cache_dit_opd import _session
s = _session.get_session(0)
runs = sum(1 for r in s.regions.regions() if r.chunks)
print(" ".join(first), "|", " ".join(second), "|", runs, s.native is not None)
"""


def test_every_op_gives_the_same_bytes_on_expandable_segments(gpu_daemon):
    outs = {}
    for conf, native in (("", "1"), ("expandable_segments:True", "1"), ("expandable_segments:True", "0")):
        r = fx.run_python(EVERY_OP.format(tests=fx.HERE), timeout=300, PYTORCH_CUDA_ALLOC_CONF=conf or None,
                          CACHE_DIT_OPD_ADDRESS=gpu_daemon.address, CACHE_DIT_OPD_NATIVE=native)
        assert r.returncode == 0, r.stdout + r.stderr
        first, second, tail = r.stdout.strip().split("|")
        runs, engine = tail.split()
        outs[(conf, native)] = first.split(), second.split(), int(runs), engine == "True"
    default, on_segments, without_engine = outs.values()
    assert default[0] == default[1] == on_segments[0] == on_segments[1] == without_engine[0] == without_engine[1]
    assert default[2] == 0 and on_segments[2] > 0 and without_engine[2] > 0  # regions of chunk runs
    assert (default[3], on_segments[3], without_engine[3]) == (True, True, False)


def test_segments_without_descriptors_get_a_clear_error(gpu_daemon):
    code = """
import torch
from cache_dit_opd import kernels
x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
try:
    kernels.fp8_comm_per_token_quant(x)
    print("NO ERROR")
except RuntimeError as e:
    print("ERR", e)
"""
    r = fx.run_python(code, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True", TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC="0",
                      CACHE_DIT_OPD_ADDRESS=gpu_daemon.address)
    assert "ERR" in r.stdout and "gives no POSIX descriptor" in r.stdout and "expandable_segments:False" in r.stdout, \
        r.stdout + r.stderr
