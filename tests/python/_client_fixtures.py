"""Helpers for the Python client's tests (tests/python/test_*.py).

* ``PYTHON_DIR`` is put first on sys.path, so the tests run against the source tree whether or not
  ``pip install ./python`` was done; ``subprocess_env()`` does the same for child interpreters.
* ``daemon()``: the real daemon, started from the build on a private socket (bench/daemon.py's
  launcher): on fake device operations (``tests/fake_daemon/``, ``fake=True``, for CPU tests: the real
  gRPC service, session channel, executor and reasons; calls are checked by the kernel library's Meta
  kernels and nothing is computed) or on the GPU (``fake=False``).
* ``FakeDriver``: the driver calls the client's region table makes, on fake allocations whose IPC
  handles the fake daemon decodes (base, size, buffer id); ``DeviceTensor``: what the client reads of
  a CUDA tensor, at an address of such an allocation.
* ``ref``: the ops' reference semantics (``kernels/reference.py``); ``ref_merge`` rounds the merge's.
* Paths of the built kernel library and binaries (``CACHE_DIT_OPD_BUILD_DIR``, default ``<repo>/build``).
"""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PYTHON_DIR = os.path.join(REPO, "python")
PACKAGE_DIR = os.path.join(PYTHON_DIR, "cache_dit_opd")

for _p in (PYTHON_DIR, REPO):  # the client package, and bench/ (its daemon launcher)
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench.daemon import Daemon, DaemonError  # noqa: E402,F401

sys.path.insert(0, os.path.join(REPO, "kernels"))
import reference as ref  # noqa: E402  (the ops' PyTorch semantics, kernels/reference.py)

sys.path.remove(os.path.join(REPO, "kernels"))


def ref_merge(prev_out, prev_lse, suff_out, suff_lse):
    """The merge's reference (float64) rounded to the op's output dtypes."""
    out, lse = ref.merge_attn_states(prev_out, prev_lse, suff_out, suff_lse)
    return out.to(suff_out.dtype), lse.to(suff_lse.dtype)


def build_dir() -> str:
    return os.environ.get("CACHE_DIT_OPD_BUILD_DIR", os.path.join(REPO, "build"))


def kernel_library_path() -> str:
    return os.path.join(build_dir(), "kernels", "libcache_dit_cuda_ops.so")


def daemon_binary_path() -> str:
    return os.path.join(build_dir(), "server", "cache-dit-opd")


def fake_daemon_binary_path() -> str:
    return os.path.join(build_dir(), "tests", "fake_daemon", "opd_fake_daemon")


def built(path: str) -> str:
    """``path``, a build output; skips the test when it is missing, or fails it under
    CACHE_DIT_OPD_REQUIRE_BUILD=1 (CI builds everything first)."""
    import pytest

    if not os.path.exists(path):
        if os.environ.get("CACHE_DIT_OPD_REQUIRE_BUILD") == "1":
            pytest.fail(f"{path} is not built (CACHE_DIT_OPD_REQUIRE_BUILD=1)")
        pytest.skip(f"{path} is not built")
    return path


def short_tmpdir() -> str:
    """A fresh directory with a short path: AF_UNIX socket paths are limited to 107 bytes."""
    return tempfile.mkdtemp(prefix="cdo-", dir="/tmp")


def daemon(directory: str | None = None, *flags: str, fake: bool = True, device: int = 0, env: dict | None = None,
           serving: bool = True, socket: str | None = None) -> Daemon:
    """A started daemon on ``<directory>/opd.sock``; ``fake``: the fake-device daemon (CPU tests).

    The binary must be built (``built``). Extra daemon flags can be given with CACHE_DIT_OPD_DAEMON_ARGS.
    """
    binary = built(fake_daemon_binary_path() if fake else daemon_binary_path())
    extra = [*flags, *os.environ.get("CACHE_DIT_OPD_DAEMON_ARGS", "").split()]
    return Daemon(Path(binary), Path(directory or short_tmpdir()), device, extra, env, socket).start(serving=serving)


def subprocess_env(**extra) -> dict:
    """os.environ with the source tree first on PYTHONPATH (an extra PYTHONPATH goes after it)."""
    env = dict(os.environ)
    paths = [PYTHON_DIR, HERE]
    if extra.get("PYTHONPATH"):
        paths.append(extra.pop("PYTHONPATH"))
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update({k: v for k, v in extra.items() if v is not None})
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
    return env


def run_python(code: str, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter with the source tree on its path."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env=subprocess_env(**env), cwd=REPO)


# -- fake device memory ------------------------------------------------------------------------------


class FakeDriver:
    """The region table's driver calls on simulated allocations: ``alloc(size) -> base``; ``free(base)``."""

    def __init__(self):
        self.allocs: dict[int, tuple[int, int, bool]] = {}  # base -> (size, buffer id, legacy ipc capable)
        self.next_base = 0x7F0000000000
        self.next_buffer_id = 1
        self.pointer_queries = 0

    def alloc(self, size: int, at: int | None = None, vmm: bool = False) -> int:
        base = at if at is not None else self.next_base
        self.next_base = max(self.next_base, base + ((size + 0xFFFFF) & ~0xFFFFF) + 0x100000)
        self.allocs[base] = (size, self.next_buffer_id, not vmm)
        self.next_buffer_id += 1
        return base

    def free(self, base: int) -> None:
        del self.allocs[base]

    def pointer_range(self, ptr: int):
        self.pointer_queries += 1
        for base, (size, bid, _) in self.allocs.items():
            if base <= ptr < base + size:
                return base, size, bid
        return 0, 0, 0

    def legacy_ipc_capable(self, ptr: int) -> bool:
        for base, (size, _, ok) in self.allocs.items():
            if base <= ptr < base + size:
                return ok
        return False

    def ipc_get_mem_handle(self, base: int) -> bytes:
        # The layout tests/fake_daemon/fakes.h's FakeRegionOpener decodes.
        size, bid, _ = self.allocs[base]
        return struct.pack("<QQQ", base, size, bid).ljust(64, b"\0")


class DeviceTensor:
    """What the client reads of a CUDA tensor: address, shape, strides, dtype, device (cuda:``device``)."""

    def __init__(self, ptr: int, shape, dtype, strides=None, device: int = 0):
        import torch

        self.ptr, self.shape, self.dtype = ptr, tuple(shape), dtype
        self._strides = tuple(strides) if strides is not None else tuple(
            math.prod(self.shape[i + 1:]) for i in range(len(self.shape)))
        self.is_cuda, self._device = True, device
        self.device = torch.device("cuda", device)

    def data_ptr(self) -> int:
        return self.ptr

    def stride(self):
        return self._strides

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        import torch

        return torch.empty((), dtype=self.dtype).element_size()

    def get_device(self) -> int:
        return self._device
