"""The Python client's sessions against the real daemon on fake device operations (no GPU needed).

Without the native engine a session's calls are host-ordered gRPC calls: the client synchronizes its
stream (counted here), the daemon numbers the call and answers once its kernel has finished (at once on
fake device operations). Allocations are FakeDriver's; the daemon decodes their handles, maps nothing,
and checks every call with the kernel library's Meta kernels.
"""

import os
import signal
import threading

import pytest
import torch

import _client_fixtures as fx

from cache_dit_opd import _attn, _comm, _errors, _session, _wire
from cache_dit_opd._errors import CatalogSkewError, DaemonUnavailableError
from test_client_reasons import wait_for

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
MB = 1 << 20


@pytest.fixture
def daemon():
    d = fx.daemon()
    yield d
    d.kill()


class Client:
    """A session and what it needs: fake allocations, a stream synchronization counter."""

    def __init__(self, d, **kw):
        self.d, self.drv, self.syncs = d, fx.FakeDriver(), 0
        self.s = self.open(**kw)

    def open(self, **kw):
        def sync():
            self.syncs += 1

        return _session.Session(0, target=d_address(self.d), driver=self.drv, native=False, synchronize=sync,
                                **kw).open()

    def tensor(self, *shape, dtype=BF16):
        numel = 1
        for n in shape:
            numel *= n
        return fx.DeviceTensor(self.drv.alloc(numel * torch.empty((), dtype=dtype).element_size()), shape, dtype)

    def quant(self, rows=4, d=64, dtype=BF16):
        return [self.tensor(rows, d, dtype=dtype), self.tensor(rows, d + 2, dtype=FP8)]

    def run(self, op, args):
        """One call through _session.run (the proxy ops' path), reopening the session like get_session does."""
        def required(_idx):
            if self.s.failed is not None:
                self.s = self.open()
            return self.s

        _session.run(required, 0, op, args)


def d_address(d) -> str:
    return d.address


def session_stats(c: Client):
    st = c.s.stats()
    return st.session[0]


def test_open_bind_and_catalog(daemon):
    c = Client(daemon)
    s = c.s
    assert s.reply.session_id > 0 and s.reply.lanes == 1 and s.transport == "grpc"
    assert s.native is None
    s.check_ops(_attn._SCHEMAS)
    s.check_ops(_comm._SCHEMAS)
    assert ("fp8_comm_per_token_quant", "out") in s.catalog
    st = session_stats(c)
    assert st.client_pid == os.getpid()  # bound on the session channel
    s.close()


def test_a_call_runs_after_the_stream_is_synchronized(daemon):
    c = Client(daemon)
    for _ in range(3):
        c.run("fp8_comm_per_token_quant", c.quant())
    assert c.syncs == 3
    st = session_stats(c)
    assert st.calls == 3 and st.errors == 0 and st.regions == 6


def test_a_rejected_call_raises_value_error_and_the_session_goes_on(daemon):
    c = Client(daemon)
    with pytest.raises(ValueError, match=r"rejected by the daemon: .*x must be torch\.bfloat16, got torch\.float16"):
        c.run("fp8_comm_per_token_quant", c.quant(dtype=torch.float16))
    assert c.s.failed is None
    c.run("fp8_comm_per_token_quant", c.quant())
    st = session_stats(c)
    assert st.calls == 1 and st.errors == 1


def test_tensors_on_expandable_segments_travel_as_runs_of_chunks_the_daemon_maps(daemon):
    """Virtual memory (PyTorch's expandable segments): each tensor's chunks go to the daemon as descriptors over
    the session channel (the fake daemon checks each holds its chunk's bytes); the region is the run, mapped
    bytes counted; a chunk mapped again is registered anew, a descriptor too small for its chunk is refused
    naming it, and the session goes on."""
    c = Client(daemon)
    base = c.drv.alloc(8 * MB, vmm=True)
    x = fx.DeviceTensor(base + 2 * MB - 64 * 2, (4, 64), BF16)  # spans chunks 0 and 1
    out = fx.DeviceTensor(base + 4 * MB, (4, 66), FP8)
    c.run("fp8_comm_per_token_quant", [x, out])
    st = session_stats(c)
    assert (st.calls, st.errors, st.regions, st.mapped_bytes) == (1, 0, 2, 3 * 2 * MB)
    assert c.drv.exported == 3
    c.run("fp8_comm_per_token_quant", [x, out])  # the same runs again: nothing new exported
    assert c.drv.exported == 3
    c.drv.remap(base + 4 * MB)
    c.run("fp8_comm_per_token_quant", [x, out])
    st = session_stats(c)
    assert (st.calls, st.regions, c.drv.exported) == (3, 2, 4)  # the stale run unregistered, the new one mapped
    small = c.drv.alloc(4 * MB, vmm=True)
    real_export = c.drv.export_chunk_fd

    def short_fd(ptr):
        fd = real_export(ptr)
        os.ftruncate(fd, 4096)  # holds less than its chunk
        return fd

    c.drv.export_chunk_fd = short_fd
    with pytest.raises(ValueError, match=r"chunk 0 of 2097152 bytes: fake cuMemMap: the descriptor holds 4096 bytes"):
        c.run("fp8_comm_per_token_quant", [fx.DeviceTensor(small, (4, 64), BF16), out])
    c.drv.export_chunk_fd = real_export
    assert c.s.failed is None and daemon.alive()
    c.run("fp8_comm_per_token_quant", [x, out])


