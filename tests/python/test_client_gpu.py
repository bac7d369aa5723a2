"""GPU suite of the Python client end to end: the real daemon, real CUDA IPC, real stream semaphores.

Runs where a CUDA device exists and the daemon is built (``$CACHE_DIT_OPD_BUILD_DIR/server/cache-dit-opd``,
default ``<repo>/build``; extra daemon flags: CACHE_DIT_OPD_DAEMON_ARGS), started on a private socket the
client is pointed at with CACHE_DIT_OPD_ADDRESS. Calls take whatever path the client picks (the native
engine's ring when its library is built, host-ordered gRPC calls otherwise). The in-process baseline loads
``$CACHE_DIT_OPD_BUILD_DIR/kernels/libcache_dit_cuda_ops.so`` in a separate process, never in this one.
"""

import hashlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import _client_fixtures as fx

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

import cache_dit_opd  # noqa: E402
from cache_dit_opd import _session, _wire, kernels  # noqa: E402

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def gpu_cases(device="cuda"):
    """Deterministic inputs for every op, with the layouts and edge values the contract names.

    Imported by child processes too (in-process baseline, worker clients), so
    every process builds bitwise the same tensors with the same strides.
    """
    g = torch.Generator().manual_seed(1234)

    def rn(*shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    cases = []
    for dtype, lse_dtype, d in ((BF16, torch.float32, 128), (torch.float16, torch.float32, 72),
                                (torch.float32, torch.float32, 64), (BF16, BF16, 1), (BF16, torch.float32, 256)):
        b, s, h = 2, 33, 5
        po, so = rn(b, s, h, d, dtype=dtype), rn(b, s, h, d, dtype=dtype)
        # flash-attn LSE: [B, H, S] permuted to [B, S, H] and unsqueezed: strided, read in place
        pl = rn(b, h, s, dtype=lse_dtype, scale=4).permute(0, 2, 1).unsqueeze(-1)
        sl = rn(b, s, h, 1, dtype=lse_dtype, scale=4)
        inf = float("inf")
        plb, slb = pl.squeeze(-1).permute(0, 2, 1), sl  # write edge values through the base layouts
        plb[0, 0, 0], slb[0, 0, 0] = inf, 1.0  # +inf counts as empty
        plb[0, 1, 0], slb[0, 0, 1] = -inf, 2.0  # one side empty
        plb[0, 2, 0], slb[0, 0, 2] = -inf, -inf  # both empty
        plb[0, 3, 0], slb[0, 0, 3] = inf, inf  # both +inf: both empty
        plb[0, 4, 0], slb[0, 0, 4] = 150.0, 10.0  # gap of 140
        plb[1, 0, 0], slb[1, 0, 0] = 10.0, 150.0
        plb[1, 1, 0], slb[1, 0, 1] = float("nan"), 0.0  # NaN propagates
        cases.append(("fused_merge_attn_states", (po, pl, so, sl)))
    for shape in ((64, 128), (3, 17, 72), (9, 1), (2, 130)):
        x = rn(*shape, dtype=BF16, scale=3)
        x.view(-1, shape[-1])[0].zero_()  # an all-zero row: amax floor
        cases.append(("fp8_comm_per_token_quant", (x,)))
        cases.append(("fp8_comm_per_token_dequant", (fx.ref.per_token_quant(x),)))
    for (b, s, p, n, d), stride_p in (((1, 16, 4, 8, 128), False), ((2, 7, 3, 5, 64), True), ((2, 3, 2, 1, 1), False)):
        if stride_p:  # B/S/P strided: a slice of a wider P axis, each [N, D] block contiguous
            x = rn(b, s, 3 * p, n, d, dtype=BF16, scale=2)[:, :, p:2 * p]
        else:
            x = rn(b, s, p, n, d, dtype=BF16, scale=2)
        cases.append(("fp8_comm_qkv_permute_quant", (x,)))
        cases.append(("fp8_comm_qkv_permute_dequant", (fx.ref.qkv_permute_quant(x.contiguous())[p - 1],)))
    # svdq (W4A4): a layer's packed checkpoint tensors from random float weights (fx.svdq_layer). The GEMM
    # takes the activation quantizer's outputs for that layer (fx.svdq_act_outputs: the bytes the quantizer
    # writes, itself a case here), with LoRA-up and bias in each output dtype (out_dtype_id 0 float16,
    # 1 bfloat16, 2 float32: kernels/svdq/svdq.h), and without either. M_pad = 512 (8 | M_pad) takes the
    # tensor-core GEMM on sm_90a, M_pad = 300 (pad_size 1) the portable one; both sides take the same.
    rank0 = []
    for dtype in (BF16, torch.float16):
        m, k, n, r, pad = 300, 384, 256, 32, 256
        layer = fx.svdq_layer(g, dtype, m, k, n, r)
        x, smooth, down = layer["x"], layer["smooth_factor"], layer["proj_down"]
        cases.append(("svdq_quantize_w4a4_act_fuse_lora",
                      (x.to(device), down.to(device), smooth.to(device), False, False, pad)))
        act, ascales, lora_act = (t.to(device) for t in fx.svdq_act_outputs(x, smooth, down, pad))
        qweight, wscales, up, bias = (layer[key].to(device) for key in ("qweight", "wscales", "proj_up", "bias"))
        for out_dtype_id in (0, 1, 2):
            cases.append(("svdq_gemm_w4a4", (act, qweight, ascales, wscales, lora_act, up, bias, False, 1.0, None,
                                             False, out_dtype_id)))
        cases.append(("svdq_gemm_w4a4", (act, qweight, ascales, wscales, None, None, None, False, 1.0, None, False,
                                         2)))
        act1, ascales1, _ = (t.to(device) for t in fx.svdq_act_outputs(x, smooth, None, 1))
        cases.append(("svdq_gemm_w4a4", (act1, qweight, ascales1, wscales, None, None, None, False, 1.0, None,
                                         False, 1 if dtype == BF16 else 0)))
        w = rn(n, k, dtype=dtype, scale=0.05)
        w[0, :64] = 0  # an all-zero group: scale 1, q 0
        cases.append(("svdq_quantize_w4a4_wgt", (w,)))
        rank0.append(("svdq_quantize_w4a4_act_fuse_lora", (x.to(device), None, None, False, False, 128)))
    # Rank 0 (no LoRA, no smoothing: lora_act_out is [M_pad, 0]) last, so that what fails there leaves the
    # others checked.
    cases += rank0
    return cases


SVDQ_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # out_dtype_id 0, 1, 2 (kernels/svdq/svdq.h)


def _kernels_call(op, args):
    """The op through the public surface cache_dit_opd.kernels, on a case's schema arguments: the GEMM's
    wrapper takes output_dtype where the schema takes out_dtype_id."""
    if op == "svdq_gemm_w4a4":
        *rest, out_dtype_id = args
        return kernels.svdq_gemm_w4a4(*rest, output_dtype=SVDQ_OUT_DTYPES[out_dtype_id])
    return getattr(kernels, op)(*args)


def _outputs_bytes(outs):
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    return [o.detach().contiguous().view(torch.uint8).cpu() for o in outs]


def _digest(results) -> str:
    h = hashlib.sha256()
    for outs in results:
        for o in outs:
            h.update(o.numpy().tobytes())
    return h.hexdigest()


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon():
    _session.close_all()
    d = fx.daemon(None, fake=False)
    old = os.environ.get("CACHE_DIT_OPD_ADDRESS")
    os.environ["CACHE_DIT_OPD_ADDRESS"] = d.address
    yield d
    try:
        _session.close_all(raise_errors=True)
    finally:
        d.stop()
        if old is None:
            os.environ.pop("CACHE_DIT_OPD_ADDRESS", None)
        else:
            os.environ["CACHE_DIT_OPD_ADDRESS"] = old
        shutil.rmtree(d.workdir, ignore_errors=True)


def _run_daemon_cases():
    results = []
    for op, args in gpu_cases():
        results.append(_outputs_bytes(_kernels_call(op, args)))
    torch.cuda.synchronize()
    return results


BASELINE_RUN = r"""
import sys, json, torch
sys.path.insert(0, {tests!r})
torch.ops.load_library({lib!r})
import _client_fixtures as fx
from test_client_gpu_cases import gpu_cases, outputs_bytes
res = []
for op, args in gpu_cases():
    res.append(outputs_bytes(getattr(torch.ops.cache_dit_cuda_ops, op)(*args)))
torch.cuda.synchronize()
torch.save(res, {out!r})
print("baseline-ok")
"""


def _baseline(tmp_path):
    """Every case computed in-process by the kernel library, in a child process."""
    lib = fx.kernel_library_path()
    if not os.path.exists(lib):
        pytest.skip(f"kernel library not built: {lib}")
    # The child must not import cache_dit_opd (it would define the same ops): copy the case builder alone.
    helper = tmp_path / "test_client_gpu_cases.py"
    import inspect

    helper.write_text(
        "import torch\nimport _client_fixtures as fx\nBF16, FP8 = torch.bfloat16, torch.float8_e4m3fn\n"
        + inspect.getsource(gpu_cases) + "\n\ndef outputs_bytes(outs):\n"
        + "    outs = outs if isinstance(outs, (tuple, list)) else (outs,)\n"
        + "    return [o.detach().contiguous().view(torch.uint8).cpu() for o in outs]\n")
    out = tmp_path / "baseline.pt"
    code = BASELINE_RUN.format(tests=str(tmp_path), lib=lib, out=str(out))
    env = fx.subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), fx.HERE])  # no python/ on the path: no client
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "baseline-ok" in r.stdout, r.stdout + r.stderr
    return torch.load(out)


