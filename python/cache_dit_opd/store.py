"""The daemon's weight store: named, immutable tensors in daemon memory that outlive the processes that
published them, so that one copy of a model's weights serves every worker on the GPU.

* ``publish_file(path, prefix)``: the daemon reads tensors of a ``.safetensors`` file itself (the fast
  path for a model on local disk), opened with this process's rights (its uid and groups: a file it may
  not read raises PermissionError); ``publish(tensors, prefix)``: the daemon copies this process's CUDA
  tensors (they may be freed once it returns). Either way the set is one allocation in the daemon and
  becomes visible at once.
* ``attach(name)``: an ordinary CUDA tensor of this process over the stored bytes, mapped read-only
  (the set's allocation is shared as a file descriptor over the session channel and mapped with
  ``cuMemSetAccess(PROT_READ)``: a kernel that writes it faults in this process only). Every op of the
  client takes it like any tensor; the daemon knows it as its own memory and refuses it as an output.
  The mapping stays while a tensor made from it lives.
* ``list_entries``, ``delete``: an entry's memory is freed once every entry of its set is deleted and no
  session has it attached any more.

Entries belong to the uid that published them and are readable by that uid, by the uids named at publish
time, by members of the daemon's ``--allowed-gid`` group and by root. The daemon's ``--max-store-bytes``
bounds the store (0, its default, turns it off). A restarted daemon's store is empty: a tensor attached
from the previous one cannot be passed to the new one (the error names its entry). Normative rules:
``server/store/weight_store.h``, ``server/store/safetensors.h`` and ``proto/cache_dit_opd/v1/session_memory.h``.

Errors: a name published twice raises ``FileExistsError``; an unknown name ``KeyError``; an entry this
uid may not read or delete ``PermissionError``; a file that is missing, truncated or lies about its sizes,
a tensor that is not contiguous, or a bad name, ``ValueError``; a full store ``RuntimeError``. Each message
names the value.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable

from . import _errors, _regions, _session, _wire

__all__ = ["StoreEntry", "attach", "attach_many", "delete", "list_entries", "publish", "publish_file"]

_DTYPE_NAMES = {v: k for k, v in _wire.DTYPE_IDS.items()}


@dataclass(frozen=True)
class StoreEntry:
    """One stored tensor as the daemon reports it."""

    name: str
    dtype: "torch.dtype"  # noqa: F821
    shape: tuple
    bytes: int
    owner_uid: int
    refs: int  # sessions that have it attached now
    set_id: int  # the set it was published with: its memory is one block
    block_bytes: int  # that block's size (0 for an empty tensor)
    offset: int  # the entry's first byte in that block


def _entry(e) -> StoreEntry:
    import torch

    return StoreEntry(e.name, getattr(torch, _DTYPE_NAMES[e.dtype]), tuple(e.shape), e.bytes, e.owner_uid, e.refs,
                      e.set_id, e.block_bytes, e.offset)


def _raise(s: _session.Session, what: str, err: _errors.DaemonError):
    """Raises the daemon's refusal of a store request as the exception its reason means."""
    by_reason = {
        _wire.REASONS["STORE_EXISTS"][0]: FileExistsError,
        _wire.REASONS["STORE_UNKNOWN"][0]: KeyError,
        _wire.REASONS["STORE_DENIED"][0]: PermissionError,
    }
    kind = by_reason.get(err.reason)
    if kind is not None:
        raise kind(f"cache_dit_opd.store: {what}: {err.message}") from None
    if err.action in (_errors.RECONNECT, _errors.FAIL):
        s.fail(err)
    _errors.raise_for(f"cache_dit_opd.store: {what}", err)


def _rpc(s: _session.Session, what: str, method: str, request, timeout: float | None = _session.CONNECT_TIMEOUT_S):
    import grpc

    try:
        return getattr(s._stub, method)(request, timeout=timeout)
    except grpc.RpcError as e:
        err = _errors.from_grpc(e)
    _raise(s, what, err)


def _session_for(device, session):
    return session if session is not None else _session.get_session(device)


