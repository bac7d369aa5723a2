"""Client side of the shared-memory call ring (``proto/cache_dit_opd/v1/ring.h``, layout 1).

This module restates the ring's constants, struct sizes and field offsets
(``tests/python/test_client_ring_layout.py`` parses ring.h and checks every
one), encodes call records, and implements the producer over the session's
memfd mapping. It imports neither torch nor grpc (the fake daemon of the tests
imports it too).

Protocol (ring.h is the contract; ticket ``t`` is the running count of
records, record ``t`` lives in slot ``t % capacity``, its completion in
completion slot ``t % capacity``):

* Back-pressure: before record ``t`` is written, completion ``t - capacity``
  must have been consumed by this client (which implies the daemon copied
  record ``t - capacity`` out of the slot). The producer waits; it never
  drops a record.
* Publish: write the record with plain stores, then store ``sq_tail = t + 1``.
  **Memory ordering**: ring.h asks for release semantics on the tail. Python
  has no atomics; this client relies on x86-64 (TSO), where stores are not
  reordered with other stores, so the plain record stores are visible before
  the tail store. The client runs only on x86-64 (the GPU hosts are x86-64):
  ``RingProducer`` raises on any other architecture and the session falls
  back to gRPC there.
* Doorbell: after the tail store the producer loads ``doorbell``; if the
  daemon is ``kDoorbellSleeping`` it stores ``kDoorbellAwake`` and
  ``FUTEX_WAKE``s the word (a *shared* futex: the mapping is shared between
  processes, so no ``FUTEX_PRIVATE_FLAG``). TSO lets a store be reordered
  after a later load (store buffer), which would lose a wake-up against the
  daemon's "store sleeping, re-check tail" (Dekker). A full fence separates the
  tail store from the doorbell load: an uncontended ``threading.Lock``
  acquire/release, which executes a ``lock``-prefixed instruction on x86-64
  (``sem_post``/``sem_trywait`` in CPython <= 3.12, an atomic compare-exchange
  in 3.13+). A lost wake-up could only delay a record until the daemon's
  futex timeout, never lose it.
* Completion: the daemon writes the completion fields, then stores
  ``done_ticket = t + 1`` (release). The client loads ``done_ticket``, then
  the fields (x86-64 does not reorder loads with loads: acquire).

Completions are consumed under the producer lock, in any order; the
"consumed" cursor (lowest unconsumed ticket) bounds reuse of the slots.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import struct
import threading
import time
from typing import Callable

from . import _layout, _wire

# -- ring.h numbers (all from _wire, generated from the header) -------------------------------

RING_VERSION = _wire.RING_VERSION
RING_CONTROL_BYTES = _wire.RING_CONTROL_BYTES
SLOT_BYTES = _wire.SLOT_BYTES
COMPLETION_BYTES = _wire.COMPLETION_BYTES
DEFAULT_RING_CAPACITY = _wire.DEFAULT_RING_CAPACITY
RECORD_MAGIC = _wire.RECORD_MAGIC
DOORBELL_AWAKE = _wire.DOORBELL_AWAKE
DOORBELL_SLEEPING = _wire.DOORBELL_SLEEPING

ARG_NONE = _wire.ARG_KINDS["none"]
ARG_TENSOR = _wire.ARG_KINDS["tensor"]
ARG_INT = _wire.ARG_KINDS["int"]
ARG_FLOAT = _wire.ARG_KINDS["float"]
ARG_BOOL = _wire.ARG_KINDS["bool"]
ARG_INT_LIST = _wire.ARG_KINDS["int_list"]
ARG_FLOAT_LIST = _wire.ARG_KINDS["float_list"]
ARG_BOOL_LIST = _wire.ARG_KINDS["bool_list"]
ARG_KIND_NAMES = {v: k for k, v in _wire.ARG_KINDS.items()}

MAX_TENSOR_DIMS = _wire.MAX_TENSOR_DIMS
MAX_ARGS = _wire.MAX_ARGS
MAX_LIST_LENGTH = _wire.MAX_LIST_LENGTH
MAX_DTYPE = _wire.DTYPE_COUNT - 1  # wire DType values 1 .. MAX_DTYPE

RECORD_FLAG_ASYNC = 1  # RecordHeader.flags bit 0 (informational for the daemon)

CONTROL_FIELDS = {k: v for k, v in _wire.RING_CONTROL_FIELDS.items()}
ARG_HEADER = _layout.struct_of(_wire.ARG_HEADER_FIELDS, _wire.ARG_HEADER_SIZE)
ARG_HEADER_BYTES = _wire.ARG_HEADER_SIZE
RECORD_HEADER = _layout.struct_of({k: v for k, v in _wire.RECORD_HEADER_FIELDS.items() if k != "reserved"},
                                  _wire.RECORD_HEADER_SIZE)
RECORD_HEADER_BYTES = _wire.RECORD_HEADER_SIZE
RECORD_FIELDS = {k: v for k, v in _wire.RECORD_HEADER_FIELDS.items() if k != "reserved"}
RECORD_RESERVED_OFFSET = _wire.RECORD_HEADER_FIELDS["reserved"][0]
COMPLETION = _layout.struct_of(_wire.COMPLETION_FIELDS, _wire.COMPLETION_SIZE)
_COMPLETION_HEAD = _layout.struct_of({k: v for k, v in _wire.COMPLETION_FIELDS.items() if k != "message"},
                                     _wire.COMPLETION_FIELDS["message"][0])
COMPLETION_FIELDS = _wire.COMPLETION_FIELDS
COMPLETION_MESSAGE_BYTES = _wire.COMPLETION_SIZE - _wire.COMPLETION_FIELDS["message"][0]


def ring_bytes(capacity: int) -> int:
    """RingBytes(capacity): the bytes a ring of ``capacity`` slots needs."""
    return RING_CONTROL_BYTES + capacity * (SLOT_BYTES + COMPLETION_BYTES)


# google.rpc.Code names by value (the completion's status_code)
STATUS_NAMES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
                "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
                "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED")


def status_name(code: int) -> str:
    return STATUS_NAMES[code] if 0 <= code < len(STATUS_NAMES) else f"CODE_{code}"


# -- records --------------------------------------------------------------------------------------
#
# Arguments arrive in the session's transport-neutral form, one (kind, value) pair each:
#   (ARG_TENSOR, (region_id, byte_offset, sizes, strides, dtype)), (ARG_INT, int), (ARG_FLOAT, float),
#   (ARG_BOOL, bool), (ARG_INT_LIST, ints), (ARG_FLOAT_LIST, floats), (ARG_BOOL_LIST, bools), (ARG_NONE, None).

_TENSOR = [struct.Struct(f"<IIQQii{n}q{n}q") for n in range(MAX_TENSOR_DIMS + 1)]
_INT = struct.Struct("<IIq")
_FLOAT = struct.Struct("<IId")
_NONE = ARG_HEADER.pack(ARG_NONE, 0)
_I64_LISTS = [struct.Struct(f"<II{n}q") for n in range(MAX_LIST_LENGTH + 1)]
_F64_LISTS = [struct.Struct(f"<II{n}d") for n in range(MAX_LIST_LENGTH + 1)]
MAX_ARGS_BYTES = SLOT_BYTES - RECORD_HEADER_BYTES


class RecordDoesNotFit(ValueError):
    """The arguments cannot be carried by one ring record (too many, too large): use gRPC."""


def encode_args(args) -> bytes:
    """The argument bytes of a record (everything after the 64-byte header).

    Raises RecordDoesNotFit when a limit of the record layout is exceeded
    (more than 32 arguments, a tensor of more than 8 dims, a list of more than
    64 values, more than kSlotBytes in all, a value outside its wire type) or
    an argument is not in the neutral form.
    """
    if len(args) > MAX_ARGS:
        raise RecordDoesNotFit(f"{len(args)} arguments (at most {MAX_ARGS})")
    parts = []
    try:
        for a in args:
            kind, v = a
            if kind == ARG_TENSOR:
                rid, off, sizes, strides, dtype = v
                n = len(sizes)
                if n > MAX_TENSOR_DIMS or len(strides) != n:
                    raise RecordDoesNotFit(f"a tensor of {n} dims (at most {MAX_TENSOR_DIMS})")
                parts.append(_TENSOR[n].pack(ARG_TENSOR, n, rid, off, dtype, 0, *sizes, *strides))
            elif kind == ARG_INT:
                parts.append(_INT.pack(ARG_INT, 1, v))
            elif kind == ARG_FLOAT:
                parts.append(_FLOAT.pack(ARG_FLOAT, 1, v))
            elif kind == ARG_BOOL:
                parts.append(_INT.pack(ARG_BOOL, 1, 1 if v else 0))
            elif kind == ARG_NONE:
                parts.append(_NONE)
            elif kind in (ARG_INT_LIST, ARG_BOOL_LIST, ARG_FLOAT_LIST):
                n = len(v)
                if n > MAX_LIST_LENGTH:
                    raise RecordDoesNotFit(f"a list of {n} values (at most {MAX_LIST_LENGTH})")
                if kind == ARG_FLOAT_LIST:
                    parts.append(_F64_LISTS[n].pack(kind, n, *v))
                elif kind == ARG_BOOL_LIST:
                    parts.append(_I64_LISTS[n].pack(kind, n, *[1 if x else 0 for x in v]))
                else:
                    parts.append(_I64_LISTS[n].pack(kind, n, *v))
            else:
                raise RecordDoesNotFit(f"argument kind {kind!r}")
    except (struct.error, TypeError, ValueError) as e:
        if isinstance(e, RecordDoesNotFit):
            raise
        raise RecordDoesNotFit(f"an argument outside its wire type: {e}") from None
    body = b"".join(parts)
    if len(body) > MAX_ARGS_BYTES:
        raise RecordDoesNotFit(f"{RECORD_HEADER_BYTES + len(body)} bytes (at most {SLOT_BYTES})")
    return body


def encode_header(record_bytes: int, ticket: int, seq: int, lane: int, op_index: int, nargs: int,
                  flags: int = 0) -> bytes:
    return RECORD_HEADER.pack(RECORD_MAGIC, record_bytes, ticket, seq, lane, op_index, nargs, flags)


def encode_record(ticket: int, seq: int, lane: int, op_index: int, args, flags: int = 0) -> bytes:
    """One whole record: header + arguments."""
    body = encode_args(args)
    return encode_header(RECORD_HEADER_BYTES + len(body), ticket, seq, lane, op_index, len(args), flags) + body


class RecordError(ValueError):
    """A malformed record (what the daemon answers INVALID_ARGUMENT to)."""


def decode_record(buf) -> dict:
    """Decodes a record (the layout's reference reader; the daemon has its own in C++).

    Returns ``{"ticket", "lane", "seq", "op_index", "flags", "args": [...]}``
    with args shaped like ``opd_ring_decode``'s JSON (``{"kind": "tensor",
    "region_id", "byte_offset", "sizes", "strides", "dtype"}``, ``{"kind":
    "int", "value"}``, ``{"kind": "int_list", "values"}``, ``{"kind":
    "none"}``, ...). Raises RecordError naming the field for every violation
    ring.h lists.
    """
    buf = bytes(buf[:SLOT_BYTES])
    if len(buf) < RECORD_HEADER_BYTES:
        raise RecordError(f"record of {len(buf)} bytes is shorter than its {RECORD_HEADER_BYTES}-byte header")
    magic, nbytes, ticket, seq, lane, op_index, nargs, flags = RECORD_HEADER.unpack_from(buf, 0)
    if magic != RECORD_MAGIC:
        raise RecordError(f"magic 0x{magic:08x} (expected 0x{RECORD_MAGIC:08x})")
    if nbytes < RECORD_HEADER_BYTES or nbytes > SLOT_BYTES or nbytes % 8 or nbytes > len(buf):
        raise RecordError(f"record_bytes {nbytes}")
    if nargs > MAX_ARGS:
        raise RecordError(f"nargs {nargs} (at most {MAX_ARGS})")
    off = RECORD_HEADER_BYTES
    args = []
    for i in range(nargs):
        if off + ARG_HEADER_BYTES > nbytes:
            raise RecordError(f"argument {i}: header past record_bytes {nbytes}")
        kind, count = ARG_HEADER.unpack_from(buf, off)
        off += ARG_HEADER_BYTES
        if kind == ARG_NONE:
            if count != 0:
                raise RecordError(f"argument {i}: none with count {count}")
            args.append({"kind": "none"})
            continue
        if kind == ARG_TENSOR:
            if count > MAX_TENSOR_DIMS:
                raise RecordError(f"argument {i}: tensor with {count} dims (at most {MAX_TENSOR_DIMS})")
            size = 24 + 16 * count
        elif kind in (ARG_INT, ARG_FLOAT, ARG_BOOL):
            if count != 1:
                raise RecordError(f"argument {i}: scalar with count {count}")
            size = 8
        elif kind in (ARG_INT_LIST, ARG_FLOAT_LIST, ARG_BOOL_LIST):
            if count > MAX_LIST_LENGTH:
                raise RecordError(f"argument {i}: list of {count} values (at most {MAX_LIST_LENGTH})")
            size = 8 * count
        else:
            raise RecordError(f"argument {i}: unknown kind {kind}")
        if off + size > nbytes:
            raise RecordError(f"argument {i}: payload past record_bytes {nbytes}")
        if kind == ARG_TENSOR:
            rid, boff, dtype, _pad = struct.unpack_from("<QQii", buf, off)
            if not 1 <= dtype <= MAX_DTYPE:
                raise RecordError(f"argument {i}: dtype {dtype}")
            vals = struct.unpack_from(f"<{2 * count}q", buf, off + 24)
            args.append({"kind": "tensor", "region_id": rid, "byte_offset": boff, "sizes": list(vals[:count]),
                         "strides": list(vals[count:]), "dtype": dtype})
        elif kind in (ARG_FLOAT, ARG_FLOAT_LIST):
            vals = list(struct.unpack_from(f"<{count}d", buf, off))
            args.append({"kind": "float", "value": vals[0]} if kind == ARG_FLOAT
                        else {"kind": "float_list", "values": vals})
        else:
            vals = list(struct.unpack_from(f"<{count}q", buf, off))
            if kind in (ARG_BOOL, ARG_BOOL_LIST):
                if any(v not in (0, 1) for v in vals):
                    raise RecordError(f"argument {i}: bool value outside 0/1")
                vals = [bool(v) for v in vals]
            if kind in (ARG_INT, ARG_BOOL):
                args.append({"kind": ARG_KIND_NAMES[kind], "value": vals[0]})
            else:
                args.append({"kind": ARG_KIND_NAMES[kind], "values": vals})
        off += size
    if off != nbytes:
        raise RecordError(f"{nbytes - off} bytes left after the last argument")
    return {"ticket": ticket, "lane": lane, "seq": seq, "op_index": op_index, "flags": flags, "args": args}


def neutral_from_decoded(arg: dict):
    """The neutral (kind, value) pair of one decoded argument (tests round-trip with it)."""
    k = arg["kind"]
    if k == "tensor":
        return ARG_TENSOR, (arg["region_id"], arg["byte_offset"], tuple(arg["sizes"]), tuple(arg["strides"]),
                            arg["dtype"])
    if k == "none":
        return ARG_NONE, None
    kind = {v: n for n, v in ARG_KIND_NAMES.items()}[k]
    return kind, (arg["value"] if "value" in arg else tuple(arg["values"]))


# -- futex ------------------------------------------------------------------------------------------

SYS_FUTEX_X86_64 = 202
FUTEX_WAIT = 0
FUTEX_WAKE = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = None


def _syscall():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        fn = lib.syscall
        fn.restype = ctypes.c_long
        fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_int]
        _libc = fn
    return _libc


def futex_wake(addr: int, count: int = 1) -> int:
    """FUTEX_WAKE on the shared futex word at ``addr``; returns the number of waiters woken."""
    r = _syscall()(SYS_FUTEX_X86_64, addr, FUTEX_WAKE, count, None, None, 0)
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"futex(FUTEX_WAKE) failed: {os.strerror(e)}")
    return r


def futex_wait(addr: int, expected: int, timeout_s: float | None) -> bool:
    """FUTEX_WAIT while the word at ``addr`` equals ``expected``; False on timeout, True otherwise."""
    ts = None
    if timeout_s is not None:
        frac, whole = math.modf(max(0.0, timeout_s))
        ts = ctypes.byref(_Timespec(int(whole), int(frac * 1e9)))
    r = _syscall()(SYS_FUTEX_X86_64, addr, FUTEX_WAIT, expected, ts, None, 0)
    if r < 0:
        e = ctypes.get_errno()
        if e == 110:  # ETIMEDOUT
            return False
        if e in (11, 4):  # EAGAIN (value changed), EINTR
            return True
        raise OSError(e, f"futex(FUTEX_WAIT) failed: {os.strerror(e)}")
    return True


_FENCE_LOCK = threading.Lock()


def store_load_fence() -> None:
    """A full fence on x86-64: an uncontended lock acquire/release executes a lock-prefixed instruction."""
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()


def architecture_supported(machine: str | None = None) -> bool:
    """The ring's memory ordering (plain stores then the tail) needs x86-64 TSO."""
    return (machine or platform.machine()).lower() in ("x86_64", "amd64")