# -- correctness -----------------------------------------------------------------------------------


def test_available_and_info(daemon):
    assert kernels.attn_extension_is_available() and kernels.comm_extension_is_available()
    assert kernels.attn_get_load_error() is None
    assert kernels.svdq_extension_is_available() and kernels.svdq_get_load_error() is None
    info = cache_dit_opd.daemon_info()
    assert info["address"] == daemon.address and info["protocol_version"] == _wire.PROTOCOL_VERSION
    assert "fp8_comm_per_token_quant.out" in info["catalog"]
    for op in SVDQ_OUTS:
        assert f"{op}.out" in info["catalog"], op
    from cache_dit_opd import _discovery

    assert info["gpu_uuid"] == _discovery.gpu_uuid(0)


def test_every_op_equals_in_process_bitwise(daemon, tmp_path):
    ours = _run_daemon_cases()
    theirs = _baseline(tmp_path)
    names = [op for op, _ in gpu_cases()]
    assert len(ours) == len(theirs) == len(names)
    differ = []  # every differing output, not only the first
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert len(a) == len(b), f"case {i} ({names[i]}): {len(a)} outputs, in-process {len(b)}"
        for j, (x, y) in enumerate(zip(a, b)):
            if not torch.equal(x, y):
                n = int((x != y).sum()) if x.shape == y.shape else "all"
                differ.append(f"case {i} ({names[i]}) output {j}: {n} of {y.numel()} bytes")
    assert not differ, "differ from the in-process kernel: " + "; ".join(differ)