def publish_file(path: str | os.PathLike, prefix: str = "", tensors: Iterable[str] | None = None,
                 readers: Iterable[int] = (), *, device=None, session=None) -> list[StoreEntry]:
    """Publishes tensors of the ``.safetensors`` file at ``path`` (read by the daemon, opened with this
    process's rights: PermissionError when it may not read it) as one set named ``prefix + <tensor name>``;
    ``tensors`` chooses some (default: all); ``readers`` are uids besides this process's that may read them.
    Returns the set, in file order. ``device``: whose GPU's daemon (default: the current device);
    ``session``: an open session instead."""
    s = _session_for(device, session)
    pb = s._pb
    req = pb.PublishFileRequest(session_id=s.reply.session_id, token=s.reply.token,
                                path=os.path.abspath(os.fspath(path)), prefix=prefix,
                                tensors=list(tensors or ()), reader_uids=[int(u) for u in readers])
    rep = _rpc(s, f"publishing {req.path}", "PublishFile", req, timeout=None)  # reading a model takes its time
    return [_entry(e) for e in rep.entries]


def list_entries(prefix: str = "", *, device=None, session=None) -> list[StoreEntry]:
    """The entries this process may read whose name starts with ``prefix``, by name."""
    s = _session_for(device, session)
    rep = _rpc(s, "listing", "ListStore",
               s._pb.ListStoreRequest(session_id=s.reply.session_id, token=s.reply.token, prefix=prefix))
    return [_entry(e) for e in rep.entries]


def delete(name: str, *, device=None, session=None) -> None:
    """Deletes the entry ``name`` (its owner or root); its memory is freed once no call or mapping uses it."""
    s = _session_for(device, session)
    _rpc(s, f"deleting '{name}'", "DeleteStore",
         s._pb.DeleteStoreRequest(session_id=s.reply.session_id, token=s.reply.token, name=name))


def publish(tensors, prefix: str = "", readers: Iterable[int] = (), *, device=None, session=None) -> list[StoreEntry]:
    """Publishes this process's CUDA tensors (``{name: tensor}``, contiguous, on the session's device) as one set
    named ``prefix + <name>``, copied by the daemon: the caller may free or change them once this returns.
    The current stream is synchronized first (its work produces them). ``readers``: uids besides this
    process's that may read the set. Returns the set, in the given order."""
    s = _session_for(device, session)
    pb = s._pb
    named = []
    pinned: set = set()
    for name, t in dict(tensors).items():
        if not s._is_tensor(t) or not _contiguous(tuple(t.shape), tuple(t.stride())):
            raise ValueError(f"cache_dit_opd.store: publish '{prefix}{name}': a contiguous CUDA tensor is needed, got "
                             f"{type(t).__name__}" + (f" with strides {tuple(t.stride())}" if s._is_tensor(t) else ""))
        s._check_device(t)
        rid, off, sizes, strides, dtype = s._tensor_ref(t, pinned)
        named.append(pb.NamedTensor(name=prefix + name, tensor=pb.TensorRef(
            region_id=rid, byte_offset=off, sizes=sizes, strides=strides, dtype=dtype)))
    s._sync_stream()
    req = pb.PublishTensorsRequest(session_id=s.reply.session_id, token=s.reply.token, tensors=named,
                                   reader_uids=[int(u) for u in readers])
    rep = _rpc(s, f"publishing {len(named)} tensors under '{prefix}'", "PublishTensors", req, timeout=None)
    return [_entry(e) for e in rep.entries]


def _contiguous(sizes: tuple, strides: tuple) -> bool:
    """Row-major dense, size-1 dims aside (common/view_extent.h FirstNonContiguousDim, which the daemon applies)."""
    want = 1
    for n, st in zip(reversed(sizes), reversed(strides)):
        if n != 1 and st != want:
            return False
        want *= n
    return True


class _BlockBytes:
    """``__cuda_array_interface__`` of bytes [offset, offset + nbytes) of a StoreBlock: what torch wraps without
    copying. torch keeps this object (so the block) alive until the tensor's storage is freed."""

    def __init__(self, block: _regions.StoreBlock, offset: int, nbytes: int):
        self.block, self.offset, self.nbytes = block, offset, nbytes

    @property
    def __cuda_array_interface__(self):
        # Read-only as mapped, but torch refuses the interface's read-only flag; writes fault in this process.
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.block.base + self.offset, False),
                "strides": None, "version": 2}


