"""The native engine (``client/core/``, ``client/python/``) on a GPU against the real daemon.

The ring GPU suite (test_client_ring_gpu.py) and the end-to-end suite run through whatever path the
client picks; with the native library built that is the engine. These tests pin what only the engine
does: the ``.out`` ops run without entering Python (counted), each case that needs Python is handed over
and counted by reason, and a ring call computes exactly what a host-ordered gRPC call computes.
"""

from __future__ import annotations

import sys

import pytest
import torch

import _client_fixtures as fx

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

import cache_dit_opd  # noqa: E402
from cache_dit_opd import _native, _proxy, _session, kernels  # noqa: E402
from test_client_ring_gpu import _mode, _session0, _sync_mode, daemon  # noqa: E402,F401

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
OPS = torch.ops.cache_dit_cuda_ops


@pytest.fixture
def native(daemon):  # noqa: F811
    if _native.library() is None:
        pytest.skip(f"native library not available: {_native.load_error()}")
    s = _session0()
    assert s.native is not None, "a ring session with the native library must use the native engine"
    return s


def _state(s):
    torch.cuda.synchronize()
    return s.native.state()


def test_out_overloads_have_the_native_cuda_kernel(native):
    for op in ("fp8_comm_per_token_quant.out", "fused_merge_attn_states.out"):
        dump = torch._C._dispatch_dump(f"cache_dit_cuda_ops::{op}")
        assert "proxy_kernel.cpp" in dump.split("CUDA: registered at", 1)[1].splitlines()[0], dump
        assert f"{_proxy.PYTHON_IMPL_KEY}: registered at" in dump, dump
    # functional overloads: the functional kernel, which never hands a call to Python (its .out call may)
    for op in ("fp8_comm_per_token_quant", "fused_merge_attn_states", "fp8_comm_qkv_permute_quant"):
        dump = torch._C._dispatch_dump(f"cache_dit_cuda_ops::{op}")
        assert "functional_kernel.cpp" in dump.split("CUDA: registered at", 1)[1].splitlines()[0], dump


@pytest.mark.parametrize("mode", ("sync", "async"))
def test_out_calls_run_natively_and_equal_a_host_ordered_call(native, daemon, mode):  # noqa: F811
    s = native
    x = torch.randn(64, 3, 128, device="cuda", dtype=BF16)
    q_native = torch.empty(64, 3, 130, device="cuda", dtype=FP8)
    q_grpc = torch.empty_like(q_native)
    OPS.fp8_comm_per_token_quant.out(x, out=q_native)  # registers the regions (through Python once)
    before = _state(s)
    n = 50
    with _mode(mode):
        for _ in range(n):
            OPS.fp8_comm_per_token_quant.out(x, out=q_native)
    cache_dit_opd.synchronize()
    after = _state(s)
    grpc = _session.Session(0, target=daemon.address, native=False).open()  # a second session, no engine
    try:
        assert grpc.transport == "grpc"
        grpc.call_host_ordered("fp8_comm_per_token_quant", [x, q_grpc])
    finally:
        grpc.close()
    assert after["native_calls"] - before["native_calls"] == n
    assert after["fallbacks"] == before["fallbacks"], (before, after)
    assert after["published"] - before["published"] == n
    assert torch.equal(q_native.view(torch.uint8), q_grpc.view(torch.uint8))
    torch.testing.assert_close(fx.ref.per_token_dequant(q_native).float(), x.float(), atol=0.2, rtol=0.1)


