"""Every error reason (proto/cache_dit_opd/v1/wire.h CACHE_DIT_OPD_REASONS) produced by the real daemon.

Each case provokes its reason from the daemon on fake device operations (tests/fake_daemon/) through the
wire as any client would (gRPC with the reason in trailing metadata, or the session channel's bind reply)
and checks the reason, its google.rpc.Code and the action the client takes (``_errors.action``, the
same table the C++ client's ``Status::action()`` reads: ``_wire.py`` is generated from wire.h). What each
action does is tested once per client: tests/python/test_client_session.py (raise, re-register,
reconnect, fail) and tests/cpp/client/engine_test.cc.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import grpc
import pytest
import torch

import _client_fixtures as fx

from cache_dit_opd import _errors, _layout, _session, _wire
from cache_dit_opd._proto import opd_grpc, opd_pb2 as pb

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
TIMEOUT_S = 10

# Reasons the cases here do not provoke, and the test that does: no outside client can provoke the first
# three deterministically; STORE_DENIED needs a second uid.
DAEMON_SIDE_ONLY = {
    "STORE_DENIED": "tests/python/test_store.py::test_another_uid_reads_through_the_allowed_group_but_may_not_delete "
                    "(a child that drops to uid 65534) and tests/cpp/server/weight_store_test.cc",
    "SESSION_ENDED": "tests/cpp/server/executor_test.cc (a call submitted for an ended session); from outside "
                     "only a race with End(), which removes the session first (later calls: SESSION_UNKNOWN)",
    "INTERNAL": "no outside trigger: the daemon's own invariants (e.g. dispatch preparing nothing)",
    "INPUTS_STALLED": "tests/cpp/server/executor_test.cc (AStalledLaneLosesItsSlotPastTheDeadlineWhenAnotherNeedsIt); "
                      "it ends the session, whose calls were answered when accepted (test_launch_ahead.py: the "
                      "stalled client's session ends and the other client's calls run)",
}


class Peer:
    """A raw protocol client of one daemon: a gRPC stub, sessions opened and bound by hand."""

    def __init__(self, d):
        self.d = d
        self.channel = grpc.insecure_channel(d.address)
        self.stub = opd_grpc.OperatorDaemonStub(self.channel)
        self.drv = fx.FakeDriver()
        self.socks: list[socket.socket] = []

    def close(self):
        for s in self.socks:
            s.close()
        self.channel.close()

    def open(self, **kw):
        req = dict(protocol_version=_wire.PROTOCOL_VERSION, client_pid=os.getpid(), lanes=1, client_name="reasons")
        req.update(kw)
        return self.stub.OpenSession(pb.OpenSessionRequest(**req), timeout=TIMEOUT_S)

    def bind(self, r, request: bytes | None = None):
        """Binds ``r`` (an OpenSessionReply) on its channel: the reply's (status code, reason)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.socks.append(sock)
        sock.settimeout(TIMEOUT_S)
        sock.connect(r.session_channel_path)
        if request is None:
            request = _layout.BIND_REQUEST.pack(_wire.BIND_REQUEST_MAGIC, _wire.PROTOCOL_VERSION, r.session_id,
                                                bytes(r.token))
        if request:
            sock.sendall(request)
        return self.bind_reply(sock)

    @staticmethod
    def bind_reply(sock):
        msg, fds, _, _ = socket.recv_fds(sock, _wire.BIND_REPLY_SIZE, 4)
        for fd in fds:
            os.close(fd)
        code, _, _, reason, _ = _layout.BIND_REPLY.unpack(msg)
        return code, reason

    def bound(self, **kw):
        r = self.open(**kw)
        assert self.bind(r) == (0, 0)
        return r

    def tensor(self, r, *shape, dtype=BF16):
        """A TensorRef of a fresh fake allocation registered in session ``r``."""
        nbytes = torch.empty(shape, dtype=dtype, device="meta").numel() * torch.empty((), dtype=dtype).element_size()
        base = self.drv.alloc(nbytes)
        rep = self.stub.RegisterRegion(pb.RegisterRegionRequest(
            session_id=r.session_id, token=r.token, ipc_handle=self.drv.ipc_get_mem_handle(base),
            client_base_address=base, size=nbytes, buffer_id=self.drv.allocs[base][1]), timeout=TIMEOUT_S)
        return self.ref(rep.region_id, shape, dtype)

    @staticmethod
    def ref(region_id, shape, dtype=BF16):
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        return pb.Argument(tensor=pb.TensorRef(region_id=region_id, sizes=shape, strides=strides,
                                               dtype=_wire.DTYPE_IDS[str(dtype).rsplit(".", 1)[-1]]))

    def quant_args(self, r, x_dtype=BF16):
        return [self.tensor(r, 4, 64, dtype=x_dtype), self.tensor(r, 4, 66, dtype=FP8)]

    def call(self, r, op="fp8_comm_per_token_quant", overload="out", args=(), **kw):
        req = dict(session_id=r.session_id, token=r.token, op=op, overload=overload, args=list(args),
                   host_ordered=True)
        req.update(kw)
        return self.stub.Call(pb.CallRequest(**req), timeout=TIMEOUT_S)


