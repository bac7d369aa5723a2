"""cache_dit_opd.store against the real daemon on fake device operations (its store in host memory):
publishing a .safetensors file the daemon reads, listing, deleting, the byte limit, and every bad input
answered with an error that names the value while the daemon keeps serving (server/store/)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest
import safetensors.torch as st
import torch

import _client_fixtures as fx
from cache_dit_opd import _errors, _session, _wire, store


@pytest.fixture()
def daemon(tmp_path):
    d = fx.daemon(None, "--max-store-bytes", "1M")
    yield d
    d.kill()


def open_session(d):
    return _session.Session(0, target=d.address, driver=fx.FakeDriver(), native=False, synchronize=lambda: None).open()


def weights(tmp_path, name="w.safetensors", **tensors):
    path = tmp_path / name
    st.save_file(tensors or {"ff.qweight": torch.arange(-8, 8, dtype=torch.int8).repeat(8).reshape(8, 16),
                             "ff.wscales": torch.ones(2, 16, dtype=torch.bfloat16),
                             "ff.bias": torch.zeros(16, dtype=torch.float16)}, str(path))
    return path


def block_bytes(path) -> int:
    """The block a whole file's tensors take as one set: each at the next 256-byte boundary, in file order."""
    data = path.read_bytes()
    header = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])
    spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    return 256 * (len(spans) - 1) + spans[-1][1] - spans[-1][0]


def test_a_file_is_published_as_one_set_listed_by_prefix_and_deleted(daemon, tmp_path):
    s = open_session(daemon)
    try:
        got = store.publish_file(weights(tmp_path), prefix="flux1-dev/blocks.0.", session=s)
        assert sorted((e.name, e.dtype, e.shape, e.bytes) for e in got) == [
            ("flux1-dev/blocks.0.ff.bias", torch.float16, (16,), 32),
            ("flux1-dev/blocks.0.ff.qweight", torch.int8, (8, 16), 128),
            ("flux1-dev/blocks.0.ff.wscales", torch.bfloat16, (2, 16), 64),
        ]
        data = weights(tmp_path).read_bytes()
        header = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])
        in_file = sorted((v["data_offsets"][0], k) for k, v in header.items() if k != "__metadata__")
        assert [e.name for e in got] == ["flux1-dev/blocks.0." + k for _, k in in_file]  # the file's order
        assert {e.owner_uid for e in got} == {os.getuid()}
        # Chosen tensors, another prefix; list by prefix, by name.
        store.publish_file(weights(tmp_path), prefix="other/", tensors=["ff.bias"], session=s)
        assert [e.name for e in store.list_entries("flux1-dev/", session=s)] == sorted(e.name for e in got)
        assert [e.name for e in store.list_entries(session=s)][-1] == "other/ff.bias"
        store.delete("flux1-dev/blocks.0.ff.qweight", session=s)
        assert len(store.list_entries("flux1-dev/", session=s)) == 2
        with pytest.raises(KeyError, match="store entry 'flux1-dev/blocks.0.ff.qweight' does not exist"):
            store.delete("flux1-dev/blocks.0.ff.qweight", session=s)
        stats = s._stub.ListStore(s._pb.ListStoreRequest(), timeout=10)  # session 0: the operator's view
        # Two blocks: the first set's (its tensors in file order at 256-byte boundaries; deleting one of them
        # frees nothing while the others live) and the second set's one tensor.
        assert (len(stats.entries), stats.store_bytes, stats.max_store_bytes) == (
            3, block_bytes(weights(tmp_path)) + 32, 1 << 20)
        assert {e.set_id for e in stats.entries if e.name.startswith("flux1-dev/")} == {got[0].set_id}
    finally:
        s.close()