def test_merge_with_strided_lse_runs_natively(native):
    s = native
    b, sq, h, d = 1, 96, 4, 64
    po, so = (torch.randn(b, sq, h, d, device="cuda", dtype=BF16) for _ in range(2))
    pl = torch.randn(b, h, sq, device="cuda").permute(0, 2, 1).unsqueeze(-1)  # flash-attn [B, H, S] view
    sl = torch.randn(b, h, sq, device="cuda").permute(0, 2, 1).unsqueeze(-1)
    out, lse = torch.empty_like(po), torch.empty(b, sq, h, 1, device="cuda")
    OPS.fused_merge_attn_states.out(po, pl, so, sl, out=out, lse=lse)
    before = _state(s)
    r = OPS.fused_merge_attn_states.out(po, pl, so, sl, out=out, lse=lse)
    after = _state(s)
    assert after["native_calls"] == before["native_calls"] + 1
    assert r[0] is out and r[1] is lse  # the .out overload returns its outputs
    want_out, want_lse = fx.ref_merge(po, pl, so, sl)
    torch.testing.assert_close(out.float(), want_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.float(), want_lse.float(), atol=1e-4, rtol=1e-4)


def test_a_new_allocation_goes_through_python_once(native):
    s = native
    x = torch.randn(256, 64, device="cuda", dtype=BF16)
    # Own segments (>= 10 MiB each: the caching allocator gives them their own cudaMalloc).
    big = torch.empty(12 << 20, device="cuda", dtype=torch.uint8)
    q = big[: 256 * 66].view(FP8).view(256, 66)
    before = _state(s)
    OPS.fp8_comm_per_token_quant.out(x, out=q)
    mid = _state(s)
    OPS.fp8_comm_per_token_quant.out(x, out=q)
    after = _state(s)
    assert mid["fallbacks"]["region_miss"] == before["fallbacks"]["region_miss"] + 1
    assert mid["native_calls"] == before["native_calls"] + 1  # Python registered q, then the engine ran it
    assert after["native_calls"] == mid["native_calls"] + 1
    assert after["fallbacks"]["region_miss"] == mid["fallbacks"]["region_miss"]


def _bytes(t):
    return t.contiguous().view(torch.uint8)


def test_an_empty_output_runs_natively_beside_the_others(native):
    """svdq's activation quantizer without LoRA (rank 0): lora_act_out [M_pad, 0] is empty, output and oscales
    are not. The engine sends the empty tensor as region 0 (no memory) and runs the call; it was once handed
    to Python as an argument it cannot carry and dropped there, output and oscales never written."""
    s = native
    x = torch.randn(200, 128, device="cuda", dtype=BF16)
    output = torch.empty(256, 128, device="cuda", dtype=FP8)
    oscales = torch.empty(2, 256, device="cuda", dtype=BF16)
    lora_act_out = torch.empty(256, 0, device="cuda", dtype=torch.float32)
    args = (x, None, None, False, False, 256)
    want = kernels.svdq_quantize_w4a4_act_fuse_lora(x, None, None, pad_size=256)  # the catalog checked
    OPS.svdq_quantize_w4a4_act_fuse_lora.out(*args, output=output, oscales=oscales, lora_act_out=lora_act_out)
    for t in (output, oscales):  # poisoned: only the call can make them right again
        t.view(torch.uint8).fill_(255)
    before = _state(s)
    OPS.svdq_quantize_w4a4_act_fuse_lora.out(*args, output=output, oscales=oscales, lora_act_out=lora_act_out)
    after = _state(s)
    assert after["native_calls"] == before["native_calls"] + 1
    assert after["fallbacks"] == before["fallbacks"], (before, after)
    assert torch.equal(_bytes(output), _bytes(want[0])) and torch.equal(_bytes(oscales), _bytes(want[1]))
    assert want[2].shape == (256, 0)


def test_a_call_of_only_empty_tensors_runs_natively_and_writes_nothing(native):
    """No client shortcut: the daemon checks the call and, with nothing to write, launches nothing."""
    s = native
    kernels.fp8_comm_per_token_quant(torch.randn(8, 64, device="cuda", dtype=BF16))  # the catalog checked
    x = torch.empty(0, 64, device="cuda", dtype=BF16)
    q = torch.empty(0, 66, device="cuda", dtype=FP8)
    before = _state(s)
    assert OPS.fp8_comm_per_token_quant.out(x, out=q) is q
    after = _state(s)
    assert after["native_calls"] == before["native_calls"] + 1
    assert after["fallbacks"] == before["fallbacks"], (before, after)
    with pytest.raises(ValueError, match="x must be torch.bfloat16"):  # still checked by the daemon
        OPS.fp8_comm_per_token_quant.out(x.float(), out=q)


