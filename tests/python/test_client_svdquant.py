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


# -- the GPU suite's svdq cases and checks, on the CPU ---------------------------------------------------


def _emulated(op, args):
    """What the kernels return for a case, from the references (the GPU suite's checks must accept it)."""
    import _client_fixtures as fx

    if op == "svdq_quantize_w4a4_act_fuse_lora":
        x, down, smooth, _, _, pad = args
        return fx.svdq_act_outputs(x, smooth, down, pad)
    if op == "svdq_quantize_w4a4_wgt":
        q, s = fx.sq.quantize_weight(args[0], args[0].dtype)
        return fx.sq.pack_qweight(q), fx.sq.pack_wscales(s)
    from test_client_gpu import SVDQ_OUT_DTYPES

    acc, lora, _ = fx.svdq_gemm_reference(*args[:7])
    y = acc if lora is None else (acc.double() + lora).float()
    return y.to(SVDQ_OUT_DTYPES[args[11]])


def test_the_gpu_suites_svdq_cases_and_checks_on_the_cpu():
    """tests/python/test_client_gpu.py's svdq cases built on the CPU (as its baseline child builds them, twice
    the same bytes), and its reference checks: they accept the references' results and reject one changed
    value in every output they check."""
    import _client_fixtures as fx
    from test_client_gpu import SVDQ_CHECKS, gpu_cases

    cases = [(op, a) for op, a in gpu_cases("cpu") if op in SVDQ_CHECKS]
    again = [(op, a) for op, a in gpu_cases("cpu") if op in SVDQ_CHECKS]
    ops = [op for op, _ in cases]
    assert ops.count("svdq_quantize_w4a4_act_fuse_lora") == 4 and ops.count("svdq_gemm_w4a4") == 10
    assert ops.count("svdq_quantize_w4a4_wgt") == 2 and ops[-2:] == ["svdq_quantize_w4a4_act_fuse_lora"] * 2
    for (op, a), (_, b) in zip(cases, again):
        for u, v in zip(a, b):
            if isinstance(u, torch.Tensor):
                assert u.dtype == v.dtype and torch.equal(u.view(torch.uint8), v.view(torch.uint8)), op
    out_ids = [a[11] for op, a in cases if op == "svdq_gemm_w4a4" and a[5] is not None]
    assert sorted(out_ids) == [0, 0, 1, 1, 2, 2]

    def rejects(op, args, got):
        with pytest.raises(AssertionError):
            SVDQ_CHECKS[op](args, got)

    for op, args in cases:
        got = _emulated(op, args)
        SVDQ_CHECKS[op](args, got)
        if op == "svdq_gemm_w4a4":
            m = args[0].shape[0] // 2
            bad = got.clone()
            bad[m, 3] = bad[m, 3] * (1 + 2 ** -5)  # 3%: far outside every bound
            rejects(op, args, bad)
            if args[5] is None:  # bit-exact: one ulp is caught
                bad = got.clone()
                bad.view(torch.uint8)[m, 0] ^= 1
                rejects(op, args, bad)
            continue
        for j in range(len(got)):
            if got[j].numel() == 0:
                continue
            bad = [t.clone() for t in got]
            flat = bad[j].view(-1)
            if bad[j].dtype == torch.float32:  # lora_act: a value off by 0.02 (its bound: K fp32 roundings, ~2e-3)
                flat[flat.numel() // 3] += 0.02
            else:
                flat.view(torch.uint8)[flat.numel() // 3] ^= 1
            rejects(op, args, tuple(bad))
        if op == "svdq_quantize_w4a4_act_fuse_lora" and args[1] is not None:
            bad = list(got)
            bad[2] = bad[2].clone()
            bad[2][-1, 0] = 1e-3  # a pad row of lora_act that is not 0
            rejects(op, args, tuple(bad))
    # the layers' values are realistic: the W4A4 GEMM with LoRA tracks the float linear it was built from
    layer = fx.svdq_layer(torch.Generator().manual_seed(0), torch.bfloat16, 300, 384, 256, 32)
    t = fx.sq.unpack_linear({k: v for k, v in layer.items() if k != "x" and v is not None})
    x = layer["x"]
    w_hat = t["q_w"].float() * t["wscales"].float().repeat_interleave(64, dim=1) + t["up"].float() @ (
        t["down"].float() * t["smooth"].float())
    want = (x.float() / t["smooth"].float()) @ w_hat.t() + t["bias"].float()
    act, ascales, lora_act = fx.svdq_act_outputs(x, layer["smooth_factor"], layer["proj_down"], 256)
    acc, lora, _ = fx.svdq_gemm_reference(act, layer["qweight"], ascales, layer["wscales"], lora_act,
                                          layer["proj_up"], layer["bias"])
    y = (acc.double() + lora)[:300]
    assert torch.nn.functional.cosine_similarity(y.flatten(), want.double().flatten(), dim=0) > 0.99
    assert (y - want).norm() / want.norm() < 0.1
    # and the reference from the GEMM's operands is sq.linear_faithful's (no LoRA: bit for bit)
    faithful = fx.sq.linear_faithful(x, t["q_w"], t["wscales"], t["smooth"], bias=t["bias"], out_dtype=torch.float32)
    assert torch.equal(acc[:300], faithful)


def test_the_bench_svdq_case_builds_what_the_ops_take():
    """bench/svdq.py's tensors for the orchestrated svdq case (bench/svdq_case.py): seeded (two builds, the
    same bytes), and its two .out calls accepted by the ops' checks (on meta, through the proxies' fakes)."""
    from bench import svdq, svdq_case
    from bench.worker import main as worker_main  # noqa: F401  (importable without a GPU)

    m, k, n = 300, 256, 128  # M not a multiple of the pad: M_pad 512
    a, b = svdq.inputs(m, k, n, device="cpu"), svdq.inputs(m, k, n, device="cpu")
    for name in ("x", "qweight", "wscales", "smooth", "down", "up", "bias"):
        assert torch.equal(a[name], b[name]), name
    assert a["act"].shape == (512, k) and a["out"].shape == (512, n) and a["lora_act"].shape == (512, svdq.RANK)
    for t in (a, b):
        for name in svdq_case.OUTPUTS:
            t[name].view(-1).view(torch.uint8).zero_()
    assert svdq_case.digest(a) == svdq_case.digest(b)
    meta = {key: v.to("meta") for key, v in a.items()}
    quant, gemm = svdq.linear_calls(ops, meta)
    quant()
    gemm()
    meta["out"] = torch.empty(m, n, dtype=BF16, device="meta")  # the checks do look: M rows, not M_pad
    with pytest.raises(ValueError, match=r"output out must have shape \[512, 128\]"):
        svdq.linear_calls(ops, meta)[1]()
    assert [s for s, _, _ in svdq.shapes(True)] == [4608] * 3 and len(svdq.shapes(False)) == 7
    assert svdq_case.params(True)["quick"] and not svdq_case.params(False)["quick"]
