"""Regions: client allocations exported to the daemon with legacy CUDA IPC.

A region is one CUDA allocation (a caching-allocator segment): the daemon maps
it once per session at its base, and a tensor travels as (region id, byte
offset, sizes, strides, dtype). Handles come from the driver API
(``cuIpcGetMemHandle`` on the allocation base), not from torch's sharing
format.

Keeping the cache correct:

* Address reuse. Every tensor of every call is looked up with one driver call,
  ``cuPointerGetAttributes(RANGE_START_ADDR, RANGE_SIZE, BUFFER_ID)``. The
  buffer id is unique per allocation for the life of the process, so a freed
  segment whose address range was handed out again by a new ``cudaMalloc``
  never matches its old cache entry: the stale region is unregistered and the
  new allocation registered. This check runs on every call because a segment
  can be freed inside torch (``empty_cache``, the allocator's retry after a
  failed ``cudaMalloc``) without any notification torch exposes to Python.
* Returning memory. A segment the daemon still maps stays resident after the
  client's ``cudaFree``. Freed segments are found by a sweep (one driver call
  per cached region) and unregistered; the sweep runs right after
  ``torch.cuda.empty_cache()`` (the function is wrapped once a session
  exists), from torch's out-of-memory observer, and from the call path at most
  once per ``SWEEP_INTERVAL_S``.
* Cost, measured on the H200 host (driver 580, torch 2.11): the per-tensor
  check is one ``cuPointerGetAttributes`` through ctypes, p50 1.7 us and p99
  3.4 us; the Python around it adds about 0.4 us (2-core CI VM, fake driver).
  A call of the merge op (6 tensors) spends about 10 us here, the comm ops
  (2 tensors) about 4 us. Cheaper torch-side signals do not exist: torch
  exposes no segment-free callback, ``torch.cuda.memory_stats()`` builds a
  large dict per call, and ``_snapshot()`` walks every segment.
* VMM memory (``expandable_segments:True``, custom or pluggable allocators)
  cannot be exported with legacy IPC; it is detected from
  ``CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE``. PyTorch's expandable
  segments map their reservation in chunks (2 or 20 MiB), each a physical
  allocation exportable as a POSIX descriptor: a tensor there is registered
  as the run of chunks it covers (``register_vmm``: the descriptors go over
  the session channel and the daemon maps them contiguously), and a run is
  taken again only while every chunk a tensor touches has its buffer id (a
  chunk torch unmapped and mapped again is other memory). Memory that cannot
  be exported that way is reported with what to change.
* Weight-store blocks (``StoreBlock``): daemon memory this process mapped
  read-only (``cache_dit_opd.store.attach``). They are found by address before
  any driver query, registered in a session by attaching one of their entries
  again (the daemon lends the block as a read-only region; nothing is
  exported), and given to the native engine as fixed ranges. A block stays
  mapped while a tensor made from it lives.
"""

from __future__ import annotations

import bisect
import functools
import os
import threading
import time
import weakref
from dataclasses import dataclass

from . import _cuda_driver, _wire

SWEEP_INTERVAL_S = 1.0
MAX_REGIONS = int(os.environ.get("CACHE_DIT_OPD_MAX_REGIONS", "4096"))

_VMM_HINT = (
    "it is virtual-memory (cuMemCreate) memory, which legacy CUDA IPC cannot export, and its chunks give no "
    "POSIX descriptor for the daemon to map (PyTorch's expandable segments give one unless "
    "TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=0; custom or pluggable allocators may not). Allocate it with the POSIX "
    "descriptor handle type, or set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False before CUDA is initialized "
    "and pass tensors from PyTorch's default caching allocator."
)


class RegionExportError(RuntimeError):
    """A tensor's memory cannot be exported to the daemon."""


class RegionsExhausted(Exception):
    """RegisterRegion answered RESOURCE_EXHAUSTED (the daemon's mapping cache is full)."""


