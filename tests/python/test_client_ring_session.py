"""Sessions over the shared-memory call ring, against the fake daemon (``--ring``): transport selection, the
synchronous and asynchronous modes and where their errors surface, ordering across lanes, threads and the gRPC
fallback, back-pressure, and a daemon that dies or hangs with records in flight. No GPU needed (FakeDriver:
stream operations act on host memory at once).
"""

import json
import os
import shutil
import signal
import threading
import time

import pytest

import _client_fixtures as fx

import cache_dit_opd
from cache_dit_opd import _ring, _session

UUID = "GPU-00000000-0000-0000-0000-0000000000{:02d}"
CATALOG = sorted(fx.client_catalog() + [("op", "out", "(Tensor x) -> ()"), ("reject_me", "out", "(Tensor x) -> ()")])


@pytest.fixture
def tmp():
    d = fx.short_tmpdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(autouse=True)
def _clean_state():
    _session.take_deferred_errors()
    prev = _session.set_async_calls(False)
    yield
    _session.set_async_calls(prev)
    _session.take_deferred_errors()


class Daemon:
    def __init__(self, tmp, n, *args):
        self.log = os.path.join(tmp, "calls.jsonl")
        self.pause_file = os.path.join(tmp, "pause")
        self.fake = fx.FakeDaemon(tmp, UUID.format(n), "--ring", "--record-log", self.log,
                                  "--ring-pause-file", self.pause_file, *args, catalog=CATALOG).start()
        self.sessions = []

    def open(self, **kw):
        kw.setdefault("driver", fx.FakeDriver())
        s = _session.Session(0, target=self.fake.address, uuid=self.fake.uuid, torch_streams=False, **kw).open()
        self.sessions.append(s)
        return s

    def calls(self, transport=None):
        if not os.path.exists(self.log):
            return []
        out = [json.loads(line) for line in open(self.log)]
        return [c for c in out if "event" not in c and (transport is None or c["transport"] == transport)]

    def opens(self):
        return [json.loads(line) for line in open(self.log) if '"event": "open"' in line]

    def pause(self):
        open(self.pause_file, "w").close()

    def resume(self):
        os.unlink(self.pause_file)

    def close(self):
        if os.path.exists(self.pause_file):
            self.resume()
        for s in self.sessions:
            try:
                s.close()
            except Exception:
                pass
        self.fake.kill()


@pytest.fixture
def daemons(tmp):
    made = []

    def make(n, *args):
        sub = os.path.join(tmp, str(n))
        os.mkdir(sub)
        d = Daemon(sub, n, *args)
        made.append(d)
        return d

    yield make
    for d in made:
        if d.fake.proc and d.fake.proc.poll() is None:
            os.kill(d.fake.proc.pid, signal.SIGCONT)
        d.close()


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _answered(s, n):
    """The daemon has answered the session's first n records."""
    p = s.transport.producer
    return lambda: all(p._done[t & p._mask].value >= t + 1 for t in range(n))


# -- transport selection --------------------------------------------------------------------------


def test_ring_is_used_when_the_daemon_offers_it(daemons):
    d = daemons(1)
    s = d.open()
    assert s.reply.ring_enabled and s.transport.name == "ring"
    assert d.opens()[-1]["want_ring"] is True
    drv = s.driver
    for _ in range(5):
        s.call("fp8_comm_per_token_quant", [])
    lane = s._lanes[0]
    assert lane.issued == lane.waited == lane.inputs_ready() == lane.done() == 5
    assert [v for _, a, v in drv.writes if a == lane.inputs_dptr] == [1, 2, 3, 4, 5]
    assert [v for _, a, v in drv.waits if a == lane.done_dptr] == [1, 2, 3, 4, 5]
    calls = d.calls()
    assert [c["transport"] for c in calls] == ["ring"] * 5
    assert [(c["ticket"], c["seq"], c["lane"], c["flags"]) for c in calls] == [(i, i + 1, 0, 0) for i in range(5)]
    assert all(c["op"] == "fp8_comm_per_token_quant" and c["overload"] == "out" for c in calls)
    assert s.stats().session[0].calls == 5 and s.stats().session[0].errors == 0