# -- the producer ------------------------------------------------------------------------------------


class RingBroken(Exception):
    """The ring can no longer be used (daemon gone, session failed, timeout, protocol violation)."""

    def __init__(self, code: str, details: str):
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


class Entry:
    """One published record, until its completion is consumed."""

    __slots__ = ("ticket", "lane", "seq", "op", "overload", "asynchronous", "context", "code", "message")

    def __init__(self, ticket, lane, seq, op, overload, asynchronous, context):
        self.ticket = ticket
        self.lane = lane
        self.seq = seq
        self.op = op
        self.overload = overload
        self.asynchronous = asynchronous
        self.context = context
        self.code: int | None = None  # set when the completion is consumed
        self.message = ""


# Polling of completions: spin (the daemon answers a call at validation, microseconds after the doorbell),
# then yield, then sleep with a growing interval; liveness is checked between sleeps.
SPIN_S = float(os.environ.get("CACHE_DIT_OPD_RING_SPIN_US", "200")) * 1e-6
_PURE_SPIN_S = 20e-6
_SLEEP_MIN_S = 20e-6
_SLEEP_MAX_S = 1e-3
_LIVENESS_EVERY_S = 5e-3


class RingProducer:
    """Publishes records into one session's ring and consumes their completions. Thread-safe.

    ``addr``: the ring's address in this process (session memory base +
    ``ring_offset``); ``nbytes``: ``ring_bytes`` from the header. The
    mapping must stay alive as long as the producer.
    ``liveness()`` returns None while the daemon serves the session, else a
    reason; every wait calls it between sleeps and raises RingBroken with it.
    """

    def __init__(self, addr: int, nbytes: int, liveness: Callable[[], str | None] | None = None,
                 machine: str | None = None):
        if not architecture_supported(machine):
            raise RuntimeError(
                f"cache_dit_opd: the shared-memory call ring needs x86-64 (total store order: the client publishes "
                f"a record with plain stores, then the tail); this machine is {machine or platform.machine()}. "
                f"Set CACHE_DIT_OPD_RING=0 to use gRPC.")
        u32 = ctypes.c_uint32.from_address
        version, capacity = u32(addr).value, u32(addr + 4).value
        slot, comp = u32(addr + 8).value, u32(addr + 12).value
        problems = []
        if version != RING_VERSION:
            problems.append(f"version {version} (expected {RING_VERSION})")
        if capacity == 0 or capacity & (capacity - 1):
            problems.append(f"capacity {capacity} (a power of two expected)")
        if slot != SLOT_BYTES:
            problems.append(f"slot_bytes {slot} (expected {SLOT_BYTES})")
        if comp != COMPLETION_BYTES:
            problems.append(f"completion_bytes {comp} (expected {COMPLETION_BYTES})")
        if not problems and ring_bytes(capacity) > nbytes:
            problems.append(f"{capacity} slots need {ring_bytes(capacity)} bytes, the ring has {nbytes}")
        if problems:
            raise ValueError("call ring control block is invalid: " + "; ".join(problems))
        self.addr = addr
        self.capacity = capacity
        self._mask = capacity - 1
        self._tail = ctypes.c_uint64.from_address(addr + CONTROL_FIELDS["sq_tail"][0])
        self._head = ctypes.c_uint64.from_address(addr + CONTROL_FIELDS["sq_head"][0])
        self.doorbell_addr = addr + CONTROL_FIELDS["doorbell"][0]
        self._doorbell = ctypes.c_uint32.from_address(self.doorbell_addr)
        self._slots = RING_CONTROL_BYTES  # offsets in self._view
        self._comps = self._slots + capacity * SLOT_BYTES
        # one view over the whole ring: records are written and completions read without a ctypes call
        self._view = memoryview((ctypes.c_char * ring_bytes(capacity)).from_address(addr)).cast("B")
        self._done = [ctypes.c_uint64.from_address(addr + self._comps + i * COMPLETION_BYTES) for i in range(capacity)]
        self._liveness = liveness or (lambda: None)
        self._lock = threading.Lock()
        self._entries: list[Entry | None] = [None] * capacity
        self._next = self._tail.value  # next ticket to hand out (a fresh ring starts at 0)
        self._cursor = self._next  # lowest ticket whose completion is not consumed yet
        self._rejected: list[Entry] = []  # asynchronous records answered with an error, not yet reported
        self.wakes = 0  # FUTEX_WAKE calls made (doorbell found sleeping)
        self.full_waits = 0  # publishes that waited for room (ring full)

    # -- state -----------------------------------------------------------------------------------
    @property
    def published(self) -> int:
        return self._next

    @property
    def consumed(self) -> int:
        return self._cursor

    def in_flight(self) -> int:
        return self._next - self._cursor

    # -- publish ---------------------------------------------------------------------------------
    def publish(self, lane: int, seq: int, op_index: int, body: bytes, nargs: int, *, op: str = "",
                overload: str = "", asynchronous: bool = False, context=None, timeout_s: float = 600.0) -> Entry:
        """Writes one record (header + ``body`` from encode_args) and publishes it; blocks while the ring is full."""
        nbytes = RECORD_HEADER_BYTES + len(body)
        flags = RECORD_FLAG_ASYNC if asynchronous else 0
        with self._lock:
            t = self._next
            if t - self._cursor >= self.capacity:
                self._wait_room_locked(t, timeout_s)
            slot = t & self._mask
            e = Entry(t, lane, seq, op, overload, asynchronous, context)
            self._entries[slot] = e
            off = self._slots + slot * SLOT_BYTES
            RECORD_HEADER.pack_into(self._view, off, RECORD_MAGIC, nbytes, t, seq, lane, op_index, nargs, flags)
            self._view[off + RECORD_HEADER_BYTES:off + nbytes] = body
            self._next = t + 1
            # One aligned 8-byte store (ctypes writes a c_uint64 with one mov), ordered after the record's
            # stores by x86-64 TSO: the release ring.h asks for.
            self._tail.value = t + 1
        store_load_fence()  # the tail store before the doorbell load (see the module docstring)
        if self._doorbell.value == DOORBELL_SLEEPING:
            self._doorbell.value = DOORBELL_AWAKE
            self.wakes += 1
            futex_wake(self.doorbell_addr, 1)
        return e

    def _wait_room_locked(self, t: int, timeout_s: float) -> None:
        """Ring full: consume completions until completion ``t - capacity`` is consumed. Holds the lock."""
        self.full_waits += 1
        oldest = self._cursor
        cond = lambda: self._harvest_locked() or t - self._cursor < self.capacity  # noqa: E731
        self._poll(cond, timeout_s, f"room in the call ring (ticket {t} waits for completion {oldest})",
                   locked=True)

    # -- completions -----------------------------------------------------------------------------
    def _read_locked(self, e: Entry, slot: int) -> None:
        off = self._comps + slot * COMPLETION_BYTES
        _done, ticket, seq, lane, code = _COMPLETION_HEAD.unpack_from(self._view, off)
        if ticket != e.ticket or (code == 0 and (lane != e.lane or seq != e.seq)):
            code, msg = 13, (f"completion of ticket {e.ticket} (lane {e.lane}, seq {e.seq}) echoes ticket {ticket} "
                             f"(lane {lane}, seq {seq})").encode()
        elif code:
            msg = bytes(self._view[off + _COMPLETION_HEAD.size:off + COMPLETION_BYTES])
        else:
            msg = b""  # the common case: no message to decode
        e.code = code
        e.message = msg.split(b"\0", 1)[0].decode("utf-8", "replace")
        if e.asynchronous and code != 0:
            self._rejected.append(e)

    def _advance_locked(self) -> None:
        ents, mask = self._entries, self._mask
        while self._cursor < self._next:
            e = ents[self._cursor & mask]
            if e is None or e.code is None:
                break
            ents[self._cursor & mask] = None
            self._cursor += 1

    def _harvest_locked(self, stop_at_pending: bool = False) -> bool:
        """Consumes every completion that has arrived; returns False (for use in poll conditions)."""
        done, ents, mask = self._done, self._entries, self._mask
        for t in range(self._cursor, self._next):
            slot = t & mask
            e = ents[slot]
            if e.code is not None:
                continue
            if done[slot].value != t + 1:
                if stop_at_pending:
                    break
                continue
            self._read_locked(e, slot)
        self._advance_locked()
        return False

    def poll(self) -> list[Entry]:
        """Consumes the completions that have arrived (no waiting); returns and forgets the async rejections."""
        c = self._cursor
        if c < self._next and self._done[c & self._mask].value == c + 1 or self._rejected:
            with self._lock:
                self._harvest_locked(stop_at_pending=True)
                out, self._rejected = self._rejected, []
            return out
        return []

    def wait(self, e: Entry, timeout_s: float = 600.0) -> tuple[int, str]:
        """Waits for ``e``'s completion (synchronous mode): (status code, message)."""
        slot = e.ticket & self._mask
        d, want = self._done[slot], e.ticket + 1
        if e.code is None and d.value != want:
            self._poll(lambda: e.code is not None or d.value == want, timeout_s,
                       f"the completion of ticket {e.ticket} ({e.op}, lane {e.lane}, seq {e.seq})")
        with self._lock:
            if e.code is None:  # the slot is still ours: reuse needs this completion consumed
                self._read_locked(e, slot)
            self._advance_locked()
        return e.code, e.message

    def wait_consumed(self, target: int | None = None, timeout_s: float = 600.0) -> None:
        """Waits until every completion of tickets < ``target`` (default: all published) is consumed."""
        if target is None:
            target = self._next

        def cond():
            with self._lock:
                self._harvest_locked()
                return self._cursor >= target

        if not cond():
            self._poll(cond, timeout_s, f"the completions of {target - self._cursor} record(s) in the call ring")

    def take_rejected(self) -> list[Entry]:
        with self._lock:
            out, self._rejected = self._rejected, []
        return out

    def _poll(self, cond, timeout_s: float, what: str, locked: bool = False) -> None:
        """Spins, yields, then sleeps until ``cond()``; RingBroken when liveness fails or on timeout."""
        start = time.monotonic()
        n = 0
        while True:  # spin
            if cond():
                return
            n += 1
            if n & 31 == 0:
                now = time.monotonic()
                if now - start > _PURE_SPIN_S:
                    break
        if not locked:
            while time.monotonic() - start < SPIN_S:  # yield the GIL to other threads
                time.sleep(0)
                if cond():
                    return
        sleep = _SLEEP_MIN_S
        next_check = 0.0
        deadline = start + timeout_s
        while True:
            now = time.monotonic()
            if now >= next_check:
                reason = self._liveness()
                if reason:
                    raise RingBroken("UNAVAILABLE", f"while waiting for {what}: {reason}")
                if now > deadline:
                    raise RingBroken("DEADLINE_EXCEEDED", f"no progress in {timeout_s:.0f} s while waiting for {what}")
                next_check = now + _LIVENESS_EVERY_S
            time.sleep(sleep)
            sleep = min(sleep * 2, _SLEEP_MAX_S)
            if cond():
                return
