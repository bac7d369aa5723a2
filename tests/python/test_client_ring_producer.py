"""The ring producer (_ring.RingProducer) against a stand-in consumer (_client_fixtures.RingConsumer) in a thread,
both on a real memfd mapping: wraparound, back-pressure, many threads, completions in any order, the doorbell
futex, liveness. No GPU, no daemon.

(Torn or rewritten records, absurd indices and other hostile input are the daemon's to detect; see
tests/cpp and test_client_ring_codec.py for the decoder's checks.)
"""

import ctypes
import mmap
import os
import threading
import time

import pytest

import _client_fixtures as fx

from cache_dit_opd import _ring as R

_keep = []  # mappings stay alive (ctypes addresses point into them)


class Ring:
    """A ring in a memfd, a consumer thread answering with ``answer(decoded) -> (code, message)``."""

    def __init__(self, capacity=4, answer=None, liveness=None, start=True, **consumer_kw):
        size = (R.ring_bytes(capacity) + 4095) // 4096 * 4096
        fd = os.memfd_create("cdo-ring-test")
        os.ftruncate(fd, size)
        self.mm = mmap.mmap(fd, size)
        os.close(fd)
        _keep.append(self.mm)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.size = size
        self.records = []  # decoded, in consumption order
        self.errors = []
        self.answer = answer or (lambda d: (0, ""))
        self.consumer = fx.RingConsumer(self.addr, capacity, self._handle, **consumer_kw)
        self.producer = R.RingProducer(self.addr, size, liveness=liveness)
        if start:
            self.consumer.start()

    def _handle(self, t, copy):
        try:
            d = R.decode_record(copy)
        except R.RecordError as e:  # pragma: no cover - reported by the tests
            self.errors.append(f"ticket {t}: {e}")
            return 3, str(e), 0, 0
        if d["ticket"] != t:
            self.errors.append(f"slot of ticket {t} holds ticket {d['ticket']}")
        self.records.append(d)
        code, message = self.answer(d)
        return code, message, d["lane"], d["seq"]

    def publish(self, lane=0, seq=1, args=(), op_index=0, asynchronous=False, **kw):
        body = R.encode_args(list(args))
        return self.producer.publish(lane, seq, op_index, body, len(args), op="op", overload="out",
                                     asynchronous=asynchronous, **kw)

    def close(self):
        self.consumer.stop()


