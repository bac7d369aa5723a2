"""The native library (``_native``, ``client/python/``) on the CPU: loading, registration, refusals.

What runs calls (the native kernels, the engine's ring and lanes) needs a GPU and
is tested in test_client_native_gpu.py; the engine against the real daemon on fakes
is tested in C++ (tests/cpp/client/engine_test.cc).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import _client_fixtures as fx
from cache_dit_opd import _errors, _native, _proxy, kernels  # noqa: F401  (kernels: the ops are defined)

needs_library = pytest.mark.skipif(_native.library() is None, reason=f"native library not built: "
                                                                     f"{_native.load_error()}")


def _cuda_kernel_source(qualname: str) -> str:
    dump = torch._C._dispatch_dump(qualname)
    return dump.split("CUDA: registered at", 1)[1].splitlines()[0]


@needs_library
def test_library_matches_this_client():
    lib = _native.library()
    assert lib.opd_native_abi_version() == _native.ABI_VERSION
    assert _native.load_error() is None


@needs_library
def test_every_overload_gets_a_native_kernel_and_keeps_python_behind_it():
    for op in ("fp8_comm_per_token_quant.out", "fp8_comm_qkv_permute_dequant.out", "fused_merge_attn_states.out"):
        q = f"cache_dit_cuda_ops::{op}"
        assert "client/python/proxy_kernel.cpp" in _cuda_kernel_source(q)
        assert f"{_proxy.PYTHON_IMPL_KEY}: registered at" in torch._C._dispatch_dump(q)
        assert _proxy.redispatch(op.split(".")[0], (), {}) is not None
    for op in ("fp8_comm_per_token_quant", "fp8_comm_qkv_permute_dequant", "fused_merge_attn_states"):
        q = f"cache_dit_cuda_ops::{op}"
        assert "client/python/functional_kernel.cpp" in _cuda_kernel_source(q)
        assert f"{_proxy.PYTHON_IMPL_KEY}: registered at" not in torch._C._dispatch_dump(q)  # never handed back
    assert _native.register_kernel("fp8_comm_per_token_quant") is None  # again: nothing to do
    # cache-dit's svdq ops, which this client defines in Libraries of their own (it gives them back when
    # cache-dit's registry loads), get the native kernel too.
    assert {"svdq_gemm_w4a4", "svdq_quantize_w4a4_wgt"} <= set(_proxy._own_libs)
    for op in sorted(_proxy.CACHE_DIT_OPS & set(_proxy._own_libs)):
        assert "client/python/functional_kernel.cpp" in _cuda_kernel_source(f"cache_dit_cuda_ops::{op}"), op


@needs_library
def test_an_op_given_back_loses_its_native_kernel_first_and_gets_it_again_when_taken_back():
    """What cache-dit's registry import does (give back, then take back what it did not define), without
    cache-dit: in between no kernel of this client is left under the name; afterwards the native one is back."""
    code = """
        import torch, cache_dit_opd
        from cache_dit_opd import _native, _proxy
        q = "cache_dit_cuda_ops::svdq_gemm_w4a4"
        assert "functional_kernel.cpp" in torch._C._dispatch_dump(q)
        gave = _proxy._yield_to_cache_dit()
        assert "svdq_gemm_w4a4" in gave
        dump = torch._C._dispatch_dump(q)
        assert "functional_kernel.cpp" not in dump and "cache_dit_opd" not in dump, dump
        assert not _native.unregister_kernel("svdq_gemm_w4a4")  # nothing left to take back
        _proxy._reclaim(gave)
        assert "functional_kernel.cpp" in torch._C._dispatch_dump(q)
        print("ok")
    """
    r = fx.run_python(textwrap.dedent(code), CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@needs_library
def test_a_given_back_op_keeps_no_kernel_of_this_client():
    """The client first, then cache-dit's registry (PyPI cache-dit, a test dependency): the svdq ops the client
    gives back carry no registration of this client, native or Python, under cache-dit's definition."""
    pytest.importorskip("cache_dit")
    code = """
        import torch, cache_dit_opd, importlib
        from cache_dit_opd import _proxy
        importlib.import_module(_proxy.CACHE_DIT_REGISTRY)
        for op in sorted(_proxy.CACHE_DIT_OPS):
            dump = torch._C._dispatch_dump(f"cache_dit_cuda_ops::{op}")
            assert "functional_kernel.cpp" not in dump and "cache_dit_opd" not in dump, dump
        print("ok")
    """
    r = fx.run_python(textwrap.dedent(code), CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@needs_library
def test_register_kernel_refuses_what_it_cannot_serve():
    assert "is not defined" in _native.register_kernel("no_such_op.out")
    lib = torch.library.Library("cache_dit_cuda_ops", "FRAGMENT")
    try:
        lib.define("opd_test_not_in_the_table(Tensor x) -> Tensor")
        lib.define("opd_test_not_in_the_table.out(Tensor x, *, Tensor out) -> Tensor")  # returns no alias
        why = _native.register_kernel("opd_test_not_in_the_table")
        assert why is not None and "is not a functional overload of kernels/ops.def" in why
        why = _native.register_kernel("opd_test_not_in_the_table.out")
        assert why is not None and "does not alias a mutable argument" in why
    finally:
        lib._destroy()


@needs_library
def test_an_engine_checks_what_the_daemon_handed_over_before_touching_the_device():
    import socket

    def open_engine(memfd, nbytes):
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            return _native.NativeSession(_native.library(), device=0, memfd=memfd, channel_fd=a.detach(),
                                         memory_bytes=nbytes, session_id=1, lanes=1, spin_s=0, call_timeout_s=1,
                                         heartbeat_timeout_s=0)
        finally:
            b.close()

    with pytest.raises(_errors.DaemonError, match=r"fstat\(session memfd\): Bad file descriptor"):
        open_engine(-1, 0)
    fd = os.memfd_create("not-a-session")
    os.ftruncate(fd, 8192)
    with pytest.raises(_errors.DaemonError, match=r"session memory magic is 0x0, expected 0x504f4443") as e:
        open_engine(fd, 8192)  # the engine owns fd (and closed it)
    assert e.value.action == _errors.FAIL


def test_native_off_keeps_the_client_pure_python():
    code = r"""
import torch
from cache_dit_opd import _native, _proxy, kernels
dump = torch._C._dispatch_dump("cache_dit_cuda_ops::fp8_comm_per_token_quant.out")
print(_native.library() is None, "PrivateUse1" in dump, _proxy.redispatch("fp8_comm_per_token_quant", (), {}) is None)
print(_native.load_error())
"""
    r = fx.run_python(code, CACHE_DIT_OPD_NATIVE="0")
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()[:2]
    assert first == "True False True", r.stdout
    assert "CACHE_DIT_OPD_NATIVE=0" in second


def test_a_missing_library_is_named_with_where_it_was_looked_for(tmp_path):
    import shutil

    pkg = tmp_path / "site" / "cache_dit_opd"  # a copy with no build folder next to it
    shutil.copytree(fx.PACKAGE_DIR, pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    code = r"""
from cache_dit_opd import _native, _proxy, kernels
print(_native.library() is None, _proxy.redispatch("fp8_comm_per_token_quant", (), {}) is None)
print(_native.load_error())
"""
    env = dict(os.environ, PYTHONPATH=str(pkg.parent), CACHE_DIT_OPD_NATIVE_LIB="/nonexistent/lib.so",
               CACHE_DIT_OPD_BUILD_DIR="/nonexistent")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()[:2]
    assert first == "True True", r.stdout
    assert "libcache_dit_opd_native.so not found" in second and "/nonexistent/client/python" in second, second
