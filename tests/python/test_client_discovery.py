"""Finding the daemon by GPU UUID (docs/DESIGN.md section 4)."""

import os

import pytest

import _client_fixtures  # noqa: F401

from cache_dit_opd import _discovery, _session

UUID = "GPU-12345678-9abc-def0-1234-56789abcdef0"


def test_format_uuid():
    raw = bytes.fromhex("123456789abcdef0123456789abcdef0")
    assert _discovery.format_uuid(raw) == UUID
    with pytest.raises(ValueError, match="got 3"):
        _discovery.format_uuid(b"abc")


def test_the_uuid_form_is_the_daemons():
    """The vectors tests/cpp/common/gpu_uuid_test.cc holds common/gpu_uuid.cc to."""
    path = os.path.join(_client_fixtures.REPO, "tests", "data", "gpu_uuid_vectors.txt")
    checked = 0
    with open(path) as f:
        for line in f:
            if not line.strip() or line.startswith("#"):
                continue
            kind, *rest = line.split()
            if kind == "format":
                assert _discovery.format_uuid(bytes.fromhex(rest[0])) == rest[1]
                assert _discovery.is_gpu_uuid(rest[1])
            else:
                text = "" if rest[0] == "-" else rest[0]
                assert _discovery.is_gpu_uuid(text) == (kind == "valid"), line
            checked += 1
    assert checked >= 10


def test_lookup_refuses_a_key_that_is_not_a_uuid(monkeypatch, tmp_path):
    _clear(monkeypatch)
    monkeypatch.setenv(_discovery.RUNTIME_DIR_ENV, str(tmp_path))
    (tmp_path / "passwd.sock").touch()
    with pytest.raises(ValueError, match=r"'\.\./passwd' is not a GPU UUID"):
        _discovery.find_daemon("../passwd")


def _clear(monkeypatch):
    for k in (_discovery.ADDRESS_ENV, _discovery.RUNTIME_DIR_ENV, "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(k, raising=False)


def test_lookup_order(monkeypatch, tmp_path):
    _clear(monkeypatch)
    rt, xdg = tmp_path / "rt", tmp_path / "xdg"
    monkeypatch.setenv(_discovery.RUNTIME_DIR_ENV, str(rt))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert _discovery.candidate_dirs() == [str(rt), "/run/cache-dit-opd", str(xdg / "cache-dit-opd"),
                                           "/tmp/cache-dit-opd"]
    target, looked = _discovery.find_daemon(UUID)
    if target is None:  # nothing on this machine serves this fake UUID
        assert looked == [os.path.join(d, f"{UUID}.sock") for d in _discovery.candidate_dirs()]
    (xdg / "cache-dit-opd").mkdir(parents=True)
    (xdg / "cache-dit-opd" / f"{UUID}.sock").touch()
    assert _discovery.find_daemon(UUID)[0] == f"unix:{xdg}/cache-dit-opd/{UUID}.sock"
    rt.mkdir()
    (rt / f"{UUID}.sock").touch()
    assert _discovery.find_daemon(UUID)[0] == f"unix:{rt}/{UUID}.sock"  # earlier in the order wins
    other = "GPU-00000000-1111-2222-3333-444444444444"
    assert _discovery.find_daemon(other)[0] in (None, f"unix:/run/cache-dit-opd/{other}.sock",
                                                f"unix:/tmp/cache-dit-opd/{other}.sock")


def test_address_overrides_everything(monkeypatch, tmp_path):
    _clear(monkeypatch)
    monkeypatch.setenv(_discovery.RUNTIME_DIR_ENV, str(tmp_path))
    (tmp_path / f"{UUID}.sock").touch()
    monkeypatch.setenv(_discovery.ADDRESS_ENV, "/somewhere/else.sock")
    assert _discovery.find_daemon(UUID)[0] == "unix:/somewhere/else.sock"
    monkeypatch.setenv(_discovery.ADDRESS_ENV, "unix:/x/y.sock")
    assert _discovery.find_daemon(UUID)[0] == "unix:/x/y.sock"


def test_start_command(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _discovery.start_command(1, UUID) == "cache-dit-opd --device 1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")  # ordinals are remapped: pin the daemon by UUID
    assert _discovery.start_command(1, UUID) == f"CUDA_VISIBLE_DEVICES={UUID} cache-dit-opd --device 0"


def test_unavailable_message_names_the_command():
    msg = _session.unavailable_message("comm", 2, UUID, "no daemon socket found")
    assert "comm ops for cuda:2" in msg and UUID in msg
    assert "cache-dit-opd --device" in msg and "build/server/cache-dit-opd" in msg
    assert "CACHE_DIT_OPD_ADDRESS" in msg
