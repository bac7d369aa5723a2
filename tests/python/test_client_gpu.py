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
    return cases


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
        results.append(_outputs_bytes(getattr(kernels, op)(*args)))
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
    info = cache_dit_opd.daemon_info()
    assert info["address"] == daemon.address and info["protocol_version"] == _wire.PROTOCOL_VERSION
    assert "fp8_comm_per_token_quant.out" in info["catalog"]
    from cache_dit_opd import _discovery

    assert info["gpu_uuid"] == _discovery.gpu_uuid(0)


def test_every_op_equals_in_process_bitwise(daemon, tmp_path):
    ours = _run_daemon_cases()
    theirs = _baseline(tmp_path)
    names = [op for op, _ in gpu_cases()]
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        for j, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"case {i} ({names[i]}) output {j} differs from the in-process kernel"


def _assert_fp8_roundtrip(decoded, x):
    """e4m3 keeps 3 mantissa bits: |error| <= 2^-4 |x| + a subnormal step of the row's scale (+ bf16 rounding)."""
    x, decoded = x.float(), decoded.float()
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448.0
    bound = x.abs() * (2 ** -4 + 2 ** -7) + scale * 2 ** -8 + 1e-6
    assert ((decoded - x).abs() <= bound).all(), (decoded - x).abs().max()


def test_every_op_matches_the_reference_math(daemon):
    for op, args in gpu_cases():
        got = getattr(kernels, op)(*args)
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
from test_client_gpu import gpu_cases, _outputs_bytes, _digest
mode = {mode!r}
iters = 0
while True:
    res = [_outputs_bytes(getattr(kernels, op)(*args)) for op, args in gpu_cases()]
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


def test_expandable_segments_get_a_clear_error(daemon):
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
    r = fx.run_python(code, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True", CACHE_DIT_OPD_ADDRESS=daemon.address)
    assert "ERR" in r.stdout and "expandable_segments:False" in r.stdout, r.stdout + r.stderr


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
