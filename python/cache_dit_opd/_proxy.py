"""Defining proxy ops in ``cache_dit_cuda_ops`` beside other owners of the namespace.

Each domain module defines its own ops with these helpers; nothing here lists
ops. Rules (docs/DESIGN.md section 6):

* op not defined yet: define it (tagged ``cudagraph_unsafe``) and attach the
  proxy CUDA impl and the fake;
* op already defined with the identical schema and no CUDA kernel: attach the
  proxy impl, and the fake unless one is registered already;
* op of upstream cache-dit's CUDA registry (CACHE_DIT_OPS): cache-dit's. Defined
  by cache-dit first, it is left alone; defined here first, it is given back
  (definition, impl and fake) when cache-dit's registry is imported, so
  cache-dit runs as it would without this package. Only
  ``cache_dit_opd.integrations.cache_dit.enable()`` serves it (serve_yielded);
* any other case (different schema, or a CUDA kernel already registered, as
  when the kernel library is loaded in-process): fail, naming the op and the
  module that owns it. One process never holds both the proxies and the
  kernel library.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import re
import sys
import warnings

import torch

NAMESPACE = "cache_dit_cuda_ops"
# A proxy op does host work per call: a captured CUDA graph would replay stale results.
PROXY_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


class NamespaceConflictError(RuntimeError):
    """cache_dit_cuda_ops already holds an incompatible definition of a served op."""


# Upstream cache-dit's CUDA registry (PyPI cache-dit 1.5.3): importing it defines these ops in
# cache_dit_cuda_ops, each with a CUDA kernel that wraps its extension cache_dit._C_svdquant (and raises when
# the extension is absent, as it always is on Hopper) and a fake. tests/python/test_integration_cache_dit.py
# checks this set against the installed package.
CACHE_DIT_REGISTRY = "cache_dit.kernels.cuda._ops_registery"
CACHE_DIT_OPS = frozenset({"svdq_quantize_w4a4_act_fuse_lora", "svdq_gemm_w4a4", "svdq_gemm_w4a4_v2",
                           "svdq_gemm_w4a4_ext", "svdq_quantize_w4a4_wgt"})

_own_libs: dict = {}   # full name -> the Library holding this client's definition of a CACHE_DIT_OPS op
_own_defs: dict = {}   # full name -> (schema, tags) of such a definition, to define it again
_yielded: set = set()  # CACHE_DIT_OPS ops that are cache-dit's in this process
_served: set = set()   # yielded ops this client serves again (serve_yielded)
_impls: dict = {}      # full name -> (cuda_impl, fake), as given to attach()


def _existing_schema(name: str, overload: str):
    try:
        packet = getattr(getattr(torch.ops, NAMESPACE), name)
        return getattr(packet, overload or "default")._schema
    except (AttributeError, RuntimeError):
        return None


def _fake_source(qualname: str) -> str | None:
    try:
        from torch._library.simple_registry import singleton
    except ImportError:
        return None
    for key in (qualname, qualname + ".default"):
        k = singleton.find(key).fake_impl.kernel
        if k is not None:
            return getattr(k, "source", None)
    return None


def owner_of(qualname: str) -> str:
    """Where an op's definition and kernels were registered, as well as torch records it."""
    parts = []
    try:
        dump = torch._C._dispatch_dump(qualname)
    except RuntimeError:
        dump = ""
    m = re.search(r"^debug: registered at (.+)$", dump, re.M)
    if m:
        parts.append(f"schema registered at {m.group(1).strip()}")
    m = re.search(r"^CUDA: registered at (\S+)", dump, re.M)
    if m:
        parts.append(f"CUDA kernel registered at {m.group(1).strip()}")
    src = _fake_source(qualname)
    if src:
        parts.append(f"fake registered at {src}")
    mods = [n for n in ("cache_dit", "cache_dit.kernels", "cache_dit._C_attn", "cache_dit._C_comm",
                        "cache_dit._C_svdquant") if n in sys.modules]
    if mods:
        f = getattr(sys.modules[mods[0]], "__file__", None) or "?"
        parts.append(f"imported modules: {', '.join(mods)} ({f})")
    return "; ".join(parts) if parts else "unknown owner"


def _normalize(schema) -> str:
    return str(schema)


