"""GPU suite of the shared-memory call ring: the real daemon, the native engine (client/core/), real CUDA IPC
and stream semaphores, calls as ring records in both modes.

Runs where a CUDA device exists, the daemon is built (``$CACHE_DIT_OPD_BUILD_DIR/server/cache-dit-opd``,
default ``<repo>/build``; extra daemon flags: CACHE_DIT_OPD_DAEMON_ARGS) and the native library is loaded.
The in-process baseline loads ``kernels/libcache_dit_cuda_ops.so`` in a separate process, never in this one.
Records the daemon's decoder refuses are tested against the real consumer in C++
(tests/cpp/server/ring_test.cc); this engine cannot write one.
"""

import os
import queue
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import _client_fixtures as fx

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

import cache_dit_opd  # noqa: E402
from cache_dit_opd import _native, _session, kernels  # noqa: E402
from test_client_gpu import _baseline, _kernels_call, _lines, _outputs_bytes, gpu_cases  # noqa: E402

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
MODES = ("sync", "async")


@pytest.fixture(scope="module")
def daemon():
    if _native.library() is None:
        pytest.skip(f"the native library is not loaded: {_native.load_error()}")
    _session.close_all()
    d = fx.daemon(None, fake=False)
    saved = {k: os.environ.get(k) for k in ("CACHE_DIT_OPD_ADDRESS", "CACHE_DIT_OPD_RING")}
    os.environ["CACHE_DIT_OPD_ADDRESS"] = d.address
    os.environ.pop("CACHE_DIT_OPD_RING", None)
    yield d
    try:
        _session.close_all(raise_errors=True)
    finally:
        d.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(d.workdir, ignore_errors=True)


@pytest.fixture(autouse=True)
def _sync_mode():
    prev = _session.set_async_calls(False)
    yield
    _session.set_async_calls(prev)


def _mode(mode):
    return cache_dit_opd.async_calls(mode == "async")


def _session0():
    return _session.get_session(0)


def _published(s) -> int:
    """Records this session's engine published into its ring."""
    return s.native.state()["published"]


def _lanes_issued(s) -> list[int]:
    return [s.native.lane(i)["issued"] for i in range(s.native.state()["lanes"])]


def _issued(s) -> int:
    return sum(_lanes_issued(s))


def test_ring_is_granted(daemon):
    assert daemon.version().ring_available, "the daemon does not offer the call ring"
    info = cache_dit_opd.daemon_info()
    assert info["transport"] == "ring", info
    assert info["ring_capacity"] >= 8
    s = _session0()
    before = _published(s)
    x = torch.randn(16, 64, device="cuda", dtype=BF16)
    kernels.fp8_comm_per_token_quant(x)
    assert _published(s) == before + 1 and s.transport == "ring"


_BASELINE = {}


@pytest.mark.parametrize("mode", MODES)
def test_every_op_equals_in_process_bitwise(daemon, tmp_path, mode):
    with _mode(mode):
        ours = [_outputs_bytes(_kernels_call(op, args)) for op, args in gpu_cases()]
    cache_dit_opd.synchronize()
    if "theirs" not in _BASELINE:
        _BASELINE["theirs"] = _baseline(tmp_path)
    theirs = _BASELINE["theirs"]
    names = [op for op, _ in gpu_cases()]
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        for j, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"{mode}: case {i} ({names[i]}) output {j} differs from the in-process kernel"


def _chain(x0, iters, snapshot_every):
    """quant -> dequant through preallocated .out buffers, with client work on the same stream in between."""
    q = torch.empty(*x0.shape[:-1], x0.shape[-1] + 2, device="cuda", dtype=FP8)
    y = x0.clone()
    snaps = []
    quant = torch.ops.cache_dit_cuda_ops.fp8_comm_per_token_quant.out
    dequant = torch.ops.cache_dit_cuda_ops.fp8_comm_per_token_dequant.out
    for i in range(iters):
        quant(y, out=q)
        dequant(q, out=y)
        y.mul_(1.0078125)  # the client's own kernel: the next daemon call must see it
        if (i + 1) % snapshot_every == 0:
            snaps.append(y.clone())
    return snaps


def test_10000_pipelined_async_calls_on_one_stream(daemon):
    x0 = torch.randn(256, 128, device="cuda", dtype=BF16) * 3
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with _mode("sync"):
        want = _chain(x0, 5000, 1000)  # 10,000 daemon calls
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    with _mode("async"):
        got = _chain(x0, 5000, 1000)
    t2 = time.perf_counter()
    cache_dit_opd.synchronize()
    t3 = time.perf_counter()
    print(f"\n[ring] 10,000 calls: sync {t1 - t0:.3f} s; async {t2 - t1:.3f} s to enqueue, "
          f"{t3 - t1:.3f} s to finish")
    for k, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a.view(torch.uint16), b.view(torch.uint16)), f"snapshot {k} differs (async vs sync)"
    assert torch.isfinite(got[-1].float()).all()


def test_two_streams_in_one_client(daemon):
    import threading

    xs = [torch.randn(128, 256, device="cuda", dtype=BF16) * (i + 1) for i in range(2)]
    torch.cuda.synchronize()
    with _mode("sync"):
        want = [_chain(x, 500, 100) for x in xs]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in xs]
    got = [None, None]
    errors = []

    def run(i):
        try:
            with torch.cuda.stream(streams[i]), _mode("async"):
                got[i] = _chain(xs[i], 500, 100)
        except Exception as e:  # pragma: no cover
            errors.append(repr(e))

    torch.cuda.synchronize()  # xs are ready for both side streams
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cache_dit_opd.synchronize()
    assert not errors, errors
    s = _session0()
    assert sum(1 for n in _lanes_issued(s) if n) >= 2, _lanes_issued(s)  # one lane per stream
    for i in range(2):
        for k, (a, b) in enumerate(zip(got[i], want[i])):
            assert torch.equal(a.view(torch.uint16), b.view(torch.uint16)), f"stream {i} snapshot {k} differs"


