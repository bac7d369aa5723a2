"""Run an installed cache-dit's kernels through the daemon, with one call.

::

    import cache_dit_opd.integrations.cache_dit as opd_cache_dit
    opd_cache_dit.enable()     # cache-dit's FP8 comm, merge and svdq_* ops now run in the daemon
    ...
    opd_cache_dit.disable()    # cache-dit's own kernels again

What ``enable()`` changes, and nothing else (cache-dit's modules, its
``SVDQW4A4Linear``, PTQ and wrappers stay as they are):

* cache-dit's backend dispatch for the ops this project serves
  (``cache_dit.kernels.ops``: FP8 comm and the attention merge, which cache-dit
  runs as Triton or CuTe DSL kernels in each process) calls this package's op
  of the same schema instead, whatever backend cache-dit would have selected;
* the CUDA kernel and the fake of cache-dit's ``cache_dit_cuda_ops::svdq_*``
  ops that this project serves (their CUDA kernels need cache-dit's extension,
  which is absent on Hopper and wherever it was not built from source) are
  this package's, and cache-dit's ``svdq_extension_is_available()`` says True.
  Where cache-dit's extension did load, its svdq ops stay its own.

It refuses, changing nothing, when the installed cache-dit is not the version
it was tested against (TESTED_VERSION) or when one of the ops it would take
over has a schema that differs from this project's (naming both). Importing
cache_dit_opd alone never changes cache-dit (docs/DESIGN.md section 6).
"""

from __future__ import annotations

import threading

import torch

from .. import _proxy, _schemas
from .. import kernels as _kernels

__all__ = ["TESTED_VERSION", "IntegrationError", "disable", "enable", "enabled", "status"]

TESTED_VERSION = "1.5.3"

# cache-dit's per-op backend dispatch (functions of cache_dit.kernels.ops, called by its public wrappers at every
# call) -> this project's op of the same schema. Parameter names are cache-dit's, which its wrappers pass as
# keywords; this package's public wrappers take the same names.
_DISPATCH = {
    "_fp8_comm_per_token_quant_impl": "fp8_comm_per_token_quant",
    "_fp8_comm_per_token_dequant_impl": "fp8_comm_per_token_dequant",
    "_fp8_comm_qkv_permute_quant_impl": "fp8_comm_qkv_permute_quant",
    "_fp8_comm_qkv_permute_dequant_impl": "fp8_comm_qkv_permute_dequant",
    "_fused_merge_attn_states_impl": "fused_merge_attn_states",
}
# The namespace whose definitions of those ops cache-dit's Triton backend registers: their schemas are compared.
_TRITON_NAMESPACE = "cache_dit_triton_ops"
_SCHEMA = {name: sig for family in _schemas.SCHEMAS.values() for name, sig in family.items()}
# cache_dit_cuda_ops ops of cache-dit that this project serves too (same name; the schema is compared).
_CUDA_OPS = sorted(_proxy.CACHE_DIT_OPS & _SCHEMA.keys())


class IntegrationError(RuntimeError):
    """The installed cache-dit is not one this integration can take over."""


_lock = threading.Lock()
# While enabled: cache-dit's ops module, its functions replaced ({name: original}), the Library serving its svdq
# ops, and their names.
_state: dict | None = None


def _args_and_returns(schema) -> str:
    s = str(schema)
    return s[s.index("("):]  # without the qualified name: namespaces differ


def _ours(name: str) -> str:
    return _args_and_returns(torch._C.parse_schema(f"x::{name}{_SCHEMA[name]}"))


def _theirs(namespace: str, name: str) -> str | None:
    try:
        return _args_and_returns(getattr(getattr(torch.ops, namespace), name).default._schema)
    except (AttributeError, RuntimeError):
        return None


