"""python/cache_dit_opd/_layout.py agrees with proto/cache_dit_opd/v1/session_memory.h."""

import os
import re
import shutil
import subprocess

import pytest

import _client_fixtures as fx

from cache_dit_opd import _layout

HEADER = os.path.join(fx.REPO, "proto", "cache_dit_opd", "v1", "session_memory.h")
SIZES = {"uint8_t": 1, "char": 1, "int32_t": 4, "uint32_t": 4, "int64_t": 8, "uint64_t": 8}


def _source() -> str:
    text = open(HEADER).read()
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def _constants(src: str) -> dict:
    out = {}
    for name, value in re.findall(r"inline\s+constexpr\s+\w+\s+(k\w+)\s*=\s*([^;]+);", src):
        out[name] = int(value.strip().rstrip("uUlL"), 0)
    return out


def _structs(src: str) -> dict:
    """name -> (fields [(name, offset, size)], sizeof) with C layout rules (natural alignment)."""
    out = {}
    for align, name, body in re.findall(r"struct\s+(?:alignas\((\d+)\)\s+)?(\w+)\s*\{(.*?)\};", src, re.S):
        off, max_align, fields = 0, int(align or 1), []
        for typ, fname, count in re.findall(r"(\w+)\s+(\w+)(?:\[([^\]]+)\])?\s*;", body):
            size = SIZES[typ]
            n = 1
            if count:
                expr = count
                for k, v in _constants(src).items():
                    expr = expr.replace(k, str(v))
                n = int(eval(expr, {"__builtins__": {}}))  # e.g. "4096 - 72"
            off = (off + size - 1) // size * size
            fields.append((fname, off, size * n))
            off += size * n
            max_align = max(max_align, size)
        sizeof = (off + max_align - 1) // max_align * max_align
        out[name] = (fields, sizeof)
    return out


def test_constants_match():
    c = _constants(_source())
    assert c["kProtocolVersion"] == _layout.PROTOCOL_VERSION
    assert c["kLayoutVersion"] == _layout.LAYOUT_VERSION
    assert c["kSessionMemoryMagic"] == _layout.SESSION_MEMORY_MAGIC
    assert c["kBindRequestMagic"] == _layout.BIND_REQUEST_MAGIC
    assert c["kTokenBytes"] == _layout.TOKEN_BYTES
    assert c["kLanesOffset"] == _layout.LANES_OFFSET
    assert set(c) == {"kProtocolVersion", "kLayoutVersion", "kSessionMemoryMagic", "kBindRequestMagic",
                      "kTokenBytes", "kLanesOffset"}, "session_memory.h gained a constant: mirror it in _layout.py"


def test_magics_spell_their_names():
    assert _layout.SESSION_MEMORY_MAGIC.to_bytes(4, "little") == b"CDOP"
    assert _layout.BIND_REQUEST_MAGIC.to_bytes(4, "little") == b"BIND"


def test_static_asserts_match_parser():
    src = _source()
    structs = _structs(src)
    for name, size in re.findall(r"static_assert\(sizeof\((\w+)\)\s*==\s*([^)]+)\)", src):
        assert structs[name][1] == int(eval(size, {"__builtins__": {}})), name


def test_bind_messages():
    structs = _structs(_source())
    fields, size = structs["BindRequest"]
    assert size == _layout.BIND_REQUEST_SIZE == _layout.BIND_REQUEST.size
    assert [(n, o) for n, o, _ in fields] == [("magic", 0), ("protocol_version", 4), ("session_id", 8), ("token", 16)]
    fields, size = structs["BindReply"]
    assert size == _layout.BIND_REPLY_SIZE == _layout.BIND_REPLY.size
    assert [(n, o, s) for n, o, s in fields] == [
        ("status_code", 0, 4), ("layout_version", 4, 4), ("shared_memory_bytes", 8, 8), ("message", 16, 256)]
    assert _layout.BIND_REPLY.format.startswith("<i")  # status_code is signed


def test_session_memory_header():
    fields, size = _structs(_source())["SessionMemoryHeader"]
    assert size == _layout.HEADER_SIZE
    named = {n: (o, s) for n, o, s in fields}
    reserved = named.pop("reserved")
    assert reserved[0] == _layout.HEADER_RESERVED_OFFSET
    assert set(named) == set(_layout.HEADER_FIELDS)
    for name, (off, fmt) in _layout.HEADER_FIELDS.items():
        assert named[name][0] == off, name
        assert named[name][1] == {"<I": 4, "<Q": 8}[fmt], name


def test_lane_semaphores():
    fields, size = _structs(_source())["LaneSemaphores"]
    assert size == _layout.LANE_STRIDE
    named = {n: o for n, o, _ in fields}
    assert named["inputs_ready"] == _layout.LANE_INPUTS_READY_OFFSET
    assert named["done"] == _layout.LANE_DONE_OFFSET
    assert _layout.LANES_OFFSET % _layout.PAGE_BYTES == 0


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")
def test_offsets_from_the_compiler(tmp_path):
    cxx = shutil.which("g++") or shutil.which("c++")
    prog = tmp_path / "layout.cc"
    lines = [f'  printf("{n} %zu\\n", offsetof(cache_dit_opd::v1::SessionMemoryHeader, {n}));'
             for n in _layout.HEADER_FIELDS]
    lines += ['  printf("inputs_ready %zu\\n", offsetof(cache_dit_opd::v1::LaneSemaphores, inputs_ready));',
              '  printf("done %zu\\n", offsetof(cache_dit_opd::v1::LaneSemaphores, done));']
    prog.write_text('#include <cstddef>\n#include <cstdio>\n#include "session_memory.h"\nint main() {\n'
                    + "\n".join(lines) + "\n}\n")
    exe = tmp_path / "layout"
    subprocess.run([cxx, "-std=c++17", "-I", os.path.dirname(HEADER), str(prog), "-o", str(exe)], check=True)
    got = dict(line.split() for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                       check=True).stdout.splitlines())
    for name, (off, _) in _layout.HEADER_FIELDS.items():
        assert int(got[name]) == off, name
    assert int(got["inputs_ready"]) == _layout.LANE_INPUTS_READY_OFFSET
    assert int(got["done"]) == _layout.LANE_DONE_OFFSET