def _assert_fp8_roundtrip(decoded, x):
    """e4m3 keeps 3 mantissa bits: |error| <= 2^-4 |x| + a subnormal step of the row's scale (+ bf16 rounding)."""
    x, decoded = x.float(), decoded.float()
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448.0
    bound = x.abs() * (2 ** -4 + 2 ** -7) + scale * 2 ** -8 + 1e-6
    assert ((decoded - x).abs() <= bound).all(), (decoded - x).abs().max()


EPS32 = torch.finfo(torch.float32).eps


def _assert_bitwise(actual, expected, what=""):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (
        what, actual.shape, actual.dtype, expected.shape, expected.dtype)
    a, e = actual.contiguous().view(torch.uint8).cpu(), expected.contiguous().view(torch.uint8).cpu()
    diff = (a != e).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} bytes differ, first at {diff[:5].tolist()}"


def _check_svdq_act(args, got):
    """Bit-exact quantizer (kernels/svdq_reference.py quantize_act: x / smooth rounded to the model dtype,
    amax * (1/7) in fp32, round half to even of x * (1 / scale), pad rows q 0 and scale 0); lora_act within K
    fp32 roundings of the float64 x @ proj_down (the kernel's sum order is its own; tests/kernels/test_svdq_gpu.py)."""
    x, lora_down, smooth, _, _, pad_size = args
    act, ascales, lora_act = got
    m, k = x.shape
    m_pad = (m + pad_size - 1) // pad_size * pad_size
    rank = 0 if lora_down is None else lora_down.shape[1]
    want_act, want_ascales, _ = fx.svdq_act_outputs(x.cpu(), None if smooth is None else smooth.cpu(), None,
                                                    pad_size)
    _assert_bitwise(act, want_act, "act")
    _assert_bitwise(ascales, want_ascales, "ascales")
    assert lora_act.shape == (m_pad, rank) and lora_act.dtype == torch.float32 and lora_act.is_contiguous()
    if rank:
        xd = x.cpu().double()
        down = fx.sq.unpack_lowrank(lora_down.cpu(), down=True).double()
        la = lora_act.cpu().double()
        bound = k * EPS32 * (xd.abs() @ down.abs().t())
        err = (la[:m] - xd @ down.t()).abs()
        assert (err <= bound).all(), f"lora_act: error {err.max():.3g}, over its bound by {(err - bound).max():.3g}"
        assert (la[m:] == 0).all()


