"""FP8 communication records, served by the cache-dit-opd daemon.

Four ops pack bf16 activations into float8_e4m3fn records with their scales
(for Ulysses all-to-all and other collectives) and unpack them again. Byte
formats and math: docs/DESIGN.md section 3 ("comm"); records are byte-compatible
with upstream cache-dit's.

Layout of this module (same order in every domain module): daemon-connection
accessors, validation, torch.library definitions, the CUDA impls that forward
to the daemon, fakes, public wrappers.
"""

from __future__ import annotations

import torch

from . import _checks, _proxy, _schemas, _session

__all__ = [
    "comm_extension_is_available",
    "comm_get_load_error",
    "fp8_comm_per_token_dequant",
    "fp8_comm_per_token_quant",
    "fp8_comm_qkv_permute_dequant",
    "fp8_comm_qkv_permute_quant",
]

_FAMILY = "comm"
_SCHEMAS = _schemas.SCHEMAS[_FAMILY]  # generated from kernels/ops.def
_FP8 = torch.float8_e4m3fn
_PER_TOKEN_SCALE_BYTES = 2  # bf16 scale after each row
_QKV_SCALE_BYTES = 4  # fp32 scale after each [D] vector
_MAX_QKV_DIM = 2**31 - 1  # kMaxQkvDim: B, S and N of the QKV ops


# -- daemon connection -------------------------------------------------------------------


def comm_extension_is_available(device=None) -> bool:
    """True when a daemon serving the comm ops is reachable for ``device`` (default: current CUDA device)."""
    return comm_get_load_error(device) is None


def comm_get_load_error(device=None) -> Exception | None:
    """Why the comm ops are unavailable for ``device``, or None. Opens the session if needed."""
    return _session.load_error(_FAMILY, _SCHEMAS, device)


def _get_required_comm_session(device=None) -> "_session.Session":
    """The session serving the comm ops; RuntimeError naming the command that starts a daemon otherwise."""
    return _session.require(_FAMILY, _SCHEMAS, device)


# -- validation and output shapes (shared by the proxy impls and the fakes) -------------------


def _per_token_quant_meta(x, out=None):
    """check_per_token_quant (kernels/comm/fp8_comm.cpp): the output's shape and dtype."""
    op = "fp8_comm_per_token_quant"
    _checks.check_device(op, "x", x)
    _checks.check_min_dims(op, "x", x, 1, "[..., D]")
    _checks.check_dtype(op, "x", x, torch.bfloat16)
    if x.shape[-1] < 1:
        raise ValueError(f"{op}: the last dim D must be >= 1, got shape {_checks.shape_str(x.shape)}")
    _checks.check_contiguous(op, "x", x)
    shape = (*x.shape[:-1], x.shape[-1] + _PER_TOKEN_SCALE_BYTES)
    if out is not None:
        _checks.check_output(op, "out", out, shape, _FP8, x)
    return shape, _FP8


def _per_token_dequant_meta(x, out=None):
    """check_per_token_dequant."""
    op = "fp8_comm_per_token_dequant"
    _checks.check_device(op, "x", x)
    _checks.check_min_dims(op, "x", x, 1, "[..., D + 2]")
    _checks.check_dtype(op, "x", x, _FP8)
    if x.shape[-1] < 1 + _PER_TOKEN_SCALE_BYTES:
        raise ValueError(f"{op}: the last dim must be D + 2 with D >= 1, got shape {_checks.shape_str(x.shape)}")
    _checks.check_contiguous(op, "x", x)
    shape = (*x.shape[:-1], x.shape[-1] - _PER_TOKEN_SCALE_BYTES)
    if out is not None:
        _checks.check_output(op, "out", out, shape, torch.bfloat16, x)
    return shape, torch.bfloat16


def _qkv_permute_quant_meta(x, out=None):
    """check_qkv_permute_quant."""
    op = "fp8_comm_qkv_permute_quant"
    _checks.check_device(op, "x", x)
    _checks.check_dims(op, "x", x, 5, "[B, S, P, N, D]")
    _checks.check_dtype(op, "x", x, torch.bfloat16)
    b, s, p, n, d = x.shape
    if d < 1:
        raise ValueError(f"{op}: head dim D must be >= 1, got shape {_checks.shape_str(x.shape)}")
    if max(b, s, n) > _MAX_QKV_DIM:
        raise ValueError(f"{op}: B, S and N must each be at most {_MAX_QKV_DIM}, got shape "
                         f"{_checks.shape_str(x.shape)}")
    if not ((d == 1 or x.stride(4) == 1) and (n == 1 or x.stride(3) == d)):
        raise ValueError(f"{op}: each [N, D] block of x must be contiguous (strides [.., .., .., D, 1]), got shape "
                         f"{_checks.shape_str(x.shape)} with strides {_checks.shape_str(x.stride())}")
    shape = (p, s, b, n, d + _QKV_SCALE_BYTES)
    if out is not None:
        _checks.check_output(op, "out", out, shape, _FP8, x)
    return shape, _FP8


