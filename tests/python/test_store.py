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
import tempfile
import textwrap

import pytest
import safetensors.torch as st
import torch

import _client_fixtures as fx
from cache_dit_opd import _session, store


@pytest.fixture()
def daemon(tmp_path):
    d = fx.daemon(None, "--max-store-bytes", "1M")
    yield d
    d.kill()


def open_session(d):
    return _session.Session(0, target=d.address, driver=fx.FakeDriver(), native=False).open()


def weights(tmp_path, name="w.safetensors", **tensors):
    path = tmp_path / name
    st.save_file(tensors or {"ff.qweight": torch.arange(-8, 8, dtype=torch.int8).repeat(8).reshape(8, 16),
                             "ff.wscales": torch.ones(2, 16, dtype=torch.bfloat16),
                             "ff.bias": torch.zeros(16, dtype=torch.float16)}, str(path))
    return path


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
        assert (len(stats.entries), stats.store_bytes, stats.max_store_bytes) == (3, 32 + 64 + 32, 1 << 20)
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
        with pytest.raises(RuntimeError, match="1200000 bytes do not fit the store: 224 of --max-store-bytes "
                                               "1048576 are in use"):
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
    sockets = tempfile.mkdtemp(prefix="opd-store-", dir="/tmp")
    os.chmod(sockets, 0o755)  # the child must reach the sockets (mode 0660, group 0)
    d = fx.daemon(sockets, "--max-store-bytes", "1M", "--allowed-gid", "0")
    s = open_session(d)
    try:
        store.publish_file(weights(tmp_path), prefix="root/", session=s)
        # The helper imports everything first, then forks before any thread exists; its child drops to
        # uid 65534 (the interpreter is already loaded: nothing under root's home is read again).
        child = textwrap.dedent(f"""
            import os, sys
            sys.path[:0] = {[fx.PYTHON_DIR, fx.HERE]!r}
            import grpc, torch
            import _client_fixtures as fx
            from cache_dit_opd import _session, store
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
        assert len(store.list_entries(session=s)) == 3
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
        assert (st_.store_entries, st_.store_bytes, st_.max_store_bytes) == (2, 128 + 64, 1 << 20)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        got = {f.name: f.samples[0].value for f in text_string_to_metric_families(body)
               if f.name.startswith("cache_dit_opd_store")}
        assert got == {"cache_dit_opd_store_entries": 2, "cache_dit_opd_store_bytes": 192,
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
        assert (j["store_bytes"], j["max_store_bytes"]) == (224, 1 << 20)
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
        assert opdctl_json("--address", str(daemon.socket), "store", "ls")["store"]["store_bytes"] == 64
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