class _RecordingStub:
    """The session's stub, keeping every Call request it sends."""

    def __init__(self, stub):
        self._stub, self.calls = stub, []

    def Call(self, req, **kw):
        self.calls.append(req)
        return self._stub.Call(req, **kw)

    def __getattr__(self, name):
        return getattr(self._stub, name)


def _empty(*shape, dtype=BF16):
    """An empty CUDA tensor as torch makes one: data pointer 0, inside no allocation."""
    return fx.DeviceTensor(0, shape, dtype)


def test_an_empty_output_beside_others_travels_without_memory_and_the_call_runs(daemon):
    """svdq activation quantizer without LoRA (rank 0): lora_act_out [M_pad, 0] is empty, output and oscales
    are not. The call reaches the daemon (once dropped by the client, leaving output and oscales unwritten);
    the empty tensor travels as region 0 at offset 0, nothing registered for it."""
    c = Client(daemon)
    c.s._stub = stub = _RecordingStub(c.s._stub)
    m_pad, k = 256, 384
    x, output, oscales = c.tensor(200, k), c.tensor(m_pad, k, dtype=FP8), c.tensor(k // 64, m_pad)
    lora_act_out = _empty(m_pad, 0, dtype=torch.float32)
    c.run("svdq_quantize_w4a4_act_fuse_lora", [x, None, None, False, False, 256, output, oscales, lora_act_out])
    assert c.syncs == 1 and len(stub.calls) == 1
    sent = stub.calls[0].args[8].tensor
    assert (sent.region_id, sent.byte_offset, list(sent.sizes), list(sent.strides)) == (
        _wire.NO_REGION, 0, [m_pad, 0], list(lora_act_out.stride()))
    assert sent.dtype == _wire.DTYPE_IDS["float32"]
    assert all(stub.calls[0].args[i].tensor.region_id != _wire.NO_REGION for i in (0, 6, 7))
    st = session_stats(c)
    assert st.calls == 1 and st.errors == 0
    assert st.regions == 3 and len(c.s.regions) == 3  # x, output, oscales; none for the empty tensor


def test_a_call_of_only_empty_tensors_is_checked_by_the_daemon_and_registers_nothing(daemon):
    """No client shortcut: whether a call has anything to write is the daemon's rule (it checks the call,
    then launches nothing; tests/cpp/dispatch), so a bad empty call is still refused."""
    c = Client(daemon)
    c.run("fp8_comm_per_token_quant", [_empty(0, 64), _empty(0, 66, dtype=FP8)])
    st = session_stats(c)
    assert st.calls == 1 and st.errors == 0 and st.regions == 0 and len(c.s.regions) == 0
    with pytest.raises(ValueError, match=r"x must be torch\.bfloat16, got torch\.float16"):
        c.run("fp8_comm_per_token_quant", [_empty(0, 64, dtype=torch.float16), _empty(0, 66, dtype=FP8)])
    # The rejection is answered before the executor counts it; a later call on the lane finishes after it.
    c.run("fp8_comm_per_token_quant", [_empty(0, 64), _empty(0, 66, dtype=FP8)])
    st = session_stats(c)
    assert st.calls == 2 and st.errors == 1 and c.s.failed is None


def test_region_zero_with_elements_is_a_bad_argument_naming_the_tensor(daemon):
    """Region 0 means "no memory": only an empty view may use it. A ref with elements there is refused as the
    caller's mistake (ValueError), not as an unknown region (which would make a client register again)."""
    import grpc

    c = Client(daemon)
    s, pb = c.s, c.s._pb
    out = c.tensor(4, 66, dtype=FP8)
    rid, off, sizes, strides, dtype = s._tensor_ref(out, set())
    req = pb.CallRequest(session_id=s.reply.session_id, token=s.reply.token, op="fp8_comm_per_token_quant",
                         overload="out", lane=0, host_ordered=True, args=[
                             pb.Argument(tensor=pb.TensorRef(region_id=_wire.NO_REGION, byte_offset=0, sizes=[4, 64],
                                                             strides=[64, 1], dtype=_wire.DTYPE_IDS["bfloat16"])),
                             pb.Argument(tensor=pb.TensorRef(region_id=rid, byte_offset=off, sizes=sizes,
                                                             strides=strides, dtype=dtype))])
    with pytest.raises(grpc.RpcError) as e:
        s._stub.Call(req, timeout=10)
    err = _errors.from_grpc(e.value)
    assert _errors.reason_name(err.reason) == "BAD_ARGUMENT" and err.action == _errors.RAISE_VALUE
    assert "argument 'x'" in err.message and "sizes [4, 64]" in err.message and "region id 0" in err.message
    c.run("fp8_comm_per_token_quant", c.quant())  # the session serves on
    assert session_stats(c).errors == 1 and c.s.failed is None


def test_a_session_without_the_engine_runs_the_call_host_ordered_whatever_the_engine_said(daemon):
    """The engine's kernel hands every call of a session that has no engine (no ring) to Python: it goes
    over gRPC, it is not handed back again."""
    c = Client(daemon)
    again = []
    _session.run(lambda _idx: c.s, 0, "fp8_comm_per_token_quant", c.quant(), again=lambda: again.append(1))
    assert again == [] and c.syncs == 1
    assert session_stats(c).calls == 1


def test_calls_from_many_threads_are_numbered_by_the_daemon(daemon):
    c = Client(daemon)
    args = [c.quant() for _ in range(4)]
    for a in args:  # register first: the threads then only call
        c.run("fp8_comm_per_token_quant", a)
    errors = []

    def work(a):
        try:
            for _ in range(25):
                c.run("fp8_comm_per_token_quant", a)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(a,)) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert session_stats(c).calls == 4 + 100