def test_op_index_is_the_catalog_position(daemons):
    d = daemons(2)
    s = d.open()
    for name in ("reject_me", "op", "fused_merge_attn_states", "fp8_comm_qkv_permute_dequant"):
        try:
            s.call(name, [])
        except ValueError:
            pass
    assert [c["op"] for c in d.calls("ring")] == ["reject_me", "op", "fused_merge_attn_states",
                                                  "fp8_comm_qkv_permute_dequant"]


def test_arguments_travel_in_the_record(daemons):
    d = daemons(3)
    s = d.open()
    rid = s.regions._register(b"\0" * 64, 0x7F0000000000, 1 << 20, 1)
    args = [(_ring.ARG_TENSOR, (rid, 256, (4, 8), (8, 1), 3)), (_ring.ARG_INT, -5), (_ring.ARG_FLOAT, 0.5),
            (_ring.ARG_BOOL, True), (_ring.ARG_INT_LIST, (1, 2)), (_ring.ARG_FLOAT_LIST, (1.0,)),
            (_ring.ARG_BOOL_LIST, (False,)), (_ring.ARG_NONE, None)]
    s._encode = lambda a, pinned: args
    s.call("op", ["anything"])
    (c,) = d.calls()
    assert c["args"] == [
        {"kind": "tensor", "region_id": rid, "byte_offset": 256, "sizes": [4, 8], "strides": [8, 1], "dtype": 3},
        {"kind": "int", "value": -5}, {"kind": "float", "value": 0.5}, {"kind": "bool", "value": True},
        {"kind": "int_list", "values": [1, 2]}, {"kind": "float_list", "values": [1.0]},
        {"kind": "bool_list", "values": [False]}, {"kind": "none"}]


def test_env_var_turns_the_ring_off(daemons, monkeypatch):
    d = daemons(4)
    monkeypatch.setenv("CACHE_DIT_OPD_RING", "0")
    s = d.open()
    assert d.opens()[-1]["want_ring"] is False
    assert not s.reply.ring_enabled and s.transport.name == "grpc"
    h = _session._layout.read_header(s._mm)
    assert h["ring_offset"] == 0 and h["ring_bytes"] == 0
    with cache_dit_opd.async_calls():  # asynchronous mode needs the ring: over gRPC calls stay synchronous
        s.call("op", [])
        with pytest.raises(ValueError, match="value 42"):
            s.call("reject_me", [])
    assert [c["transport"] for c in d.calls()] == ["grpc", "grpc"]


def test_daemon_without_ring_means_grpc(tmp):
    with fx.FakeDaemon(tmp, UUID.format(5), catalog=CATALOG) as d:
        s = _session.Session(0, target=d.address, uuid=d.uuid, driver=fx.FakeDriver(), torch_streams=False).open()
        assert s.transport.name == "grpc"
        s.call("op", [])
        s.close()


def test_ring_off_on_other_architectures(daemons, monkeypatch):
    monkeypatch.setattr(_ring, "architecture_supported", lambda machine=None: False)
    monkeypatch.setattr(_session, "_arch_warned", False)
    d = daemons(6)
    s = d.open()
    assert s.transport.name == "grpc" and d.opens()[-1]["want_ring"] is False


# -- synchronous mode ------------------------------------------------------------------------------


def test_sync_rejection_raises_at_the_call_site(daemons):
    d = daemons(7)
    s = d.open()
    with pytest.raises(ValueError, match=r"cache_dit_cuda_ops::reject_me\.out rejected by the daemon: "
                                         r"rejected: op reject_me, value 42"):
        s.call("reject_me", [])
    assert s.failed is None
    s.call("op", [])
    lane = s._lanes[0]
    assert lane.issued == 2 and lane.done() == 2 and lane.waited == 2
    assert not _session.take_deferred_errors()


