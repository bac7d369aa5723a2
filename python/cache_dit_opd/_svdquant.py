"""SVDQuant W4A4 (INT4) linear layers, served by the cache-dit-opd daemon.

Three ops in upstream cache-dit's names and schemas: the activation quantizer with smoothing and
LoRA-down, the W4A4 GEMM with LoRA-up and bias, the runtime weight quantizer. Checkpoint tensors
(qweight, wscales, bias, smooth_factor, proj_down, proj_up) are nunchaku's packed layouts
(``kernels/svdq_reference.py`` packs and unpacks them); the activation, its scales and lora_act are the
daemon's own (``kernels/svdq/svdq.h``). INT4 only: FP4 needs FP4 tensor cores, which Hopper has not.

Layout of this module (same order in every domain module): daemon-connection accessors, validation,
torch.library definitions, the CUDA impls that forward to the daemon, fakes, public wrappers.
"""

from __future__ import annotations

import torch

from . import _checks, _proxy, _schemas, _session

__all__ = [
    "svdq_extension_is_available",
    "svdq_gemm_w4a4",
    "svdq_get_load_error",
    "svdq_quantize_w4a4_act_fuse_lora",
    "svdq_quantize_w4a4_wgt",
]

_FAMILY = "svdq"
_SCHEMAS = _schemas.SCHEMAS[_FAMILY]  # generated from kernels/ops.def
_GROUP, _BLOCK_N, _K_ALIGN, _RANK_ALIGN = 64, 128, 128, 16
_MAX_ROWS, _MAX_K = 65535 * 16, 65535 * 128 * _GROUP  # kMaxRows, kMaxK (kernels/svdq/svdq.h)
_HALVES = (torch.float16, torch.bfloat16)
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # out_dtype_id 0, 1, 2

_ACT = "svdq_quantize_w4a4_act_fuse_lora"
_GEMM = "svdq_gemm_w4a4"
_WGT = "svdq_quantize_w4a4_wgt"


# -- daemon connection -------------------------------------------------------------------


def svdq_extension_is_available(device=None) -> bool:
    """True when a daemon serving the svdq ops is reachable for ``device`` (default: current CUDA device)."""
    return svdq_get_load_error(device) is None


def svdq_get_load_error(device=None) -> Exception | None:
    """Why the svdq ops are unavailable for ``device``, or None. Opens the session if needed."""
    return _session.load_error(_FAMILY, _SCHEMAS, device)


def _get_required_svdq_session(device=None) -> "_session.Session":
    return _session.require(_FAMILY, _SCHEMAS, device)


# -- validation and output shapes (kernels/svdq/svdq.cpp, same order and messages) --------------------


def _check_int4_only(op, fp4, flag, value):
    if fp4:
        raise ValueError(f"{op}: fp4=True is not supported: this build serves INT4 only (NVFP4 needs FP4 tensor "
                         "cores, which sm_90 has not)")
    if value:
        raise ValueError(f"{op}: {flag}=True is not supported: this build serves signed INT4 without it")


def _check_multiple(op, what, v, of, t):
    if v % of != 0:
        raise ValueError(f"{op}: {what} must be a multiple of {of}, got {v} (shape {_checks.shape_str(t.shape)})")


def _check_vector(op, name, v, n, dtype, ref, ref_name):
    _checks.check_dims(op, name, v, 1, "[N] (packed)")
    if v.shape[0] != n:
        raise ValueError(f"{op}: {name} must have {n} entries, got shape {_checks.shape_str(v.shape)}")
    _checks.check_dtype(op, name, v, dtype)
    _checks.check_contiguous(op, name, v)
    _checks.check_same_device(op, ref, ref_name, [(name, v)])


def _check_lowrank(op, name, layout, dim, t, channels, dtype):
    """check_lowrank: a packed factor [channels, R], R a multiple of 16, the model dtype, contiguous."""
    _checks.check_dims(op, name, t, 2, layout)
    if t.shape[0] != channels:
        raise ValueError(f"{op}: {name} must be [{dim}, R] with {dim} = {channels}, got shape "
                         f"{_checks.shape_str(t.shape)}")
    _check_multiple(op, f"R ({name}.shape[1])", t.shape[1], _RANK_ALIGN, t)
    _checks.check_dtype(op, name, t, dtype)
    _checks.check_contiguous(op, name, t)


