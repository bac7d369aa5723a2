"""Ring records: the Python encoder against the layout's reference decoder (_ring.decode_record) and against
the daemon's own decoder (``$CACHE_DIT_OPD_BUILD_DIR/server/opd_ring_decode``, common/ring_decode.cc).

The C++ comparisons skip, saying why, when the tool is not built; CI builds it.
"""

import json
import math
import os
import struct
import subprocess

import pytest

import _client_fixtures as fx

from cache_dit_opd import _ring as R

CATALOG = [("fp8_comm_per_token_quant", "out"), ("fused_merge_attn_states", "out"), ("op", "out"),
           ("reject_me", "out")]
I64_MIN, I64_MAX, U64_MAX = -(1 << 63), (1 << 63) - 1, (1 << 64) - 1
INF, NAN = float("inf"), float("nan")


def _decoder() -> str:
    return os.path.join(fx.build_dir(), "server", "opd_ring_decode")


def _need_decoder():
    path = _decoder()
    if not os.path.exists(path):
        pytest.skip(f"the daemon's record decoder is not built: {path} (build target opd_ring_decode, or set "
                    f"CACHE_DIT_OPD_BUILD_DIR)")
    return path


def _tensor(rid=1, off=0, sizes=(2, 3), strides=None, dtype=3):
    if strides is None:
        strides, acc = [], 1
        for s in reversed(sizes):
            strides.insert(0, acc)
            acc *= max(s, 1)
    return R.ARG_TENSOR, (rid, off, tuple(sizes), tuple(strides), dtype)


def _cases():
    """name -> (ticket, seq, lane, op_index, args, flags)."""
    every_kind = [_tensor(7, 4096, (1, 4608, 6, 128)), (R.ARG_INT, -3), (R.ARG_FLOAT, 0.125), (R.ARG_BOOL, True),
                  (R.ARG_INT_LIST, (1, -2, 3)), (R.ARG_FLOAT_LIST, (1.5, -2.25)), (R.ARG_BOOL_LIST, (True, False)),
                  (R.ARG_NONE, None)]
    edge_ints = [(R.ARG_INT, v) for v in (0, -1, 1, I64_MIN, I64_MAX, -(1 << 40))]
    edge_floats = [(R.ARG_FLOAT, v) for v in (INF, -INF, NAN, 0.0, -0.0, 5e-324, -1.7976931348623157e308,
                                              2.2250738585072014e-308, 1 / 3)]
    dims8 = [_tensor(U64_MAX, U64_MAX, (2, 1, 3, 1, 5, 1, 7, 9), (1 << 40, 0, 7, 3, I64_MAX, 1, 2, 1), 11),
             _tensor(1, 0, (), (), 1),  # 0-dim
             _tensor(2, 8, (0, 5), (5, 1), 4),  # zero-size dim
             _tensor(3, 16, (4, 4), (-4, 1), 5)]  # negative stride: the decoder carries it; validation rejects later
    lists64 = [(R.ARG_INT_LIST, tuple(range(-32, 32))),
               (R.ARG_FLOAT_LIST, tuple(float(i) * 0.5 for i in range(63)) + (NAN,)),
               (R.ARG_BOOL_LIST, tuple(i % 3 == 0 for i in range(64))),
               (R.ARG_INT_LIST, ()), (R.ARG_FLOAT_LIST, ()), (R.ARG_BOOL_LIST, ())]
    # exactly kSlotBytes: 64 + 3 * 520 + 2 * 160 + 104
    full = [(R.ARG_INT_LIST, tuple(range(64))), (R.ARG_FLOAT_LIST, tuple(-float(i) for i in range(64))),
            (R.ARG_BOOL_LIST, (True,) * 64), _tensor(1, 2, (1,) * 8), _tensor(3, 4, (2,) * 8),
            (R.ARG_FLOAT_LIST, (INF,) * 12)]
    max_args = [(R.ARG_INT, i - 16) for i in range(R.MAX_ARGS)]
    dtypes = [_tensor(d, d * 8, (d,), (1,), d) for d in range(1, R.MAX_DTYPE + 1)]
    return {
        "every_kind": (0, 1, 0, 0, every_kind, 0),
        "edge_ints": (U64_MAX, U64_MAX, 0xFFFFFFFF, 3, edge_ints, R.RECORD_FLAG_ASYNC),
        "edge_floats": (123456789, 42, 7, 2, edge_floats, 0),
        "tensors_8_dims": (64, 65, 1, 1, dims8, 0),
        "lists_64": (1 << 40, 3, 2, 1, lists64, 1),
        "full_slot": (5, 6, 3, 0, full, 0),
        "max_args": (9, 10, 0, 2, max_args, 0),
        "every_dtype": (11, 12, 4, 1, dtypes, 0),
        "no_args": (13, 14, 5, 3, [], 0),
    }


