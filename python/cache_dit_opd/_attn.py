"""Attention-state merge, served by the cache-dit-opd daemon.

``cache_dit_cuda_ops::fused_merge_attn_states`` combines two partial attention
results over disjoint key sets (e.g. a cached prefix and a fresh suffix) from
their outputs and log-sum-exps. Semantics: docs/DESIGN.md section 3 ("attn").

Layout of this module (same order in every domain module): daemon-connection
accessors, validation, torch.library definitions, the CUDA impl that forwards
to the daemon, fakes, public wrappers.
"""

from __future__ import annotations

import torch

from . import _checks, _proxy, _schemas, _session

__all__ = [
    "attn_extension_is_available",
    "attn_get_load_error",
    "fused_merge_attn_states",
]

_FAMILY = "attn"
_SCHEMAS = _schemas.SCHEMAS[_FAMILY]  # generated from kernels/ops.def
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # outputs and LSEs alike


# -- daemon connection -------------------------------------------------------------------


def attn_extension_is_available(device=None) -> bool:
    """True when a daemon serving the attn ops is reachable for ``device`` (default: current CUDA device)."""
    return attn_get_load_error(device) is None


def attn_get_load_error(device=None) -> Exception | None:
    """Why the attn ops are unavailable for ``device``, or None. Opens the session if needed."""
    return _session.load_error(_FAMILY, _SCHEMAS, device)


def _get_required_attn_session(device=None) -> "_session.Session":
    """The session serving the attn ops; RuntimeError naming the command that starts a daemon otherwise."""
    return _session.require(_FAMILY, _SCHEMAS, device)


# -- validation (shared by the proxy impls and the fakes) ----------------------------------


def _check_merge_inputs(prev_out, prev_lse, suff_out, suff_lse, out=None, lse=None) -> None:
    """check_merge_attn_states (kernels/attn/merge_attn_states.cpp), outputs included when given."""
    op = "fused_merge_attn_states"
    _checks.check_dims(op, "prev_out", prev_out, 4, "[B, S, H, D]")
    _checks.check_dims(op, "suff_out", suff_out, 4, "[B, S, H, D]")
    _checks.check_dims(op, "prev_lse", prev_lse, 4, "[B, S, H, 1]")
    _checks.check_dims(op, "suff_lse", suff_lse, 4, "[B, S, H, 1]")
    for name, t in (("prev_out", prev_out), ("suff_out", suff_out), ("prev_lse", prev_lse), ("suff_lse", suff_lse)):
        _checks.check_dtype_in(op, name, t, _OUT_DTYPES)
    _checks.check_same_device(op, suff_out, "suff_out",
                              (("prev_out", prev_out), ("prev_lse", prev_lse), ("suff_lse", suff_lse)))
    if tuple(prev_out.shape) != tuple(suff_out.shape):
        raise ValueError(f"{op}: prev_out and suff_out must have the same shape, got "
                         f"{_checks.shape_str(prev_out.shape)} and {_checks.shape_str(suff_out.shape)}")
    if suff_out.shape[3] < 1:
        raise ValueError(f"{op}: head dim D must be >= 1, got shape {_checks.shape_str(suff_out.shape)}")
    lse_shape = (*suff_out.shape[:3], 1)
    for name, t in (("prev_lse", prev_lse), ("suff_lse", suff_lse)):
        if tuple(t.shape) != lse_shape:
            raise ValueError(f"{op}: {name} must have shape {_checks.shape_str(lse_shape)} ([B, S, H, 1] of the "
                             f"outputs of shape {_checks.shape_str(suff_out.shape)}), got {_checks.shape_str(t.shape)}")
    for name, t in (("prev_out", prev_out), ("suff_out", suff_out)):
        if t.shape[3] != 1 and t.stride(3) != 1:
            raise ValueError(f"{op}: {name} must have a contiguous last dim (stride 1), got strides "
                             f"{_checks.shape_str(t.stride())}")
    if out is not None:
        _checks.check_output(op, "out", out, suff_out.shape, suff_out.dtype, suff_out)
    if lse is not None:
        _checks.check_output(op, "lse", lse, lse_shape, suff_lse.dtype, suff_out)


# -- definitions -------------------------------------------------------------------------

_LIB = torch.library.Library(_proxy.NAMESPACE, "FRAGMENT")
_FAKE_PRESENT = _proxy.define_or_adopt(_LIB, _SCHEMAS, tags=_proxy.PROXY_TAGS)