def _qkv_permute_dequant_meta(quant_x, out=None):
    """check_qkv_permute_dequant."""
    op = "fp8_comm_qkv_permute_dequant"
    _checks.check_device(op, "quant_x", quant_x)
    _checks.check_dims(op, "quant_x", quant_x, 4, "[S, B, N, D + 4]")
    _checks.check_dtype(op, "quant_x", quant_x, _FP8)
    s, b, n, d4 = quant_x.shape
    if d4 < 1 + _QKV_SCALE_BYTES:
        raise ValueError(f"{op}: the last dim must be D + 4 with D >= 1, got shape "
                         f"{_checks.shape_str(quant_x.shape)}")
    if max(s, b, n) > _MAX_QKV_DIM:
        raise ValueError(f"{op}: S, B and N must each be at most {_MAX_QKV_DIM}, got shape "
                         f"{_checks.shape_str(quant_x.shape)}")
    _checks.check_contiguous(op, "quant_x", quant_x)
    shape = (b, s, n, d4 - _QKV_SCALE_BYTES)
    if out is not None:
        _checks.check_output(op, "out", out, shape, torch.bfloat16, quant_x)
    return shape, torch.bfloat16


# -- definitions -------------------------------------------------------------------------

_LIB = torch.library.Library(_proxy.NAMESPACE, "FRAGMENT")
_FAKE_PRESENT = _proxy.define_or_adopt(_LIB, _SCHEMAS, tags=_proxy.PROXY_TAGS)


def _call_comm_op(op: str, device_index: int, x, out) -> None:
    # Thin bridge: every comm .out overload is (x, *, out).
    _session.run(_get_required_comm_session, device_index, op, [x, out], _proxy.redispatch(op, (x,), {"out": out}))


def _forward(op: str, meta, x):
    """Proxy impl of a functional overload: validate, allocate the output, let the daemon fill it."""
    shape, dtype = meta(x)
    idx = _proxy.device_index(op, x)
    _proxy.check_not_capturing(op, idx)
    _get_required_comm_session(idx)
    out = torch.empty(shape, dtype=dtype, device=x.device)
    if out.numel():
        getattr(torch.ops.cache_dit_cuda_ops, op).out(x, out=out)
    return out


def _forward_out(op: str, meta, x, out):
    """Proxy impl of an .out overload."""
    meta(x, out)
    idx = _proxy.device_index(f"{op}.out", x, out)
    _proxy.check_not_capturing(f"{op}.out", idx)
    if out.numel():
        _call_comm_op(op, idx, x, out)
    return out


def _fp8_comm_per_token_quant(x):
    return _forward("fp8_comm_per_token_quant", _per_token_quant_meta, x)


def _fp8_comm_per_token_quant_out(x, *, out):
    return _forward_out("fp8_comm_per_token_quant", _per_token_quant_meta, x, out)


def _fp8_comm_per_token_dequant(x):
    return _forward("fp8_comm_per_token_dequant", _per_token_dequant_meta, x)


def _fp8_comm_per_token_dequant_out(x, *, out):
    return _forward_out("fp8_comm_per_token_dequant", _per_token_dequant_meta, x, out)


def _fp8_comm_qkv_permute_quant(x):
    return _forward("fp8_comm_qkv_permute_quant", _qkv_permute_quant_meta, x)


def _fp8_comm_qkv_permute_quant_out(x, *, out):
    return _forward_out("fp8_comm_qkv_permute_quant", _qkv_permute_quant_meta, x, out)


def _fp8_comm_qkv_permute_dequant(quant_x):
    return _forward("fp8_comm_qkv_permute_dequant", _qkv_permute_dequant_meta, quant_x)


def _fp8_comm_qkv_permute_dequant_out(quant_x, *, out):
    return _forward_out("fp8_comm_qkv_permute_dequant", _qkv_permute_dequant_meta, quant_x, out)


def _fake_of(meta, x):
    """Fake of a functional overload: the output the daemon would fill, from the shared checks."""
    shape, dtype = meta(x)
    return torch.empty(shape, dtype=dtype, device=x.device)


def _fake_of_out(op: str, meta, x, out):
    """Fake of an .out overload: the shared checks, outputs included."""
    meta(x, out)
    return out


def _fake_fp8_comm_per_token_quant(x):
    return _fake_of(_per_token_quant_meta, x)


def _fake_fp8_comm_per_token_quant_out(x, *, out):
    return _fake_of_out("fp8_comm_per_token_quant", _per_token_quant_meta, x, out)


def _fake_fp8_comm_per_token_dequant(x):
    return _fake_of(_per_token_dequant_meta, x)


def _fake_fp8_comm_per_token_dequant_out(x, *, out):
    return _fake_of_out("fp8_comm_per_token_dequant", _per_token_dequant_meta, x, out)