def test_invalid_call_in_async_mode_is_reported_at_synchronize(daemon):
    x = torch.randn(4, 8, device="cuda", dtype=BF16)
    bad = torch.empty(4, 10, device="cuda", dtype=BF16)  # wrong dtype for the output: the daemon rejects it
    with _mode("async"):
        torch.ops.cache_dit_cuda_ops.fp8_comm_per_token_quant.out(x, out=bad)  # returns: the record is in the ring
    with pytest.raises(ValueError) as e:
        cache_dit_opd.synchronize()
    assert "fp8_comm_per_token_quant.out rejected by the daemon" in str(e.value)
    assert "asynchronous call" in str(e.value)
    with _mode("async"):
        q = kernels.fp8_comm_per_token_quant(x)  # the lane goes on
    cache_dit_opd.synchronize()
    torch.testing.assert_close(fx.ref.per_token_dequant(q).float(), x.float(), atol=0.2, rtol=0.1)


def test_async_rejection_raised_by_the_next_call(daemon):
    s = _session0()
    x = torch.randn(4, 8, device="cuda", dtype=BF16)
    bad = torch.empty(4, 10, device="cuda", dtype=BF16)
    with _mode("async"):
        torch.ops.cache_dit_cuda_ops.fp8_comm_per_token_quant.out(x, out=bad)
        torch.cuda.synchronize()  # the rejected call's done came after its completion
        issued = _issued(s)
        with pytest.raises(ValueError, match="rejected by the daemon"):
            kernels.fp8_comm_per_token_quant(x)
        assert _issued(s) == issued  # the call that raised did not run
        kernels.fp8_comm_per_token_quant(x)
    cache_dit_opd.synchronize()


KILL_WORKER = r"""
import sys, torch
sys.path.insert(0, {tests!r})
import cache_dit_opd
from cache_dit_opd import kernels
cache_dit_opd.set_async_calls(True)
x = torch.randn(4608, 128, device="cuda", dtype=torch.bfloat16)
kernels.fp8_comm_per_token_quant(x)
torch.cuda.synchronize()
first = True
while True:
    torch.cuda._sleep(int(2e8))  # GPU work ahead of the calls' inputs: the daemon holds records waiting
    for _ in range(200):
        q = kernels.fp8_comm_per_token_quant(x)
        y = kernels.fp8_comm_per_token_dequant(q)
    if first:
        print("running", flush=True)
        first = False
"""


def test_client_killed_with_records_in_flight_leaves_daemon_healthy(daemon):
    before = daemon.stats()
    p = subprocess.Popen([sys.executable, "-c", KILL_WORKER.format(tests=fx.HERE)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=fx.subprocess_env(CACHE_DIT_OPD_ADDRESS=daemon.address))
    try:
        assert _lines(p).get(timeout=300) == "running"
    except queue.Empty:
        p.kill()
        raise
    assert p.pid in {s.client_pid for s in daemon.stats().session}
    time.sleep(0.2)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(30)
    deadline = time.monotonic() + 60
    while True:
        st = daemon.stats()
        if (p.pid not in {s.client_pid for s in st.session} and st.regions <= before.regions
                and st.mapped_bytes <= before.mapped_bytes):
            break
        assert time.monotonic() < deadline, f"the dead client's session or mappings remain: {st}\n{daemon.log_tail()}"
        time.sleep(0.1)
    assert daemon.version().serving
    x = torch.randn(16, 64, device="cuda", dtype=BF16)
    for mode in MODES:
        with _mode(mode):
            q = kernels.fp8_comm_per_token_quant(x)
        cache_dit_opd.synchronize()
        torch.testing.assert_close(fx.ref.per_token_dequant(q).float(), x.float(), atol=0.2, rtol=0.1)


CHAIN_WORKER = r"""
import sys, torch
sys.path.insert(0, {tests!r})
import cache_dit_opd
from test_client_ring_gpu import _chain
torch.manual_seed({seed})
x0 = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16) * 3
with cache_dit_opd.async_calls(False):
    want = _chain(x0, 1000, 250)
torch.cuda.synchronize()
with cache_dit_opd.async_calls(True):
    got = _chain(x0, 1000, 250)
cache_dit_opd.synchronize()
same = all(torch.equal(a.view(torch.uint16), b.view(torch.uint16)) for a, b in zip(got, want))
print("same" if same and len(got) == 4 else "differ", flush=True)
"""


def test_client_processes_on_two_executor_threads_each_get_their_own_results():
    """Four processes at once on a daemon with --executor-threads 2 (two sessions per thread): each one's
    asynchronous chain of 2,000 daemon calls equals its synchronous one bit for bit."""
    if _native.library() is None:
        pytest.skip(f"the native library is not loaded: {_native.load_error()}")
    d = fx.daemon(None, "--executor-threads", "2", fake=False)
    try:
        procs = [subprocess.Popen([sys.executable, "-c", CHAIN_WORKER.format(tests=fx.HERE, seed=k)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=fx.subprocess_env(CACHE_DIT_OPD_ADDRESS=d.address)) for k in range(4)]
        outs = [p.communicate(timeout=300) for p in procs]
        for k, (p, (out, err)) in enumerate(zip(procs, outs)):
            assert p.returncode == 0 and out.strip() == "same", f"process {k}: {out!r}\n{err[-3000:]}"
        st = d.stats()
        assert st.calls >= 4 * 4000, st
        assert d.version().serving
    finally:
        d.stop()
        shutil.rmtree(d.workdir, ignore_errors=True)