def test_a_rejected_sync_call_raises_what_the_python_path_raises(native):
    s = native
    x = torch.randn(8, 64, device="cuda", dtype=BF16)
    bad = torch.empty(8, 66, device="cuda", dtype=BF16)  # wrong dtype: the daemon refuses it
    before = _state(s)
    with pytest.raises(ValueError, match="output out must be torch"):
        OPS.fp8_comm_per_token_quant.out(x, out=bad)
    after = _state(s)
    assert after["fallbacks"]["rejected"] == before["fallbacks"]["rejected"] + 1
    q = torch.empty(8, 66, device="cuda", dtype=FP8)
    OPS.fp8_comm_per_token_quant.out(x, out=q)  # the lane goes on
    OPS.fp8_comm_per_token_quant.out(x, out=q)
    assert _state(s)["native_calls"] >= after["native_calls"] + 1


def test_an_async_rejection_is_raised_by_the_next_call_then_reported_once(native):
    s = native
    x = torch.randn(8, 64, device="cuda", dtype=BF16)
    q = torch.empty(8, 66, device="cuda", dtype=FP8)
    bad = torch.empty(8, 66, device="cuda", dtype=BF16)
    OPS.fp8_comm_per_token_quant.out(x, out=q)
    with _mode("async"):
        OPS.fp8_comm_per_token_quant.out(x, out=bad)  # native: published, rejected later by the daemon
        torch.cuda.synchronize()
        before = _state(s)
        with pytest.raises(ValueError, match=r"(?s)rejected by the daemon.*asynchronous call"):
            OPS.fp8_comm_per_token_quant.out(x, out=q)
        assert _state(s)["fallbacks"]["pending_errors"] == before["fallbacks"]["pending_errors"] + 1
        OPS.fp8_comm_per_token_quant.out(x, out=q)  # reported once: this one runs
    cache_dit_opd.synchronize()
    torch.testing.assert_close(fx.ref.per_token_dequant(q).float(), x.float(), atol=0.2, rtol=0.1)


def test_graph_capture_is_refused_by_the_python_path(native):
    s = native
    x = torch.randn(8, 64, device="cuda", dtype=BF16)
    q = torch.empty(8, 66, device="cuda", dtype=FP8)
    OPS.fp8_comm_per_token_quant.out(x, out=q)
    torch.cuda.synchronize()
    before = s.native.state()
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        with torch.cuda.graph(g):
            OPS.fp8_comm_per_token_quant.out(x, out=q)
    assert s.native.state()["fallbacks"]["capturing"] == before["fallbacks"]["capturing"] + 1
    OPS.fp8_comm_per_token_quant.out(x, out=q)  # and afterwards the session still serves


def test_pure_python_client_in_a_subprocess_gives_the_same_bytes(native, daemon):  # noqa: F811
    """CACHE_DIT_OPD_NATIVE=0 (no engine) and CACHE_DIT_OPD_RING=0 (the engine loaded, a session without a
    ring): the same call over host-ordered gRPC is bitwise the same as through the engine."""
    code = r"""
import hashlib, sys, torch
sys.path.insert(0, {tests!r})
from cache_dit_opd import _native, _session
torch.manual_seed(0)
x = torch.randn(64, 3, 128, device="cuda", dtype=torch.bfloat16)
q = torch.empty(64, 3, 130, device="cuda", dtype=torch.float8_e4m3fn)
torch.ops.cache_dit_cuda_ops.fp8_comm_per_token_quant.out(x, out=q)
torch.cuda.synchronize()
print(_native.library() is not None, _session.get_session(0).native is not None,
      hashlib.sha256(q.view(torch.uint8).cpu().numpy().tobytes()).hexdigest())
"""
    outs = {}
    for native, ring in (("1", "1"), ("0", "1"), ("1", "0")):
        r = fx.run_python(code.format(tests=fx.HERE), CACHE_DIT_OPD_ADDRESS=daemon.address, CACHE_DIT_OPD_NATIVE=native,
                          CACHE_DIT_OPD_RING=ring)
        assert r.returncode == 0, r.stderr
        outs[native + ring] = r.stdout.split()
    assert [o[:2] for o in outs.values()] == [["True", "True"], ["False", "False"], ["True", "False"]], outs
    assert len({o[2] for o in outs.values()}) == 1, outs


