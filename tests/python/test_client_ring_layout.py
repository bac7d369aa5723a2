"""python/cache_dit_opd/_ring.py agrees with proto/cache_dit_opd/v1/ring.h (constants, kinds, struct layouts)."""

import os
import re
import shutil
import struct
import subprocess

import pytest

import _client_fixtures as fx

from cache_dit_opd import _ring

HEADER = os.path.join(fx.REPO, "proto", "cache_dit_opd", "v1", "ring.h")
CALL_H = os.path.join(fx.REPO, "common", "call.h")
SIZES = {"uint8_t": 1, "char": 1, "int32_t": 4, "uint32_t": 4, "int64_t": 8, "uint64_t": 8}


def _strip_comments(text: str) -> str:
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def _source() -> str:
    return _strip_comments(open(HEADER).read())


def _constants(src: str) -> dict:
    return {name: int(value.strip().rstrip("uUlL"), 0)
            for name, value in re.findall(r"inline\s+constexpr\s+\w+\s+(k\w+)\s*=\s*([^;]+);", src)}


def _structs(src: str) -> dict:
    """name -> ({field: (offset, bytes)}, sizeof), C layout with natural and alignas() alignment."""
    consts = _constants(src)
    out = {}
    for salign, name, body in re.findall(r"struct\s+(?:alignas\((\d+)\)\s+)?(\w+)\s*\{(.*?)\};", src, re.S):
        off, max_align, fields = 0, int(salign or 1), {}
        for falign, typ, fname, count in re.findall(
                r"(?:alignas\((\d+)\)\s+)?(\w+)\s+(\w+)(?:\[([^\]]+)\])?\s*;", body):
            size = SIZES[typ]
            n = 1
            if count:
                expr = count
                for k, v in consts.items():
                    expr = expr.replace(k, str(v))
                n = int(eval(expr, {"__builtins__": {}}))
            align = max(size, int(falign or 1))
            off = (off + align - 1) // align * align
            fields[fname] = (off, size * n)
            off += size * n
            max_align = max(max_align, align)
        out[name] = (fields, (off + max_align - 1) // max_align * max_align)
    return out


def _enum(src: str, name: str) -> dict:
    body = re.search(r"enum\s+class\s+" + name + r"\s*:\s*\w+\s*\{(.*?)\};", src, re.S).group(1)
    return {k: int(v, 0) for k, v in re.findall(r"(k\w+)\s*=\s*(\w+)", body)}


def test_constants_match():
    c = _constants(_source())
    assert c == {
        "kRingVersion": _ring.RING_VERSION,
        "kRingControlBytes": _ring.RING_CONTROL_BYTES,
        "kSlotBytes": _ring.SLOT_BYTES,
        "kCompletionBytes": _ring.COMPLETION_BYTES,
        "kDefaultRingCapacity": _ring.DEFAULT_RING_CAPACITY,
        "kRecordMagic": _ring.RECORD_MAGIC,
        "kDoorbellAwake": _ring.DOORBELL_AWAKE,
        "kDoorbellSleeping": _ring.DOORBELL_SLEEPING,
    }, "ring.h changed: mirror it in python/cache_dit_opd/_ring.py"
    assert _ring.RECORD_MAGIC.to_bytes(4, "little") == b"CALL"
    cap = _ring.DEFAULT_RING_CAPACITY
    assert cap & (cap - 1) == 0


def test_call_h_limits():
    src = _strip_comments(open(CALL_H).read())
    c = {n: int(v) for n, v in re.findall(r"inline\s+constexpr\s+int\s+(k\w+)\s*=\s*(\d+)\s*;", src)}
    assert c["kMaxTensorDims"] == _ring.MAX_TENSOR_DIMS
    assert c["kMaxArgs"] == _ring.MAX_ARGS
    assert c["kMaxListLength"] == _ring.MAX_LIST_LENGTH
    dtypes = re.search(r"enum\s+class\s+DType\s*:\s*int32_t\s*\{(.*?)\};", src, re.S).group(1)
    assert max(int(v) for v in re.findall(r"=\s*(\d+)", dtypes)) == _ring.MAX_DTYPE


def test_arg_kinds():
    kinds = _enum(_source(), "RingArgKind")
    assert kinds == {"kNone": _ring.ARG_NONE, "kTensor": _ring.ARG_TENSOR, "kInt": _ring.ARG_INT,
                     "kFloat": _ring.ARG_FLOAT, "kBool": _ring.ARG_BOOL, "kIntList": _ring.ARG_INT_LIST,
                     "kFloatList": _ring.ARG_FLOAT_LIST, "kBoolList": _ring.ARG_BOOL_LIST}


def test_static_asserts_match_parser():
    src = _source()
    structs = _structs(src)
    consts = _constants(src)
    asserts = re.findall(r"static_assert\(sizeof\((\w+)\)\s*==\s*([^)]+)\)", src)
    assert {n for n, _ in asserts} == {"RingControl", "RingArgHeader", "RecordHeader", "CompletionRecord"}
    for name, size in asserts:
        size = size.strip()
        assert structs[name][1] == (consts[size] if size in consts else int(size, 0)), name


def test_ring_control():
    fields, size = _structs(_source())["RingControl"]
    assert size == _ring.RING_CONTROL_BYTES
    for name, (off, fmt) in _ring.CONTROL_FIELDS.items():
        assert fields[name][0] == off, name
        assert fields[name][1] == {"<I": 4, "<Q": 8}[fmt], name
    assert {n for n in fields if not n.startswith("pad")} == set(_ring.CONTROL_FIELDS)
    # tail, head and doorbell on their own cache lines
    assert len({_ring.CONTROL_FIELDS[n][0] // 64 for n in ("sq_tail", "sq_head", "doorbell", "version")}) == 4


def test_record_header():
    structs = _structs(_source())
    fields, size = structs["RecordHeader"]
    assert size == _ring.RECORD_HEADER_BYTES == _ring.RECORD_HEADER.size
    assert fields.pop("reserved") == (_ring.RECORD_RESERVED_OFFSET, 24)
    assert {n: o for n, (o, _) in fields.items()} == {n: o for n, (o, _) in _ring.RECORD_FIELDS.items()}
    packed = _ring.encode_header(0x1111, 0x2222, 0x3333, 0x44, 0x55, 0x66, 0x77)
    for name, (off, fmt) in _ring.RECORD_FIELDS.items():  # the Struct puts each field at its offset
        want = {"magic": _ring.RECORD_MAGIC, "record_bytes": 0x1111, "ticket": 0x2222, "seq": 0x3333, "lane": 0x44,
                "op_index": 0x55, "nargs": 0x66, "flags": 0x77}[name]
        assert struct.unpack_from(fmt, packed, off)[0] == want, name
    assert structs["RingArgHeader"][1] == _ring.ARG_HEADER_BYTES == _ring.ARG_HEADER.size


def test_completion_record():
    fields, size = _structs(_source())["CompletionRecord"]
    assert size == _ring.COMPLETION_BYTES == _ring.COMPLETION.size
    assert {n: o for n, (o, _) in fields.items()} == {n: o for n, (o, _) in _ring.COMPLETION_FIELDS.items()}
    assert fields["message"][1] == _ring.COMPLETION_MESSAGE_BYTES
    assert _ring.COMPLETION.format.count("i") == 1  # status_code is signed


def test_ring_bytes():
    src = _source()
    body = re.search(r"RingBytes\(uint32_t capacity\)\s*\{\s*return([^;]+);", src).group(1)
    assert "kRingControlBytes" in body and "kSlotBytes + kCompletionBytes" in body
    for cap in (1, 4, 64, 1024):
        assert _ring.ring_bytes(cap) == 256 + cap * (2048 + 256)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")
def test_layout_from_the_compiler(tmp_path):
    cxx = shutil.which("g++") or shutil.which("c++")
    ns = "cache_dit_opd::v1::"
    lines = []
    for struct_name, table in (("RingControl", _ring.CONTROL_FIELDS), ("RecordHeader", _ring.RECORD_FIELDS),
                               ("CompletionRecord", _ring.COMPLETION_FIELDS)):
        lines += [f'  printf("{struct_name}.{n} %zu\\n", offsetof({ns}{struct_name}, {n}));' for n in table]
        lines.append(f'  printf("{struct_name} %zu\\n", sizeof({ns}{struct_name}));')
    lines.append(f'  printf("RingArgHeader %zu\\n", sizeof({ns}RingArgHeader));')
    lines.append(f'  printf("RingBytes64 %llu\\n", (unsigned long long){ns}RingBytes(64));')
    prog = tmp_path / "ring_layout.cc"
    prog.write_text('#include <cstddef>\n#include <cstdio>\n#include "ring.h"\nint main() {\n' + "\n".join(lines)
                    + "\n}\n")
    exe = tmp_path / "ring_layout"
    subprocess.run([cxx, "-std=c++17", "-I", os.path.dirname(HEADER), str(prog), "-o", str(exe)], check=True)
    got = dict(line.split() for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                       check=True).stdout.splitlines())
    for struct_name, table in (("RingControl", _ring.CONTROL_FIELDS), ("RecordHeader", _ring.RECORD_FIELDS),
                               ("CompletionRecord", _ring.COMPLETION_FIELDS)):
        for n, (off, _) in table.items():
            assert int(got[f"{struct_name}.{n}"]) == off, (struct_name, n)
    assert int(got["RingControl"]) == _ring.RING_CONTROL_BYTES
    assert int(got["RecordHeader"]) == _ring.RECORD_HEADER_BYTES
    assert int(got["CompletionRecord"]) == _ring.COMPLETION_BYTES
    assert int(got["RingArgHeader"]) == _ring.ARG_HEADER_BYTES
    assert int(got["RingBytes64"]) == _ring.ring_bytes(64)
