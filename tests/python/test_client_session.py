"""Sessions against a fake daemon process that speaks the real protocol (no GPU needed).

The fake completes a call by writing the lane's ``done`` from the host; the
client's stream operations act on host memory at once (FakeDriver), so every
ordering rule can be checked from the host.
"""

import threading
import time

import pytest

import _client_fixtures as fx

from cache_dit_opd import _attn, _comm, _layout, _session
from cache_dit_opd._proto import opd_pb2 as pb


@pytest.fixture
def tmp_path():
    import shutil

    d = fx.short_tmpdir()  # socket paths must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon(tmp_path):
    d = fx.FakeDaemon(tmp_path).start()
    yield d
    d.kill()


def _open(d, **kw):
    return _session.Session(0, target=d.address, uuid=d.uuid, driver=fx.FakeDriver(), torch_streams=False,
                            **kw).open()


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_open_bind_and_catalog(daemon):
    s = _open(daemon, lanes=3)
    assert s.reply.session_id > 0 and s.reply.lanes == 3
    assert len(s._lanes) == 3
    assert s.driver.registered and s.driver.registered[0][1] == len(s._mm)  # cuMemHostRegister'ed
    h = _layout.read_header(s._mm)
    assert h["magic"] == _layout.SESSION_MEMORY_MAGIC and h["lane_count"] == 3
    s.check_ops(_attn._SCHEMAS)
    s.check_ops(_comm._SCHEMAS)
    assert ("fp8_comm_per_token_quant", "out") in s.catalog
    s.close()


def test_calls_order_seq_inputs_and_waits(daemon):
    s = _open(daemon)
    drv = s.driver
    for _ in range(5):
        s.call("fp8_comm_per_token_quant", [])  # the fake rejects a call whose inputs_ready < seq
    lane = s._lanes[0]
    assert lane.issued == 5 and lane.inputs_ready() == 5 and lane.done() == 5
    # per call: inputs_ready := seq enqueued before the call, wait done >= seq after it
    assert [v for _, a, v in drv.writes if a == lane.inputs_dptr] == [1, 2, 3, 4, 5]
    assert [v for _, a, v in drv.waits if a == lane.done_dptr] == [1, 2, 3, 4, 5]
    assert drv.waits_satisfied()
    st = s.stats()
    assert st.session[0].calls == 5 and st.session[0].errors == 0
    s.close()


def test_one_lane_per_stream_and_lane_moves_with_a_gpu_wait(daemon):
    s = _open(daemon, lanes=2)
    drv = s.driver
    s._call_on_lane("op", "out", [], 100)
    s._call_on_lane("op", "out", [], 200)
    s._call_on_lane("op", "out", [], 100)
    a, b = s._lane_of_stream[100], s._lane_of_stream[200]
    assert a is not b and (a.issued, b.issued) == (2, 1)
    # a third stream takes the least recently used lane (200's), after waiting for its last call
    s._call_on_lane("op", "out", [], 300)
    assert s._lane_of_stream[300] is b and 200 not in s._lane_of_stream
    assert (300, b.done_dptr, 1) in drv.waits  # the new stream waits done >= 1 before writing inputs_ready 2
    assert b.issued == 2 and b.inputs_ready() == 2
    s.close()