def _check_rows(op, m_pad, t):
    if m_pad > _MAX_ROWS:
        raise ValueError(f"{op}: M_pad (rows after padding) must be at most {_MAX_ROWS}, got {m_pad} "
                         f"(shape {_checks.shape_str(t.shape)})")


def _padded_rows(m, pad_size):
    return (m + pad_size - 1) // pad_size * pad_size


def _act_meta(input, lora_down, smooth, fuse_glu, fp4, pad_size, outs=None):
    """check_quantize_act; returns the outputs' (shape, dtype)s."""
    op = _ACT
    _check_int4_only(op, fp4, "fuse_glu", fuse_glu)
    _checks.check_device(op, "input", input)
    _checks.check_dims(op, "input", input, 2, "[M, K]")
    _checks.check_dtype_in(op, "input", input, _HALVES)
    _checks.check_contiguous(op, "input", input)
    _check_multiple(op, "K (input.shape[1])", input.shape[1], _K_ALIGN, input)
    if not 1 <= pad_size <= _MAX_ROWS:
        raise ValueError(f"{op}: pad_size must be in [1, {_MAX_ROWS}], got {pad_size}")
    dtype, k, rank = input.dtype, input.shape[1], 0
    if k > _MAX_K:
        raise ValueError(f"{op}: K (input.shape[1]) must be at most {_MAX_K}, got {k}")
    _check_rows(op, _padded_rows(input.shape[0], pad_size), input)
    if lora_down is not None:
        _check_lowrank(op, "lora_down", "[K, R] (packed proj_down)", "K", lora_down, k, dtype)
        _checks.check_same_device(op, input, "input", [("lora_down", lora_down)])
        rank = lora_down.shape[1]
    if smooth is not None:
        _check_vector(op, "smooth", smooth, k, dtype, input, "input")
    m_pad = _padded_rows(input.shape[0], pad_size)
    specs = (((m_pad, k), torch.float8_e4m3fn), ((k // _GROUP, m_pad), dtype), ((m_pad, rank), torch.float32))
    if outs is not None:
        for name, out, (shape, dt) in zip(("output", "oscales", "lora_act_out"), outs, specs):
            _checks.check_output(op, name, out, shape, dt, input)
    return specs


def _gemm_meta(act, wgt, ascales, wscales, lora_act_in, lora_up, bias, fp4, alpha, wcscales, act_unsigned,
               out_dtype_id, out=None):
    """check_gemm; returns the output's (shape, dtype)."""
    op = _GEMM
    _check_int4_only(op, fp4, "act_unsigned", act_unsigned)
    if alpha != 1.0:
        raise ValueError(f"{op}: alpha must be 1.0 for INT4 (it scales NVFP4 only), got {alpha:g}")
    if wcscales is not None:
        raise ValueError(f"{op}: wcscales must be None for INT4 (it scales NVFP4 only)")
    if not 0 <= out_dtype_id <= 2:
        raise ValueError(f"{op}: out_dtype_id must be 0 (float16), 1 (bfloat16) or 2 (float32), got {out_dtype_id}")
    _checks.check_device(op, "act", act)
    _checks.check_dims(op, "act", act, 2, "[M_pad, K] (from svdq_quantize_w4a4_act_fuse_lora)")
    _checks.check_dtype(op, "act", act, torch.float8_e4m3fn)
    _checks.check_contiguous(op, "act", act)
    _checks.check_dims(op, "wgt", wgt, 2, "[N, K/2] (packed qweight)")
    _checks.check_dtype(op, "wgt", wgt, torch.int8)
    _checks.check_contiguous(op, "wgt", wgt)
    m_pad, k, n = act.shape[0], act.shape[1], wgt.shape[0]
    _check_rows(op, m_pad, act)
    if wgt.shape[1] * 2 != k:
        raise ValueError(f"{op}: wgt must be [N, K/2] with K = {k} as in act, got wgt shape "
                         f"{_checks.shape_str(wgt.shape)} and act shape {_checks.shape_str(act.shape)}")
    _check_multiple(op, "K (act.shape[1])", k, _K_ALIGN, act)
    _check_multiple(op, "N (wgt.shape[0])", n, _BLOCK_N, wgt)
    _checks.check_dims(op, "wscales", wscales, 2, "[K/64, N] (packed)")
    _checks.check_dtype_in(op, "wscales", wscales, _HALVES)
    dtype = wscales.dtype
    if wscales.shape[0] != k // _GROUP or wscales.shape[1] != n:
        raise ValueError(f"{op}: wscales must be [{k // _GROUP}, {n}], got shape {_checks.shape_str(wscales.shape)}")
    _checks.check_contiguous(op, "wscales", wscales)
    _checks.check_dims(op, "ascales", ascales, 2, "[K/64, M_pad]")
    _checks.check_dtype(op, "ascales", ascales, dtype)
    if ascales.shape[0] != k // _GROUP or ascales.shape[1] != m_pad:
        raise ValueError(f"{op}: ascales must be [{k // _GROUP}, {m_pad}], got shape "
                         f"{_checks.shape_str(ascales.shape)}")
    _checks.check_contiguous(op, "ascales", ascales)
    _checks.check_same_device(op, act, "act", [("wgt", wgt), ("ascales", ascales), ("wscales", wscales)])
    if (lora_act_in is None) != (lora_up is None):
        got = "lora_act_in without lora_up" if lora_act_in is not None else "lora_up without lora_act_in"
        raise ValueError(f"{op}: lora_act_in and lora_up come together (both or neither), got {got}")
    if lora_up is not None:
        _check_lowrank(op, "lora_up", "[N, R] (packed proj_up)", "N", lora_up, n, dtype)
        _checks.check_dims(op, "lora_act_in", lora_act_in, 2, "[M_pad, R]")
        if lora_act_in.shape[0] != m_pad or lora_act_in.shape[1] != lora_up.shape[1]:
            raise ValueError(f"{op}: lora_act_in must be [{m_pad}, {lora_up.shape[1]}], got shape "
                             f"{_checks.shape_str(lora_act_in.shape)}")
        _checks.check_dtype(op, "lora_act_in", lora_act_in, torch.float32)
        _checks.check_contiguous(op, "lora_act_in", lora_act_in)
        _checks.check_same_device(op, act, "act", [("lora_up", lora_up), ("lora_act_in", lora_act_in)])
    if bias is not None:
        _check_vector(op, "bias", bias, n, dtype, act, "act")
    spec = ((m_pad, n), _OUT_DTYPES[out_dtype_id])
    if out is not None:
        _checks.check_output(op, "out", out, *spec, act)
    return spec


def _wgt_meta(input, outs=None):
    """check_quantize_wgt; returns the outputs' (shape, dtype)s."""
    op = _WGT
    _checks.check_device(op, "input", input)
    _checks.check_dims(op, "input", input, 2, "[N, K]")
    _checks.check_dtype_in(op, "input", input, _HALVES)
    _checks.check_contiguous(op, "input", input)
    _check_multiple(op, "N (input.shape[0])", input.shape[0], _BLOCK_N, input)
    _check_multiple(op, "K (input.shape[1])", input.shape[1], _K_ALIGN, input)
    n, k = input.shape
    specs = (((n, k // 2), torch.int8), ((k // _GROUP, n), input.dtype))
    if outs is not None:
        for name, out, (shape, dt) in zip(("output", "oscales"), outs, specs):
            _checks.check_output(op, name, out, shape, dt, input)
    return specs


# -- definitions -------------------------------------------------------------------------

_LIB = torch.library.Library(_proxy.NAMESPACE, "FRAGMENT")
_FAKE_PRESENT = _proxy.define_or_adopt(_LIB, _SCHEMAS, tags=_proxy.PROXY_TAGS)


def _tensors(*ts):
    return [t for t in ts if t is not None]


def _empty(specs, like):
    return [torch.empty(shape, dtype=dt, device=like.device) for shape, dt in specs]


def _call(op, device_index, args, positional, outs: dict):
    # Thin bridge: the daemon's .out overload takes every argument in schema order.
    _session.run(_get_required_svdq_session, device_index, op, [*args, *outs.values()],
                 _proxy.redispatch(op, tuple(positional), outs))


def _writes_something(*outs) -> bool:
    """Whether some output has an element. Not just the first: K = 0 leaves act and ascales empty while
    lora_act [M_pad, R] (x @ lora_down, all zeros) is not, and rank 0 the other way round."""
    return any(t.numel() for t in outs)


def _prepare(op, *tensors):
    idx = _proxy.device_index(op, *tensors)
    _proxy.check_not_capturing(op, idx)
    return idx


def _act(input, lora_down, smooth, fuse_glu, fp4, pad_size):
    specs = _act_meta(input, lora_down, smooth, fuse_glu, fp4, pad_size)
    _get_required_svdq_session(_prepare(_ACT, *_tensors(input, lora_down, smooth)))
    output, oscales, lora_act_out = _empty(specs, input)
    if _writes_something(output, oscales, lora_act_out):
        torch.ops.cache_dit_cuda_ops.svdq_quantize_w4a4_act_fuse_lora.out(
            input, lora_down, smooth, fuse_glu, fp4, pad_size, output=output, oscales=oscales,
            lora_act_out=lora_act_out)
    return output, oscales, lora_act_out


def _act_out(input, lora_down, smooth, fuse_glu, fp4, pad_size, *, output, oscales, lora_act_out):
    _act_meta(input, lora_down, smooth, fuse_glu, fp4, pad_size, (output, oscales, lora_act_out))
    idx = _prepare(f"{_ACT}.out", *_tensors(input, lora_down, smooth, output, oscales, lora_act_out))
    if _writes_something(output, oscales, lora_act_out):
        args = (input, lora_down, smooth, fuse_glu, fp4, pad_size)
        _call(_ACT, idx, args, args, {"output": output, "oscales": oscales, "lora_act_out": lora_act_out})
    return output, oscales, lora_act_out


def _gemm(act, wgt, ascales, wscales, lora_act_in, lora_up, bias, fp4, alpha, wcscales, act_unsigned, out_dtype_id):
    spec = _gemm_meta(act, wgt, ascales, wscales, lora_act_in, lora_up, bias, fp4, alpha, wcscales, act_unsigned,
                      out_dtype_id)
    _get_required_svdq_session(_prepare(_GEMM, *_tensors(act, wgt, ascales, wscales, lora_act_in, lora_up, bias)))
    (out,) = _empty([spec], act)
    if out.numel():
        torch.ops.cache_dit_cuda_ops.svdq_gemm_w4a4.out(act, wgt, ascales, wscales, lora_act_in, lora_up, bias, fp4,
                                                       alpha, wcscales, act_unsigned, out_dtype_id, out=out)
    return out


def _gemm_out(act, wgt, ascales, wscales, lora_act_in, lora_up, bias, fp4, alpha, wcscales, act_unsigned,
              out_dtype_id, *, out):
    args = (act, wgt, ascales, wscales, lora_act_in, lora_up, bias, fp4, alpha, wcscales, act_unsigned, out_dtype_id)
    _gemm_meta(*args, out=out)
    idx = _prepare(f"{_GEMM}.out", *_tensors(act, wgt, ascales, wscales, lora_act_in, lora_up, bias, out))
    if out.numel():
        _call(_GEMM, idx, args, args, {"out": out})
    return out


def _wgt(input):
    specs = _wgt_meta(input)
    _get_required_svdq_session(_prepare(_WGT, input))
    output, oscales = _empty(specs, input)
    if output.numel():
        torch.ops.cache_dit_cuda_ops.svdq_quantize_w4a4_wgt.out(input, output=output, oscales=oscales)
    return output, oscales


def _wgt_out(input, *, output, oscales):
    _wgt_meta(input, (output, oscales))
    idx = _prepare(f"{_WGT}.out", input, output, oscales)
    if output.numel():
        _call(_WGT, idx, (input,), (input,), {"output": output, "oscales": oscales})
    return output, oscales


def _fake_act(input, lora_down, smooth, fuse_glu, fp4, pad_size):
    return tuple(_empty(_act_meta(input, lora_down, smooth, fuse_glu, fp4, pad_size), input))


def _fake_act_out(input, lora_down, smooth, fuse_glu, fp4, pad_size, *, output, oscales, lora_act_out):
    _act_meta(input, lora_down, smooth, fuse_glu, fp4, pad_size, (output, oscales, lora_act_out))
    return output, oscales, lora_act_out


def _fake_gemm(act, wgt, ascales, wscales, lora_act_in, lora_up, bias, fp4, alpha, wcscales, act_unsigned,
               out_dtype_id):
    spec = _gemm_meta(act, wgt, ascales, wscales, lora_act_in, lora_up, bias, fp4, alpha, wcscales, act_unsigned,
                      out_dtype_id)
    return _empty([spec], act)[0]


def _fake_gemm_out(act, wgt, ascales, wscales, lora_act_in, lora_up, bias, fp4, alpha, wcscales, act_unsigned,
                   out_dtype_id, *, out):
    _gemm_meta(act, wgt, ascales, wscales, lora_act_in, lora_up, bias, fp4, alpha, wcscales, act_unsigned,
               out_dtype_id, out=out)
    return out


def _fake_wgt(input):
    return tuple(_empty(_wgt_meta(input), input))


def _fake_wgt_out(input, *, output, oscales):
    _wgt_meta(input, (output, oscales))
    return output, oscales


for _name, _impl, _fake in (
    (_ACT, _act, _fake_act),
    (f"{_ACT}.out", _act_out, _fake_act_out),
    (_GEMM, _gemm, _fake_gemm),
    (f"{_GEMM}.out", _gemm_out, _fake_gemm_out),
    (_WGT, _wgt, _fake_wgt),
    (f"{_WGT}.out", _wgt_out, _fake_wgt_out),
):
    _proxy.attach(_LIB, _name, _impl, _fake, _FAKE_PRESENT)
del _name, _impl, _fake


# -- public wrappers ------------------------------------------------------------------------


def svdq_quantize_w4a4_act_fuse_lora(input: torch.Tensor, lora_down: torch.Tensor | None = None,
                                     smooth: torch.Tensor | None = None, fuse_glu: bool = False, fp4: bool = False,
                                     pad_size: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Smooths, quantizes to signed INT4 per 64-group and runs LoRA-down on the raw input, in one call.

    :param input: ``[M, K]`` float16/bfloat16, contiguous, K a multiple of 128.
    :param lora_down: packed ``proj_down`` ``[K, R]`` in the input's dtype (R a multiple of 16), or None (rank 0).
    :param smooth: packed ``smooth_factor`` ``[K]`` in the input's dtype, or None.
    :param pad_size: rows are padded to a multiple of it (pad rows quantize to 0).
    :returns: ``(act, ascales, lora_act)`` for :func:`svdq_gemm_w4a4`: ``[M_pad, K]`` float8_e4m3fn (the e4m3 codes of the INT4 values),
        ``[K/64, M_pad]`` in the input's dtype, ``[M_pad, R]`` float32 (the daemon's internal layouts).
    :raises ValueError: on a wrong shape, dtype or layout (naming the value); for ``fp4`` or ``fuse_glu``.
    """
    _proxy.require_served(_ACT)
    return torch.ops.cache_dit_cuda_ops.svdq_quantize_w4a4_act_fuse_lora(input, lora_down, smooth, fuse_glu, fp4,
                                                                         pad_size)


def svdq_gemm_w4a4(act: torch.Tensor, wgt: torch.Tensor, ascales: torch.Tensor, wscales: torch.Tensor,
                   lora_act_in: torch.Tensor | None = None, lora_up: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, fp4: bool = False, alpha: float | None = 1.0,
                   wcscales: torch.Tensor | None = None, act_unsigned: bool = False,
                   output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The W4A4 GEMM: per-group INT4 dot products (exact), scaled and summed in fp32, plus bias and LoRA-up.

    :param act, ascales, lora_act_in: from :func:`svdq_quantize_w4a4_act_fuse_lora`.
    :param wgt, wscales, lora_up, bias: a checkpoint's packed ``qweight`` ``[N, K/2]`` int8, ``wscales``
        ``[K/64, N]``, ``proj_up`` ``[N, R]`` and ``bias`` ``[N]`` (N a multiple of 128).
    :param output_dtype: float16, bfloat16 or float32; default the scales' dtype.
    :returns: ``[M_pad, N]``.
    :raises ValueError: on a wrong shape, dtype or layout (naming the value); for FP4 arguments.
    """
    _proxy.require_served(_GEMM)
    dtype = output_dtype or wscales.dtype
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"{_GEMM}: output_dtype must be one of {_OUT_DTYPES}, got {dtype}")
    return torch.ops.cache_dit_cuda_ops.svdq_gemm_w4a4(act, wgt, ascales, wscales, lora_act_in, lora_up, bias, fp4,
                                                       1.0 if alpha is None else alpha, wcscales, act_unsigned,
                                                       _OUT_DTYPES.index(dtype))


def svdq_quantize_w4a4_wgt(input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes a weight ``[N, K]`` (float16/bfloat16, N % 128 == 0, K % 128 == 0) to packed ``qweight``
    ``[N, K/2]`` int8 and ``wscales`` ``[K/64, N]`` (scale = amax/7 in the input's dtype, round half to even)."""
    _proxy.require_served(_WGT)
    return torch.ops.cache_dit_cuda_ops.svdq_quantize_w4a4_wgt(input)