def _fake_fp8_comm_qkv_permute_quant(x):
    return _fake_of(_qkv_permute_quant_meta, x)


def _fake_fp8_comm_qkv_permute_quant_out(x, *, out):
    return _fake_of_out("fp8_comm_qkv_permute_quant", _qkv_permute_quant_meta, x, out)


def _fake_fp8_comm_qkv_permute_dequant(quant_x):
    return _fake_of(_qkv_permute_dequant_meta, quant_x)


def _fake_fp8_comm_qkv_permute_dequant_out(quant_x, *, out):
    return _fake_of_out("fp8_comm_qkv_permute_dequant", _qkv_permute_dequant_meta, quant_x, out)


for _name, _impl, _fake in (
    ("fp8_comm_per_token_quant", _fp8_comm_per_token_quant, _fake_fp8_comm_per_token_quant),
    ("fp8_comm_per_token_quant.out", _fp8_comm_per_token_quant_out, _fake_fp8_comm_per_token_quant_out),
    ("fp8_comm_per_token_dequant", _fp8_comm_per_token_dequant, _fake_fp8_comm_per_token_dequant),
    ("fp8_comm_per_token_dequant.out", _fp8_comm_per_token_dequant_out, _fake_fp8_comm_per_token_dequant_out),
    ("fp8_comm_qkv_permute_quant", _fp8_comm_qkv_permute_quant, _fake_fp8_comm_qkv_permute_quant),
    ("fp8_comm_qkv_permute_quant.out", _fp8_comm_qkv_permute_quant_out, _fake_fp8_comm_qkv_permute_quant_out),
    ("fp8_comm_qkv_permute_dequant", _fp8_comm_qkv_permute_dequant, _fake_fp8_comm_qkv_permute_dequant),
    ("fp8_comm_qkv_permute_dequant.out", _fp8_comm_qkv_permute_dequant_out,
     _fake_fp8_comm_qkv_permute_dequant_out),
):
    _proxy.attach(_LIB, _name, _impl, _fake, _FAKE_PRESENT)
del _name, _impl, _fake


# -- public wrappers ------------------------------------------------------------------------


def fp8_comm_per_token_quant(x: torch.Tensor) -> torch.Tensor:
    """Quantizes each row of ``x`` to float8_e4m3fn with a bf16 scale appended.

    :param x: ``[..., D]`` bfloat16, contiguous, D >= 1.
    :returns: ``[..., D+2]`` float8_e4m3fn: D quantized values, then the row's bf16 scale
        (``max(1e-4, max|x|) / 448``) in two little-endian bytes.
    :raises ValueError: on a wrong dtype, rank or layout (naming the value).
    :raises RuntimeError: when no daemon serves the tensor's device (with the command that starts one).
    """
    return torch.ops.cache_dit_cuda_ops.fp8_comm_per_token_quant(x)


def fp8_comm_per_token_dequant(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`fp8_comm_per_token_quant`.

    :param x: ``[..., D+2]`` float8_e4m3fn records, contiguous.
    :returns: ``[..., D]`` bfloat16, ``q * scale`` per row.
    :raises ValueError: on a wrong dtype, rank or layout (naming the value).
    :raises RuntimeError: when no daemon serves the tensor's device (with the command that starts one).
    """
    return torch.ops.cache_dit_cuda_ops.fp8_comm_per_token_dequant(x)


def fp8_comm_qkv_permute_quant(x: torch.Tensor) -> torch.Tensor:
    """Quantizes ``[B, S, P, N, D]`` activations into the Ulysses all-to-all send layout.

    :param x: ``[B, S, P, N, D]`` bfloat16; B, S and P may be strided, each ``[N, D]`` block contiguous.
    :returns: contiguous ``[P, S, B, N, D+4]`` float8_e4m3fn: per (b, s, p, n) vector its D
        quantized values, then its fp32 scale (``max(max|x|/448, 1e-6)``) in four bytes.
        Destination rank p's chunk ``[p]`` is contiguous.
    :raises ValueError: on a wrong dtype, rank or layout (naming the value).
    :raises RuntimeError: when no daemon serves the tensor's device (with the command that starts one).
    """
    return torch.ops.cache_dit_cuda_ops.fp8_comm_qkv_permute_quant(x)


def fp8_comm_qkv_permute_dequant(quant_x: torch.Tensor) -> torch.Tensor:
    """Unpacks one received ``[S, B, N, D+4]`` chunk of :func:`fp8_comm_qkv_permute_quant` records.

    :param quant_x: ``[S, B, N, D+4]`` float8_e4m3fn, contiguous.
    :returns: contiguous ``[B, S, N, D]`` bfloat16 in true ``[B, S]`` order.
    :raises ValueError: on a wrong dtype, rank or layout (naming the value).
    :raises RuntimeError: when no daemon serves the tensor's device (with the command that starts one).
    """
    return torch.ops.cache_dit_cuda_ops.fp8_comm_qkv_permute_dequant(quant_x)
