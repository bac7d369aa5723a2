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
  ``sq``: SVDQuant's packers, unpackers and kernel-faithful numerics (``kernels/svdq_reference.py``);
  ``svdq_layer`` / ``svdq_act_outputs`` build a W4A4 layer's packed checkpoint tensors and the activation
  quantizer's outputs from them; ``svdq_gemm_reference`` is the GEMM's faithful sum from its own operands.
* Paths of the built binaries (``CACHE_DIT_OPD_BUILD_DIR``, default ``<repo>/build``) and of the kernel
  library, which is loaded into Python (``CACHE_DIT_OPD_LIBRARY_BUILD_DIR``, default the same): they differ
  when the binaries are a sanitizer build, whose libraries an uninstrumented Python cannot load
  (tests/run.sh, step 5).
"""

from __future__ import annotations

import atexit
import math
import os
import shutil
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
import svdq_reference as sq  # noqa: E402  (SVDQuant's layouts and kernel-faithful numerics)

sys.path.remove(os.path.join(REPO, "kernels"))


def ref_merge(prev_out, prev_lse, suff_out, suff_lse):
    """The merge's reference (float64) rounded to the op's output dtypes."""
    out, lse = ref.merge_attn_states(prev_out, prev_lse, suff_out, suff_lse)
    return out.to(suff_out.dtype), lse.to(suff_lse.dtype)


def build_dir() -> str:
    return os.environ.get("CACHE_DIT_OPD_BUILD_DIR", os.path.join(REPO, "build"))


def kernel_library_path() -> str:
    return os.path.join(os.environ.get("CACHE_DIT_OPD_LIBRARY_BUILD_DIR", build_dir()), "kernels",
                        "libcache_dit_cuda_ops.so")


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


_made_dirs: list[str] = []


def _remove_made_dirs() -> None:
    for d in _made_dirs:
        shutil.rmtree(d, ignore_errors=True)


def short_tmpdir() -> str:
    """A fresh directory with a short path: AF_UNIX socket paths are limited to 107 bytes.

    Removed when this process exits (a daemon's log is in its failures' messages already); set
    CACHE_DIT_OPD_KEEP_TMP=1 to keep them for a post-mortem."""
    d = tempfile.mkdtemp(prefix="cdo-", dir="/tmp")
    if os.environ.get("CACHE_DIT_OPD_KEEP_TMP") != "1":
        if not _made_dirs:
            atexit.register(_remove_made_dirs)
        _made_dirs.append(d)
    return d


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
    """The region table's driver calls on simulated allocations: ``alloc(size) -> base``; ``free(base)``.

    ``map_readonly`` maps a weight-store block's descriptor (from the fake-device daemon: a memfd) with
    ``mmap(PROT_READ)``, so a test reads the very bytes the store holds at the "device" address; ``unmap``
    undoes it. ``mapped`` holds what is mapped now."""

    def __init__(self):
        self.allocs: dict[int, tuple[int, int, bool]] = {}  # base -> (size, buffer id, legacy ipc capable)
        self.next_base = 0x7F0000000000
        self.next_buffer_id = 1
        self.pointer_queries = 0
        self.mapped: dict[int, int] = {}  # base -> size
        self.chunks: dict[int, list] = {}  # virtual memory: chunk base -> [size, buffer id]
        self.exported = 0  # chunk descriptors handed out
        self.no_descriptors = False  # chunks of an allocation made without the POSIX descriptor handle type

    def map_readonly(self, fd: int, size: int, device: int) -> int:
        import ctypes
        import mmap

        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        base = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if base in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of a store block ({size} bytes)")
        self.mapped[base] = size
        return base

    def unmap(self, base: int, size: int) -> None:
        import ctypes

        assert self.mapped.pop(base) == size
        libc = ctypes.CDLL(None)
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.munmap(ctypes.c_void_p(base), size)

    def alloc(self, size: int, at: int | None = None, vmm: bool = False, chunk: int = 2 << 20) -> int:
        """A fake allocation; ``vmm``: virtual memory as PyTorch's expandable segments map it, chunks of
        ``chunk`` bytes each with a buffer id of its own (``chunk_range``, ``buffer_id``, ``export_chunk_fd``)."""
        base = at if at is not None else self.next_base
        self.next_base = max(self.next_base, base + ((size + 0xFFFFF) & ~0xFFFFF) + 0x100000)
        self.allocs[base] = (size, self.next_buffer_id, not vmm)
        self.next_buffer_id += 1
        if vmm:
            for c in range(base, base + size, chunk):
                self.chunks[c] = [min(chunk, base + size - c), self.next_buffer_id]
                self.next_buffer_id += 1
        return base

    def free(self, base: int) -> None:
        size = self.allocs.pop(base)[0]
        for c in [c for c in self.chunks if base <= c < base + size]:
            del self.chunks[c]

    def _chunk(self, ptr: int):
        for c, (size, cid) in self.chunks.items():
            if c <= ptr < c + size:
                return c, size, cid
        return None

    def pointer_range(self, ptr: int):
        self.pointer_queries += 1
        for base, (size, bid, _) in self.allocs.items():
            if base <= ptr < base + size:
                c = self._chunk(ptr)  # virtual memory: the reservation's range, the chunk's buffer id
                return base, size, c[2] if c else bid
        return 0, 0, 0

    def chunk_range(self, ptr: int):
        c = self._chunk(ptr)
        if c is None:
            raise AssertionError(f"chunk_range(0x{ptr:x}): no chunk")
        return c[0], c[1]

    def buffer_id(self, ptr: int) -> int:
        self.pointer_queries += 1
        c = self._chunk(ptr)
        return c[2] if c else self.pointer_range(ptr)[2]

    def export_chunk_fd(self, ptr: int) -> int:
        """A memfd of the chunk's size: what the fake daemon's OpenChunks checks (fstat)."""
        base, size, _ = self._chunk(ptr)
        if self.no_descriptors:
            from cache_dit_opd._cuda_driver import CudaDriverError

            raise CudaDriverError("cuMemExportToShareableHandle", 1, "CUDA_ERROR_INVALID_VALUE")
        fd = os.memfd_create("fake-chunk", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        self.exported += 1
        return fd

    def remap(self, ptr: int) -> None:
        """The chunk holding ``ptr`` unmapped and mapped again (torch's empty_cache, then growth): a new id."""
        base, _, _ = self._chunk(ptr)
        self.chunks[base][1] = self.next_buffer_id
        self.next_buffer_id += 1

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


# -- SVDQuant W4A4 inputs and the GEMM's reference (kernels/svdq_reference.py) ---------------------------


def svdq_layer(g, dtype, m: int, k: int, n: int, rank: int) -> dict:
    """A W4A4 linear's input and packed checkpoint tensors (nunchaku's names and layouts), on the CPU, from
    the generator ``g``.

    What ``sq.quantize_linear`` makes of a float layer, without its SVD (LAPACK need not return the same bits
    in every process, and the GPU suite rebuilds these in a child process to compare bytes): the smoothed
    weight is drawn as its rank-R split plus a residual, W diag(s) = up @ down + residual, the residual
    quantized per 64-group (``sq.quantize_weight``, one all-zero group), proj_down = down / s (the kernels
    apply LoRA to the raw input), every tensor packed by the checkpoint packers in the model dtype.
    Keys: x [M, K] (row 1 all zero); smooth_factor [K]; qweight [N, K/2] int8; wscales [K/64, N];
    bias [N]; proj_down [K, R] and proj_up [N, R] (None for rank 0).
    """
    import torch

    x = (torch.randn(m, k, generator=g) * 2).to(dtype)
    x[1] = 0  # an all-zero row: scale 0, q 0, lora_act 0
    s = (torch.rand(k, generator=g) + 0.5).to(dtype)  # the smoothing, in [0.5, 1.5), as stored
    residual = torch.randn(n, k, generator=g) * 0.05
    residual[0, :sq.GROUP] = 0  # an all-zero weight group: scale 1
    q, scales = sq.quantize_weight(residual, dtype)
    out = {"x": x, "smooth_factor": sq.pack_channel_vector(s), "qweight": sq.pack_qweight(q),
           "wscales": sq.pack_wscales(scales),
           "bias": sq.pack_channel_vector((torch.randn(n, generator=g) * 0.1).to(dtype)),
           "proj_down": None, "proj_up": None}
    if rank:
        up = torch.randn(n, rank, generator=g) * 0.1
        down = torch.randn(rank, k, generator=g) * 0.1  # the smoothed weight's
        out["proj_down"] = sq.pack_lowrank((down / s.float()).to(dtype), down=True)
        out["proj_up"] = sq.pack_lowrank(up.to(dtype), down=False)
    return out


def svdq_act_outputs(x, smooth, proj_down, pad_size: int):
    """What ``svdq_quantize_w4a4_act_fuse_lora(x, proj_down, smooth, False, False, pad_size)`` returns
    (kernels/svdq/svdq.h layouts), from the references, on the CPU: act [M_pad, K] e4m3 codes and ascales
    [K/64, M_pad] as the kernel writes them (``sq.quantized_act_outputs``, which it equals bit for bit; pad
    rows q 0, scale 0); lora_act [M_pad, R] float32: x @ proj_down in float64 rounded once (the kernel's fp32 sum is
    within K roundings of it; pad rows 0)."""
    import torch

    m = x.shape[0]
    act, ascales = sq.quantized_act_outputs(x, None if smooth is None else sq.unpack_channel_vector(smooth),
                                            pad_size)
    m_pad = act.shape[0]
    rank = 0 if proj_down is None else proj_down.shape[1]
    lora_act = torch.zeros(m_pad, rank, dtype=torch.float32)
    if rank:
        down = sq.unpack_lowrank(proj_down, down=True)
        lora_act[:m] = (x.double() @ down.double().t()).float()
    return act, ascales, lora_act


def svdq_gemm_reference(act, wgt, ascales, wscales, lora_act_in=None, lora_up=None, bias=None):
    """``svdq_gemm_w4a4``'s sum from its own operands, on the CPU: ``(acc, lora, lora_abs)``.

    ``acc`` [M_pad, N] float32 is the main part and the bias exactly as the kernels compute it
    (``sq.group_sum_faithful``, as in ``sq.linear_faithful``; then + bias). ``lora`` [M_pad, N] float64 is
    LoRA-up on lora_act rounded to the model dtype (as both kernel paths round it) and ``lora_abs`` the sum
    of its terms' magnitudes (to bound the kernels' fp32 sums, whose order is each path's own); both None
    without LoRA.
    """
    import torch

    q_x = act.cpu().float().to(torch.int64)  # [M_pad, K] INT4 values
    q_w, ws = sq.unpack_qweight(wgt.cpu()), sq.unpack_wscales(wscales.cpu())  # [N, K], [N, K/64]
    acc = sq.group_sum_faithful(q_x, ascales.cpu().t(), q_w, ws)
    if bias is not None:
        acc = acc + sq.unpack_channel_vector(bias.cpu()).float()
    if lora_up is None:
        return acc, None, None
    la = lora_act_in.cpu().to(wscales.dtype).double()
    up = sq.unpack_lowrank(lora_up.cpu(), down=False).double()
    return acc, la @ up.t(), la.abs() @ up.abs().t()
