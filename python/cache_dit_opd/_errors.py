"""The client's exceptions, and the one rule that turns a daemon error into what the client does.

Every error the daemon returns carries a reason (``proto/cache_dit_opd/v1/wire.h``, generated into
``_wire``); :func:`action` says what to do about it, exactly as the C++ client's ``Status::action()``
does: ``raise_value`` / ``raise`` (the call fails, the session goes on), ``reregister`` (register the
call's allocations again and run it once more), ``reconnect`` (the session is gone; run the call once
more on a new one) or ``fail`` (the session is gone and running again cannot help). No decision here or
anywhere in the client reads a message.
"""

from __future__ import annotations

from . import _wire

RAISE_VALUE, RAISE, REREGISTER, RECONNECT, FAIL = (_wire.ACTIONS[k] for k in
                                                   ("raise_value", "raise", "reregister", "reconnect", "fail"))
_ACTION_NAMES = {v: k for k, v in _wire.ACTIONS.items()}
_REASON_BY_VALUE = {v[0]: (name, v[2]) for name, v in _wire.REASONS.items()}
# google.rpc.Code names by value (grpc.StatusCode spells them; no grpc import needed here)
CODE_NAMES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
              "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
              "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED")


class DaemonUnavailableError(RuntimeError):
    """No operator daemon serves the device (not running, unreachable or not serving)."""


class SessionFailedError(RuntimeError):
    """The session with the daemon broke; the next call opens a new one (``retryable``: the call did not run)."""

    retryable = False


class CatalogSkewError(RuntimeError):
    """The daemon's op schemas, protocol or layout differ from this client's."""


def action(code: int, reason: int) -> int:
    """What to do about an error of google.rpc.Code ``code`` with wire Reason ``reason`` (0: none)."""
    if code == 0:
        return 0
    known = _REASON_BY_VALUE.get(reason)
    if known is not None:
        return known[1]
    return _wire.CODE_ACTIONS.get(code, FAIL)


def action_name(value: int) -> str:
    return _ACTION_NAMES.get(value, "none")


def reason_name(reason: int) -> str:
    known = _REASON_BY_VALUE.get(reason)
    return known[0] if known else ("UNSPECIFIED" if reason == 0 else f"REASON({reason})")


def code_name(code: int) -> str:
    return CODE_NAMES[code] if 0 <= code < len(CODE_NAMES) else f"CODE_{code}"


class DaemonError(Exception):
    """One error answer of the daemon (or of the transport to it): code, reason and message."""

    def __init__(self, code: int, reason: int, message: str):
        super().__init__(f"{code_name(code)} [{reason_name(reason)}]: {message}")
        self.code, self.reason, self.message = code, reason, message
        self.action = action(code, reason)


def from_grpc(err) -> DaemonError:
    """A ``grpc.RpcError`` as a DaemonError: its code, the reason in its trailing metadata, its details."""
    code = err.code().value[0] if err.code() is not None else 2
    value = dict(err.trailing_metadata() or ()).get(_wire.REASON_METADATA_KEY)
    try:
        reason = int(value) if value is not None else 0
    except ValueError:
        reason = 0
    return DaemonError(code, reason, err.details() or "")


def raise_for(op: str, e: DaemonError, where: str = "") -> None:
    """Raises what an error whose action is to raise means for a call of ``op`` (``where``: more context)."""
    if e.action == RAISE_VALUE:
        raise ValueError(f"{op} rejected by the daemon: {e.message}{where}") from None
    if e.action in (RECONNECT, FAIL):
        err = SessionFailedError(f"cache_dit_opd: the session with the daemon failed during {op}{where}: {e}")
        err.retryable = e.action == RECONNECT
        raise err from None
    raise RuntimeError(f"{op} failed in the daemon: {e}{where}") from None


def combine(errors: list) -> Exception:
    """One exception for several deferred errors (the first one's type)."""
    if len(errors) == 1:
        return errors[0]
    return type(errors[0])(f"{errors[0]}\n(and {len(errors) - 1} more: " + "; ".join(str(e) for e in errors[1:])
                           + ")")