@pytest.fixture
def rings():
    made = []

    def make(*a, **kw):
        r = Ring(*a, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def test_publish_then_wait(rings):
    r = rings(capacity=4)
    e = r.publish(lane=2, seq=5, op_index=3, args=[(R.ARG_INT, -9), (R.ARG_TENSOR, (4, 64, (3, 5), (5, 1), 3))])
    assert r.producer.wait(e) == (0, "")
    (d,) = r.records
    assert (d["ticket"], d["lane"], d["seq"], d["op_index"], d["flags"]) == (0, 2, 5, 3, 0)
    assert d["args"][0] == {"kind": "int", "value": -9}
    assert r.producer.published == r.producer.consumed == 1
    assert r.consumer.tail.value == 1 and r.consumer.head_word.value == 1
    assert not r.errors


def test_wraparound_sync(rings):
    r = rings(capacity=4)
    for i in range(50):
        e = r.publish(seq=i + 1, args=[(R.ARG_INT, i * 7)])
        assert r.producer.wait(e) == (0, "")
    assert [d["ticket"] for d in r.records] == list(range(50))
    assert [d["args"][0]["value"] for d in r.records] == [i * 7 for i in range(50)]
    assert r.producer.consumed == 50 and r.producer.in_flight() == 0
    assert not r.errors


def test_wraparound_async_pipelined_never_drops(rings):
    r = rings(capacity=4)
    n = 300
    for i in range(n):
        r.publish(seq=i + 1, args=[(R.ARG_INT, i), (R.ARG_INT_LIST, tuple(range(i % 64)))], asynchronous=True)
    r.producer.wait_consumed()
    assert [d["seq"] for d in r.records] == list(range(1, n + 1))  # every record, once, in order
    assert all(d["flags"] == R.RECORD_FLAG_ASYNC for d in r.records)
    assert all(d["args"][1]["values"] == list(range(i % 64)) for i, d in enumerate(r.records))
    assert r.producer.poll() == [] and not r.errors


def test_ring_full_blocks_until_completions_are_consumed(rings):
    paused = threading.Event()
    paused.set()
    r = rings(capacity=4, pause=paused.is_set)
    for i in range(4):  # fills the ring without waiting
        r.publish(seq=i + 1, asynchronous=True)
    assert r.producer.published == 4 and r.producer.full_waits == 0
    done = threading.Event()

    def fifth():
        r.publish(seq=5, asynchronous=True)
        done.set()

    t = threading.Thread(target=fifth)
    t.start()
    time.sleep(0.3)
    assert not done.is_set(), "a full ring must block the producer"
    assert r.consumer.tail.value == 4  # nothing overwritten, nothing dropped
    paused.clear()
    t.join(10)
    assert done.is_set()
    r.producer.wait_consumed()
    assert [d["seq"] for d in r.records] == [1, 2, 3, 4, 5]
    assert r.producer.full_waits == 1 and not r.errors


def test_back_pressure_follows_completions_not_the_head(rings):
    """The consumer copied records out (head moved) but answered none: the producer still waits, since the
    completion slot of ticket t - capacity must be consumed before record t may be answered into it."""
    pending = []

    def handler(t, copy):
        d = R.decode_record(copy)
        pending.append((t, d["lane"], d["seq"]))
        return None, "", 0, 0  # no completion yet

    r = rings(capacity=2, start=False)
    r.consumer.handler = handler
    r.consumer.start()
    r.publish(seq=1, asynchronous=True)
    r.publish(seq=2, asynchronous=True)
    assert _wait_for(lambda: r.consumer.head_word.value == 2)
    got = []
    t = threading.Thread(target=lambda: got.append(r.publish(seq=3, asynchronous=True)))
    t.start()
    time.sleep(0.2)
    assert not got, "record 2 may not be published before completion 0 is consumed"
    r.consumer.complete(1, 0, 2, 0, "")  # completion 1 first: not enough
    time.sleep(0.2)
    assert not got
    r.consumer.complete(0, 0, 1, 0, "")
    t.join(10)
    assert got and got[0].ticket == 2
    assert r.producer.consumed == 2  # 0 and 1 consumed (1 out of order), 2 in flight


def test_completions_in_any_order(rings):
    r = rings(capacity=8, start=False)
    r.consumer.handler = lambda t, copy: (None, "", 0, 0)
    r.consumer.start()
    a = r.publish(seq=1)
    b = r.publish(lane=1, seq=1)
    assert _wait_for(lambda: r.consumer.head_word.value == 2)
    r.consumer.complete(1, 1, 1, 3, "lane 1 rejected")
    assert r.producer.wait(b) == (3, "lane 1 rejected")
    assert r.producer.consumed == 0 and r.producer.in_flight() == 2  # a is still unanswered: the cursor waits
    r.consumer.complete(0, 0, 1, 0, "")
    assert r.producer.wait(a) == (0, "")
    assert r.producer.consumed == 2


def test_many_threads_one_producer(rings):
    lanes, per = 8, 150
    last_seq = {}
    order_errors = []

    def answer(d):
        prev = last_seq.get(d["lane"], 0)
        if d["seq"] != prev + 1:
            order_errors.append((d["lane"], prev, d["seq"]))
        last_seq[d["lane"]] = d["seq"]
        if d["args"][0]["value"] != d["lane"] * 100000 + d["seq"]:  # the slot held this record, whole
            order_errors.append(("payload", d))
        return 0, ""

    r = rings(capacity=8, answer=answer)
    errors = []

    def work(lane):
        lock = threading.Lock()  # one thread per lane here; the session's lane lock plays this part
        try:
            for seq in range(1, per + 1):
                with lock:
                    e = r.publish(lane=lane, seq=seq, args=[(R.ARG_INT, lane * 100000 + seq)],
                                  asynchronous=seq % 3 != 0)
                    if seq % 3 == 0:
                        assert r.producer.wait(e) == (0, "")
        except Exception as ex:  # pragma: no cover
            errors.append(repr(ex))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(lanes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    r.producer.wait_consumed()
    assert not errors and not order_errors and not r.errors, (errors, order_errors[:3], r.errors[:3])
    assert len(r.records) == lanes * per
    assert sorted(d["ticket"] for d in r.records) == list(range(lanes * per))
    assert last_seq == {i: per for i in range(lanes)}


def test_rejections(rings):
    long = "x" * 500
    r = rings(capacity=4, answer=lambda d: (3, "value 7 rejected") if d["seq"] == 1 else (11, long))
    assert r.producer.wait(r.publish(seq=1)) == (3, "value 7 rejected")
    code, msg = r.producer.wait(r.publish(seq=2))
    assert code == 11 and msg == "x" * (R.COMPLETION_MESSAGE_BYTES - 1)  # NUL-terminated, truncated
    assert r.producer.poll() == []  # synchronous rejections are the caller's, never queued


def test_async_rejections_are_reported_once(rings):
    r = rings(capacity=4, answer=lambda d: (3, f"bad seq {d['seq']}") if d["seq"] in (2, 4) else (0, ""))
    for i in range(1, 6):
        r.publish(seq=i, asynchronous=True)
    got = []
    assert _wait_for(lambda: got.extend(r.producer.poll()) or len(got) == 2)  # no waiting inside poll()
    r.producer.wait_consumed()
    got += r.producer.take_rejected()
    assert [(e.seq, e.code, e.message) for e in got] == [(2, 3, "bad seq 2"), (4, 3, "bad seq 4")]
    assert all(e.op == "op" and e.overload == "out" for e in got)
    assert r.producer.poll() == [] and r.producer.take_rejected() == []


def test_completion_echoing_another_ticket_is_an_internal_error(rings):
    r = rings(capacity=4, start=False)
    r.consumer.handler = lambda t, copy: (None, "", 0, 0)
    r.consumer.start()
    e = r.publish(seq=1)
    assert _wait_for(lambda: r.consumer.head_word.value == 1)
    a = r.consumer.comps
    ctypes.memmove(a + 8, R.COMPLETION.pack(0, 99, 1, 0, 0, b"")[8:], R.COMPLETION_BYTES - 8)
    ctypes.c_uint64.from_address(a).value = 1
    code, msg = r.producer.wait(e)
    assert code == 13 and "echoes ticket 99" in msg


def test_doorbell_futex_wakes_a_sleeping_consumer(rings):
    r = rings(capacity=4, spin_s=0.0, futex_timeout_s=30.0)
    assert _wait_for(lambda: r.consumer.sleeps >= 1 and r.consumer.doorbell.value == R.DOORBELL_SLEEPING)
    # the idle consumer sleeps in the kernel (FUTEX_WAIT), burning no CPU
    tid = r.consumer.thread.native_id

    def state():
        with open(f"/proc/self/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    assert _wait_for(lambda: state() == "S")
    time.sleep(0.05)
    assert state() == "S" and r.consumer.sleeps == 1  # still asleep: no spinning, no timeouts
    t0 = time.monotonic()
    e = r.publish(seq=1)
    assert r.producer.wait(e, timeout_s=10) == (0, "")
    assert time.monotonic() - t0 < 5, "the consumer was not woken (it would sleep 30 s)"
    assert r.producer.wakes == 1 and r.consumer.woken == 1
    # after idling again, the next record wakes it again
    assert _wait_for(lambda: r.consumer.sleeps >= 2 and r.consumer.doorbell.value == R.DOORBELL_SLEEPING)
    assert r.producer.wait(r.publish(seq=2), timeout_s=10) == (0, "")
    assert r.producer.wakes == 2 and r.consumer.woken == 2


def test_no_wake_while_the_consumer_is_awake(rings):
    r = rings(capacity=4, spin_s=60.0)
    for i in range(20):
        assert r.producer.wait(r.publish(seq=i + 1)) == (0, "")
    assert r.producer.wakes == 0 and r.consumer.sleeps == 0


def test_futex_helpers():
    word = ctypes.c_uint32(R.DOORBELL_SLEEPING)
    addr = ctypes.addressof(word)
    assert R.futex_wake(addr, 1) == 0  # nobody waits
    t0 = time.monotonic()
    assert R.futex_wait(addr, R.DOORBELL_SLEEPING, 0.05) is False  # timed out
    assert time.monotonic() - t0 >= 0.04
    assert R.futex_wait(addr, R.DOORBELL_AWAKE, 5) is True  # value differs: returns at once


def test_a_completion_that_never_comes_breaks_the_wait_by_liveness(rings):
    gone = []
    r = rings(capacity=4, start=False, liveness=lambda: gone[0] if gone else None)
    r.consumer.handler = lambda t, copy: (None, "", 0, 0)  # the daemon takes the record and dies
    r.consumer.start()
    e = r.publish(seq=1)
    threading.Timer(0.2, lambda: gone.append("the daemon process exited")).start()
    t0 = time.monotonic()
    with pytest.raises(R.RingBroken, match="the daemon process exited") as ex:
        r.producer.wait(e)
    assert ex.value.code == "UNAVAILABLE" and time.monotonic() - t0 < 5


def test_wait_times_out(rings):
    r = rings(capacity=4, start=False)
    r.consumer.handler = lambda t, copy: (None, "", 0, 0)
    r.consumer.start()
    with pytest.raises(R.RingBroken) as ex:
        r.producer.wait(r.publish(seq=1), timeout_s=0.2)
    assert ex.value.code == "DEADLINE_EXCEEDED"


def test_full_ring_wait_breaks_by_liveness(rings):
    gone = []
    r = rings(capacity=2, pause=lambda: True, liveness=lambda: gone[0] if gone else None)
    r.publish(seq=1, asynchronous=True)
    r.publish(seq=2, asynchronous=True)
    threading.Timer(0.2, lambda: gone.append("heartbeat lost")).start()
    with pytest.raises(R.RingBroken, match="heartbeat lost"):
        r.publish(seq=3, asynchronous=True)
    assert r.producer.published == 2  # nothing overwritten


@pytest.mark.parametrize("field,value,needle", [
    ("version", 3, "version 3"),
    ("capacity", 6, "capacity 6"),
    ("capacity", 0, "capacity 0"),
    ("slot_bytes", 1024, "slot_bytes 1024"),
    ("completion_bytes", 128, "completion_bytes 128"),
    ("capacity", 1 << 20, "need"),
])
def test_invalid_control_block(field, value, needle):
    r = Ring(capacity=4, start=False)
    ctypes.c_uint32.from_address(r.addr + R.CONTROL_FIELDS[field][0]).value = value
    with pytest.raises(ValueError, match=needle):
        R.RingProducer(r.addr, r.size)


def test_other_architectures_are_refused_clearly():
    r = Ring(capacity=4, start=False)
    with pytest.raises(RuntimeError, match="x86-64.*CACHE_DIT_OPD_RING=0"):
        R.RingProducer(r.addr, r.size, machine="aarch64")
    assert R.architecture_supported("x86_64") and R.architecture_supported("AMD64")
    assert not R.architecture_supported("aarch64") and not R.architecture_supported("ppc64le")