def _call_fused_merge_attn_states(device_index, prev_out, prev_lse, suff_out, suff_lse, out, lse) -> None:
    # Thin bridge: the daemon's .out overload takes every argument in schema order.
    _session.run(_get_required_attn_session, device_index, "fused_merge_attn_states",
                 [prev_out, prev_lse, suff_out, suff_lse, out, lse],
                 _proxy.redispatch("fused_merge_attn_states", (prev_out, prev_lse, suff_out, suff_lse),
                                   {"out": out, "lse": lse}))


def _fused_merge_attn_states(prev_out, prev_lse, suff_out, suff_lse):
    _check_merge_inputs(prev_out, prev_lse, suff_out, suff_lse)
    idx = _proxy.device_index("fused_merge_attn_states", prev_out, prev_lse, suff_out, suff_lse)
    _proxy.check_not_capturing("fused_merge_attn_states", idx)
    _get_required_attn_session(idx)
    out = torch.empty(suff_out.shape, dtype=suff_out.dtype, device=suff_out.device)
    lse = torch.empty(suff_lse.shape, dtype=suff_lse.dtype, device=suff_lse.device)
    if out.numel():
        torch.ops.cache_dit_cuda_ops.fused_merge_attn_states.out(prev_out, prev_lse, suff_out, suff_lse, out=out,
                                                                lse=lse)
    return out, lse


def _fused_merge_attn_states_out(prev_out, prev_lse, suff_out, suff_lse, *, out, lse):
    op = "fused_merge_attn_states.out"
    _check_merge_inputs(prev_out, prev_lse, suff_out, suff_lse, out, lse)
    idx = _proxy.device_index(op, prev_out, prev_lse, suff_out, suff_lse, out, lse)
    _proxy.check_not_capturing(op, idx)
    if out.numel():
        _call_fused_merge_attn_states(idx, prev_out, prev_lse, suff_out, suff_lse, out, lse)
    return out, lse


def _fake_fused_merge_attn_states(prev_out, prev_lse, suff_out, suff_lse):
    _check_merge_inputs(prev_out, prev_lse, suff_out, suff_lse)
    out = torch.empty(suff_out.shape, dtype=suff_out.dtype, device=suff_out.device)
    lse = torch.empty(suff_lse.shape, dtype=suff_lse.dtype, device=suff_lse.device)
    return out, lse


def _fake_fused_merge_attn_states_out(prev_out, prev_lse, suff_out, suff_lse, *, out, lse):
    _check_merge_inputs(prev_out, prev_lse, suff_out, suff_lse, out, lse)
    return out, lse


_proxy.attach(_LIB, "fused_merge_attn_states", _fused_merge_attn_states, _fake_fused_merge_attn_states,
              _FAKE_PRESENT)
_proxy.attach(_LIB, "fused_merge_attn_states.out", _fused_merge_attn_states_out,
              _fake_fused_merge_attn_states_out, _FAKE_PRESENT)


# -- public wrappers ------------------------------------------------------------------------


def fused_merge_attn_states(
    prev_out: torch.Tensor,
    prev_lse: torch.Tensor,
    suff_out: torch.Tensor,
    suff_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges two partial attention results over disjoint key sets.

    :param prev_out: ``[B, S, H, D]`` float16/bfloat16/float32, last dim contiguous.
    :param prev_lse: ``[B, S, H, 1]`` log-sum-exp of ``prev_out`` (float16/bfloat16/float32, any strides;
        a permuted flash-attn ``[B, H, S]`` LSE is read in place).
    :param suff_out: ``[B, S, H, D]``, same shape as ``prev_out``.
    :param suff_lse: ``[B, S, H, 1]`` log-sum-exp of ``suff_out``.
    :returns: ``(out, lse)``, contiguous: ``out`` in ``suff_out``'s dtype, ``lse`` in ``suff_lse``'s.
        An LSE of +inf counts as empty; a row empty on both sides yields ``prev_out`` and ``-inf``.
    :raises ValueError: on a wrong rank, shape, dtype or stride (naming the value).
    :raises RuntimeError: when no daemon serves the tensors' device (with the command that starts one).
    """
    return torch.ops.cache_dit_cuda_ops.fused_merge_attn_states(prev_out, prev_lse, suff_out, suff_lse)