def test_a_region_the_daemon_evicted_is_registered_again(tmp_path):
    d = fx.daemon(None, "--max-regions", "2")
    try:
        c = Client(d)
        a, b = c.quant(), c.quant()
        c.run("fp8_comm_per_token_quant", a)
        first = {r.base: r.region_id for r in c.s.regions.regions()}
        c.run("fp8_comm_per_token_quant", b)  # the daemon evicts a's two (idle) regions to map b's
        c.run("fp8_comm_per_token_quant", a)  # REGION_UNKNOWN: registered again, run once more
        again = {r.base: r.region_id for r in c.s.regions.regions()}
        base = a[0].data_ptr()
        assert again[base] != first[base], "a's region was registered anew"
        st = session_stats(c)
        assert st.calls == 3 and st.errors == 1  # the one rejection that asked for re-registration
        assert c.s.failed is None
    finally:
        d.kill()


def test_a_catalog_skew_names_both_sides(daemon):
    c = Client(daemon)
    skewed = {"fp8_comm_per_token_quant.out": "(Tensor x, *, Tensor(a!) out, int extra) -> Tensor(a!)"}
    with pytest.raises(CatalogSkewError) as e:
        c.s.check_ops(skewed)
    text = str(e.value)
    assert "client (cache_dit_opd" in text and "daemon (cache-dit-opd" in text and "int extra" in text


def test_a_missing_family_says_so(daemon):
    c = Client(daemon)
    with pytest.raises(DaemonUnavailableError, match="opd_not_served.out"):
        c.s.check_ops({"opd_not_served.out": "(Tensor act, *, Tensor(a!) out) -> Tensor(a!)"})
    c.s.check_ops(_comm._SCHEMAS)  # the other family is unaffected


def test_a_daemon_without_a_device_is_not_served_with_its_reason():
    d = fx.daemon(None, env={"CACHE_DIT_OPD_FAKE_NOT_SERVING": "no GPU in this container"}, serving=False)
    try:
        with pytest.raises(DaemonUnavailableError, match="no GPU in this container"):
            Client(d)
    finally:
        d.kill()


def test_a_daemon_of_another_gpu_is_refused(daemon):
    with pytest.raises(DaemonUnavailableError, match="WRONG_DEVICE"):
        Client(daemon, uuid="GPU-ffffffff-ffff-ffff-ffff-ffffffffffff")


def test_no_daemon_is_daemon_unavailable(tmp_path):
    with pytest.raises(DaemonUnavailableError, match="no answer"):
        _session.Session(0, target=f"unix:{tmp_path}/absent.sock", driver=fx.FakeDriver(), native=False).open()