def _check_svdq_gemm(args, got):
    """Without LoRA bit-exact (kernels/svdq/svdq.h: bit-exact on every path); with LoRA-up within the fp32
    roundings of the LoRA sum, whose order is the kernel path's own, then one rounding to the output dtype."""
    act, wgt, ascales, wscales, lora_act, lora_up, bias, _, _, _, _, out_dtype_id = args
    out_dtype = SVDQ_OUT_DTYPES[out_dtype_id]
    assert got.shape == (act.shape[0], wgt.shape[0]) and got.dtype == out_dtype and got.is_contiguous()
    acc, lora, lora_abs = fx.svdq_gemm_reference(act, wgt, ascales, wscales, lora_act, lora_up, bias)
    if lora is None:
        _assert_bitwise(got, acc.to(out_dtype), "out")  # pad rows included: 0, or the bias
        return
    # The portable kernel sums the R products in a chain of fp32 FMAs, then adds it to acc; the tensor-core
    # one adds them into acc with one m16n8k16 MMA per 16 ranks, which aligns its 17 addends to the largest
    # and truncates (at most 2 ulp of that per addend, 1 of the result). Worst cases of both, each against
    # the magnitudes it involves:
    rank = lora_up.shape[1]
    a = acc.double().abs() + lora_abs
    bound = EPS32 * ((rank + 1) * lora_abs + ((2 * 17 + 1) * -(-rank // 16) + 1) * a)
    want = acc.double() + lora
    if out_dtype != torch.float32:  # and the final rounding to the output dtype (half an ulp)
        fi = torch.finfo(out_dtype)
        bound = bound + fi.eps / 2 * (want.abs() + bound) + fi.smallest_normal * fi.eps
    err = (got.cpu().double() - want).abs()
    assert (err <= bound).all(), (f"out ({out_dtype}): error {err.max():.3g}, over its bound by "
                                  f"{(err - bound).max():.3g}")


def _check_svdq_wgt(args, got):
    """Bit-exact (quantize_weight: amax / 7 rounded to the model dtype, 1 for an all-zero group, round half to
    even of w / scale), in the checkpoint's packed layouts."""
    (w,) = args
    qweight, wscales = got
    q, scales = fx.sq.quantize_weight(w.cpu(), w.dtype)
    _assert_bitwise(wscales, fx.sq.pack_wscales(scales), "wscales")
    _assert_bitwise(qweight, fx.sq.pack_qweight(q), "qweight")


SVDQ_CHECKS = {"svdq_quantize_w4a4_act_fuse_lora": _check_svdq_act, "svdq_gemm_w4a4": _check_svdq_gemm,
               "svdq_quantize_w4a4_wgt": _check_svdq_wgt}


def test_every_op_matches_the_reference_math(daemon):
    for c, (op, args) in enumerate(gpu_cases()):
        got = _kernels_call(op, args)
        if op in SVDQ_CHECKS:
            try:
                SVDQ_CHECKS[op](args, got)
            except AssertionError as e:
                raise AssertionError(f"case {c} ({op}): {e}") from None
            continue
        if op == "fused_merge_attn_states":
            out, lse = got
            want_out, want_lse = fx.ref_merge(*args)
            assert out.dtype == args[2].dtype and lse.dtype == args[3].dtype
            assert out.is_contiguous() and lse.is_contiguous()
            torch.testing.assert_close(out.float(), want_out.float(), atol=2e-2, rtol=2e-2, equal_nan=True)
            torch.testing.assert_close(lse.float(), want_lse.float(), atol=2e-2, rtol=2e-2, equal_nan=True)
            assert not torch.isposinf(lse).any()  # +inf never comes out; empty rows give -inf
        elif op == "fp8_comm_per_token_quant":
            (x,) = args
            assert got.shape == (*x.shape[:-1], x.shape[-1] + 2) and got.dtype == FP8
            _assert_fp8_roundtrip(fx.ref.per_token_dequant(got), x)
        elif op == "fp8_comm_qkv_permute_quant":
            (x,) = args
            b, s_, p, n, d = x.shape
            assert got.shape == (p, s_, b, n, d + 4) and got.is_contiguous()
            for i in range(p):
                _assert_fp8_roundtrip(fx.ref.qkv_permute_dequant(got[i]), x[:, :, i])
        else:  # the dequant ops decode exactly what the reference encoded
            ref = fx.ref.per_token_dequant if "per_token" in op else fx.ref.qkv_permute_dequant
            torch.testing.assert_close(got.float(), ref(*args).float(), atol=0, rtol=2 ** -7)


def test_out_overloads_and_empty_inputs(daemon):
    x = torch.randn(32, 64, device="cuda", dtype=BF16)
    buf = torch.empty(32, 66, device="cuda", dtype=FP8)
    r = torch.ops.cache_dit_cuda_ops.fp8_comm_per_token_quant.out(x, out=buf)
    assert r is buf
    assert torch.equal(buf.view(torch.uint8), kernels.fp8_comm_per_token_quant(x).view(torch.uint8))
    empty = kernels.fp8_comm_per_token_quant(torch.empty(0, 64, device="cuda", dtype=BF16))
    assert empty.shape == (0, 66)


SVDQ_OUTS = {"svdq_quantize_w4a4_act_fuse_lora": ("output", "oscales", "lora_act_out"), "svdq_gemm_w4a4": ("out",),
             "svdq_quantize_w4a4_wgt": ("output", "oscales")}


def _poisoned_like(t):
    """A tensor of t's shape and dtype with every byte 0xFF (NaN in every float dtype used here)."""
    return torch.full((t.numel() * t.element_size(),), 255, dtype=torch.uint8, device=t.device).view(
        t.dtype).view(t.shape)


def test_svdq_out_overloads_write_every_output_byte(daemon):
    """Each svdq case through its .out overload on outputs filled with 0xFF returns the buffers it was given,
    holding the bytes of the functional form (compared with the in-process kernels above), pad rows included."""
    ops = torch.ops.cache_dit_cuda_ops
    seen = 0
    for i, (op, args) in enumerate(gpu_cases()):
        if op not in SVDQ_OUTS:
            continue
        want = _kernels_call(op, args)
        want = want if isinstance(want, tuple) else (want,)
        bufs = [_poisoned_like(t) for t in want]
        got = getattr(ops, op).out(*args, **dict(zip(SVDQ_OUTS[op], bufs)))
        got = got if isinstance(got, tuple) else (got,)
        assert len(got) == len(bufs) and all(a is b for a, b in zip(got, bufs)), f"case {i} ({op})"
        for name, b, w in zip(SVDQ_OUTS[op], bufs, want):
            _assert_bitwise(b, w, f"case {i} ({op}) {name}")
        seen += 1
    assert seen == sum(op in SVDQ_OUTS for op, _ in gpu_cases()) > 0


def test_a_bad_out_call_raises_the_kernels_message_and_the_session_goes_on(daemon):
    # The .out overload with a wrong-dtype output. The engine checks no values: the daemon rejects the
    # call, and the Python implementation it is handed to raises the op's own check (the same words as
    # the kernel library's, tests/python/test_client_parity.py). Without the engine Python checks first.
    x = torch.randn(4, 8, device="cuda", dtype=BF16)
    bad = torch.empty(4, 10, device="cuda", dtype=BF16)
    s = _session.get_session(0)
    before = s.native.state()["fallbacks"]["rejected"] if s.native is not None else 0
    with pytest.raises(ValueError, match=r"^fp8_comm_per_token_quant: output out must be torch\.float8_e4m3fn, got "
                                         r"torch\.bfloat16$"):
        torch.ops.cache_dit_cuda_ops.fp8_comm_per_token_quant.out(x, out=bad)
    if s.native is not None:
        assert s.native.state()["fallbacks"]["rejected"] == before + 1  # the daemon saw it and said no
    assert kernels.fp8_comm_per_token_quant(x).shape == (4, 10)  # the session goes on


def test_torch_compile_end_to_end(daemon):
    cases = gpu_cases()

    def f(po, pl, so, sl, x, q5):
        out, lse = kernels.fused_merge_attn_states(po, pl, so, sl)
        q = kernels.fp8_comm_per_token_quant(x)
        y = kernels.fp8_comm_per_token_dequant(q)
        rec = kernels.fp8_comm_qkv_permute_quant(q5)
        z = kernels.fp8_comm_qkv_permute_dequant(rec[0])
        return out * 2, lse, y + 1, z

    merge = cases[0][1]
    x = [a for op, a in cases if op == "fp8_comm_per_token_quant"][0][0]
    q5 = [a for op, a in cases if op == "fp8_comm_qkv_permute_quant"][0][0]
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    got = compiled(*merge, x, q5)
    want = f(*merge, x, q5)
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


def test_streams_and_threads(daemon):
    x = torch.randn(8, 256, 128, device="cuda", dtype=BF16)
    want = kernels.fp8_comm_per_token_quant(x).view(torch.uint8).clone()
    torch.cuda.synchronize()
    errors = []

    def work(i):
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for k in range(50):
                    xi = x.clone()  # produced on this stream, then consumed by the daemon in order
                    q = kernels.fp8_comm_per_token_quant(xi)
                    y = kernels.fp8_comm_per_token_dequant(q)
                    if k % 10 == 0 and not torch.equal(q.view(torch.uint8), want):
                        errors.append(f"thread {i} iteration {k}: wrong result")
                    del y
            s.synchronize()
        except Exception as e:  # pragma: no cover
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# -- several processes ----------------------------------------------------------------------------------

WORKER = r"""
import sys, hashlib, torch
sys.path.insert(0, {tests!r})
import cache_dit_opd
from cache_dit_opd import kernels
from test_client_gpu import gpu_cases, _kernels_call, _outputs_bytes, _digest
mode = {mode!r}
iters = 0
while True:
    res = [_outputs_bytes(_kernels_call(op, args)) for op, args in gpu_cases()]
    torch.cuda.synchronize()
    iters += 1
    if mode == "digest":
        print("DIGEST", _digest(res), flush=True)
        break
    if iters == 1:
        print("running", flush=True)
"""


def _worker(mode, address):
    code = WORKER.format(tests=fx.HERE, mode=mode)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=fx.subprocess_env(CACHE_DIT_OPD_ADDRESS=address))


def test_four_client_processes_at_once(daemon):
    want = _digest(_run_daemon_cases())
    procs = [_worker("digest", daemon.address) for _ in range(4)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert f"DIGEST {want}" in out, out + err


def _session_pids(stats):
    return {s.client_pid for s in stats.session}


def test_client_killed_mid_run_leaves_daemon_healthy(daemon):
    before = daemon.stats()
    p = _worker("loop", daemon.address)
    try:
        assert _lines(p).get(timeout=300) == "running"
    except queue.Empty:
        p.kill()
        raise
    assert p.pid in _session_pids(daemon.stats())
    os.kill(p.pid, signal.SIGKILL)
    p.wait(30)
    deadline = time.monotonic() + 30
    while True:
        st = daemon.stats()
        if p.pid not in _session_pids(st) and st.regions <= before.regions and st.mapped_bytes <= before.mapped_bytes:
            break
        assert time.monotonic() < deadline, f"the dead client's session or mappings remain: {st}\n{daemon.log_tail()}"
        time.sleep(0.1)
    assert daemon.version().serving
    x = torch.randn(16, 64, device="cuda", dtype=BF16)
    assert kernels.fp8_comm_per_token_quant(x).shape == (16, 66)


RESTART_WORKER = r"""
import sys, torch
sys.path.insert(0, {tests!r})
import cache_dit_opd, _client_fixtures as fx
from cache_dit_opd import kernels
x = torch.randn(1024, 128, device="cuda", dtype=torch.bfloat16)
kernels.fp8_comm_per_token_quant(x)
torch.cuda.synchronize()
torch.cuda._sleep(int(3e9))  # ~1.5 s of GPU work ahead of the call's inputs
print("calling", flush=True)
try:
    q = kernels.fp8_comm_per_token_quant(x)
    y = q.float().sum()  # waits on the call's "done" on the GPU
    print("returned", flush=True)
except Exception as e:
    print("raised", type(e).__name__, str(e).splitlines()[0], flush=True)
sys.stdin.readline()  # the test killed and restarted the daemon
torch.cuda.synchronize()  # must not hang: the client released its own waits
print("drained", flush=True)
try:
    cache_dit_opd.synchronize()
    print("sync-clean", flush=True)
except cache_dit_opd.SessionFailedError as e:
    print("sync-reported", str(e).splitlines()[0], flush=True)
x2 = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
q2 = kernels.fp8_comm_per_token_quant(x2)
torch.testing.assert_close(fx.ref.per_token_dequant(q2).float(), x2.float(), atol=0.1, rtol=0.1)
print("next-call-ok", flush=True)
"""


def _lines(p):
    q = queue.Queue()

    def pump():
        for line in p.stdout:
            q.put(line.strip())
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def test_daemon_killed_and_restarted(tmp_path):
    d = fx.daemon(None, fake=False)
    p = subprocess.Popen([sys.executable, "-c", RESTART_WORKER.format(tests=fx.HERE)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=fx.subprocess_env(CACHE_DIT_OPD_ADDRESS=d.address))
    lines = _lines(p)
    try:
        assert lines.get(timeout=120) == "calling"
        time.sleep(0.3)
        d.kill()
        first = lines.get(timeout=60)
        assert first.startswith(("returned", "raised")), first
        d.start()
        p.stdin.write("restarted\n")
        p.stdin.flush()
        assert lines.get(timeout=60) == "drained", "the client's stream stayed blocked on a dead daemon"
        report = lines.get(timeout=30)
        assert report.startswith(("sync-clean", "sync-reported")), report
        if first == "returned":
            # the call was accepted and then lost with the daemon: it must be reported
            assert report.startswith("sync-reported") and "unfinished" in report, report
        assert lines.get(timeout=120) == "next-call-ok"
        assert p.wait(60) == 0, p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
        d.stop()
        shutil.rmtree(d.workdir, ignore_errors=True)


# -- memory --------------------------------------------------------------------------------------------


def test_empty_cache_returns_memory_the_daemon_mapped(daemon):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free0 = torch.cuda.mem_get_info()[0]
    n = 256 << 20
    x = torch.randn(n // 256, 128, device="cuda", dtype=BF16)  # 256 MiB of input, own segment
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB, own segment
    q = torch.ops.cache_dit_cuda_ops.fp8_comm_per_token_quant.out(
        x, out=big[: x.shape[0] * 130].view(FP8).view(x.shape[0], 130))
    torch.cuda.synchronize()
    s = _session.get_session(0)
    assert any(r.base <= big.data_ptr() < r.base + r.size for r in s.regions.regions())
    regions = s.stats().session[0].regions
    assert regions == len(s.regions)
    del x, big, q
    torch.cuda.empty_cache()  # frees the segments; the client unregisters them right after
    assert s.stats().session[0].regions <= regions - 2, "the freed segments' regions remain in the daemon"
    deadline = time.monotonic() + 20
    while torch.cuda.mem_get_info()[0] < free0 - (64 << 20):
        assert time.monotonic() < deadline, (
            f"memory not returned: free {torch.cuda.mem_get_info()[0] >> 20} MiB, was {free0 >> 20} MiB; "
            f"daemon stats: {cache_dit_opd.daemon_stats()}")
        time.sleep(0.1)


# -- the client's CUDA side without a daemon ---------------------------------------------------------


def test_capture_raises_before_any_daemon_work():
    x = torch.randn(16, 64, device="cuda", dtype=BF16)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        with torch.cuda.graph(g):
            kernels.fp8_comm_per_token_quant(x)
    assert torch.ops.cache_dit_cuda_ops.fp8_comm_per_token_quant.default.tags.count(torch.Tag.cudagraph_unsafe) == 1


def test_driver_entry_points():
    from cache_dit_opd import _cuda_driver  # the Python control plane's: exporting regions

    drv = _cuda_driver.get_driver()
    assert drv.driver_version() >= 12000
    x = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
    base, size, bid = drv.pointer_range(x.data_ptr() + 100)
    assert base <= x.data_ptr() < base + size and bid != 0
    assert drv.legacy_ipc_capable(base)
    assert len(drv.ipc_get_mem_handle(base)) == 64
    assert drv.pointer_range(0x10) == (0, 0, 0)  # not CUDA memory


def test_vmm_memory_detected():
    code = """
import torch
from cache_dit_opd import _regions
t = _regions.RegionTable(lambda *a: 1, lambda rid: None, None, 0)
x = torch.empty(1 << 20, device="cuda")
try:
    t.ref(x.data_ptr(), 8)
    print("NO ERROR")
except _regions.RegionExportError as e:
    print("ERR", e)
"""
    r = fx.run_python(code, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    assert "ERR" in r.stdout and "expandable_segments:False" in r.stdout, r.stdout + r.stderr