def test_sync_call_waits_for_its_completion(daemons):
    d = daemons(8)
    s = d.open()
    d.pause()
    done = threading.Event()
    t = threading.Thread(target=lambda: (s.call("op", []), done.set()))
    t.start()
    time.sleep(0.3)
    assert not done.is_set()
    d.resume()
    t.join(10)
    assert done.is_set()


def _encode_one_tensor(s) -> None:
    """Every call of ``s`` carries one uint8 tensor of 64 bytes in one (fake) allocation: its region."""
    base = s.driver.alloc(1 << 20)

    def encode(args, pinned):
        rid, off = s.regions.ref(base, 64, pinned)
        return [(_ring.ARG_TENSOR, (rid, off, (64,), (1,), 5))]

    s._encode = encode


def test_region_evicted_by_the_daemon_is_registered_again(daemons):
    d = daemons(9)
    s = d.open()
    _encode_one_tensor(s)
    s.call("op", ["x"])
    (rid,) = [r.region_id for r in s.regions.regions()]
    s._unregister_region(rid)  # behind the table's back, as the daemon's LRU would
    s.call("op", ["x"])  # NOT_FOUND over the ring: registered again, sent again
    (rid2,) = [r.region_id for r in s.regions.regions()]
    assert rid2 != rid and s.failed is None
    assert [c["transport"] for c in d.calls()] == ["ring"] * 3


# -- asynchronous mode -------------------------------------------------------------------------------


def test_async_call_returns_once_published_and_the_stream_still_waits(daemons):
    d = daemons(10)
    s = d.open()
    d.pause()  # the daemon reads nothing
    with cache_dit_opd.async_calls():
        for _ in range(3):
            s.call("op", [])
    lane = s._lanes[0]
    assert lane.issued == lane.waited == 3 and lane.done() == 0
    assert [v for _, a, v in s.driver.waits if a == lane.done_dptr] == [1, 2, 3]  # enqueued before the answer
    assert s.transport.in_flight() == 3 and d.calls() == []
    d.resume()
    assert _wait_for(lambda: lane.done() == 3)
    cache_dit_opd.synchronize()  # nothing to report
    assert s.transport.in_flight() == 0
    assert [c["flags"] for c in d.calls()] == [_ring.RECORD_FLAG_ASYNC] * 3


def test_async_rejection_is_raised_by_the_next_call(daemons):
    d = daemons(11)
    s = d.open()
    with cache_dit_opd.async_calls():
        s.call("reject_me", [])  # returns: the rejection comes later
        assert _wait_for(_answered(s, 1))
        with pytest.raises(ValueError) as e:
            s.call("op", [])
    msg = str(e.value)
    assert "cache_dit_cuda_ops::reject_me.out rejected by the daemon" in msg and "value 42" in msg
    assert "asynchronous call on lane 0, seq 1" in msg and "outputs were not written" in msg
    assert [c["op"] for c in d.calls()] == ["reject_me"]  # the call that raised did not run
    lane = s._lanes[0]
    assert lane.issued == 1 and lane.done() == 1  # the rejected seq was still completed in order
    s.call("op", [])  # reported once; the lane goes on
    assert lane.issued == 2 and lane.done() == 2
    assert not _session.take_deferred_errors()


def test_async_rejection_is_raised_by_synchronize(daemons):
    d = daemons(12)
    s = d.open()
    _session.set_async_calls(True)  # process-wide
    d.pause()  # published before any answer: no later call sees the rejection first
    s.call("op", [])
    s.call("reject_me", [])
    s.call("op", [])
    d.resume()
    with pytest.raises(ValueError, match=r"reject_me\.out rejected by the daemon: rejected: op reject_me, "
                                         r"value 42 \(asynchronous call on lane 0, seq 2"):
        cache_dit_opd.synchronize()
    cache_dit_opd.synchronize()  # reported once
    s.call("op", [])
    cache_dit_opd.synchronize()
    assert s._lanes[0].done() == 4