def rejected(fn) -> _errors.DaemonError:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return _errors.from_grpc(e.value)


def daemon_of(*flags, env=None, serving=True, survives=True):
    """The daemon a case needs (default: a plain one); ``survives``: it still serves after the case."""

    def mark(case):
        case.daemon = (flags, env, serving, survives)
        return case

    return mark


def wait_for(cond):
    deadline = time.monotonic() + TIMEOUT_S
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# -- the cases: each returns (google.rpc.Code, reason value) as the daemon sent them ---------------------


def bad_argument(p):
    r = p.bound()
    return rejected(lambda: p.call(r, args=p.quant_args(r, x_dtype=torch.float16)))


def unsupported(p):
    r = p.bound()
    return rejected(lambda: p.call(r, overload="", args=p.quant_args(r)[:1]))  # functional: returns a new tensor


def op_unknown(p):
    r = p.bound()
    return rejected(lambda: p.call(r, op="no_such_op", args=[]))


def region_unknown(p):
    r = p.bound()
    return rejected(lambda: p.call(r, args=[p.ref(999, (4, 64)), p.ref(998, (4, 66), FP8)]))


def session_unknown(p):
    r = p.bound()
    return rejected(lambda: p.call(r, session_id=r.session_id + 100, args=[]))


def session_unbound(p):
    r = p.open()
    return rejected(lambda: p.call(r, args=[]))


def bad_token(p):
    r = p.bound()
    return rejected(lambda: p.call(r, token=bytes(_wire.TOKEN_BYTES), args=[]))


def lane_sequence(p):
    r = p.bound()
    return rejected(lambda: p.call(r, args=p.quant_args(r), host_ordered=False, lane=0, seq=5))  # expected 1


def lane_range(p):
    r = p.bound()
    return rejected(lambda: p.call(r, args=p.quant_args(r), host_ordered=False, lane=r.lanes, seq=1))


def malformed(p):
    r = p.open()
    return p.bind(r, request=b"\0" * _layout.BIND_REQUEST.size)  # no bind magic


@daemon_of("--max-sessions", "1")
def resource_exhausted(p):
    p.bound()
    return rejected(p.open)


def peer_refused(p):
    # Another process's pid: this one is not that client (its gRPC connection says who it is).
    return rejected(lambda: p.open(client_pid=os.getppid()))


def version_mismatch(p):
    e = rejected(lambda: p.open(protocol_version=_wire.PROTOCOL_VERSION - 1))
    assert (f"protocol version {_wire.PROTOCOL_VERSION - 1}" in e.message
            and f"protocol version {_wire.PROTOCOL_VERSION}" in e.message), e.message  # both named
    return e


def wrong_device(p):
    return rejected(lambda: p.open(gpu_uuid="GPU-11111111-2222-3333-4444-555555555555"))


@daemon_of(env={"CACHE_DIT_OPD_FAKE_NOT_SERVING": "no device, for the test"}, serving=False)
def not_serving(p):
    e = rejected(p.open)
    assert "no device, for the test" in e.message
    return e


@daemon_of("--drain-deadline-ms", "5000", env={"CACHE_DIT_OPD_FAKE_HOLD": "1"}, survives=False)
def draining(p):
    r = p.bound()
    args = p.quant_args(r)
    held = threading.Thread(target=lambda: rejected(lambda: p.call(r, args=args)), daemon=True)
    held.start()  # a kernel that never finishes keeps the daemon draining
    wait_for(lambda: p.d.stats().calls >= 1)
    os.kill(p.d.pid, signal.SIGTERM)
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            p.open()
        except grpc.RpcError as e:
            err = _errors.from_grpc(e)
            if err.reason == _wire.REASONS["DRAINING"][0] or time.monotonic() > deadline:
                return err
        time.sleep(0.01)


@daemon_of(env={"CACHE_DIT_OPD_FAKE_STICKY_AFTER": "1"}, survives=False)  # the daemon exits to be restarted
def device_lost(p):
    r = p.bound()
    return rejected(lambda: p.call(r, args=p.quant_args(r)))


