"""The region table: export once, never send a reused address as the old region, free what torch freed."""


import pytest

import _client_fixtures as fx

from cache_dit_opd import _regions

MB = 1 << 20


class Remote:
    """Stands in for the daemon's RegisterRegion / UnregisterRegion."""

    def __init__(self, limit=1 << 30):
        self.live = {}
        self.next_id = 1
        self.limit = limit
        self.registrations = 0

    def register(self, handle, base, size, buffer_id):
        assert len(handle) == 64
        if len(self.live) >= self.limit:
            raise _regions.RegionsExhausted("full")
        rid = self.next_id
        self.next_id += 1
        self.live[rid] = (base, size, buffer_id)
        self.registrations += 1
        return rid

    def unregister(self, rid):
        del self.live[rid]


@pytest.fixture
def table():
    drv, remote = fx.FakeDriver(), Remote()
    t = _regions.RegionTable(remote.register, remote.unregister, drv, device_index=0)
    yield t, drv, remote
    t.close()


def test_one_registration_per_allocation(table):
    t, drv, remote = table
    base = drv.alloc(2 * MB)
    r1, off1 = t.ref(base + 512, 1024)
    r2, off2 = t.ref(base + 4096, 4096)
    assert r1 == r2 and (off1, off2) == (512, 4096)
    assert remote.registrations == 1 and len(t) == 1
    other = drv.alloc(MB)
    r3, off3 = t.ref(other, 16)
    assert r3 != r1 and off3 == 0 and remote.registrations == 2


def test_reused_address_is_never_sent_as_the_old_region(table):
    t, drv, remote = table
    base = drv.alloc(2 * MB)
    old, _ = t.ref(base, 64)
    drv.free(base)
    drv.alloc(2 * MB, at=base)  # same address, new cudaMalloc: new buffer id
    new, off = t.ref(base, 64)
    assert new != old and off == 0
    assert old not in remote.live and new in remote.live  # the stale mapping was dropped
    assert len(t) == 1


def test_reuse_with_a_different_size(table):
    t, drv, remote = table
    base = drv.alloc(2 * MB)
    old, _ = t.ref(base, 64)
    drv.free(base)
    drv.alloc(4 * MB, at=base)
    new, _ = t.ref(base + 3 * MB, 64)
    assert new != old and remote.live[new][1] == 4 * MB


def test_sweep_unregisters_freed_segments(table):
    t, drv, remote = table
    a, b = drv.alloc(2 * MB), drv.alloc(2 * MB)
    ra, _ = t.ref(a, 8)
    rb, _ = t.ref(b, 8)
    drv.free(a)
    assert t.sweep() == 1
    assert ra not in remote.live and rb in remote.live and len(t) == 1
    assert t.sweep() == 0


def test_sweep_all_reaches_every_table(table):
    t, drv, remote = table
    a = drv.alloc(MB)
    t.ref(a, 8)
    drv.free(a)
    assert _regions.sweep_all() >= 1
    assert not remote.live


def test_periodic_sweep_from_the_call_path(table, monkeypatch):
    t, drv, remote = table
    a = drv.alloc(MB)
    t.ref(a, 8)
    drv.free(a)
    t.maybe_sweep()
    assert remote.live  # not yet due
    t._next_sweep = 0
    t.maybe_sweep()
    assert not remote.live


def test_vmm_memory_without_chunk_registration_gets_a_clear_error(table):
    t, drv, _ = table  # a table without register_vmm
    base = drv.alloc(2 * MB, vmm=True)
    with pytest.raises(_regions.RegionExportError) as e:
        t.ref(base, 64)
    msg = str(e.value)
    assert "expandable_segments:False" in msg and "POSIX descriptor" in msg
    assert f"0x{base:x}" in msg


class Runs(Remote):
    """Stands in for the daemon's region requests of chunk runs too: what each carried."""

    def __init__(self):
        super().__init__()
        self.runs = []

    def register_vmm(self, chunks, fds):
        import os

        assert [os.fstat(fd).st_size for fd in fds] == [c[1] for c in chunks]  # one descriptor per chunk, in order
        self.runs.append(list(chunks))
        rid = self.next_id
        self.next_id += 1
        self.live[rid] = (chunks[0][0], sum(c[1] for c in chunks), None)
        return rid


@pytest.fixture
def runs():
    drv, remote = fx.FakeDriver(), Runs()
    t = _regions.RegionTable(remote.register, remote.unregister, drv, device_index=0, register_vmm=remote.register_vmm)
    yield t, drv, remote
    t.close()


