"""Inputs, outputs and one zero-argument call of each op's ``.out`` overload (or of its functional overload,
which allocates its outputs) at a benchmark shape.

Child-side (imports torch). ``ops`` is ``torch.ops.cache_dit_cuda_ops`` of the
calling process: the kernel library's ops in an in-process child, the
client's proxies in a client child. The same code builds the same tensors in
both, so the figures differ only by how the call reaches the kernel.

Layouts follow the models: the merge reads flash-attn's [B, H, S] LSE in place
(a permuted view); the QKV pair is Ulysses-4's all-to-all (send
[B, S/4, 4, H, D], receive [S, B, H, D+4]). Records for the dequant ops come
from the PyTorch reference (kernels/reference.py), so no op runs while the
inputs are built.
"""

from __future__ import annotations

import sys
from typing import Callable

from bench.common import D, DEQUANT, MERGE, OPS, QKV_DEQUANT, QKV_QUANT, QUANT, REPO, SHAPES, ULYSSES

MIN_LARGE_ALLOC = 10 << 20  # torch's caching allocator gives a request this large its own segment
SEGMENT_ROUND = 2 << 20


def _reference():
    if str(REPO / "kernels") not in sys.path:
        sys.path.insert(0, str(REPO / "kernels"))
    import reference

    return reference


def _builders(ops, s: int, h: int, dev: str, functional: bool) -> dict[str, Callable[[], Callable[[], object]]]:
    import torch

    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    ref = _reference()

    def rnd(*shape):
        return torch.randn(*shape, device=dev).to(bf16)

    def merge():
        po, so = rnd(1, s, h, D), rnd(1, s, h, D)
        pl = torch.randn(1, h, s, device=dev).permute(0, 2, 1).unsqueeze(-1)  # flash-attn LSE view
        sl = torch.randn(1, h, s, device=dev).permute(0, 2, 1).unsqueeze(-1)
        if functional:
            return lambda: ops.fused_merge_attn_states(po, pl, so, sl)
        out, lse = torch.empty_like(so), torch.empty(1, s, h, 1, device=dev)
        return lambda: ops.fused_merge_attn_states.out(po, pl, so, sl, out=out, lse=lse)

    def quant():
        x = rnd(1, s, h, D)
        if functional:
            return lambda: ops.fp8_comm_per_token_quant(x)
        q = torch.empty(1, s, h, D + 2, device=dev, dtype=fp8)
        return lambda: ops.fp8_comm_per_token_quant.out(x, out=q)

    def dequant():
        rec = ref.per_token_quant(rnd(1, s, h, D))
        if functional:
            return lambda: ops.fp8_comm_per_token_dequant(rec)
        y = torch.empty(1, s, h, D, device=dev, dtype=bf16)
        return lambda: ops.fp8_comm_per_token_dequant.out(rec, out=y)

    def qkv_quant():
        x = rnd(1, s // ULYSSES, ULYSSES, h, D)
        if functional:
            return lambda: ops.fp8_comm_qkv_permute_quant(x)
        q = torch.empty(ULYSSES, s // ULYSSES, 1, h, D + 4, device=dev, dtype=fp8)
        return lambda: ops.fp8_comm_qkv_permute_quant.out(x, out=q)

    def qkv_dequant():
        rec = ref.qkv_permute_quant(rnd(1, s, 1, h, D))[0]  # [S, 1, H, D+4]
        if functional:
            return lambda: ops.fp8_comm_qkv_permute_dequant(rec)
        y = torch.empty(1, s, h, D, device=dev, dtype=bf16)
        return lambda: ops.fp8_comm_qkv_permute_dequant.out(rec, out=y)

    return {MERGE: merge, QUANT: quant, DEQUANT: dequant, QKV_QUANT: qkv_quant, QKV_DEQUANT: qkv_dequant}


def make_calls(ops, shape: str, only=None, device: str = "cuda", functional: bool = False) -> dict[str, object]:
    """op -> zero-argument callable, or the exception that building its tensors raised (that op only fails).

    ``device="meta"`` builds the same layouts without memory (to check them against the ops' schemas);
    ``functional`` calls the functional overloads (outputs allocated per call) instead of ``.out``.
    """
    _, s, h, _ = SHAPES[shape]
    builders = _builders(ops, s, h, device, functional)
    calls: dict[str, object] = {}
    for op in OPS:
        if only is not None and op not in only:
            continue
        try:
            calls[op] = builders[op]()
        except Exception as e:  # noqa: BLE001  (e.g. out of memory: recorded for this op)
            calls[op] = e
    return calls


def measure_each_op(ops, shapes, measure, functional: bool = False) -> dict:
    """{shape: {op: measure(call)}} for every op at each shape in turn; an op whose tensors could not be
    built or whose measurement raised records {"error": ...} and the others are still measured."""
    from bench.common import error_text

    out = {}
    for shape in shapes:
        calls = make_calls(ops, shape, functional=functional)
        out[shape] = {}
        for op, f in calls.items():
            try:
                if isinstance(f, Exception):
                    raise f
                out[shape][op] = measure(f)
            except Exception as e:  # noqa: BLE001  (this op fails; the others are measured)
                out[shape][op] = {"error": error_text(e)}
        del calls
        free_memory()  # the next shape's tensors do not stack on these
    return out


def own_segment(shape: tuple, dtype):
    """A tensor alone in a fresh caching-allocator segment (its base is the segment's base).

    Requests of 10 MiB and more get a segment of exactly their size rounded to
    2 MiB, so no later small tensor shares it and no earlier segment's free tail
    can hold it: after ``torch.cuda.empty_cache()`` the next one is a new
    ``cudaMalloc`` (a new allocation for the client to register).
    """
    import torch

    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    size = max(nbytes, MIN_LARGE_ALLOC)
    size = (size + SEGMENT_ROUND - 1) // SEGMENT_ROUND * SEGMENT_ROUND
    buf = torch.empty(size, dtype=torch.uint8, device="cuda")
    return buf[:nbytes].view(dtype).view(shape)


def free_memory() -> None:
    """Drops the previous shape's tensors before the next are built (they would stack up otherwise)."""
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()