def _expected(args) -> list:
    """The decoded form of neutral args (the tool's JSON shape)."""
    out = []
    for kind, v in args:
        if kind == R.ARG_TENSOR:
            rid, off, sizes, strides, dtype = v
            out.append({"kind": "tensor", "region_id": rid, "byte_offset": off, "sizes": list(sizes),
                        "strides": list(strides), "dtype": dtype})
        elif kind == R.ARG_NONE:
            out.append({"kind": "none"})
        elif kind in (R.ARG_INT, R.ARG_FLOAT, R.ARG_BOOL):
            out.append({"kind": R.ARG_KIND_NAMES[kind], "value": v})
        else:
            out.append({"kind": R.ARG_KIND_NAMES[kind], "values": list(v)})
    return out


def _same_float(a, b) -> bool:
    if isinstance(a, float) and math.isnan(a) or isinstance(b, float) and math.isnan(b):
        return isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    if float(a) == 0.0 and float(b) == 0.0:
        return True  # "%.17g" prints -0.0 as "-0", which JSON reads as the integer 0
    return struct.pack("<d", float(a)) == struct.pack("<d", float(b))


def _assert_args_equal(got, want, where):
    assert len(got) == len(want), where
    for i, (g, w) in enumerate(zip(got, want)):
        assert g["kind"] == w["kind"], (where, i)
        if w["kind"] == "float":
            assert _same_float(g["value"], w["value"]), (where, i, g, w)
        elif w["kind"] == "float_list":
            assert len(g["values"]) == len(w["values"]) and all(
                _same_float(a, b) for a, b in zip(g["values"], w["values"])), (where, i, g, w)
        else:
            assert g == w, (where, i)
            for key in ("value", "values"):  # bools stay bools, ints stay ints
                if key in w:
                    got_v = g[key] if isinstance(g[key], list) else [g[key]]
                    want_v = w[key] if isinstance(w[key], list) else [w[key]]
                    assert [type(x) for x in got_v] == [type(x) for x in want_v], (where, i)


# -- the encoder and the reference decoder --------------------------------------------------------


@pytest.mark.parametrize("name", list(_cases()))
def test_round_trip_python(name):
    ticket, seq, lane, op_index, args, flags = _cases()[name]
    rec = R.encode_record(ticket, seq, lane, op_index, args, flags)
    nbytes = struct.unpack_from("<I", rec, 4)[0]
    assert nbytes == len(rec) and nbytes % 8 == 0 and nbytes <= R.SLOT_BYTES
    d = R.decode_record(rec)
    assert (d["ticket"], d["seq"], d["lane"], d["op_index"], d["flags"]) == (ticket, seq, lane, op_index, flags)
    _assert_args_equal(d["args"], _expected(args), name)
    # decoding gives back the neutral form, which encodes to the same bytes
    back = [R.neutral_from_decoded(a) for a in d["args"]]
    assert R.encode_record(ticket, seq, lane, op_index, back, flags) == rec


def test_full_slot_is_exactly_one_slot():
    ticket, seq, lane, op_index, args, flags = _cases()["full_slot"]
    assert len(R.encode_record(ticket, seq, lane, op_index, args, flags)) == R.SLOT_BYTES


def test_record_bytes_bounds_what_is_read():
    """A slot holds stale bytes after record_bytes: they are never read."""
    ticket, seq, lane, op_index, args, flags = _cases()["every_kind"]
    rec = R.encode_record(ticket, seq, lane, op_index, args, flags)
    slot = rec + b"\xab" * (R.SLOT_BYTES - len(rec))
    assert R.decode_record(slot) == R.decode_record(rec)


@pytest.mark.parametrize("args,needle", [
    ([(R.ARG_INT, 0)] * (R.MAX_ARGS + 1), "33 arguments"),
    ([_tensor(sizes=(1,) * 9)], "9 dims"),
    ([(R.ARG_INT_LIST, tuple(range(65)))], "65 values"),
    ([(R.ARG_FLOAT_LIST, (0.0,) * 64)] * 4, r"2144 bytes \(at most 2048\)"),
    ([(R.ARG_INT, 1 << 63)], "outside its wire type"),
    ([(R.ARG_TENSOR, (-1, 0, (1,), (1,), 3))], "outside its wire type"),
    ([(99, 0)], "kind 99"),
    (["not a neutral arg"], "outside its wire type"),
])
def test_what_a_record_cannot_carry(args, needle):
    with pytest.raises(R.RecordDoesNotFit, match=needle):
        R.encode_args(args)