def test_a_tensor_on_expandable_segments_is_the_run_of_chunks_it_covers(runs):
    t, drv, remote = runs
    base = drv.alloc(10 * MB, vmm=True)  # chunks of 2 MiB
    rid, off = t.ref(base + 3 * MB, 2 * MB)  # chunks 1 and 2
    assert remote.runs == [[(base + 2 * MB, 2 * MB, drv.chunks[base + 2 * MB][1]),
                            (base + 4 * MB, 2 * MB, drv.chunks[base + 4 * MB][1])]]
    assert off == MB and drv.exported == 2 and remote.registrations == 0  # no legacy export
    # Inside the run: no registration, one query per chunk the view touches.
    q = drv.pointer_queries
    assert t.ref(base + 4 * MB + 64, 128) == (rid, 2 * MB + 64)
    assert drv.pointer_queries == q + 1
    # A view past the run is another run (its chunks 2..3).
    rid2, off2 = t.ref(base + 5 * MB, 2 * MB)
    assert rid2 != rid and off2 == MB and len(remote.runs) == 2


def test_a_chunk_mapped_again_is_never_sent_as_the_old_run(runs):
    t, drv, remote = runs
    base = drv.alloc(6 * MB, vmm=True)
    rid, _ = t.ref(base, 4 * MB)
    drv.remap(base + 2 * MB)  # torch unmapped chunk 1 and mapped it again: other memory
    assert t.ref(base + 2 * MB, 64)[0] != rid
    assert rid not in remote.live  # unregistered
    rid2, _ = t.ref(base, 4 * MB)
    drv.remap(base)
    t._next_sweep = 0
    t.maybe_sweep()  # the sweep finds runs with a chunk mapped again
    assert rid2 not in remote.live


def test_runs_are_bounded_and_need_descriptors(runs):
    t, drv, _ = runs
    base = drv.alloc(250 * 2 * MB, vmm=True)
    with pytest.raises(_regions.RegionExportError, match="spans more than 240 virtual-memory chunks"):
        t.ref(base, 241 * 2 * MB)
    drv.no_descriptors = True
    with pytest.raises(_regions.RegionExportError, match=r"gives no POSIX descriptor .*expandable_segments:False"):
        t.ref(base, 64)


def test_not_device_memory(table):
    t, _, _ = table
    with pytest.raises(_regions.RegionExportError, match="not in a live CUDA device allocation"):
        t.ref(0x1234, 8)


def test_view_past_its_allocation_is_refused(table):
    t, drv, _ = table
    base = drv.alloc(MB)
    with pytest.raises(ValueError, match="exceed their CUDA allocation"):
        t.ref(base + MB - 8, 16)


def test_exhausted_daemon_cache_evicts_idle_regions():
    drv, remote = fx.FakeDriver(), Remote(limit=2)
    t = _regions.RegionTable(remote.register, remote.unregister, drv)
    a, b, c = drv.alloc(MB), drv.alloc(MB), drv.alloc(MB)
    pinned = set()
    ra, _ = t.ref(a, 8, pinned)
    t.ref(b, 8)
    rc, _ = t.ref(c, 8, pinned)  # the daemon is full: an idle region (b) goes, the pinned one (a) stays
    assert set(remote.live) == {ra, rc}
    t.close()


def test_forget_drops_without_unregistering(table):
    t, drv, remote = table
    a = drv.alloc(MB)
    r, _ = t.ref(a, 8)
    t.forget({r})
    assert len(t) == 0 and r in remote.live
    r2, _ = t.ref(a, 8)
    assert r2 != r


def test_empty_cache_hook_sweeps():
    # In a child process: the hook wraps torch.cuda.empty_cache for the whole process.
    code = """
import torch, _client_fixtures as fx
from cache_dit_opd import _regions
drv, live = fx.FakeDriver(), {}
t = _regions.RegionTable(lambda h, b, s, i: live.setdefault(len(live) + 1, b) and len(live),
                         lambda rid: live.pop(rid), drv)
orig = torch.cuda.empty_cache
_regions.install_free_hooks()
_regions.install_free_hooks()  # idempotent
assert torch.cuda.empty_cache is not orig and torch.cuda.memory.empty_cache is torch.cuda.empty_cache
assert torch.cuda.empty_cache.__wrapped__ is orig
a = drv.alloc(1 << 20)
t.ref(a, 8)
drv.free(a)
torch.cuda.empty_cache()
assert not live, live
print("ok")
"""
    r = fx.run_python(code, CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