def _load_cache_dit():
    try:
        import cache_dit
    except ImportError as e:
        raise IntegrationError(f"cache_dit_opd: cache-dit is not importable ({e}); pip install "
                               f"cache-dit=={TESTED_VERSION}") from e
    version = getattr(cache_dit, "__version__", "unknown")
    if version != TESTED_VERSION:
        raise IntegrationError(
            f"cache_dit_opd: installed cache-dit is {version}, this integration was tested against "
            f"{TESTED_VERSION} only; it takes over cache-dit's ops {sorted(_DISPATCH.values())} and {_CUDA_OPS} "
            f"and cannot know that they mean the same in {version}. Install cache-dit=={TESTED_VERSION}, or "
            f"call cache_dit_opd.kernels directly."
        )
    import cache_dit.kernels.cuda  # noqa: F401  (defines cache-dit's cuda ops; this client gives its copies back)
    import cache_dit.kernels.ops as ops
    from cache_dit.kernels.cuda import _svdquant

    try:
        import cache_dit.kernels.triton  # noqa: F401  (defines cache-dit's Triton ops, whose schemas are compared)
    except ImportError as e:
        raise IntegrationError(f"cache_dit_opd: cache-dit's Triton backend does not import ({e}), so the schemas "
                               f"of its ops {sorted(_DISPATCH.values())} cannot be compared; nothing was taken "
                               f"over") from e

    return ops, _svdquant


def _check(ops) -> None:
    mismatches = []
    for fn, name in _DISPATCH.items():
        if not callable(getattr(ops, fn, None)):
            mismatches.append(f"cache_dit.kernels.ops.{fn} (the dispatch of {name}) is missing")
        elif _theirs(_TRITON_NAMESPACE, name) != _ours(name):
            mismatches.append(f"{name}: cache-dit ({_TRITON_NAMESPACE}) {_theirs(_TRITON_NAMESPACE, name)}, "
                              f"cache_dit_opd {_ours(name)}")
    for name in _CUDA_OPS:
        if _theirs(_proxy.NAMESPACE, name) != _ours(name):
            mismatches.append(f"{name}: cache-dit ({_proxy.NAMESPACE}) {_theirs(_proxy.NAMESPACE, name)}, "
                              f"cache_dit_opd {_ours(name)}")
    if mismatches:
        raise IntegrationError("cache_dit_opd: cache-dit's ops differ from this project's, nothing was taken "
                               "over:\n  " + "\n  ".join(mismatches))


def enable() -> dict:
    """Makes cache-dit's kernels run through the daemon; returns status(). Idempotent.

    :raises IntegrationError: cache-dit missing, not TESTED_VERSION, or an op's schema differs (nothing changed).
    """
    global _state
    with _lock:
        if _state is None:
            ops, svdquant = _load_cache_dit()
            _check(ops)
            # cache-dit's extension loaded: its svdq ops can run in-process and stay its own.
            svdq = [] if svdquant.svdq_extension_is_available() else _CUDA_OPS
            replace = {fn: getattr(_kernels, name) for fn, name in _DISPATCH.items()}
            if svdq:
                replace.update(_svdq_extension_is_available_impl=lambda: True, _svdq_get_load_error_impl=lambda: None)
            patched = {fn: getattr(ops, fn) for fn in replace}
            lib = _proxy.serve_yielded(svdq)
            for fn, f in replace.items():
                setattr(ops, fn, f)
            _state = {"ops": ops, "patched": patched, "lib": lib, "svdq": svdq}
        return _status_locked()


def disable() -> dict:
    """Gives cache-dit its own kernels back; returns status(). Idempotent."""
    global _state
    with _lock:
        if _state is not None:
            for fn, original in _state["patched"].items():
                setattr(_state["ops"], fn, original)
            _proxy.give_back(_state["lib"], _state["svdq"])
            _state = None
        return _status_locked()


def enabled() -> bool:
    return _state is not None


def status() -> dict:
    """``{op: "daemon" | "cache-dit"}`` for each cache-dit op this project serves, while enabled; ``{}`` otherwise."""
    with _lock:
        return _status_locked()


def _status_locked() -> dict:
    if _state is None:
        return {}
    out = {name: "daemon" for name in _DISPATCH.values()}
    out.update({name: "daemon" if name in _state["svdq"] else "cache-dit" for name in _CUDA_OPS})
    return out