def test_threads_and_streams(daemon):
    s = _open(daemon, lanes=4)
    errors = []

    def work(stream):
        try:
            for _ in range(40):
                s._call_on_lane("op", "out", [], stream)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(1000 + i % 6,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sum(l.issued for l in s._lanes) == 12 * 40
    assert all(l.done() == l.issued == l.inputs_ready() for l in s._lanes)
    assert s.stats().session[0].errors == 0  # every seq arrived as previous + 1 with its inputs ready
    s.close()


def test_rejected_call_raises_value_error_and_the_lane_goes_on(daemon):
    s = _open(daemon)
    with pytest.raises(ValueError, match="value 42"):
        s.call("reject_me", [])
    assert s.failed is None
    s.call("fp8_comm_per_token_quant", [])
    assert s._lanes[0].issued == 2 and s._lanes[0].done() == 2
    s.close()


def test_region_evicted_by_the_daemon_is_registered_again(daemon):
    s = _open(daemon)
    drv = s.driver
    base = drv.alloc(1 << 20)

    def encode(args, pinned):
        rid, off = s.regions.ref(base, 64, pinned)
        return [pb.Argument(tensor=pb.TensorRef(region_id=rid, byte_offset=off, sizes=[64], strides=[1],
                                                dtype=5))]

    s._encode = encode
    s.call("fp8_comm_per_token_quant", ["x"])
    (rid,) = [r.region_id for r in s.regions.regions()]
    s._unregister_region(rid)  # behind the table's back, as the daemon's LRU would
    s.call("fp8_comm_per_token_quant", ["x"])
    (rid2,) = [r.region_id for r in s.regions.regions()]
    assert rid2 != rid
    assert s.failed is None
    s.close()


def test_catalog_skew_names_both_versions(tmp_path):
    with fx.FakeDaemon(tmp_path, "GPU-00000000-0000-0000-0000-000000000001",
                       catalog=fx.client_catalog(skew=True)) as d:
        s = _open(d)
        with pytest.raises(_session.CatalogSkewError) as e:
            s.check_ops(_attn._SCHEMAS)
        msg = str(e.value)
        assert "0.0.0-fake" in msg and "cache_dit_opd 0.1.0" in msg
        assert "fused_merge_attn_states.out" in msg and "float scale" in msg
        s.check_ops(_comm._SCHEMAS)  # the other family is unaffected
        s.close()


def test_missing_family(tmp_path):
    with fx.FakeDaemon(tmp_path, "GPU-00000000-0000-0000-0000-000000000002",
                       catalog=fx.client_catalog(families=("attn",))) as d:
        s = _open(d)
        s.check_ops(_attn._SCHEMAS)
        with pytest.raises(_session.DaemonUnavailableError, match="fp8_comm_per_token_quant.out"):
            s.check_ops(_comm._SCHEMAS)
        s.close()


@pytest.mark.parametrize("flag,exc,needle", [
    ("--bad-magic", _session.SessionFailedError, "magic 0xdeadbeef"),
    ("--refuse-bind", _session.SessionFailedError, "refused by --refuse-bind"),
])
def test_bad_bind(tmp_path, flag, exc, needle):
    with fx.FakeDaemon(tmp_path, "GPU-00000000-0000-0000-0000-000000000003", flag) as d:
        with pytest.raises(exc, match=needle):
            _open(d)


def test_not_serving(tmp_path):
    with fx.FakeDaemon(tmp_path, "GPU-00000000-0000-0000-0000-000000000004", "--not-serving",
                       "no GPU in this container") as d:
        with pytest.raises(_session.DaemonUnavailableError, match="no GPU in this container"):
            _open(d)


def test_wrong_gpu(daemon):
    s = _session.Session(0, target=daemon.address, uuid="GPU-ffffffff-0000-0000-0000-000000000000",
                         driver=fx.FakeDriver(), torch_streams=False)
    with pytest.raises(_session.DaemonUnavailableError, match="GPU-ffffffff"):
        s.open()


def test_no_daemon(tmp_path):
    s = _session.Session(0, target=f"unix:{tmp_path}/absent.sock", uuid="GPU-x", driver=fx.FakeDriver(),
                         torch_streams=False)
    with pytest.raises(_session.DaemonUnavailableError, match="no answer"):
        s.open()


def test_daemon_killed_releases_pending_waits_and_reports(tmp_path):
    _session.take_deferred_errors()
    d = fx.FakeDaemon(tmp_path, "GPU-00000000-0000-0000-0000-000000000005", "--hold").start()
    s = _open(d, lanes=2)
    for stream in (1, 1, 1, 2):
        s._call_on_lane("op", "out", [], stream)  # accepted, but the "kernels" never finish
    assert not s.driver.waits_satisfied()
    d.kill()
    assert _wait_for(lambda: s.failed is not None)
    assert s.driver.waits_satisfied()  # every pending wait was released from the host
    assert [l.done() for l in s._lanes] == [3, 1]
    assert s.retryable
    errs = _session.take_deferred_errors()
    assert len(errs) == 1 and "died with 4 call(s) unfinished" in str(errs[0])
    with pytest.raises(_session.SessionFailedError):
        s.call("op", [])


def test_daemon_closing_channel_after_completing_loses_nothing(tmp_path):
    _session.take_deferred_errors()
    d = fx.FakeDaemon(tmp_path, "GPU-00000000-0000-0000-0000-000000000006").start()
    s = _open(d)
    s.call("op", [])
    d.kill()
    assert _wait_for(lambda: s.failed is not None)
    assert not _session.take_deferred_errors()


def test_restart_reconnects_through_run(tmp_path):
    """run(): a call that meets a dead daemon's session runs again on a new session."""
    uuid = "GPU-00000000-0000-0000-0000-000000000007"
    d = fx.FakeDaemon(tmp_path, uuid).start()
    current = {}

    def get_required(idx):
        s = current.get("s")
        if s is None or s.failed is not None:
            s = current["s"] = _open(d)
        return s

    _session.run(get_required, 0, "op", [])
    first = current["s"]
    d.kill()
    d.start()  # restarted daemon on the same socket
    # whether or not the watcher noticed the death yet, the next call succeeds on a new session
    _session.run(get_required, 0, "op", [])
    assert current["s"] is not first and current["s"].failed is None
    assert first.failed is not None
    assert current["s"].stats().session[0].calls == 1
    current["s"].close()
    d.kill()


def test_close_completes_lanes(daemon):
    s = _open(daemon)
    s.call("op", [])
    s.close()
    assert s.failed is not None and "closed by the client" in s.failed
    assert s.regions.closed
    with pytest.raises(_session.SessionFailedError):
        s.call("op", [])


def test_transport_slot_for_the_ring():
    """The ring (issue 6) plugs in beside gRPC through the same two methods."""
    t = _session._GrpcTransport(None, pb, 1, b"x" * 32)
    assert t.name == "grpc" and callable(t.call) and t.deferred_errors() == []