class _PythonCalls:
    """The cache_dit_opd Python functions entered while it is active (sys.setprofile)."""

    def __init__(self):
        self.names = []

    def _profile(self, frame, event, arg):
        if event == "call" and "cache_dit_opd" in frame.f_code.co_filename:
            self.names.append(frame.f_code.co_name)

    def __enter__(self):
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


def test_functional_overloads_run_natively_without_entering_python(native):
    """The functional kernel validates, allocates and calls .out in C++: no Python frame of the client."""
    s = native
    x = torch.randn(32, 128, device="cuda", dtype=BF16)
    po, so = (torch.randn(1, 24, 4, 64, device="cuda", dtype=BF16) for _ in range(2))
    pl, sl = (torch.randn(1, 4, 24, device="cuda").permute(0, 2, 1).unsqueeze(-1) for _ in range(2))
    w = torch.randn(128, 128, device="cuda", dtype=BF16)  # svdq's, defined in Libraries of their own
    xa = torch.randn(200, 128, device="cuda", dtype=BF16)
    for _ in range(2):  # the first calls may register output allocations (through Python)
        q = OPS.fp8_comm_per_token_quant(x)
        OPS.fp8_comm_per_token_dequant(q)
        OPS.fused_merge_attn_states(po, pl, so, sl)
        OPS.svdq_quantize_w4a4_wgt(w)
        OPS.svdq_quantize_w4a4_act_fuse_lora(xa, None, None, False, False, 256)
    before = _state(s)
    with _PythonCalls() as calls:
        q = OPS.fp8_comm_per_token_quant(x)
        y = OPS.fp8_comm_per_token_dequant(q)
        out, lse = OPS.fused_merge_attn_states(po, pl, so, sl)
        qw, ws = OPS.svdq_quantize_w4a4_wgt(w)
        act, ascales, lora_act = OPS.svdq_quantize_w4a4_act_fuse_lora(xa, None, None, False, False, 256)
    after = _state(s)
    assert calls.names == [], calls.names
    assert after["native_calls"] - before["native_calls"] == 5
    assert act.shape == (256, 128) and ascales.shape == (2, 256) and lora_act.shape == (256, 0)
    q_ref, s_ref = fx.sq.quantize_weight(w.cpu(), BF16)  # the weight quantizer is bit-exact to it
    assert torch.equal(qw.cpu().view(torch.uint8), fx.sq.pack_qweight(q_ref).view(torch.uint8))
    assert torch.equal(ws.cpu().view(torch.uint8), fx.sq.pack_wscales(s_ref).view(torch.uint8))
    assert after["fallbacks"] == before["fallbacks"], (before, after)
    assert q.shape == (32, 130) and q.dtype == FP8 and y.shape == (32, 128) and y.dtype == BF16
    torch.testing.assert_close(y.float(), x.float(), atol=0.2, rtol=0.1)
    want_out, want_lse = fx.ref_merge(po, pl, so, sl)
    torch.testing.assert_close(out.float(), want_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.float(), want_lse.float(), atol=1e-4, rtol=1e-4)
    # the same bytes as the .out overload on outputs the caller allocated
    q_out = torch.empty_like(q)
    OPS.fp8_comm_per_token_quant.out(x, out=q_out)
    assert torch.equal(q.view(torch.uint8), q_out.view(torch.uint8))