def test_bad_inputs_are_refused_naming_the_value_and_the_daemon_goes_on(daemon, tmp_path):
    s = open_session(daemon)
    try:
        path = weights(tmp_path)
        store.publish_file(path, prefix="m/", session=s)
        with pytest.raises(FileExistsError, match=r"store entry 'm/ff\.\w+' exists; delete it first"):
            store.publish_file(path, prefix="m/", session=s)
        with pytest.raises(ValueError, match="No such file"):
            store.publish_file(tmp_path / "absent.safetensors", session=s)
        with pytest.raises(ValueError, match="has no tensor 'ff.nope'"):
            store.publish_file(path, prefix="n/", tensors=["ff.nope"], session=s)
        with pytest.raises(ValueError, match=r"store name 'bad name/ff\.\w+': byte 3 \(0x20\) is not allowed"):
            store.publish_file(path, prefix="bad name/", session=s)
        data = path.read_bytes()
        (tmp_path / "short.safetensors").write_bytes(data[:-5])
        with pytest.raises(ValueError, match="short.safetensors: the tensors end at data byte 224, but the file "
                                             "holds 219 data bytes"):
            store.publish_file(tmp_path / "short.safetensors", prefix="s/", session=s)
        n = struct.unpack("<Q", data[:8])[0]
        header = data[8:8 + n].replace(b'"shape":[8,16]', b'"shape":[9,16]')  # lies about its size
        (tmp_path / "lies.safetensors").write_bytes(data[:8] + header + data[8 + n:])
        with pytest.raises(ValueError, match="tensor 'ff.qweight': data_offsets .*128 bytes, but its dtype and "
                                             "shape take 144"):
            store.publish_file(tmp_path / "lies.safetensors", prefix="l/", session=s)
        big = weights(tmp_path, "big.safetensors", x=torch.zeros(300_000, dtype=torch.float32))
        with pytest.raises(RuntimeError, match=f"1200000 bytes do not fit the store: {block_bytes(path)} of "
                                               f"--max-store-bytes 1048576 are in use"):
            store.publish_file(big, prefix="big/", session=s)
        with pytest.raises(KeyError, match="store entry 'nope' does not exist"):
            store.delete("nope", session=s)
        # Nothing of the refused sets is left; the session and the daemon go on.
        assert [e.name for e in store.list_entries(session=s)] == ["m/ff.bias", "m/ff.qweight", "m/ff.wscales"]
        assert daemon.alive() and s.failed is None
    finally:
        s.close()


def test_a_daemon_without_store_bytes_says_how_to_turn_it_on(tmp_path):
    d = fx.daemon(None)
    s = open_session(d)
    try:
        with pytest.raises(RuntimeError, match="the weight store is off: start the daemon with --max-store-bytes"):
            store.publish_file(weights(tmp_path), session=s)
    finally:
        s.close()
        d.kill()