def attach_block(name: str, *, device=None, session=None) -> tuple[_regions.StoreBlock | None, dict]:
    """Attaches ``name`` on the session: (this process's mapping of its set's block, or None for an empty
    tensor; the entry as the daemon describes it: offset, bytes, dtype, shape). The block is registered in
    the session (a read-only region the daemon lends it)."""
    s = _session_for(device, session)
    try:
        reply, fd = s.attach_store(name)
    except _errors.DaemonError as e:
        _raise(s, f"attaching '{name}'", e)
    if fd is None:
        return None, reply
    try:
        block = _regions.map_store_block(s.device_index, reply, fd, name, s.regions.driver)
    finally:
        os.close(fd)
    s.regions.add_store_block(block, reply["region_id"])
    return block, reply


def _tensor(block: _regions.StoreBlock | None, offset: int, nbytes: int, dtype, shape, dev):
    """A CUDA tensor over bytes [offset, offset + nbytes) of ``block`` (an empty one without a block)."""
    import torch

    if block is None or nbytes == 0:
        return torch.empty(shape, dtype=dtype, device=dev)
    raw = torch.as_tensor(_BlockBytes(block, offset, nbytes), device=dev)
    return raw.view(dtype).view(shape)


def attach(name: str, *, device=None, session=None):
    """The store entry ``name`` as a CUDA tensor of this process (read-only memory of the daemon: no copy).
    Attaching entries of one set shares one mapping; it is removed when no tensor made from it lives."""
    import torch

    s = _session_for(device, session)
    dev = torch.device("cuda", s.device_index)
    with torch.cuda.device(dev):  # the mapping is made in this device's context
        block, reply = attach_block(name, session=s)
        return _tensor(block, reply["offset"], reply["bytes"], getattr(torch, _DTYPE_NAMES[reply["dtype"]]),
                       reply["shape"], dev)


def attach_blocks(prefix: str = "", names: Iterable[str] | None = None, *, device=None,
                  session=None) -> dict:
    """The entries under ``prefix`` this process may read (or those of ``names`` among them), attached with one
    attach per published set: ``{name: (this process's mapping of its set's block or None for an empty
    tensor, its StoreEntry)}``; the entries' places in their blocks come from the listing. What
    :func:`attach_many` makes tensors of (the part that needs no device)."""
    s = _session_for(device, session)
    entries = list_entries(prefix, session=s)
    if names is not None:
        want = set(names)
        missing = sorted(want - {e.name for e in entries})
        if missing:
            raise KeyError(f"cache_dit_opd.store: no entries {missing[:8]} under '{prefix}' that this process "
                           f"may read")
        entries = [e for e in entries if e.name in want]
    by_set: dict = {}
    for e in entries:
        by_set.setdefault(e.set_id, []).append(e)
    out = {}
    for set_id, members in by_set.items():
        first = max(members, key=lambda e: e.bytes)
        block, reply = attach_block(first.name, session=s)
        if block is not None and reply["block_id"] != set_id:
            # deleted and published again since the listing: list it again
            return attach_blocks(prefix, names, session=s)
        out.update((e.name, (block, e)) for e in members)
    return out


def attach_many(prefix: str = "", names: Iterable[str] | None = None, *, device=None, session=None) -> dict:
    """The entries under ``prefix`` this process may read (or those of ``names`` among them) as CUDA tensors,
    ``{name: tensor}``: as :func:`attach`, with one attach per published set (:func:`attach_blocks`), so a
    model's thousand tensors cost one round trip per set."""
    import torch

    s = _session_for(device, session)
    dev = torch.device("cuda", s.device_index)
    with torch.cuda.device(dev):  # the mappings are made in this device's context
        return {name: _tensor(block, e.offset, e.bytes, e.dtype, e.shape, dev)
                for name, (block, e) in attach_blocks(prefix, names, session=s).items()}