def define_or_adopt(lib: "torch.library.Library", schemas: dict, tags=()) -> dict:
    """Defines each ``{"name[.overload]": "(args) -> rets"}`` in ``lib`` or adopts an identical definition.

    Returns ``{full name: True}`` for ops whose fake is already registered
    (left in place). Raises NamespaceConflictError otherwise.
    """
    fake_present = {}
    for full, sig in schemas.items():
        name, _, overload = full.partition(".")
        qualname = f"{NAMESPACE}::{full}"
        theirs = _existing_schema(name, overload)
        if theirs is None:
            if full in CACHE_DIT_OPS:
                _define_own(full, sig, tags)
            else:
                lib.define(f"{full}{sig}", tags=tuple(tags))
            fake_present[full] = False
            continue
        if full in CACHE_DIT_OPS and CACHE_DIT_REGISTRY in sys.modules:
            _yielded.add(full)  # cache-dit's; its schema is compared only when the integration is enabled
            continue
        ours = str(torch._C.parse_schema(f"{qualname}{sig}"))
        if _normalize(theirs) != ours:
            raise NamespaceConflictError(
                f"cache_dit_opd: {qualname} is already defined with a different schema.\n"
                f"  existing: {theirs}\n  cache_dit_opd: {ours}\n"
                f"  owner: {owner_of(qualname)}\n"
                f"The daemon client cannot proxy this op in this process."
            )
        if torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CUDA"):
            raise NamespaceConflictError(
                f"cache_dit_opd: {qualname} already has a CUDA kernel in this process "
                f"({owner_of(qualname)}). The daemon client and an in-process implementation of the same op "
                f"(upstream cache-dit's CUDA extension or the cache-dit-opd kernel library) cannot share one "
                f"process; load the kernel library in a separate process."
            )
        fake_present[full] = _fake_source(qualname) is not None or torch._C._dispatch_has_kernel_for_dispatch_key(
            qualname, "Meta"
        )
    return fake_present


# The key of the Python impl of an op that has a native kernel: the native kernel (CUDA key) redispatches the
# calls it cannot finish there. No tensor of these ops is ever a PrivateUse1 tensor.
PYTHON_IMPL_KEY = "PrivateUse1"


def attach(lib, full: str, cuda_impl, fake, fake_present: dict) -> None:
    """Registers the proxy impl and, unless one exists, the fake.

    With the native library (``_native``) every op gets a native CUDA kernel: an ``.out`` overload the proxy
    kernel, with ``cuda_impl`` moved to PYTHON_IMPL_KEY behind it for the calls the kernel hands back; a
    functional overload the functional kernel, which validates and allocates with the op's own Meta kernel
    and calls the ``.out`` overload (client/python/functional_kernel.h), so its ``cuda_impl`` serves only
    the pure-Python client and cache-dit's integration. The functional ops this client may give back to
    cache-dit (CACHE_DIT_OPS, defined in a Library of their own) have their native kernel taken out of the
    dispatcher before that Library goes (_yield_to_cache_dit): left there, it would become the CUDA kernel of
    cache-dit's definition. Without the native library every op gets ``cuda_impl`` as its CUDA kernel.
    """
    from . import _native

    _impls[full] = (cuda_impl, fake)
    if full in _yielded:
        return
    lib = _own_libs.get(full, lib)
    qualname = f"{NAMESPACE}::{full}"
    out_overload = _returns_alias_outputs(qualname)
    if _native.library() is not None:
        if out_overload:
            torch.library.impl(qualname, PYTHON_IMPL_KEY, cuda_impl, lib=lib)
        why = _native.register_kernel(full)
        if why is not None:
            raise RuntimeError(f"cache_dit_opd: native kernel for {qualname}: {why}")
        if out_overload:
            _native_out.add(full)
    else:
        torch.library.impl(qualname, "CUDA", cuda_impl, lib=lib)
    if not fake_present.get(full, False):
        # _stacklevel=2: the fake's recorded source is the domain module that calls attach().
        torch.library.register_fake(qualname, fake, lib=lib, _stacklevel=2)


_native_out: set[str] = set()  # "name.out" overloads whose CUDA kernel is the native one


def require_served(full: str) -> None:
    """Raises when ``full`` is cache-dit's in this process and this client does not serve it."""
    if full in _yielded and full not in _served:
        raise RuntimeError(
            f"cache_dit_opd: {NAMESPACE}::{full} is defined by cache-dit in this process ({CACHE_DIT_REGISTRY} is "
            f"imported), and its CUDA kernel is cache-dit's own extension. To run cache-dit's op (and this "
            f"wrapper) through the daemon, call cache_dit_opd.integrations.cache_dit.enable(); the .out overload "
            f"is always the daemon's."
        )


