"""Fakes, validation and torch.compile tracing of the proxy ops, without a GPU or a daemon."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import _bad_inputs as bad
import _client_fixtures  # noqa: F401  (source tree on sys.path)

from cache_dit_opd import _attn, _comm, kernels

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
ops = torch.ops.cache_dit_cuda_ops


def _modes():
    yield "meta", None
    yield "fake-cuda", FakeTensorMode


@pytest.fixture(params=["meta", "fake-cuda"])
def make(request):
    """make(shape, dtype) -> tensor on the meta device, or a fake CUDA tensor."""
    if request.param == "meta":
        yield lambda *shape, dtype, **kw: torch.empty(*shape, dtype=dtype, device="meta", **kw)
    else:
        with FakeTensorMode():
            yield lambda *shape, dtype, **kw: torch.empty(*shape, dtype=dtype, device="cuda", **kw)


# -- shapes and dtypes ----------------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lse_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [1, 64, 80, 128, 256])
def test_merge_fake(make, out_dtype, lse_dtype, d):
    b, s, h = 2, 5, 3
    po = make(b, s, h, d, dtype=torch.float32)
    so = make(b, s, h, d, dtype=out_dtype)
    pl = make(b, h, s, dtype=torch.float32).permute(0, 2, 1).unsqueeze(-1)  # flash-attn LSE, strided
    sl = make(b, s, h, 1, dtype=lse_dtype)
    out, lse = kernels.fused_merge_attn_states(po, pl, so, sl)
    assert out.shape == (b, s, h, d) and out.dtype == out_dtype and out.is_contiguous()
    assert lse.shape == (b, s, h, 1) and lse.dtype == lse_dtype and lse.is_contiguous()
    assert out.device == so.device
    o2, l2 = make(b, s, h, d, dtype=out_dtype), make(b, s, h, 1, dtype=lse_dtype)
    r = ops.fused_merge_attn_states.out(po, pl, so, sl, out=o2, lse=l2)
    assert r[0] is o2 and r[1] is l2


@pytest.mark.parametrize("shape", [(7, 1), (3, 4, 128), (2, 5, 6, 96), (1, 130)])
def test_per_token_fakes(make, shape):
    x = make(*shape, dtype=BF16)
    q = kernels.fp8_comm_per_token_quant(x)
    assert q.shape == (*shape[:-1], shape[-1] + 2) and q.dtype == FP8 and q.is_contiguous()
    y = kernels.fp8_comm_per_token_dequant(q)
    assert y.shape == shape and y.dtype == BF16 and y.is_contiguous()
    buf = make(*q.shape, dtype=FP8)
    assert ops.fp8_comm_per_token_quant.out(x, out=buf) is buf
    buf2 = make(*shape, dtype=BF16)
    assert ops.fp8_comm_per_token_dequant.out(q, out=buf2) is buf2


@pytest.mark.parametrize("b,s,p,n,d", [(1, 16, 4, 8, 128), (2, 7, 3, 5, 64), (3, 2, 1, 1, 1)])
def test_qkv_permute_fakes(make, b, s, p, n, d):
    x = make(b, s, p, n, d, dtype=BF16)
    q = kernels.fp8_comm_qkv_permute_quant(x)
    assert q.shape == (p, s, b, n, d + 4) and q.dtype == FP8 and q.is_contiguous()
    # strided B/S/P: a [B, S, 3P, N, D] slice keeps each [N, D] block contiguous
    wide = make(b, s, 3 * p, n, d, dtype=BF16)
    assert kernels.fp8_comm_qkv_permute_quant(wide[:, :, p:2 * p]).shape == (p, s, b, n, d + 4)
    chunk = q[0]
    y = kernels.fp8_comm_qkv_permute_dequant(chunk)
    assert y.shape == (b, s, n, d) and y.dtype == BF16 and y.is_contiguous()
    buf = make(p, s, b, n, d + 4, dtype=FP8)
    assert ops.fp8_comm_qkv_permute_quant.out(x, out=buf) is buf
    buf2 = make(b, s, n, d, dtype=BF16)
    assert ops.fp8_comm_qkv_permute_dequant.out(chunk, out=buf2) is buf2


# -- validation: ValueError naming the value ----------------------------------------------------------


def _m(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("case", bad.CASES, ids=[c[0] for c in bad.CASES])
def test_validation_raises_value_error_naming_the_value(case):
    kind, message = bad.run(ops, case)
    assert kind == "ValueError", (kind, message)
    assert case[3] in message, message


@pytest.mark.parametrize("case", bad.CASES, ids=[c[0] for c in bad.CASES])
def test_validation_under_fake_tensors(case):
    with FakeTensorMode(allow_non_fake_inputs=True):
        kind, message = bad.run(ops, case)
    assert kind == "ValueError", (kind, message)
    assert case[3] in message, message


def test_proxy_impls_validate_before_allocating(monkeypatch):
    # The CUDA impls share the fakes' checks and must raise before any allocation.
    x16 = _m(4, 8, dtype=torch.float16)
    bad_merge = (_m(2, 3, 8), _m(2, 3, 4, 1), _m(2, 3, 4, 8), _m(2, 3, 4, 1))
    chunk = _m(3, 2, 4, 12, dtype=FP8)

    def boom(*a, **k):
        raise AssertionError("allocated before validating")

    monkeypatch.setattr(torch, "empty", boom)
    with pytest.raises(ValueError, match="torch.float16"):
        _comm._fp8_comm_per_token_quant(x16)
    with pytest.raises(ValueError, match=r"\[2, 3, 8\]"):
        _attn._fused_merge_attn_states(*bad_merge)
    with pytest.raises(ValueError, match="CUDA device"):  # valid inputs, but not on CUDA
        _comm._fp8_comm_qkv_permute_dequant(chunk)


# -- torch.compile ---------------------------------------------------------------------------------------


def _every_op(po, pl, so, sl, x, qkv, chunk):
    out, lse = kernels.fused_merge_attn_states(po, pl, so, sl)
    y = kernels.fp8_comm_per_token_dequant(kernels.fp8_comm_per_token_quant(x))
    q = kernels.fp8_comm_qkv_permute_quant(qkv)
    z = kernels.fp8_comm_qkv_permute_dequant(chunk)
    return out * 2, lse.squeeze(-1), y + 1, q, z


def _inputs(device, b=2, s=8, h=4, d=64, p=3):
    po = torch.empty(b, s, h, d, dtype=BF16, device=device)
    pl = torch.empty(b, h, s, dtype=torch.float32, device=device).permute(0, 2, 1).unsqueeze(-1)
    x = torch.empty(b, s, h * d, dtype=BF16, device=device)
    qkv = torch.empty(b, s, p, h, d, dtype=BF16, device=device)
    chunk = torch.empty(s, b, h, d + 4, dtype=FP8, device=device)
    return po, pl, po.clone(), pl.clone(), x, qkv, chunk


EXPECTED = lambda b=2, s=8, h=4, d=64, p=3: [  # noqa: E731
    ((b, s, h, d), BF16), ((b, s, h), torch.float32), ((b, s, h * d), BF16), ((p, s, b, h, d + 4), FP8),
    ((b, s, h, d), BF16)]

OUR_OPS = {"fused_merge_attn_states", "fp8_comm_per_token_quant", "fp8_comm_per_token_dequant",
           "fp8_comm_qkv_permute_quant", "fp8_comm_qkv_permute_dequant"}


def _recording_backend(seen):
    from torch._dynamo.backends.common import aot_autograd

    def fw(gm, example_inputs):
        for n in gm.graph.nodes:
            if n.op == "call_function" and getattr(n.target, "namespace", None) == "cache_dit_cuda_ops":
                seen.add(n.target._opname)
        return gm.forward

    return aot_autograd(fw_compiler=fw)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_traces_every_op_on_meta(dynamic):
    torch._dynamo.reset()
    seen = set()
    f = torch.compile(_every_op, fullgraph=True, backend=_recording_backend(seen), dynamic=dynamic)
    res = f(*_inputs("meta"))
    assert seen == OUR_OPS
    assert [(tuple(r.shape), r.dtype) for r in res] == EXPECTED()
    res = f(*_inputs("meta", b=1, s=5))
    assert [(tuple(r.shape), r.dtype) for r in res] == EXPECTED(b=1, s=5)


def test_compile_fullgraph_with_fake_cuda_tensors():
    torch._dynamo.reset()
    seen = set()
    with FakeTensorMode():
        args = _inputs("cuda")
        res = torch.compile(_every_op, fullgraph=True, backend=_recording_backend(seen))(*args)
    assert seen == OUR_OPS
    assert [(tuple(r.shape), r.dtype) for r in res] == EXPECTED()
    assert all(r.device.type == "cuda" for r in res)


def test_make_fx_fake_tracing():
    with FakeTensorMode():
        args = _inputs("cuda")
    gm = make_fx(_every_op, tracing_mode="fake")(*args)
    targets = {n.target._opname for n in gm.graph.nodes
               if n.op == "call_function" and getattr(n.target, "namespace", None) == "cache_dit_cuda_ops"}
    assert targets == OUR_OPS


def test_opcheck_schema_and_fake_on_meta():
    # opcheck's schema / fake checks need no CUDA kernel when the inputs are meta tensors.
    po, pl, so, sl, x, qkv, chunk = _inputs("meta")
    cases = [
        (ops.fused_merge_attn_states.default, (po, pl, so, sl)),
        (ops.fp8_comm_per_token_quant.default, (x,)),
        (ops.fp8_comm_per_token_dequant.default, (torch.empty(4, 66, dtype=FP8, device="meta"),)),
        (ops.fp8_comm_qkv_permute_quant.default, (qkv,)),
        (ops.fp8_comm_qkv_permute_dequant.default, (chunk,)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
