"""The generated contract numbers (python/cache_dit_opd/_wire.py) are what the C headers say.

``_wire.py`` is written by ``proto/tools/wire_py.cc`` from proto/cache_dit_opd/v1/*.h (constants via the
compiler, offsets via offsetof) and committed, so a pure-Python install needs no compiler. Here the
built generator runs and its output must equal the committed file byte for byte; the Python shapes
derived from it (``_layout``'s structs) must have the headers' sizes.
"""

import os
import struct
import subprocess


import _client_fixtures as fx

WIRE_PY = os.path.join(fx.PACKAGE_DIR, "_wire.py")


def _generator():
    return fx.built(os.path.join(fx.build_dir(), "proto", "opd_wire_py"))


def test_committed_wire_py_is_what_the_headers_generate():
    fresh = subprocess.run([_generator()], capture_output=True, text=True, check=True).stdout
    with open(WIRE_PY) as f:
        committed = f.read()
    assert committed == fresh, ("python/cache_dit_opd/_wire.py is stale: regenerate it with "
                                "build/proto/opd_wire_py > python/cache_dit_opd/_wire.py")


def test_derived_structs_have_the_header_sizes():
    from cache_dit_opd import _layout, _wire

    assert _layout.BIND_REQUEST.size == _wire.BIND_REQUEST_SIZE == 48
    assert _layout.BIND_REPLY.size == _wire.BIND_REPLY_SIZE == 272
    packed = _layout.BIND_REQUEST.pack(_wire.BIND_REQUEST_MAGIC, 1, 7, b"t" * 32)
    off, fmt = _wire.BIND_REQUEST_FIELDS["session_id"]
    assert struct.unpack_from(fmt, packed, off)[0] == 7


def test_struct_of_pads_between_fields_and_to_the_size():
    from cache_dit_opd import _layout

    s = _layout.struct_of({"a": (0, "<I"), "b": (8, "<Q"), "c": (64, "<I")}, 128)
    assert s.format == "<I4xQ48xI60x" and s.size == 128
    buf = s.pack(1, 2, 3)
    assert struct.unpack_from("<Q", buf, 8)[0] == 2 and struct.unpack_from("<I", buf, 64)[0] == 3


def test_dtype_table_matches_the_proto_enum():
    from cache_dit_opd import _wire
    from cache_dit_opd._proto import opd_pb2

    assert set(_wire.DTYPE_IDS.values()) == set(range(1, _wire.DTYPE_COUNT))
    for torch_name, value in _wire.DTYPE_IDS.items():
        assert opd_pb2.DType.Value("DTYPE_" + torch_name.upper()) == value, torch_name
    assert len(opd_pb2.DType.keys()) == _wire.DTYPE_COUNT  # the enum has nothing else (besides UNSPECIFIED)