def test_another_uid_reads_through_the_allowed_group_but_may_not_delete(tmp_path):
    """A child that drops to uid 65534 with group 0 (the daemon's --allowed-gid) binds its own session:
    it lists and reads root's entries (the group admits it) and is refused deleting them (owner only)."""
    if os.getuid() != 0:
        pytest.skip("needs root to start a child of another uid")
    sockets = fx.short_tmpdir()
    os.chmod(sockets, 0o755)  # the child must reach the sockets (mode 0660, group 0)
    d = fx.daemon(sockets, "--max-store-bytes", "1M", "--allowed-gid", "0")
    s = open_session(d)
    # Files the child names to PublishFile (in a folder it may search): the daemon, root here, opens them with
    # the child's rights, so root's own file is refused and one its group (0) may read is published.
    own, group = weights(Path(sockets), "own.safetensors"), weights(Path(sockets), "group.safetensors")
    os.chmod(own, 0o600)
    os.chmod(group, 0o640)
    try:
        store.publish_file(weights(tmp_path), prefix="root/", session=s)
        # The helper imports everything first, then forks before any thread exists; its child drops to
        # uid 65534 (the interpreter is already loaded: nothing under root's home is read again).
        child = textwrap.dedent(f"""
            import os, sys
            sys.path[:0] = {[fx.PYTHON_DIR, fx.HERE]!r}
            import grpc, torch
            import _client_fixtures as fx
            from cache_dit_opd import _errors, _session, _wire, store
            from cache_dit_opd._proto import opd_grpc, opd_pb2
            pid = os.fork()
            if pid:
                _, status = os.waitpid(pid, 0)
                sys.exit(os.waitstatus_to_exitcode(status))
            try:
                os.setgroups([0]); os.setgid(0); os.setuid(65534)
                s = _session.Session(0, target={d.address!r}, driver=fx.FakeDriver(), native=False).open()
                names = [e.name for e in store.list_entries(session=s)]
                assert names == ["root/ff.bias", "root/ff.qweight", "root/ff.wscales"], names
                try:
                    store.delete("root/ff.bias", session=s)
                except PermissionError as e:
                    print("refused:", e, flush=True)
                try:
                    store.publish_file({str(own)!r}, prefix="mine/", session=s)
                except PermissionError as e:
                    print("not readable:", e, flush=True)
                store.publish_file({str(group)!r}, prefix="group/", session=s)
                s.close()
                os._exit(0)
            except BaseException as e:
                print("child failed:", repr(e), flush=True)
                os._exit(1)
        """)
        r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60,
                           env=fx.subprocess_env())
        assert r.returncode == 0, r.stdout + r.stderr
        assert "refused: cache_dit_opd.store: deleting 'root/ff.bias': delete: store entry 'root/ff.bias' belongs " \
               f"to uid {os.getuid()}; uid 65534 may not delete it" in r.stdout, r.stdout + r.stderr
        assert f"not readable: cache_dit_opd.store: publishing {own}" in r.stdout, r.stdout + r.stderr
        assert f"publish: uid 65534 may not read {own} (Permission denied)" in r.stdout, r.stdout + r.stderr
        entries = store.list_entries(session=s)
        assert sorted(e.name for e in entries if e.name.startswith("group/")) == [
            "group/ff.bias", "group/ff.qweight", "group/ff.wscales"]
        assert len(entries) == 6 and not any(e.name.startswith("mine/") for e in entries)
    finally:
        s.close()
        d.kill()
        shutil.rmtree(sockets, ignore_errors=True)


def test_the_store_shows_in_get_stats_and_metrics(tmp_path):
    import socket
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    d = fx.daemon(None, "--max-store-bytes", "1M", "--metrics-address", f"127.0.0.1:{port}")
    s = open_session(d)
    try:
        store.publish_file(weights(tmp_path), prefix="m/", session=s)
        store.delete("m/ff.bias", session=s)
        st_ = s.stats()
        used = block_bytes(weights(tmp_path))  # the set's block stays while two of its entries live
        assert (st_.store_entries, st_.store_bytes, st_.max_store_bytes) == (2, used, 1 << 20)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        got = {f.name: f.samples[0].value for f in text_string_to_metric_families(body)
               if f.name.startswith("cache_dit_opd_store")}
        assert got == {"cache_dit_opd_store_entries": 2, "cache_dit_opd_store_bytes": used,
                       "cache_dit_opd_store_max_bytes": 1 << 20}, got
    finally:
        s.close()
        d.kill()


def test_opdctl_store_lists_every_entry_as_a_table_and_json(daemon, tmp_path):
    from test_operations import opdctl, opdctl_json

    s = open_session(daemon)
    try:
        store.publish_file(weights(tmp_path), prefix="flux/", session=s)
        j = opdctl_json("--address", str(daemon.socket), "store")["store"]
        assert [(e["name"], e["shape"], e["bytes"], e["owner_uid"]) for e in j["entries"]] == [
            ("flux/ff.bias", [16], 32, os.getuid()), ("flux/ff.qweight", [8, 16], 128, os.getuid()),
            ("flux/ff.wscales", [2, 16], 64, os.getuid())]
        assert (j["store_bytes"], j["max_store_bytes"]) == (block_bytes(weights(tmp_path)), 1 << 20)
        human = opdctl("--address", str(daemon.socket), "store")
        assert human.returncode == 0, human.stderr
        assert "flux/ff.qweight" in human.stdout and "INT8" in human.stdout and "[8, 16]" in human.stdout
        assert "3 entries;" in human.stdout
    finally:
        s.close()


