"""The validation helpers of ``kernels/common/checks.h``, in Python, with the same messages.

The client's fakes and proxy impls validate exactly as the kernel library's check functions do (so a
bad call fails the same way traced, in-process and through the daemon): the same checks in the same
order, each raising ValueError with the message the C++ check raises. ``tests/python/test_client_parity.py``
runs one table of bad inputs through both and compares exception type and message.
"""

from __future__ import annotations


def shape_str(sizes) -> str:
    """``[2, 3, 4]`` (checks::shape_str)."""
    return "[" + ", ".join(str(int(s)) for s in sizes) + "]"


def check_dims(op: str, name: str, t, dims: int, layout: str) -> None:
    if t.dim() != dims:
        raise ValueError(f"{op}: {name} must have {dims} dims {layout}, got shape {shape_str(t.shape)}")


def check_min_dims(op: str, name: str, t, min_dims: int, layout: str) -> None:
    if t.dim() < min_dims:
        raise ValueError(f"{op}: {name} must have at least {min_dims} dims {layout}, got shape {shape_str(t.shape)}")


def check_dtype(op: str, name: str, t, expected) -> None:
    if t.dtype != expected:
        raise ValueError(f"{op}: {name} must be {expected}, got {t.dtype}")


def check_dtype_in(op: str, name: str, t, allowed) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{op}: {name} must be one of {{{', '.join(str(d) for d in allowed)}}}, got {t.dtype}")


def check_contiguous(op: str, name: str, t) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous, got shape {shape_str(t.shape)} with strides "
                         f"{shape_str(t.stride())} (call .contiguous() first)")


def check_device(op: str, name: str, t) -> None:
    if t.device.type not in ("cuda", "meta"):
        raise ValueError(f"{op}: {name} must be a CUDA tensor, got device {t.device}")


def check_same_device(op: str, ref, ref_name: str, others) -> None:
    check_device(op, ref_name, ref)
    for name, t in others:
        if t.device != ref.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}")


def check_output(op: str, name: str, out, sizes, dtype, device_ref) -> None:
    """An output: exactly ``sizes`` and ``dtype``, the inputs' device, contiguous (the daemon also checks that
    it overlaps no other operand)."""
    if tuple(out.shape) != tuple(sizes):
        raise ValueError(f"{op}: output {name} must have shape {shape_str(sizes)}, got {shape_str(out.shape)}")
    if out.dtype != dtype:
        raise ValueError(f"{op}: output {name} must be {dtype}, got {out.dtype}")
    if out.device != device_ref.device:
        raise ValueError(f"{op}: output {name} is on {out.device} but the inputs are on {device_ref.device}")
    if not out.is_contiguous():
        raise ValueError(f"{op}: output {name} must be contiguous and non-overlapping, got strides "
                         f"{shape_str(out.stride())} for shape {shape_str(out.shape)}")