@dataclass
class Region:
    region_id: int
    base: int
    size: int
    buffer_id: int
    last_use: int = 0
    fixed: bool = False  # a StoreBlock's region: no driver query, no sweep
    chunks: tuple = ()  # a run of virtual-memory chunks: ((base, size, buffer id), ...) in address order


class StoreBlock:
    """A weight-store block of the daemon serving ``device_index``, mapped read-only into this process: the
    memory of one published set (session_memory.h StoreAttachReply). Every tensor attached from it holds it;
    when the last one goes, each session's region of it is unregistered and the mapping removed. ``name``
    is an entry of the set, what another session attaches to register the block."""

    def __init__(self, device_index: int, daemon_instance: int, block_id: int, base: int, size: int, name: str,
                 driver):
        self.device_index, self.daemon_instance, self.block_id = device_index, daemon_instance, block_id
        self.base, self.size, self.name = base, size, name
        self.tables: "weakref.WeakSet[RegionTable]" = weakref.WeakSet()  # sessions that registered it
        self._finalizer = weakref.finalize(self, _release_block, self.key, base, size, device_index, driver,
                                           self.tables)
        self._finalizer.atexit = False  # the process's exit unmaps everything

    @property
    def key(self) -> tuple:
        return self.device_index, self.daemon_instance, self.block_id

    def contains(self, ptr: int) -> bool:
        return self.base <= ptr < self.base + self.size


_blocks: "dict[tuple, weakref.ref]" = {}  # StoreBlock.key -> the live block
_blocks_lock = threading.Lock()


def store_block_at(device_index: int, ptr: int) -> StoreBlock | None:
    """The live store block of ``device_index`` that holds ``ptr`` (no driver query)."""
    for ref in list(_blocks.values()):
        b = ref()
        if b is not None and b.device_index == device_index and b.contains(ptr):
            return b
    return None


def map_store_block(device_index: int, reply: dict, fd: int, name: str, driver) -> StoreBlock:
    """The block an attach reply names: this process's mapping of it when one lives, else ``fd`` mapped
    read-only now. The caller closes ``fd`` either way."""
    key = (device_index, reply["daemon_instance"], reply["block_id"])
    with _blocks_lock:
        ref = _blocks.get(key)
        b = ref() if ref is not None else None
        if b is None:
            base = driver.map_readonly(fd, reply["block_bytes"], device_index)
            b = StoreBlock(device_index, reply["daemon_instance"], reply["block_id"], base, reply["block_bytes"],
                           name, driver)
            _blocks[key] = weakref.ref(b)
        return b


def _release_block(key, base, size, device_index, driver, tables) -> None:
    """A block's last tensor is gone: unregister its regions, then unmap it once this process's own work on
    the device (which may still read it) has finished."""
    with _blocks_lock:
        ref = _blocks.get(key)
        if ref is not None and ref() is None:
            del _blocks[key]
    for t in list(tables):
        t.forget_base(base)
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize(device_index)
        driver.unmap(base, size)
    except Exception:  # noqa: BLE001  (a finalizer: a failed unmap leaves the range to the process's exit)
        pass