def test_several_async_rejections_are_reported_together(daemons):
    d = daemons(13)
    s = d.open()
    d.pause()  # all three published before the first answer (else the next call raises it)
    with cache_dit_opd.async_calls():
        for _ in range(3):
            s.call("reject_me", [])
    d.resume()
    with pytest.raises(ValueError) as e:
        cache_dit_opd.synchronize()
    assert "seq 1" in str(e.value) and "(and 2 more:" in str(e.value) and "seq 3" in str(e.value)


def test_async_rejection_is_raised_at_close(daemons):
    d = daemons(14)
    s = d.open()
    d.pause()
    with cache_dit_opd.async_calls():
        s.call("op", [])
        s.call("reject_me", [])
    threading.Timer(0.3, d.resume).start()  # close waits for the records in flight
    with pytest.raises(ValueError, match=r"reject_me\.out rejected by the daemon"):
        s.close()
    assert s.failed is not None and "closed by the client" in s.failed
    assert [c["op"] for c in d.calls()] == ["op", "reject_me"]
    assert not _session.take_deferred_errors()


def test_close_sessions_raises_async_errors(daemons, monkeypatch):
    d = daemons(15)
    s = d.open()
    monkeypatch.setitem(_session._sessions, 0, s)
    with cache_dit_opd.async_calls():
        s.call("reject_me", [])
    with pytest.raises(ValueError, match="reject_me"):
        cache_dit_opd.close_sessions()
    assert s.failed is not None


def test_async_region_not_found_forgets_the_region(daemons):
    d = daemons(16)
    s = d.open()
    _encode_one_tensor(s)
    s.call("op", ["x"])
    (rid,) = [r.region_id for r in s.regions.regions()]
    s._unregister_region(rid)
    with cache_dit_opd.async_calls():
        s.call("op", ["x"])
        assert _wait_for(_answered(s, 2))
        with pytest.raises(RuntimeError, match=f"NOT_FOUND: region {rid} not found"):
            s.call("op", ["x"])
        s.call("op", ["x"])  # registered again
    cache_dit_opd.synchronize()
    assert rid not in [r.region_id for r in s.regions.regions()]


def test_async_scope_is_per_thread_and_set_async_calls_per_process():
    assert not cache_dit_opd.async_calls_enabled()
    seen = {}
    with cache_dit_opd.async_calls():
        assert cache_dit_opd.async_calls_enabled()
        t = threading.Thread(target=lambda: seen.setdefault("other", cache_dit_opd.async_calls_enabled()))
        t.start()
        t.join()
        with cache_dit_opd.async_calls(False):
            assert not cache_dit_opd.async_calls_enabled()
        assert cache_dit_opd.async_calls_enabled()
    assert seen["other"] is False  # a scope is the thread's own
    assert not cache_dit_opd.async_calls_enabled()
    assert cache_dit_opd.set_async_calls(True) is False
    t = threading.Thread(target=lambda: seen.setdefault("process", cache_dit_opd.async_calls_enabled()))
    t.start()
    t.join()
    assert seen["process"] is True
    with cache_dit_opd.async_calls(False):
        assert not cache_dit_opd.async_calls_enabled()
    assert cache_dit_opd.set_async_calls(False) is True


# -- ordering, threads, back-pressure ---------------------------------------------------------------