def test_opdctl_store_rm_deletes_each_name_and_names_the_ones_it_could_not(daemon, tmp_path):
    from test_client_reasons import wait_for
    from test_operations import _open_to_everyone, opdctl, opdctl_json

    s = open_session(daemon)
    try:
        store.publish_file(weights(tmp_path), prefix="flux/", session=s)
        # One known name, one unknown: the known one goes, the unknown one is named with its reason.
        j = opdctl_json("--address", str(daemon.socket), "store", "rm", "flux/ff.bias", "flux/nope", expect_rc=1)
        assert j["deleted"] == ["flux/ff.bias"]
        assert [(e["name"], e["reason"]) for e in j["errors"]] == [("flux/nope", "STORE_UNKNOWN")]
        assert "flux/nope" in j["errors"][0]["error"]
        assert [e.name for e in store.list_entries(session=s)] == ["flux/ff.qweight", "flux/ff.wscales"]
        human = opdctl("--address", str(daemon.socket), "store", "rm", "flux/ff.qweight")
        assert human.returncode == 0 and human.stdout == "deleted flux/ff.qweight\n", (human.stdout, human.stderr)
        assert [e.name for e in store.list_entries(session=s)] == ["flux/ff.wscales"]
        # The set's block stays while one of its entries lives.
        assert opdctl_json("--address", str(daemon.socket), "store", "ls")["store"]["store_bytes"] == \
            block_bytes(weights(tmp_path))
        # Usage errors name what is wrong; opdctl's own sessions are gone.
        for args, says in ((["store", "rm"], "needs the names"), (["store", "mv", "x"], "unknown store command 'mv'"),
                           (["store", "ls", "x"], "unexpected argument 'x'"), (["stats", "x"], "unexpected argument")):
            r = opdctl("--address", str(daemon.socket), *args)
            assert r.returncode == 2 and says in r.stderr, (args, r.stderr)
        wait_for(lambda: len(s._stub.GetStats(s._pb.StatsRequest()).session) == 1)  # opdctl's sessions closed
        if os.geteuid() == 0:  # another uid cannot even bind a session, so it deletes nothing
            _open_to_everyone(daemon)
            r = opdctl("--address", str(daemon.socket), "store", "rm", "flux/ff.wscales", user=65534)
            assert r.returncode == 1 and "flux/ff.wscales" in r.stderr and "uid 65534" in r.stderr, r.stderr
            assert [e.name for e in store.list_entries(session=s)] == ["flux/ff.wscales"]
        assert daemon.alive()
    finally:
        s.close()


# -- attaching entries: a read-only mapping of the set's block (fake daemon: memfd blocks, mmap PROT_READ) ----