def serve_yielded(names) -> "torch.library.Library":
    """Registers this client's CUDA impl and fake over cache-dit's for each yielded op in ``names``.

    Destroying the returned Library (give_back) restores cache-dit's kernel and fake: the dispatcher and
    torch's fake registry keep earlier registrations beneath later ones.
    """
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    for full in names:
        if full not in _yielded:
            raise AssertionError(f"{full} is not cache-dit's")
        impl, fake = _impls[full]
        with warnings.catch_warnings():  # "Overriding a previously registered kernel": that is the point
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
            lib.impl(full, impl, "CUDA", allow_override=True)
        torch.library.register_fake(f"{NAMESPACE}::{full}", fake, lib=lib, allow_override=True)
        _served.add(full)
    return lib


def give_back(lib: "torch.library.Library", names) -> None:
    """Undoes serve_yielded."""
    lib._destroy()
    _served.difference_update(names)


def _define_own(full: str, sig: str, tags) -> None:
    # In a Library of its own, so that it can be given back alone.
    lib = _own_libs[full] = torch.library.Library(NAMESPACE, "FRAGMENT")
    _own_defs[full] = (sig, tuple(tags))
    lib.define(f"{full}{sig}", tags=tuple(tags))


def _yield_to_cache_dit() -> list:
    from . import _native

    gave = list(_own_libs)
    for full in gave:
        _native.unregister_kernel(full)  # first: it is not in the Library below, and must not outlive it
        _own_libs.pop(full)._destroy()  # definition, impl and fake; torch drops torch.ops' cached packet too
        _yielded.add(full)
    return gave


def _reclaim(names) -> None:
    """Defines again those of ``names`` that nobody defines now (cache-dit's registry failed to import)."""
    for full in names:
        name, _, overload = full.partition(".")
        if _existing_schema(name, overload) is None:
            _yielded.discard(full)
            _define_own(full, *_own_defs[full])
            attach(None, full, *_impls[full], {})


class _CacheDitRegistryLoader(importlib.abc.Loader):
    """cache-dit's registry module, executed after this client gave back its definitions of CACHE_DIT_OPS."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        gave = _yield_to_cache_dit()
        try:
            self._loader.exec_module(module)
        except BaseException:
            _reclaim(gave)  # what cache-dit did not define is this client's again
            raise


class _CacheDitRegistryFinder(importlib.abc.MetaPathFinder):
    """Sees cache-dit's registry being imported while this client defines some of its ops: torch allows one
    definition per op, and cache-dit's import must not fail because this package was imported first."""

    def find_spec(self, fullname, path, target=None):
        if fullname != CACHE_DIT_REGISTRY or not _own_libs:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _CacheDitRegistryLoader(spec.loader)
        return spec


if not any(isinstance(f, _CacheDitRegistryFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _CacheDitRegistryFinder())


def redispatch(name: str, args: tuple, kwargs: dict):
    """A callable that runs ``<name>.out(*args, **kwargs)`` again through its native kernel, or None when the
    op has none (the Python implementation then runs the call itself, over gRPC)."""
    if f"{name}.out" not in _native_out:
        return None
    op = getattr(getattr(torch.ops, NAMESPACE), name).out
    return lambda: op(*args, **kwargs)


def _returns_alias_outputs(qualname: str) -> bool:
    name, _, overload = qualname.split("::", 1)[1].partition(".")
    schema = _existing_schema(name, overload)
    return bool(schema.returns) and all(r.alias_info is not None and r.alias_info.is_write for r in schema.returns)


def check_not_capturing(op: str, device_index: int) -> None:
    """Proxy ops do host work per call; a captured graph would replay without reaching the daemon."""
    from ._session import current_stream_is_capturing

    if current_stream_is_capturing(device_index):
        raise RuntimeError(
            f"{NAMESPACE}::{op} runs in the cache-dit-opd daemon and cannot be captured in a CUDA graph "
            f"(a replay would never reach the daemon). Call it outside torch.cuda.graph capture, or compile "
            f"without CUDA graphs (e.g. torch.compile mode other than 'reduce-overhead'); the op carries "
            f"torch.Tag.cudagraph_unsafe so Inductor's cudagraph trees skip it."
        )


def device_index(op: str, *tensors) -> int:
    """The common CUDA device of ``tensors``; ValueError naming the devices otherwise."""
    idx = tensors[0].get_device()  # an int, without building a torch.device per tensor
    if idx >= 0 and all(t.is_cuda and t.get_device() == idx for t in tensors):
        return idx
    devs = {t.device for t in tensors}
    if len(devs) != 1:
        raise ValueError(f"{op}: all tensors must be on one CUDA device, got {sorted(str(d) for d in devs)}")
    raise ValueError(f"{op}: tensors must be on a CUDA device, got {next(iter(devs))}")