def test_many_threads_and_streams_one_client(daemons):
    d = daemons(17, "--max-lanes", "4")
    s = d.open(lanes=4)
    errors = []
    per = 40

    def work(i):
        try:
            with cache_dit_opd.async_calls(i % 2 == 0):
                for k in range(per):
                    s._call_on_lane("op", "out", [(_ring.ARG_INT, i * 1000 + k)], 1000 + i % 6,
                                    cache_dit_opd.async_calls_enabled())
        except Exception as e:  # pragma: no cover
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    cache_dit_opd.synchronize()
    assert not errors, errors
    assert sum(l.issued for l in s._lanes) == 12 * per
    assert all(l.done() == l.issued == l.inputs_ready() == l.waited for l in s._lanes)
    assert s.stats().session[0].errors == 0  # every seq arrived as previous + 1 with its inputs ready
    calls = d.calls()
    assert len(calls) == 12 * per and sorted(c["ticket"] for c in calls) == list(range(12 * per))
    assert sum(c["flags"] for c in calls) == 6 * per  # the async threads' records
    by_lane = {}
    for c in calls:
        by_lane.setdefault(c["lane"], []).append(c["seq"])
    assert all(v == list(range(1, len(v) + 1)) for v in by_lane.values())


def test_ring_full_blocks_the_caller_and_drops_nothing(daemons):
    d = daemons(18, "--ring-capacity", "4")
    s = d.open()
    assert s.transport.producer.capacity == 4
    d.pause()
    with cache_dit_opd.async_calls():
        for _ in range(4):
            s.call("op", [])
        done = threading.Event()

        def fifth():
            with cache_dit_opd.async_calls():
                s.call("op", [])
            done.set()

        t = threading.Thread(target=fifth)
        t.start()
        time.sleep(0.3)
        assert not done.is_set(), "a full ring blocks the call"
        d.resume()
        t.join(10)
        assert done.is_set()
        for _ in range(20):  # wraps around the 4 slots several times
            s.call("op", [])
    cache_dit_opd.synchronize()
    assert [c["seq"] for c in d.calls()] == list(range(1, 26))
    assert s.transport.producer.full_waits >= 1


def test_calls_the_ring_cannot_carry_go_over_grpc_in_order(daemons):
    d = daemons(19)
    s = d.open()
    d.pause()
    with cache_dit_opd.async_calls():
        s.call("op", [])
        s.call("op", [])
    threading.Timer(0.3, d.resume).start()
    s.call("not_in_the_catalog", [])  # waits for the ring's earlier records, then gRPC
    s._call_on_lane("op", "out", [(_ring.ARG_INT, i) for i in range(40)], 0)  # > 32 args: no record
    s.call("op", [])
    calls = d.calls()
    assert [(c["transport"], c["seq"]) for c in calls] == [("ring", 1), ("ring", 2), ("grpc", 3), ("grpc", 4),
                                                         ("ring", 5)]
    assert s.transport.grpc_calls == 2 and s.stats().session[0].errors == 0


# -- failures: no stream waits forever ---------------------------------------------------------------------


def test_daemon_killed_with_async_records_in_flight(daemons):
    d = daemons(20, "--hold")  # accepted, "kernels" never finish
    s = d.open(lanes=2)
    with cache_dit_opd.async_calls():
        for stream in (1, 1, 1, 2):
            s._call_on_lane("op", "out", [], stream, True)
    assert _wait_for(lambda: len(d.calls()) == 4)
    d.pause()  # the next record is never read
    with cache_dit_opd.async_calls():
        s._call_on_lane("op", "out", [], 1, True)
    assert not s.driver.waits_satisfied()
    d.fake.kill()
    assert _wait_for(lambda: s.failed is not None)
    assert _wait_for(lambda: s.driver.waits_satisfied())  # every pending wait released from the host
    assert [l.done() for l in s._lanes] == [4, 1]
    assert s.retryable
    errs = _session.take_deferred_errors()
    assert len(errs) == 1 and "died with 5 call(s) unfinished" in str(errs[0]), errs
    with pytest.raises(_session.SessionFailedError):
        s.call("op", [])


def _call_in_thread(s):
    """Starts ``s.call("op", [])`` on a thread: (the thread, the list its exception lands in)."""
    got = []

    def call():
        try:
            s.call("op", [])
        except Exception as e:
            got.append(e)

    t = threading.Thread(target=call)
    t.start()
    return t, got