def test_a_client_of_another_protocol_is_refused_naming_both_versions(daemon, monkeypatch):
    monkeypatch.setattr(_wire, "PROTOCOL_VERSION", _wire.PROTOCOL_VERSION + 1)
    with pytest.raises(CatalogSkewError) as e:
        Client(daemon)
    text = str(e.value)
    assert f"speaks protocol version {_wire.PROTOCOL_VERSION - 1}" in text  # the daemon's
    assert f"speaks protocol version {_wire.PROTOCOL_VERSION}" in text      # this client's


def test_a_restarted_daemon_is_reconnected_to_and_the_call_runs_once_more(tmp_path):
    d = fx.daemon()
    try:
        c = Client(d)
        c.run("fp8_comm_per_token_quant", c.quant())
        first = c.s.reply.session_id
        d.kill()
        d.start()  # the same socket, a new daemon that knows no session
        c.run("fp8_comm_per_token_quant", c.quant())  # UNAVAILABLE or SESSION_UNKNOWN: reconnect, run again
        assert c.s.failed is None and c.s.reply.session_id >= 1
        assert session_stats(c).calls == 1
        assert c.s.reply.session_id == 1 or c.s.reply.session_id != first
    finally:
        d.kill()


def test_close_ends_the_session_in_the_daemon(daemon):
    c = Client(daemon)
    c.run("fp8_comm_per_token_quant", c.quant())
    c.s.close()
    assert c.s.failed is not None
    assert _errors.reason_name(c.s.failed.reason) == "CLOSED"
    assert daemon.stats().sessions == 0


def test_a_call_waits_for_its_kernel_and_a_closed_session_answers_it():
    d = fx.daemon(None, env={"CACHE_DIT_OPD_FAKE_HOLD": "1"})  # kernels never finish
    try:
        c = Client(d)
        args = c.quant()
        c.s.register(args)
        done = []
        t = threading.Thread(target=lambda: done.append(_call_result(c, args)))
        t.start()
        t.join(0.5)
        assert t.is_alive(), "a host-ordered call returned before its kernel finished"
        stub_close(c.s)
        t.join(10)
        assert done and _errors.reason_name(done[0].reason) == "CLOSED", done
        assert done[0].action == _errors.RECONNECT
    finally:
        d.kill()


def _call_result(c, args):
    try:
        c.s.call_host_ordered("fp8_comm_per_token_quant", args)
        return None
    except _errors.DaemonError as e:
        return e


def stub_close(s):
    s._stub.CloseSession(s._pb.CloseSessionRequest(session_id=s.reply.session_id, token=s.reply.token), timeout=5)


def test_sigterm_drains_and_the_daemon_exits_cleanly(daemon):
    c = Client(daemon)
    c.run("fp8_comm_per_token_quant", c.quant())
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(30) == 0


class _DeadDaemonsEngine:
    """In place of the native engine (which runs calls only on a GPU: test_client_gpu's restart test drives the
    real one): an engine whose daemon died with two calls accepted and unfinished, as its monitor reports it."""

    def __init__(self):
        self.lost, self.closed, self.failed_with = 2, False, None

    def failure(self):
        return _errors.DaemonError(14, _wire.REASONS["CLOSED"][0], "the daemon closed the session channel")

    def take_rejected(self, wait=False):
        return []

    def take_lost(self):
        n, self.lost = self.lost, 0
        return n

    def fail(self, err):
        self.failed_with = err

    def activate(self, on):
        pass

    def close(self):
        self.closed = True


def test_a_failure_noticed_by_reading_failed_still_releases_the_session_and_keeps_its_lost_calls(daemon):
    """Reading ``failed`` records the engine's failure; releasing the session afterwards (what get_session and
    close do) must still close the engine and the daemon's side, and the calls the dead daemon left unfinished
    must be raised by take_deferred_errors() (once), not dropped with the engine."""
    c = Client(daemon)
    engine = c.s.native = _DeadDaemonsEngine()
    assert c.s.failed is not None  # recorded here...
    c.s.fail(c.s.failed)  # ...and released here all the same
    assert engine.closed and engine.failed_with is not None
    wait_for(lambda: daemon.stats().sessions_closed >= 1)  # CloseSession reached the daemon
    errs = _session.take_deferred_errors()
    assert len(errs) == 1 and "died with 2 call(s) unfinished" in str(errs[0]), errs
    assert _session.take_deferred_errors() == []
    c.s.fail(c.s.failed)  # once only
    c.s.close()
    assert _session.take_deferred_errors() == []
