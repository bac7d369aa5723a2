"""The svdq proxy ops without a GPU or a daemon: output geometry, torch.compile through the fakes, opcheck.

Bad inputs (ValueError naming the value, identical to the kernel library's Meta kernels) are in the one
table tests/python/_bad_inputs.py, run by test_client_fakes.py and test_client_parity.py.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import _client_fixtures  # noqa: F401  (source tree on sys.path)
from test_client_fakes import _recording_backend

from cache_dit_opd import kernels

BF16 = torch.bfloat16
ops = torch.ops.cache_dit_cuda_ops


def _linear(x, qweight, wscales, smooth, proj_down, proj_up, bias):
    """A W4A4 linear as SVDQW4A4Linear runs it: quantize (+ LoRA-down), then the GEMM (+ LoRA-up, bias)."""
    act, ascales, lora_act = kernels.svdq_quantize_w4a4_act_fuse_lora(x, proj_down, smooth, pad_size=256)
    y = kernels.svdq_gemm_w4a4(act, qweight, ascales, wscales, lora_act, proj_up, bias)
    return y[: x.shape[0]]


def _layer(device, m=300, k=384, n=256, r=32, dtype=BF16):
    e = lambda *s, dt=dtype: torch.empty(*s, dtype=dt, device=device)  # noqa: E731
    return (e(m, k), e(n, k // 2, dt=torch.int8), e(k // 64, n), e(k), e(k, r), e(n, r), e(n))


@pytest.mark.parametrize("device_mode", ["meta", "fake-cuda"])
def test_output_geometry(device_mode):
    def run():
        x, qw, ws, smooth, down, up, bias = _layer("meta" if device_mode == "meta" else "cuda", m=300)
        act, ascales, lora_act = kernels.svdq_quantize_w4a4_act_fuse_lora(x, down, smooth)
        assert (act.shape, act.dtype) == ((512, 384), torch.float8_e4m3fn)  # 300 rows padded to 512
        assert (ascales.shape, ascales.dtype) == ((6, 512), BF16)
        assert (lora_act.shape, lora_act.dtype) == ((512, 32), torch.float32)
        y = kernels.svdq_gemm_w4a4(act, qw, ascales, ws, lora_act, up, bias, output_dtype=torch.float32)
        assert (y.shape, y.dtype) == ((512, 256), torch.float32)
        _, _, no_lora = kernels.svdq_quantize_w4a4_act_fuse_lora(x, None, None, pad_size=1)
        assert no_lora.shape == (300, 0)  # rank 0: no dummy LoRA
        q, s = kernels.svdq_quantize_w4a4_wgt(torch.empty(256, 384, dtype=torch.float16, device=x.device))
        assert (q.shape, q.dtype, s.shape, s.dtype) == ((256, 192), torch.int8, (6, 256), torch.float16)
        out = torch.empty(512, 256, dtype=BF16, device=x.device)
        assert ops.svdq_gemm_w4a4.out(act, qw, ascales, ws, lora_act, up, bias, False, 1.0, None, False, 1,
                                      out=out) is out

    if device_mode == "meta":
        run()
    else:
        with FakeTensorMode():
            run()


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_traces_the_linear(dynamic):
    torch._dynamo.reset()
    seen = set()
    f = torch.compile(_linear, fullgraph=True, backend=_recording_backend(seen), dynamic=dynamic)
    for m in (300, 1024):
        y = f(*_layer("meta", m=m))
        assert (tuple(y.shape), y.dtype) == ((m, 256), BF16)
    assert seen == {"svdq_quantize_w4a4_act_fuse_lora", "svdq_gemm_w4a4"}


def test_opcheck_schema_and_fake_on_meta():
    x, qw, ws, smooth, down, up, bias = _layer("meta")
    act, ascales, lora_act = ops.svdq_quantize_w4a4_act_fuse_lora(x, down, smooth, False, False, 256)
    cases = [
        (ops.svdq_quantize_w4a4_act_fuse_lora.default, (x, down, smooth, False, False, 256)),
        (ops.svdq_gemm_w4a4.default, (act, qw, ascales, ws, lora_act, up, bias, False, 1.0, None, False, 1)),
        (ops.svdq_quantize_w4a4_wgt.default, (torch.empty(256, 384, dtype=BF16, device="meta"),)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


# -- through the real daemon (fake device ops: its Meta checks) ------------------------------------------


@pytest.fixture
def client():
    from test_client_session import Client

    d = _client_fixtures.daemon()
    c = Client(d)
    yield c
    d.kill()


def test_the_daemon_serves_the_svdq_out_overloads_with_optional_and_scalar_arguments(client):
    c = client
    m_pad, k, n, r = 256, 384, 256, 32
    x, down, smooth = c.tensor(200, k), c.tensor(k, r), c.tensor(k)  # 200 rows: M_pad 256
    outs = [c.tensor(m_pad, k, dtype=torch.float8_e4m3fn), c.tensor(k // 64, m_pad), c.tensor(m_pad, r, dtype=torch.float32)]
    c.run("svdq_quantize_w4a4_act_fuse_lora", [x, down, smooth, False, False, 256, *outs])
    c.run("svdq_quantize_w4a4_act_fuse_lora", [x, None, None, False, False, 256, outs[0], outs[1],
                                               c.tensor(m_pad, 0, dtype=torch.float32)])
    act, ascales, lora_act = outs
    qw, ws, up, bias = c.tensor(n, k // 2, dtype=torch.int8), c.tensor(k // 64, n), c.tensor(n, r), c.tensor(n)
    out = c.tensor(m_pad, n, dtype=torch.float32)
    c.run("svdq_gemm_w4a4", [act, qw, ascales, ws, lora_act, up, bias, False, 1.0, None, False, 2, out])
    c.run("svdq_gemm_w4a4", [act, qw, ascales, ws, None, None, None, False, 1.0, None, False, 2, out])
    c.run("svdq_quantize_w4a4_wgt", [c.tensor(n, k), qw, ws])
    # The daemon's own checks reject what the client would have: the value named, the session serving on.
    with pytest.raises(ValueError, match="got 0.5"):
        c.run("svdq_gemm_w4a4", [act, qw, ascales, ws, None, None, None, False, 0.5, None, False, 2, out])
    with pytest.raises(ValueError, match=r"must be \[6, 256\]"):
        c.run("svdq_gemm_w4a4", [act, qw, c.tensor(6, 255), ws, None, None, None, False, 1.0, None, False, 2, out])
    c.run("svdq_quantize_w4a4_wgt", [c.tensor(n, k), qw, ws])  # and the session still serves
    assert c.s.stats().session[0].errors == 2
