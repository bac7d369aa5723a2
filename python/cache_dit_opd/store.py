"""The daemon's weight store: named, immutable tensors in daemon memory that outlive the processes that
published them, so that one copy of a model's weights serves every worker on the GPU.

What is here today: publishing the tensors of a ``.safetensors`` file that the daemon reads itself (the
fast path for a model on local disk), listing, deleting. A set published together becomes visible at once;
entries belong to the uid that published them and are readable by that uid, by the uids named at publish
time, by members of the daemon's ``--allowed-gid`` group and by root. The daemon's ``--max-store-bytes``
bounds the store (0, its default, turns it off). A restarted daemon's store is empty. Normative rules:
``server/store/weight_store.h`` and ``server/store/safetensors.h``.

Errors: a name published twice raises ``FileExistsError``; an unknown name ``KeyError``; an entry this
uid may not read or delete ``PermissionError``; a file that is missing, truncated or lies about its sizes,
or a bad name, ``ValueError``; a full store ``RuntimeError``. Each message names the value.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable

from . import _errors, _session, _wire

__all__ = ["StoreEntry", "delete", "list_entries", "publish_file"]

_DTYPE_NAMES = {v: k for k, v in _wire.DTYPE_IDS.items()}


@dataclass(frozen=True)
class StoreEntry:
    """One stored tensor as the daemon reports it."""

    name: str
    dtype: "torch.dtype"  # noqa: F821
    shape: tuple
    bytes: int
    owner_uid: int
    refs: int  # calls and mappings using it now


def _entry(e) -> StoreEntry:
    import torch

    return StoreEntry(e.name, getattr(torch, _DTYPE_NAMES[e.dtype]), tuple(e.shape), e.bytes, e.owner_uid, e.refs)


def _rpc(s: _session.Session, what: str, method: str, request, timeout: float | None = _session.CONNECT_TIMEOUT_S):
    import grpc

    try:
        return getattr(s._stub, method)(request, timeout=timeout)
    except grpc.RpcError as e:
        err = _errors.from_grpc(e)
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


def _session_for(device, session):
    return session if session is not None else _session.get_session(device)


def publish_file(path: str | os.PathLike, prefix: str = "", tensors: Iterable[str] | None = None,
                 readers: Iterable[int] = (), *, device=None, session=None) -> list[StoreEntry]:
    """Publishes tensors of the ``.safetensors`` file at ``path`` (read by the daemon: it must be able to
    open it) as one set named ``prefix + <tensor name>``; ``tensors`` chooses some (default: all);
    ``readers`` are uids besides this process's that may read them. Returns the set, in file order.
    ``device``: whose GPU's daemon (default: the current device); ``session``: an open session instead."""
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