def test_daemon_killed_during_a_sync_ring_call(daemons):
    d = daemons(21, "--ring-no-completions")  # records are read, never answered
    s = d.open()
    t, got = _call_in_thread(s)
    assert _wait_for(lambda: len(d.calls()) == 1)
    time.sleep(0.1)
    assert t.is_alive()
    d.fake.kill()
    t.join(15)
    assert not t.is_alive(), "the synchronous call hung on a dead daemon"
    (e,) = got
    assert isinstance(e, _session.SessionFailedError) and e.retryable
    assert s.driver.waits_satisfied() and s._lanes[0].done() >= s._lanes[0].issued


def test_unanswered_async_records_of_an_ended_session_are_reported(daemons):
    d = daemons(22, "--ring-no-completions")
    s = d.open()
    with cache_dit_opd.async_calls():
        s.call("op", [])  # read and run (done written) but never answered
    assert _wait_for(lambda: s._lanes[0].done() == 1)
    d.fake.kill()
    assert _wait_for(lambda: s.failed is not None)
    assert _wait_for(lambda: any("never answered" in str(e) for e in _session._deferred))
    errs = _session.take_deferred_errors()
    assert len(errs) == 1 and "1 asynchronous call(s)" in str(errs[0]) and "outputs are undefined" in str(errs[0])


def test_hung_daemon_is_detected_by_its_heartbeat(daemons, monkeypatch):
    monkeypatch.setattr(_session, "HEARTBEAT_TIMEOUT_S", 0.6)
    monkeypatch.setattr(_session, "DRAIN_TIMEOUT_S", 1.0)
    d = daemons(23, "--hold")
    s = d.open()
    with cache_dit_opd.async_calls():
        s.call("op", [])  # accepted; its "kernel" never finishes: a stream waits on done >= 1
    assert _wait_for(lambda: s._hb_armed)  # the heartbeat was seen advancing
    os.kill(d.fake.proc.pid, signal.SIGSTOP)  # alive, but frozen
    t, got = _call_in_thread(s)
    t.join(20)
    assert not t.is_alive(), "the call hung on a frozen daemon"
    assert isinstance(got[0], _session.SessionFailedError), got
    assert "heartbeat" in str(got[0]) or "heartbeat" in (s.failed or "")
    assert _wait_for(lambda: s.driver.waits_satisfied(), 15)  # released after DRAIN_TIMEOUT_S
    os.kill(d.fake.proc.pid, signal.SIGCONT)


def test_heartbeat_watch_fails_an_idle_client_with_pending_waits(daemons, monkeypatch):
    """No call is being made: the watcher alone notices the frozen daemon and releases the stream."""
    monkeypatch.setattr(_session, "HEARTBEAT_TIMEOUT_S", 0.6)
    monkeypatch.setattr(_session, "DRAIN_TIMEOUT_S", 1.0)
    d = daemons(24, "--hold")
    s = d.open()
    with cache_dit_opd.async_calls():
        s.call("op", [])
    assert _wait_for(lambda: s._hb_armed)
    os.kill(d.fake.proc.pid, signal.SIGSTOP)
    assert _wait_for(lambda: s.failed is not None, 15)
    assert "heartbeat" in s.failed
    assert _wait_for(lambda: s.driver.waits_satisfied(), 15)
    errs = _session.take_deferred_errors()
    assert any("unfinished" in str(e) for e in errs), errs
    os.kill(d.fake.proc.pid, signal.SIGCONT)


def test_no_heartbeat_no_false_alarm(daemons, monkeypatch):
    """A daemon that never advances its heartbeat is not judged by it (the check arms on the first increment)."""
    monkeypatch.setattr(_session, "HEARTBEAT_TIMEOUT_S", 0.3)
    d = daemons(25, "--no-heartbeat")
    s = d.open()
    with cache_dit_opd.async_calls():
        s.call("op", [])
    time.sleep(1.0)
    s.call("op", [])
    assert s.failed is None and not s._hb_armed
