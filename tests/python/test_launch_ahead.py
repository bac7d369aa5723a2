"""Launch ahead through the real daemon (fake device ops): parked waits, their bound and their release.

The daemon enqueues a call whose inputs are not ready yet behind a GPU wait on the lane's inputs_ready
while the lane holds one of ``--parking-slots`` slots (server/exec/executor.h). These tests drive it as a
raw protocol client does: a session bound on its channel, its shared memory mapped, calls with explicit
lane sequence numbers, inputs_ready written (or not) by hand. The fake device's streams honour the waits
(tests/fake_daemon/fakes.h), so "done" moves only when the inputs do.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct

import pytest

import _client_fixtures as fx
from test_client_reasons import TIMEOUT_S, Peer, rejected, wait_for

from cache_dit_opd import _layout, _wire


class Client(Peer):
    """A Peer whose sessions keep their shared memory mapped: inputs_ready and done by hand."""

    def __init__(self, d):
        super().__init__(d)
        self.maps: dict[int, mmap.mmap] = {}
        self.channels: dict[int, socket.socket] = {}

    def bound_mapped(self):
        r = self.open()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.socks.append(sock)
        sock.settimeout(TIMEOUT_S)
        sock.connect(r.session_channel_path)
        sock.sendall(_layout.BIND_REQUEST.pack(_wire.BIND_REQUEST_MAGIC, _wire.PROTOCOL_VERSION, r.session_id,
                                               bytes(r.token)))
        msg, fds, _, _ = socket.recv_fds(sock, _wire.BIND_REPLY_SIZE, 4)
        assert _layout.BIND_REPLY.unpack(msg)[0] == 0 and len(fds) == 1
        self.maps[r.session_id] = mmap.mmap(fds[0], r.shared_memory_bytes)
        self.channels[r.session_id] = sock
        os.close(fds[0])
        return r

    def _word(self, r, offset):
        return _layout.LANES_OFFSET + offset  # lane 0

    def inputs_ready(self, r, value=None):
        off = self._word(r, _layout.LANE_INPUTS_READY_OFFSET)
        if value is not None:
            struct.pack_into("<Q", self.maps[r.session_id], off, value)
        return struct.unpack_from("<Q", self.maps[r.session_id], off)[0]

    def done(self, r):
        return struct.unpack_from("<Q", self.maps[r.session_id], self._word(r, _layout.LANE_DONE_OFFSET))[0]

    def call_seq(self, r, seq, args):
        return self.call(r, args=args, host_ordered=False, lane=0, seq=seq)

    def close(self):
        for m in self.maps.values():
            m.close()
        super().close()


@pytest.fixture
def client(request):
    d = fx.daemon(None, *request.param)
    c = Client(d)
    yield c
    c.close()
    d.stop()


@pytest.mark.parametrize("client", [("--parking-slots", "2")], indirect=True)
def test_a_call_goes_ahead_of_its_inputs_and_completes_when_they_arrive(client):
    r = client.bound_mapped()
    args = client.quant_args(r)
    for seq in (1, 2):
        client.call_seq(r, seq, args)  # accepted at once, inputs not ready
    wait_for(lambda: client.d.stats().calls >= 2)  # both enqueued on the (fake) GPU
    assert client.done(r) == 0
    client.inputs_ready(r, 1)
    wait_for(lambda: client.done(r) == 1)
    client.inputs_ready(r, 2)
    wait_for(lambda: client.done(r) == 2)


@pytest.mark.parametrize("client", [("--parking-slots", "1", "--park-deadline-ms", "200")], indirect=True)
def test_a_stalled_client_loses_its_slot_and_its_session_and_the_other_runs(client):
    stalled, other = client.bound_mapped(), client.bound_mapped()
    client.call_seq(stalled, 1, client.quant_args(stalled))  # parked; its client never signals
    wait_for(lambda: client.d.stats().calls >= 1)
    client.call_seq(other, 1, client.quant_args(other))  # needs the only slot
    # Past the deadline the daemon releases the stalled wait (raising that client's own inputs_ready)...
    wait_for(lambda: client.inputs_ready(stalled) >= 1 and client.done(stalled) == 1)
    # ...and ends its session.
    wait_for(lambda: client.d.stats().sessions_closed >= 1)
    err = rejected(lambda: client.call_seq(stalled, 2, client.quant_args(other)))
    assert err.reason == _wire.REASONS["SESSION_UNKNOWN"][0], err.message
    # The other client parked in its place and runs once it signals.
    assert client.done(other) == 0
    client.inputs_ready(other, 1)
    wait_for(lambda: client.done(other) == 1)
    assert client.d.alive()


def test_a_client_that_never_signals_cannot_block_the_daemon_by_queueing_calls():
    """A CUDA launch blocks while its stream's queue is full (the fake's streams here hold 96 operations), and
    one thread launches for every session: calls behind a wait that never passes stay on the host beyond a
    bound, so the other clients are served, and the client's death lets everything go."""
    client = Client(fx.daemon(None, "--parking-slots", "2", env={"CACHE_DIT_OPD_FAKE_MAX_QUEUED": "96"}))
    try:
        stalled = client.bound_mapped()
        args = client.quant_args(stalled)
        n = 200
        for seq in range(1, n + 1):
            client.call_seq(stalled, seq, args)  # all accepted; its inputs never arrive
        other = client.bound_mapped()
        client.call_seq(other, 1, client.quant_args(other))
        client.inputs_ready(other, 1)
        wait_for(lambda: client.done(other) == 1)
        assert client.done(stalled) == 0
        # The stalled client dies (its session channel closes): the session ends, its calls run or are dropped,
        # and "done" reaches every seq in order.
        client.channels[stalled.session_id].close()
        wait_for(lambda: client.done(stalled) == n)
        third = client.bound_mapped()
        client.call_seq(third, 1, client.quant_args(third))
        client.inputs_ready(third, 1)
        wait_for(lambda: client.done(third) == 1)
        assert client.d.alive()
    finally:
        client.close()
        client.d.stop()


def test_grpc_calls_past_held_calls_are_refused_and_taken_again_once_earlier_ones_run():
    """A gRPC caller has no ring to wait in: while its session holds --held-calls calls, the next is refused with
    RESOURCE_EXHAUSTED and its seq is not taken, so the same seq is accepted once the inputs let calls run."""
    client = Client(fx.daemon(None, "--held-calls", "8", "--parking-slots", "0"))  # every call waits on the host
    try:
        r = client.bound_mapped()
        args = client.quant_args(r)
        for seq in range(1, 9):
            client.call_seq(r, seq, args)  # accepted, held: inputs never ready
        err = rejected(lambda: client.call_seq(r, 9, args))
        assert err.reason == _wire.REASONS["RESOURCE_EXHAUSTED"][0], err.message
        assert "8 calls waiting" in err.message and "--held-calls" in err.message, err.message
        assert client.d.alive()
        client.inputs_ready(r, 8)
        wait_for(lambda: client.done(r) == 8)
        client.call_seq(r, 9, args)  # the refused seq, taken now
        client.inputs_ready(r, 9)
        wait_for(lambda: client.done(r) == 9)
    finally:
        client.close()
        client.d.stop()