class RegionTable:
    """One session's exported allocations, keyed by allocation base.

    ``register(handle, base, size, buffer_id) -> region_id`` and
    ``unregister(region_id)`` are the session's RPCs. Thread-safe: lookups read
    a dict; changes happen under one lock.
    """

    def __init__(self, register, unregister, driver=None, device_index: int = 0, on_add=None, on_forget=None,
                 attach=None, register_vmm=None):
        self._register = register
        self._unregister = unregister
        # register_vmm(chunks, fds) -> region id: a run of virtual-memory chunks (None: such memory is refused).
        self._register_vmm = register_vmm
        self._run_bases: list[int] = []  # bases of the chunk runs in _by_base, sorted
        # attach(block) -> region id: registers a StoreBlock in this session (by attaching its entry again).
        self._attach = attach
        # Told about every region that enters or leaves the table (the native session's copy).
        self._on_add = on_add or (lambda r: None)
        self._on_forget = on_forget or (lambda r: None)
        self._drv = driver
        self._device_index = device_index
        self._by_base: dict[int, Region] = {}
        self._lock = threading.Lock()
        self._clock = 0
        self._next_sweep = time.monotonic() + SWEEP_INTERVAL_S
        self.closed = False
        _tables.add(self)

    @property
    def driver(self):
        if self._drv is None:
            self._drv = _cuda_driver.get_driver()
        return self._drv

    def __len__(self) -> int:
        return len(self._by_base)

    def regions(self) -> list[Region]:
        return list(self._by_base.values())

    # -- hot path ---------------------------------------------------------------
    def ref(self, ptr: int, nbytes: int, pinned: set | None = None) -> tuple[int, int]:
        """(region id, byte offset) for ``nbytes`` of device memory at ``ptr``."""
        block = store_block_at(self._device_index, ptr) if _blocks else None
        if block is not None:
            return self._store_ref(block, ptr, nbytes, pinned)
        r = self._run_at(ptr, nbytes) if self._run_bases else None
        if r is not None:
            return self._use(r, pinned), ptr - r.base
        base, size, buffer_id = self.driver.pointer_range(ptr)
        r = self._by_base.get(base)
        if r is None or r.chunks or r.buffer_id != buffer_id or r.size != size:
            r = self._register_allocation(ptr, nbytes, base, size, buffer_id, pinned)
            if r.chunks:
                return self._use(r, pinned), ptr - r.base
        self._clock += 1
        r.last_use = self._clock
        if pinned is not None:
            pinned.add(r.region_id)
        if ptr + nbytes > base + size:  # a view past its allocation: never send it
            raise ValueError(
                f"tensor bytes [0x{ptr:x}, 0x{ptr + nbytes:x}) exceed their CUDA allocation "
                f"[0x{base:x}, 0x{base + size:x})"
            )
        return r.region_id, ptr - base

    def _use(self, r: Region, pinned: set | None) -> int:
        self._clock += 1
        r.last_use = self._clock
        if pinned is not None:
            pinned.add(r.region_id)
        return r.region_id

    def _run_at(self, ptr: int, nbytes: int) -> Region | None:
        """The chunk run holding [ptr, ptr + nbytes) whose chunks that range touches still have their buffer ids;
        a run with a chunk mapped again is dropped (its memory is another)."""
        i = bisect.bisect_right(self._run_bases, ptr) - 1
        if i < 0:
            return None
        r = self._by_base.get(self._run_bases[i])
        if r is None or ptr + nbytes > r.base + r.size:
            return None
        last = ptr + max(nbytes, 1) - 1
        for base, size, cid in r.chunks:
            if base + size > ptr and base <= last and self.driver.buffer_id(base) != cid:
                with self._lock:
                    self._drop(r)
                return None
        return r

    def _store_ref(self, block: StoreBlock, ptr: int, nbytes: int, pinned: set | None) -> tuple[int, int]:
        if ptr + nbytes > block.base + block.size:
            raise ValueError(f"tensor bytes [0x{ptr:x}, 0x{ptr + nbytes:x}) exceed weight-store block "
                             f"[0x{block.base:x}, 0x{block.base + block.size:x}) of '{block.name}'")
        self._clock += 1
        r = self._by_base.get(block.base)
        if r is None or not r.fixed:
            r = self.add_store_block(block)
        r.last_use = self._clock
        if pinned is not None:
            pinned.add(r.region_id)
        return r.region_id, ptr - block.base

    def add_store_block(self, block: StoreBlock, region_id: int | None = None) -> Region:
        """Registers ``block`` in this session: with the region id an attach on this session answered, else by
        attaching its entry again (the ``attach`` callback)."""
        with self._lock:
            r = self._by_base.get(block.base)
            if r is not None and r.fixed and (region_id is None or r.region_id == region_id):
                return r
            if self._attach is None and region_id is None:
                raise RegionExportError(f"cache_dit_opd: weight-store block of '{block.name}' cannot be registered "
                                        f"in this session (no attach)")
            rid = region_id if region_id is not None else self._attach(block)
            block.tables.add(self)
            # Replaces a freed allocation that had this address, or another region id of the block.
            return self._add(Region(rid, block.base, block.size, 0, fixed=True))

    def forget_base(self, base: int) -> None:
        """Unregisters the region at ``base`` (a store block whose last tensor went)."""
        with self._lock:
            r = self._by_base.get(base)
            if r is not None:
                self._drop(r)

    def maybe_sweep(self) -> None:
        if time.monotonic() >= self._next_sweep:
            self.sweep()

    # -- registration -------------------------------------------------------------
    def _register_allocation(self, ptr, nbytes, base, size, buffer_id, pinned) -> Region:
        drv = self.driver
        if base == 0 or size == 0 or buffer_id == 0:
            raise RegionExportError(
                f"cache_dit_opd: address 0x{ptr:x} is not in a live CUDA device allocation"
            )
        with self._lock:
            r = self._by_base.get(base)
            if r is not None and not r.chunks and r.buffer_id == buffer_id and r.size == size:
                return r
            if not drv.legacy_ipc_capable(base):
                return self._register_run(ptr, nbytes, pinned)
            if r is not None:  # the old allocation at this address was freed: drop its mapping
                self._drop(r)
            try:
                handle = drv.ipc_get_mem_handle(base)
            except _cuda_driver.CudaDriverError as e:
                if e.code == _cuda_driver.CUDA_ERROR_INVALID_VALUE:
                    raise RegionExportError(
                        f"cache_dit_opd: cuIpcGetMemHandle refused the allocation at 0x{base:x} "
                        f"({size} bytes on cuda:{self._device_index}): {e}; if {_VMM_HINT}"
                    ) from e
                raise
            region_id = self._registered(pinned, lambda: self._register(handle, base, size, buffer_id))
            return self._add(Region(region_id, base, size, buffer_id))

    def _registered(self, pinned, register) -> int:
        """``register()``'s region id, idle regions evicted first when the table (or the daemon) is full."""
        if len(self._by_base) >= MAX_REGIONS:
            self._evict_idle(pinned, len(self._by_base) // 2)
        try:
            return register()
        except RegionsExhausted:
            if not self._evict_idle(pinned, max(1, len(self._by_base) // 2)):
                raise
            return register()

    def _add(self, r: Region) -> Region:
        old = self._by_base.get(r.base)
        if old is not None:
            self._drop(old)
        self._by_base[r.base] = r
        if r.chunks:
            bisect.insort(self._run_bases, r.base)
        self._on_add(r)
        return r

    def _register_run(self, ptr, nbytes, pinned) -> Region:
        """Registers the run of virtual-memory chunks [ptr, ptr + nbytes) covers (under the lock)."""
        drv = self.driver
        where = f"tensor memory at 0x{ptr:x} ({nbytes} bytes on cuda:{self._device_index})"
        if self._register_vmm is None or not hasattr(drv, "chunk_range"):
            raise RegionExportError(f"cache_dit_opd: cannot export {where} to the operator daemon: {_VMM_HINT}")
        chunks, at, end = [], ptr, ptr + max(nbytes, 1)
        while at < end:
            base, size = drv.chunk_range(at)
            if size == 0 or not base <= at < base + size or (chunks and base != at):
                raise RegionExportError(f"cache_dit_opd: {where}: the driver maps no chunk at 0x{at:x}")
            chunks.append((base, size, drv.buffer_id(base)))
            if len(chunks) > _wire.MAX_VMM_CHUNKS:
                raise RegionExportError(f"cache_dit_opd: {where} spans more than {_wire.MAX_VMM_CHUNKS} "
                                        f"virtual-memory chunks, the most one region takes")
            at = base + size
        fds = []
        try:
            for base, _, _ in chunks:
                try:
                    fds.append(drv.export_chunk_fd(base))
                except _cuda_driver.CudaDriverError as e:
                    raise RegionExportError(f"cache_dit_opd: cannot export {where}: its chunk at 0x{base:x} gives "
                                            f"no POSIX descriptor ({e}); {_VMM_HINT}") from e
            region_id = self._registered(pinned, lambda: self._register_vmm(chunks, fds))
        finally:
            for fd in fds:
                os.close(fd)
        return self._add(Region(region_id, chunks[0][0], sum(c[1] for c in chunks), 0, chunks=tuple(chunks)))

    def _pop(self, r: Region) -> None:
        if self._by_base.get(r.base) is r:
            del self._by_base[r.base]
            if r.chunks:
                self._run_bases.remove(r.base)
        self._on_forget(r)

    def _drop(self, r: Region) -> None:
        self._pop(r)
        if not self.closed:
            try:
                self._unregister(r.region_id)
            except Exception:  # the session is failing; its regions die with it
                pass

    def _evict_idle(self, pinned, count: int) -> int:
        pinned = pinned or set()
        idle = sorted((r for r in self._by_base.values() if r.region_id not in pinned), key=lambda r: r.last_use)
        for r in idle[:count]:
            self._drop(r)
        return min(count, len(idle))

    def forget(self, region_ids) -> None:
        """Drops regions the daemon no longer knows (e.g. it answered NOT_FOUND)."""
        ids = set(region_ids)
        with self._lock:
            for r in [r for r in self._by_base.values() if r.region_id in ids]:
                self._pop(r)

    def sweep(self) -> int:
        """Unregisters every region whose allocation was freed; returns how many."""
        self._next_sweep = time.monotonic() + SWEEP_INTERVAL_S
        if self.closed or not self._by_base:
            return 0
        drv = self.driver
        freed = 0
        with self._lock:
            for r in list(self._by_base.values()):
                if r.fixed:  # mapped by this process until its tensors go (StoreBlock)
                    continue
                if r.chunks:  # a run: gone when one of its chunks was unmapped or mapped again
                    try:
                        same = all(drv.buffer_id(b) == cid for b, _, cid in r.chunks)
                    except _cuda_driver.CudaDriverError:
                        same = False
                    if not same:
                        self._drop(r)
                        freed += 1
                    continue
                try:
                    base, size, buffer_id = drv.pointer_range(r.base)
                except _cuda_driver.CudaDriverError:
                    base = size = buffer_id = 0
                if base != r.base or buffer_id != r.buffer_id or size != r.size:
                    self._drop(r)
                    freed += 1
        return freed

    def close(self) -> None:
        self.closed = True
        for r in self._by_base.values():
            self._on_forget(r)
        self._by_base.clear()
        self._run_bases.clear()
        _tables.discard(self)


# -- hooks that find freed segments ---------------------------------------------------
_tables: "weakref.WeakSet[RegionTable]" = weakref.WeakSet()
_hooks_lock = threading.Lock()
_hooks_installed = False


def sweep_all() -> int:
    """Sweeps every live session's regions (after empty_cache and on OOM)."""
    n = 0
    for t in list(_tables):
        try:
            n += t.sweep()
        except Exception:
            pass
    return n


def install_free_hooks() -> None:
    """Wraps torch.cuda.empty_cache and attaches an OOM observer, once per process."""
    global _hooks_installed
    if _hooks_installed:
        return
    with _hooks_lock:
        if _hooks_installed:
            return
        import torch
        import torch.cuda.memory as memory

        orig = memory.empty_cache
        if not getattr(orig, "_cache_dit_opd_sweeps", False):

            @functools.wraps(orig)
            def empty_cache() -> None:
                orig()
                sweep_all()

            empty_cache._cache_dit_opd_sweeps = True
            memory.empty_cache = empty_cache
            if torch.cuda.empty_cache is orig:
                torch.cuda.empty_cache = empty_cache
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is not None:
            try:  # needs an initialized CUDA allocator; absent in CPU-only processes
                attach(lambda device, alloc, device_allocated, device_free: sweep_all())
            except RuntimeError:
                pass
        _hooks_installed = True