def _malformed():
    """name -> (record bytes, message fragment of the reference decoder). Both decoders must refuse each."""
    good = R.encode_record(1, 2, 0, 0, [(R.ARG_INT, 5)])

    def patch(rec, off, fmt, value):
        b = bytearray(rec)
        struct.pack_into(fmt, b, off, value)
        return bytes(b)

    def with_arg(payload: bytes, nargs=1):
        return R.encode_header(64 + len(payload), 1, 2, 0, 0, nargs) + payload

    return {
        "short": (good[:40], "shorter than"),
        "bad_magic": (patch(good, 0, "<I", 0x12345678), "magic"),
        "record_bytes_not_multiple_of_8": (patch(good, 4, "<I", 76), "record_bytes"),
        "record_bytes_past_slot": (patch(good, 4, "<I", R.SLOT_BYTES + 8), "record_bytes"),
        "record_bytes_below_header": (patch(good, 4, "<I", 56), "record_bytes"),
        "nargs_too_many": (patch(good, 32, "<I", R.MAX_ARGS + 1), "nargs"),
        "nargs_past_end": (patch(good, 32, "<I", 2), "past record_bytes"),
        "unknown_kind": (with_arg(struct.pack("<IIq", 8, 1, 0)), "unknown kind"),
        "tensor_9_dims": (with_arg(struct.pack("<IIQQii", 1, 9, 1, 0, 3, 0) + b"\0" * 144), "dims"),
        "list_65": (with_arg(struct.pack("<II", R.ARG_INT_LIST, 65) + b"\0" * 520), "65 values"),
        "scalar_count_2": (with_arg(struct.pack("<IIqq", R.ARG_INT, 2, 1, 2)), "count 2"),
        "none_count_1": (with_arg(struct.pack("<IIq", R.ARG_NONE, 1, 0)), "count 1"),
        "bool_2": (with_arg(struct.pack("<IIq", R.ARG_BOOL, 1, 2)), "bool"),
        "bool_list_minus_1": (with_arg(struct.pack("<IIqq", R.ARG_BOOL_LIST, 2, 0, -1)), "bool"),
        "dtype_0": (with_arg(struct.pack("<IIQQii", 1, 1, 1, 0, 0, 0) + struct.pack("<qq", 1, 1)), "dtype 0"),
        "dtype_12": (with_arg(struct.pack("<IIQQii", 1, 1, 1, 0, 12, 0) + struct.pack("<qq", 1, 1)), "dtype 12"),
        "payload_past_end": (patch(with_arg(struct.pack("<IIqq", R.ARG_INT_LIST, 2, 1, 2)), 4, "<I", 80),
                             "past record_bytes"),
        "bytes_left_over": (with_arg(struct.pack("<IIq", R.ARG_INT, 1, 1) + b"\0" * 8), "left after"),
    }


@pytest.mark.parametrize("name", list(_malformed()))
def test_reference_decoder_refuses_malformed(name):
    rec, needle = _malformed()[name]
    with pytest.raises(R.RecordError, match=needle):
        R.decode_record(rec)


# -- against the daemon's decoder ------------------------------------------------------------------


def _run_decoder(tmp_path, rec: bytes, name: str, catalog=CATALOG):
    tool = _need_decoder()
    rf = tmp_path / f"{name}.rec"
    cf = tmp_path / "catalog.txt"
    rf.write_bytes(rec)
    cf.write_text("".join(f"{n} {o}\n" if o else f"{n}\n" for n, o in catalog))
    p = subprocess.run([tool, str(rf), str(cf)], capture_output=True, text=True, timeout=30)
    assert p.returncode in (0, 1), f"opd_ring_decode exited {p.returncode}: {p.stdout}{p.stderr}"
    out = json.loads(p.stdout)
    assert out["ok"] == (p.returncode == 0), p.stdout
    return out


@pytest.mark.parametrize("slot", [False, True], ids=["record_bytes", "whole_slot"])
@pytest.mark.parametrize("name", list(_cases()))
def test_round_trip_against_daemon_decoder(tmp_path, name, slot):
    ticket, seq, lane, op_index, args, flags = _cases()[name]
    rec = R.encode_record(ticket, seq, lane, op_index, args, flags)
    if slot:
        rec = rec + b"\xcd" * (R.SLOT_BYTES - len(rec))
    out = _run_decoder(tmp_path, rec, name)
    assert out["ok"], out
    assert (out["ticket"], out["seq"], out["lane"]) == (ticket, seq, lane)
    assert (out["op"], out["overload"]) == CATALOG[op_index]
    _assert_args_equal(out["args"], _expected(args), name)
    # and the reference decoder reads the same
    _assert_args_equal(out["args"], R.decode_record(rec)["args"], name)


@pytest.mark.parametrize("name", list(_malformed()))
def test_daemon_decoder_refuses_malformed(tmp_path, name):
    rec, _ = _malformed()[name]
    out = _run_decoder(tmp_path, rec, name)
    assert out == {"ok": False, "code": 3, "message": out["message"]} and out["message"], out


def test_daemon_decoder_checks_op_index(tmp_path):
    rec = R.encode_record(1, 1, 0, len(CATALOG), [])
    out = _run_decoder(tmp_path, rec, "op_index")
    assert not out["ok"] and out["code"] == 3 and "op_index" in out["message"], out


def test_default_overload_in_catalog(tmp_path):
    catalog = [("fused_merge_attn_states", ""), ("fused_merge_attn_states", "out")]
    out = _run_decoder(tmp_path, R.encode_record(1, 1, 0, 0, []), "default", catalog)
    assert (out["op"], out["overload"]) == ("fused_merge_attn_states", "")
    out = _run_decoder(tmp_path, R.encode_record(1, 1, 0, 1, []), "out", catalog)
    assert (out["op"], out["overload"]) == ("fused_merge_attn_states", "out")