def test_a_functional_call_allocates_on_its_tensors_device_and_current_stream(native):
    x = torch.randn(16, 64, device="cuda", dtype=BF16)
    OPS.fp8_comm_per_token_quant(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q = OPS.fp8_comm_per_token_quant(x)
        y = OPS.fp8_comm_per_token_dequant(q)
    side.synchronize()
    assert q.device == x.device and q.is_contiguous()
    torch.testing.assert_close(y.float(), x.float(), atol=0.2, rtol=0.1)


def _to_cuda(v):
    """A meta tensor of the bad-input table as a CUDA tensor of the same sizes, strides, offset and dtype."""
    if not isinstance(v, torch.Tensor):
        return v
    base = torch.empty(max(1, v.untyped_storage().nbytes() // v.element_size()), dtype=v.dtype, device="cuda")
    return base.as_strided(v.shape, v.stride(), v.storage_offset())


def test_functional_bad_inputs_raise_what_the_fakes_raise_and_reach_no_daemon(native):
    """Every functional case of the shared bad-input table (tests/python/_bad_inputs.py) on CUDA tensors: the
    functional kernel's Meta checks raise the fakes' exception with the fakes' message (the parity test ties
    those to the kernel library's), and nothing is published."""
    import _bad_inputs as bad

    s = native
    cases = [c for c in bad.CASES if "." not in c[1]]
    assert len(cases) >= 10
    before = _state(s)
    for case in cases:
        cid, full, build, names = case
        args, kwargs = build()
        want = bad.run(OPS, case)  # meta tensors: the fakes
        cuda_case = (cid, full, lambda args=args, kwargs=kwargs: (
            tuple(_to_cuda(a) for a in args), {k: _to_cuda(v) for k, v in kwargs.items()}), names)
        got = bad.run(OPS, cuda_case)
        if "meta" in (want[1] or ""):  # a message naming the device differs by the device's name only
            assert got[0] == want[0], (cid, got, want)
        else:
            assert got == want, (cid, got, want)
        assert want[0] == "ValueError", (cid, want)
    after = _state(s)
    assert after["published"] == before["published"]


def test_a_functional_call_with_empty_outputs_publishes_nothing(native):
    s = native
    x = torch.empty(0, 64, device="cuda", dtype=BF16)
    before = _state(s)
    q = OPS.fp8_comm_per_token_quant(x)
    after = _state(s)
    assert q.shape == (0, 66) and q.dtype == FP8
    assert after["published"] == before["published"] and after["fallbacks"] == before["fallbacks"]


MULTI_GPU_WORKER = r"""
import sys, torch
sys.path.insert(0, {tests!r})
import _client_fixtures as fx
from cache_dit_opd import _session
ops = torch.ops.cache_dit_cuda_ops
torch.cuda.set_device(0)  # the current device stays 0 while cuda:1's daemon serves its calls
for dev in ("cuda:1", "cuda:0"):
    x = torch.randn(128, 3, 64, device=dev, dtype=torch.bfloat16)
    q = torch.empty(128, 3, 66, device=dev, dtype=torch.float8_e4m3fn)
    for _ in range(20):
        ops.fp8_comm_per_token_quant.out(x, out=q)
    torch.cuda.synchronize(dev)
    ok = torch.equal(q.cpu().view(torch.uint8), fx.ref.per_token_quant(x.cpu()).view(torch.uint8))
    st = _session.get_session(torch.device(dev).index).native.state()
    print(dev, ok, st["native_calls"], torch.cuda.current_device())
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_each_gpu_has_its_daemon_and_calls_run_natively_whatever_device_is_current():
    import os
    import shutil

    from cache_dit_opd import _discovery

    run = fx.short_tmpdir()
    daemons = []
    try:
        for idx in (0, 1):  # each on <run>/<GPU UUID>.sock: found by discovery
            daemons.append(fx.daemon(os.path.join(run, f"d{idx}"), fake=False, device=idx,
                                     socket=os.path.join(run, f"{_discovery.gpu_uuid(idx)}.sock")))
        r = fx.run_python(MULTI_GPU_WORKER.format(tests=fx.HERE), CACHE_DIT_OPD_ADDRESS=None,
                          CACHE_DIT_OPD_RUNTIME_DIR=run, timeout=180)
        assert r.returncode == 0, r.stderr
        lines = [l.split() for l in r.stdout.splitlines()]
        assert [l[0] for l in lines] == ["cuda:1", "cuda:0"], r.stdout
        for dev, ok, native_calls, current in lines:
            assert ok == "True", f"{dev}: records differ from the reference"
            assert int(native_calls) >= 19, f"{dev}: {native_calls} native calls of 20"
            assert current == "0"
    finally:
        for d in daemons:
            d.stop()
        shutil.rmtree(run, ignore_errors=True)


VISIBLE_ONE_WORKER = r"""
import torch
from cache_dit_opd import _session
from cache_dit_opd.kernels import fp8_comm_per_token_quant
x = torch.randn(64, 128, device="cuda:0", dtype=torch.bfloat16)
for _ in range(10):
    fp8_comm_per_token_quant(x)
torch.cuda.synchronize()
s = _session.get_session(0)
print(torch.cuda.device_count(), s.uuid, s.version.gpu_uuid)
"""

CROSS_GPU_WORKER = r"""
import sys, torch
sys.path.insert(0, {tests!r})
import _client_fixtures as fx
from cache_dit_opd.kernels import fp8_comm_per_token_quant, fused_merge_attn_states
out = torch.randn(1, 16, 2, 64, device="cuda:0", dtype=torch.bfloat16)
lse = torch.randn(1, 16, 2, 1, device="cuda:1", dtype=torch.float32)
try:
    fused_merge_attn_states(out, lse, out, lse)
except (ValueError, RuntimeError) as e:
    print(type(e).__name__, e)
x = torch.randn(64, 128, device="cuda:1", dtype=torch.bfloat16)  # GPU 1's daemon still serves this client
print(torch.equal(fp8_comm_per_token_quant(x).view(torch.uint8).cpu(),
                  fx.ref.per_token_quant(x.cpu()).view(torch.uint8)))
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_client_that_sees_gpu_1_as_cuda_0_reaches_gpu_1s_daemon_and_a_cross_gpu_call_is_refused():
    """CUDA_VISIBLE_DEVICES renumbers GPUs; discovery goes by UUID, so cuda:0 of such a client is GPU 1's daemon."""
    import os
    import shutil

    from cache_dit_opd import _discovery

    run = fx.short_tmpdir()
    daemons = []
    try:
        uuids = [_discovery.gpu_uuid(idx) for idx in (0, 1)]
        for idx in (0, 1):
            daemons.append(fx.daemon(os.path.join(run, f"d{idx}"), fake=False, device=idx,
                                     socket=os.path.join(run, f"{uuids[idx]}.sock")))
        calls = [d.stats().calls for d in daemons]
        r = fx.run_python(VISIBLE_ONE_WORKER, CACHE_DIT_OPD_ADDRESS=None, CACHE_DIT_OPD_RUNTIME_DIR=run,
                          CUDA_VISIBLE_DEVICES="1", timeout=180)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["1", uuids[1], uuids[1]], r.stdout
        assert daemons[1].stats().calls - calls[1] >= 10
        assert daemons[0].stats().calls == calls[0]  # GPU 0's daemon saw none of it

        r = fx.run_python(CROSS_GPU_WORKER.format(tests=fx.HERE), CACHE_DIT_OPD_ADDRESS=None,
                          CACHE_DIT_OPD_RUNTIME_DIR=run, timeout=180)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[0].startswith("ValueError") and "cuda:1" in lines[0] and "cuda:0" in lines[0], r.stdout
        assert lines[1] == "True", r.stdout
        assert all(d.alive() for d in daemons)
    finally:
        for d in daemons:
            d.stop()
        shutil.rmtree(run, ignore_errors=True)
