"""Protobuf messages as plain Python values (no protobuf import: works on any message object).

``json_format.MessageToDict`` would turn 64-bit integers into strings and leave out fields at their
default (``serving = False`` must show). The benchmark loads this file by path, without the package.
"""

from __future__ import annotations


def _is_repeated(field) -> bool:
    rep = getattr(field, "is_repeated", None)  # protobuf >= 5.28
    return rep if rep is not None else field.label == field.LABEL_REPEATED


def message_to_dict(msg) -> dict:
    """Every field, defaults included, as plain values: messages as dicts, bytes as hex."""
    out = {}
    for f in msg.DESCRIPTOR.fields:
        v = getattr(msg, f.name)
        if f.message_type is not None:
            v = [message_to_dict(m) for m in v] if _is_repeated(f) else message_to_dict(v)
        elif _is_repeated(f):
            v = list(v)
        elif isinstance(v, bytes):
            v = v.hex()
        out[f.name] = v
    return out