@daemon_of("--bind-timeout-ms", "200")
def bind_timeout(p):
    r = p.open()
    return p.bind(r, request=b"")  # connects and says nothing


@daemon_of(env={"CACHE_DIT_OPD_FAKE_HOLD": "1"})
def closed(p):
    r = p.bound()
    args = p.quant_args(r)
    got = []
    t = threading.Thread(target=lambda: got.append(rejected(lambda: p.call(r, args=args))))
    t.start()  # held: its kernel never finishes
    wait_for(lambda: p.d.stats().calls >= 1)
    p.stub.CloseSession(pb.CloseSessionRequest(session_id=r.session_id, token=r.token), timeout=TIMEOUT_S)
    t.join(TIMEOUT_S)
    return got[0]  # answered with the session's end


def _store_file(p) -> str:
    import safetensors.torch as st

    path = str(p.d.workdir / "store.safetensors")
    st.save_file({"w": torch.zeros(4)}, path)
    return path


@daemon_of("--max-store-bytes", "1M")
def store_unknown(p):
    r = p.bound()
    return rejected(lambda: p.stub.DeleteStore(pb.DeleteStoreRequest(session_id=r.session_id, token=r.token,
                                                                     name="no/such/entry"), timeout=TIMEOUT_S))


@daemon_of("--max-store-bytes", "1M")
def store_exists(p):
    r = p.bound()
    req = pb.PublishFileRequest(session_id=r.session_id, token=r.token, path=_store_file(p), prefix="twice/")
    p.stub.PublishFile(req, timeout=TIMEOUT_S)
    return rejected(lambda: p.stub.PublishFile(req, timeout=TIMEOUT_S))


CASES = {name: globals()[name.lower()] for name in _wire.REASONS if name not in DAEMON_SIDE_ONLY}


def test_every_reason_has_a_case_or_a_named_daemon_side_test():
    assert set(CASES) | set(DAEMON_SIDE_ONLY) == set(_wire.REASONS)
    assert not set(CASES) & set(DAEMON_SIDE_ONLY)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_daemon_sends_the_reason_and_the_client_acts_on_it(name):
    value, code, action = _wire.REASONS[name]
    case = CASES[name]
    flags, env, serving, survives = getattr(case, "daemon", ((), None, True, True))
    d = fx.daemon(None, *flags, env=env, serving=serving)
    p = Peer(d)
    try:
        got = case(p)
        got_code, got_reason = (got.code, got.reason) if isinstance(got, _errors.DaemonError) else got
        assert (got_code, _errors.reason_name(got_reason)) == (code, name), got
        assert _errors.action(got_code, got_reason) == action
        if survives:  # a rejection costs the daemon nothing: it goes on serving
            assert d.alive() and p.stub.GetVersion(pb.VersionRequest(), timeout=TIMEOUT_S).serving == serving
    finally:
        p.close()
        d.kill()


def test_an_error_echoing_a_huge_value_keeps_its_reason_and_a_bounded_message():
    """The daemon cuts a message to 2048 bytes (server/grpc/grpc_status.h): a 20 KB op name (a non-ASCII one
    travels percent-encoded, three bytes each) would otherwise push the answer past gRPC's 16 KiB of metadata,
    and the client would get gRPC's own RESOURCE_EXHAUSTED with no reason instead of OP_UNKNOWN."""
    d = fx.daemon(None)
    p = Peer(d)
    try:
        r = p.bound()
        for name in ("x" * 20000, "\u00e9" * 10000):
            err = rejected(lambda: p.call(r, op=name, args=[]))
            assert (err.code, _errors.reason_name(err.reason)) == (5, "OP_UNKNOWN"), err
            assert len(err.message.encode()) <= 2048 and err.message.endswith(" more bytes cut)"), err.message[-80:]
            assert name[:100] in err.message
        assert d.alive()
    finally:
        p.close()
        d.kill()


def test_an_error_without_a_reason_acts_by_its_code():
    for code, action in _wire.CODE_ACTIONS.items():
        assert _errors.action(code, 0) == action
    assert _errors.action(0, 0) == 0  # OK: nothing to do
    assert _errors.action(13, 0) == _errors.FAIL  # INTERNAL: not listed, fails the session
    assert _errors.action(3, 9999) == _errors.RAISE_VALUE  # an unknown (newer) reason: its code decides


def test_the_proto_enum_names_every_reason_with_its_value():
    for name, (value, _, _) in _wire.REASONS.items():
        assert pb.Reason.Value(f"REASON_{name}") == value
    assert len(pb.Reason.keys()) == len(_wire.REASONS) + 1  # + REASON_UNSPECIFIED