def want_bytes(path, name: str) -> bytes:
    """A tensor's bytes as the safetensors file holds them."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    begin, end = json.loads(data[8:8 + n])[name]["data_offsets"]
    return data[8 + n + begin:8 + n + end]


def read(block, offset: int, nbytes: int) -> bytes:
    import ctypes

    return ctypes.string_at(block.base + offset, nbytes)


def test_attached_entries_map_the_stored_bytes_read_only_one_mapping_per_set(daemon, tmp_path):
    s = open_session(daemon)
    try:
        path = weights(tmp_path)
        store.publish_file(path, prefix="m/", session=s)
        w, info = store.attach_block("m/ff.qweight", session=s)
        b, binfo = store.attach_block("m/ff.bias", session=s)
        assert b is w  # one set, one block, one mapping
        assert info["region_id"] == binfo["region_id"] != 0
        assert (info["dtype"], info["shape"], info["bytes"]) == (_wire.DTYPE_IDS["int8"], (8, 16), 128)
        assert info["offset"] % 256 == 0 and binfo["offset"] % 256 == 0 and info["offset"] != binfo["offset"]
        assert read(w, info["offset"], 128) == want_bytes(path, "ff.qweight")
        assert read(b, binfo["offset"], 32) == want_bytes(path, "ff.bias")
        assert s.regions.driver.mapped == {w.base: w.size}
        # The region is the session's; the daemon counts the attachment on every entry of the set.
        listed = {e.name: e for e in store.list_entries("m/", session=s)}
        assert {n: e.refs for n, e in listed.items()} == {"m/ff.bias": 1, "m/ff.qweight": 1, "m/ff.wscales": 1}
        assert (listed["m/ff.qweight"].offset, listed["m/ff.bias"].offset) == (info["offset"], binfo["offset"])
        # Every entry of a set, one attach for the set: the places come from the listing.
        many = store.attach_blocks("m/", session=s)
        assert sorted(many) == sorted(listed) and {b for b, _ in many.values()} == {w}
        assert read(w, many["m/ff.wscales"][1].offset, 64) == \
            want_bytes(path, "ff.wscales")
        with pytest.raises(KeyError, match=r"no entries \['m/nope'\]"):
            store.attach_blocks("m/", names=["m/ff.bias", "m/nope"], session=s)
        # A tensor in the block resolves to that region without any driver query or export.
        queries = s.regions.driver.pointer_queries
        assert s.regions.ref(w.base + info["offset"], 128) == (info["region_id"], info["offset"])
        assert s.regions.driver.pointer_queries == queries
        with pytest.raises(ValueError, match="exceed weight-store block"):
            s.regions.ref(w.base + w.size - 8, 16)
        # Unknown names are KeyError naming them; the daemon goes on.
        with pytest.raises(KeyError, match="store entry 'm/nope' does not exist"):
            store.attach_block("m/nope", session=s)
        with pytest.raises(ValueError, match="has 0 bytes"):
            store.attach_block("", session=s)
        assert daemon.alive() and s.failed is None
    finally:
        s.close()


def test_a_store_tensor_is_read_by_an_op_but_refused_as_its_output(daemon, tmp_path):
    s = open_session(daemon)
    drv = s.regions.driver
    try:
        x = torch.randn(4, 64).to(torch.bfloat16)
        st.save_file({"x": x, "y": torch.zeros(4, 66, dtype=torch.uint8)}, str(tmp_path / "io.safetensors"))
        store.publish_file(tmp_path / "io.safetensors", prefix="io/", session=s)
        blk, xi = store.attach_block("io/x", session=s)
        _, yi = store.attach_block("io/y", session=s)
        x_in = fx.DeviceTensor(blk.base + xi["offset"], (4, 64), torch.bfloat16)
        y_in = fx.DeviceTensor(blk.base + yi["offset"], (4, 66), torch.float8_e4m3fn)
        out = fx.DeviceTensor(drv.alloc(4 * 66), (4, 66), torch.float8_e4m3fn)
        s.call_host_ordered("fp8_comm_per_token_quant", [x_in, out])  # read from the store: fine
        with pytest.raises(_errors.DaemonError, match=r"argument 'out' is written by the op, but region \d+ is "
                                                      r"weight-store memory, which no op may write") as e:
            s.call_host_ordered("fp8_comm_per_token_quant", [fx.DeviceTensor(drv.alloc(512), (4, 64), torch.bfloat16),
                                                             y_in])
        assert e.value.reason == _wire.REASONS["BAD_ARGUMENT"][0]
        assert s.failed is None and daemon.alive()
    finally:
        s.close()


def test_publish_copies_the_sessions_tensors_from_the_regions_they_name(daemon):
    s = open_session(daemon)
    drv = s.regions.driver
    try:
        base = drv.alloc(1 << 16)
        a = fx.DeviceTensor(base + 4096, (8, 4), torch.float32)
        b = fx.DeviceTensor(base + 256, (16,), torch.bfloat16)
        got = store.publish({"a": a, "b": b}, prefix="up/", session=s)
        assert [(e.name, e.shape, e.bytes) for e in got] == [("up/a", (8, 4), 128), ("up/b", (16,), 32)]
        blk, ai = store.attach_block("up/a", session=s)
        _, bi = store.attach_block("up/b", session=s)
        # The fake block records each copied word's source address: the region resolved at the right offset.
        assert struct.unpack("<Q", read(blk, ai["offset"], 8))[0] == base + 4096
        assert struct.unpack("<Q", read(blk, bi["offset"], 8))[0] == base + 256
        with pytest.raises(ValueError, match=r"publish 'up/t': a contiguous CUDA tensor is needed, got DeviceTensor "
                                             r"with strides \(1, 8\)"):
            store.publish({"t": fx.DeviceTensor(base, (8, 4), torch.float32, strides=(1, 8))}, prefix="up/", session=s)
        with pytest.raises(FileExistsError, match="store entry 'up/a' exists"):
            store.publish({"a": a}, prefix="up/", session=s)
        # Region 0 names no memory: a tensor with elements there is a bad argument, not an unknown region (which
        # would have the client register its memory again).
        pb = s._pb
        ref = pb.TensorRef(region_id=0, sizes=[4], strides=[1], dtype=_wire.DTYPE_IDS["float32"])
        with pytest.raises(grpc.RpcError) as e:
            s._stub.PublishTensors(pb.PublishTensorsRequest(session_id=s.reply.session_id, token=s.reply.token,
                                                            tensors=[pb.NamedTensor(name="up/z", tensor=ref)]),
                                   timeout=10)
        err = _errors.from_grpc(e.value)
        assert _errors.reason_name(err.reason) == "BAD_ARGUMENT", err
        assert "publish 'up/z': region 0 holds no memory" in err.message, err.message
        assert [e.name for e in store.list_entries("up/", session=s)] == ["up/a", "up/b"]
    finally:
        s.close()


def _stored_bytes(s) -> int:
    """The store's bytes in use (session 0: the operator's view)."""
    return s._stub.ListStore(s._pb.ListStoreRequest(), timeout=10).store_bytes


def test_a_deleted_set_lives_while_attached_and_goes_with_its_last_tensor(daemon, tmp_path):
    from test_client_reasons import wait_for

    s = open_session(daemon)
    try:
        store.publish_file(weights(tmp_path), prefix="d/", session=s)
        blk, _ = store.attach_block("d/ff.qweight", session=s)
        used = _stored_bytes(s)
        for name in ("d/ff.qweight", "d/ff.wscales", "d/ff.bias"):
            store.delete(name, session=s)
        assert store.list_entries(session=s) == []
        assert _stored_bytes(s) == used  # the session's region holds the block
        base, drv = blk.base, s.regions.driver
        del blk  # the last reference: the region is unregistered, the mapping removed
        assert base not in drv.mapped
        wait_for(lambda: _stored_bytes(s) == 0)
    finally:
        s.close()


def test_another_session_of_the_process_registers_the_same_mapping_by_attaching_again(daemon, tmp_path):
    s1, s2 = open_session(daemon), open_session(daemon)
    s2.regions._drv = s1.regions.driver  # one process, one driver
    try:
        store.publish_file(weights(tmp_path), prefix="two/", session=s1)
        blk, info = store.attach_block("two/ff.qweight", session=s1)
        rid, off = s2.regions.ref(blk.base + info["offset"], 128)  # attaches it on s2 by its name
        assert off == info["offset"] and rid != 0
        assert s1.regions.driver.mapped == {blk.base: blk.size}  # no second mapping
        assert {e.refs for e in store.list_entries("two/", session=s1)} == {2}  # the set, in two sessions
    finally:
        s1.close()
        s2.close()


def test_a_restarted_daemon_cannot_take_a_tensor_attached_from_the_old_one_and_says_which(tmp_path):
    d = fx.daemon(None, "--max-store-bytes", "1M")
    s = open_session(d)
    try:
        store.publish_file(weights(tmp_path), prefix="gone/", session=s)
        blk, info = store.attach_block("gone/ff.qweight", session=s)
        drv = s.regions.driver
        d.kill()
        d2 = fx.daemon(os.path.dirname(d.socket), "--max-store-bytes", "1M")
        try:
            s2 = _session.Session(0, target=d2.address, driver=drv, native=False).open()
            x = fx.DeviceTensor(blk.base + info["offset"], (8, 16), torch.int8)
            with pytest.raises(RuntimeError, match=r"attached from 'gone/ff.qweight'.*store entry 'gone/ff.qweight' "
                                                   r"does not exist \(a restarted daemon's store is empty"):
                s2.regions.ref(x.ptr, 128)
            # Published again in the new daemon: a new block, not the one this process maps.
            store.publish_file(weights(tmp_path), prefix="gone/", session=s2)
            with pytest.raises(RuntimeError, match="attach 'gone/ff.qweight' again"):
                s2.regions.ref(x.ptr, 128)
            s2.close()
        finally:
            d2.kill()
    finally:
        s.close()
        d.kill()


def test_only_the_process_that_bound_the_session_attaches_for_it(daemon, tmp_path):
    s = open_session(daemon)
    try:
        store.publish_file(weights(tmp_path), prefix="p/", session=s)
        code = textwrap.dedent(f"""
            import socket, struct
            from cache_dit_opd import _layout, _wire
            req = _layout.STORE_ATTACH_REQUEST.pack(_layout.STORE_ATTACH_MAGIC, _wire.PROTOCOL_VERSION,
                                                    {s.reply.session_id}, {bytes(s.reply.token)!r}, 12, 0, b"p/ff.qweight")
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.connect({s.reply.session_channel_path!r})
            sock.sendall(req)
            msg, fds, _, _ = socket.recv_fds(sock, 1024, 2)
            r = _layout.read_attach_reply(msg)
            print(len(fds), r["reason"], r["message"])
        """)
        r = fx.run_python(code)
        assert r.returncode == 0, r.stderr
        n, reason, message = r.stdout.split(" ", 2)
        assert (int(n), int(reason)) == (0, _wire.REASONS["PEER_REFUSED"][0]), r.stdout
        assert f"was bound by pid {os.getpid()}" in message and "may not use it" in message, message
        assert store.attach_block("p/ff.qweight", session=s)[0] is not None  # the owner still can
    finally:
        s.close()


def test_the_entry_limit_and_a_listing_too_large_for_one_answer(tmp_path):
    """--max-store-entries bounds what empty tensors (no bytes) could otherwise pile up; a listing past one
    answer's 4 MiB is RESOURCE_EXHAUSTED naming its size (not gRPC's own error with no reason), and a prefix
    lists a part of it."""
    long = "n" * 500
    many = {f"{long}{i:04d}": torch.zeros(0, dtype=torch.float16) for i in range(4096)}
    path = weights(tmp_path, "many.safetensors", **many)
    d = fx.daemon(None, "--max-store-bytes", "1M", "--max-store-entries", "8194")
    s = open_session(d)
    try:
        for prefix in ("a/", "b/"):
            store.publish_file(path, prefix=prefix, session=s)
        with pytest.raises(RuntimeError) as e:  # 8192 + 3 > 8194
            store.publish_file(weights(tmp_path), prefix="c/", session=s)
        assert "3 entries do not fit the store: 8192 of --max-store-entries 8194 are held" in str(e.value), e.value
        with pytest.raises(RuntimeError) as e:
            store.list_entries(session=s)
        assert "the listing of 8192 entries under '' is" in str(e.value) and "list by a longer prefix" in str(e.value)
        assert len(store.list_entries("a/", session=s)) == 4096
        assert d.alive()
    finally:
        s.close()
        d.kill()
