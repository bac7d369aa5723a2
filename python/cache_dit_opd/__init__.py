"""cache_dit_opd: the Python client of the cache-dit operator daemon.

Importing the package defines the proxy ops ``torch.ops.cache_dit_cuda_ops.*``
with local fakes; it needs neither a daemon nor a GPU. The first op call on a
CUDA device opens a session with the daemon that serves that GPU (found by its
UUID; ``CACHE_DIT_OPD_ADDRESS`` overrides the lookup). Ops live in
:mod:`cache_dit_opd.kernels`, modules built on them (``SVDQW4A4Linear``) in
:mod:`cache_dit_opd.nn`, the one-line cache-dit integration in
:mod:`cache_dit_opd.integrations.cache_dit`, and the daemon's weight store
(tensors published once for every process) in :mod:`cache_dit_opd.store`.

With the native engine (``libcache_dit_opd_native.so``, built by ``pip install
--no-build-isolation ./python``) calls run in C++ through the session's
shared-memory call ring, ordered on the caller's stream; without it they go
over gRPC, host-synchronized (``daemon_info()["native"]`` says which).
Calls are synchronous by default (a rejected call raises where it is made);
``set_async_calls(True)`` (process) or ``with async_calls():`` (this thread)
makes ring calls asynchronous: errors then surface at the session's next
call, at :func:`synchronize`, or when the session closes.
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import kernels  # noqa: E402  (defines the ops in cache_dit_cuda_ops)
from . import integrations, nn, store  # noqa: E402  (integrations change nothing until enabled)
from ._session import (  # noqa: E402
    CatalogSkewError,
    DaemonUnavailableError,
    SessionFailedError,
    async_calls,
    async_calls_enabled,
    set_async_calls,
)

__all__ = [
    "CatalogSkewError",
    "DaemonUnavailableError",
    "SessionFailedError",
    "async_calls",
    "async_calls_enabled",
    "close_sessions",
    "daemon_address",
    "daemon_info",
    "daemon_stats",
    "integrations",
    "kernels",
    "nn",
    "set_async_calls",
    "store",
    "synchronize",
]


def synchronize(device=None) -> None:
    """Waits for ``device``'s work, then raises any error the daemon reported asynchronously.

    Errors that could not be raised at a call site (the daemon died with calls
    unfinished; with the shared-memory ring in asynchronous mode, a rejected
    call, named with its op and the daemon's reason) are raised here, once:
    the first error's type (``ValueError`` for rejected arguments), with the
    others in its message. Waits for every ring record in flight (of every
    session of this process) to be answered first. With no CUDA device it only
    reports errors.
    """
    import torch

    from . import _session

    if torch.cuda.is_available():
        torch.cuda.synchronize(device)
    errors = _session.take_deferred_errors()
    if errors:
        raise _session.combine_errors(errors)


def daemon_address(device=None) -> str | None:
    """The gRPC target of the daemon that serves ``device`` (a torch CUDA device), or None if none is found."""
    from . import _discovery, _session

    return _discovery.find_daemon(_discovery.gpu_uuid(_session._device_index(device)))[0]


def daemon_info(device=None) -> dict:
    """The session with ``device``'s daemon (opened if needed): address, versions, session id, lanes, catalog."""
    from . import _native, _session

    s = _session.get_session(device)
    v = s.version
    return {
        "address": s.target,
        "gpu_uuid": s.reply.gpu_uuid or s.uuid,
        "daemon_version": v.daemon_version,
        "protocol_version": v.protocol_version,
        "git_commit": v.git_commit,
        "torch_version": v.torch_version,
        "session_id": s.reply.session_id,
        "lanes": s.reply.lanes,
        "transport": s.transport,  # "ring" (the native engine) or "grpc" (host-ordered calls)
        "native": s.native is not None,  # calls run in the native engine (client/python/)
        "native_error": None if s.native is not None else _native.load_error(),
        "ring_capacity": s.native.state()["ring_capacity"] if s.native is not None else 0,
        "async_calls": _session.async_calls_enabled(),
        "catalog": sorted(f"{n}.{o}" if o else n for n, o in s.catalog),
    }


def daemon_stats(device=None) -> dict:
    """The daemon's counters (GetStats) with this process's session for ``device``: a plain dict."""
    from . import _session
    from ._proto.plain import message_to_dict

    return message_to_dict(_session.get_session(device).stats())


def close_sessions() -> None:
    """Closes this process's sessions; the next op call opens new ones.

    Raises what asynchronous calls of those sessions were rejected with and
    that was not reported yet (after closing them all).
    """
    from . import _session

    _session.close_all(raise_errors=True)
