"""Modules whose forward runs through the daemon.

:class:`SVDQW4A4Linear` is a linear layer quantized with SVDQuant W4A4
(docs/DESIGN.md section 8), holding the packed tensors of nunchaku's and
cache-dit's checkpoints under their names, so a state dict of either loads
as it is. Its forward calls only the public wrappers of
:mod:`cache_dit_opd.kernels`, so it traces under ``torch.compile`` with the
ops' fakes (no daemon, no GPU) and runs through the daemon on a CUDA device.

Weights in the daemon's store (:mod:`cache_dit_opd.store`): one process
publishes a quantized model's layers (:func:`publish_quantized`, or the
daemon reads a checkpoint file with ``store.publish_file``), every worker
attaches them (:func:`attach_quantized`, :meth:`SVDQW4A4Linear.from_store`):
its layers then hold read-only tensors over the daemon's one copy.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from . import kernels
from ._svdquant import _BLOCK_N, _GROUP, _K_ALIGN, _RANK_ALIGN  # kernels/svdq/svdq.h's shape rules

__all__ = ["SVDQW4A4Linear", "attach_quantized", "load_quantized", "load_safetensors", "publish_quantized"]

_PAD_ROWS = 256  # rows of the activation quantizer's outputs: M padded to a multiple (its default)
# The tensors a layer holds (its state dict's keys).
_STATE_KEYS = ("qweight", "wscales", "smooth_factor", "smooth_factor_orig", "proj_down", "proj_up", "bias")
_FP4_KEYS = ("wcscales", "wtscale")


def _padded(n: int, align: int = _K_ALIGN) -> int:
    return (n + align - 1) // align * align


class SVDQW4A4Linear(nn.Module):
    """``y = x W^T + b`` with W as SVDQuant INT4 W4A4 (per-64-group scales, rank-R LoRA-style correction).

    :param in_features, out_features: the float layer's logical sizes; stored padded to multiples of 128
        (x is zero-padded on the way in, the extra outputs are cut off), as nunchaku and cache-dit do.
    :param rank: of ``proj_down`` / ``proj_up`` (a multiple of 16; 0: no low-rank part).
    :param torch_dtype: float16 or bfloat16: the scales, smoothing, bias, low-rank factors and the output.

    Parameters (packed layouts: ``kernels/svdq/svdq.h``): ``qweight [N_pad, K_pad/2]`` int8,
    ``wscales [K_pad/64, N_pad]``, ``smooth_factor`` and ``smooth_factor_orig [K_pad]``, ``proj_down
    [K_pad, R]``, ``proj_up [N_pad, R]``, ``bias [N_pad]`` (if ``bias``). Loading a state dict checks
    each tensor's dtype as well as its shape (a float ``qweight`` is refused, not converted).
    """

    def __init__(self, in_features: int, out_features: int, rank: int = 32, bias: bool = True,
                 torch_dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise ValueError(f"SVDQW4A4Linear: in_features and out_features must be >= 1, got {in_features}, "
                             f"{out_features}")
        if rank < 0 or rank % _RANK_ALIGN:
            raise ValueError(f"SVDQW4A4Linear: rank must be a non-negative multiple of {_RANK_ALIGN}, got {rank}")
        if torch_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"SVDQW4A4Linear: torch_dtype must be torch.float16 or torch.bfloat16, got {torch_dtype}")
        self.in_features, self.out_features, self.rank, self.torch_dtype = in_features, out_features, rank, torch_dtype
        k, n = _padded(in_features), _padded(out_features, _BLOCK_N)

        def param(*shape, dtype=torch_dtype):
            return nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)

        self.qweight = param(n, k // 2, dtype=torch.int8)
        self.wscales = param(k // _GROUP, n)
        self.smooth_factor = param(k)
        self.smooth_factor_orig = param(k)
        self.proj_down = param(k, rank)
        self.proj_up = param(n, rank)
        self.bias = param(n) if bias else None
        self._register_load_state_dict_pre_hook(self._check_loaded_dtypes)

    @classmethod
    def from_state_dict(cls, state_dict: dict, in_features: int | None = None, out_features: int | None = None,
                        prefix: str = "", device=None) -> "SVDQW4A4Linear":
        """A module with the geometry of a checkpoint's tensors (``prefix`` + name), loaded from them.

        The logical sizes default to the stored (padded) ones; rank, bias and dtype come from the tensors.
        """
        m = cls._shaped_like(state_dict, in_features, out_features, prefix, device)
        m.load_state_dict({name[len(prefix):]: t for name, t in state_dict.items() if name.startswith(prefix)})
        return m

    @classmethod
    def _shaped_like(cls, state_dict: dict, in_features, out_features, prefix: str, device) -> "SVDQW4A4Linear":
        """An unloaded module with the geometry of the tensors ``prefix`` + name of ``state_dict``."""
        def get(name):
            if prefix + name not in state_dict:
                raise KeyError(f"SVDQW4A4Linear: checkpoint has no '{prefix}{name}' (keys: "
                               f"{sorted(k for k in state_dict if k.startswith(prefix))[:12]})")
            return state_dict[prefix + name]

        qweight, wscales, proj_up = get("qweight"), get("wscales"), get("proj_up")
        if qweight.dim() != 2 or proj_up.dim() != 2:
            raise ValueError(f"SVDQW4A4Linear: '{prefix}qweight' and '{prefix}proj_up' must be 2-D, got "
                             f"{tuple(qweight.shape)} and {tuple(proj_up.shape)}")
        n, k = qweight.shape[0], qweight.shape[1] * 2
        m = cls(in_features or k, out_features or n, rank=proj_up.shape[1], bias=prefix + "bias" in state_dict,
                torch_dtype=wscales.dtype, device=device)
        k_pad, n_pad = _padded(m.in_features), _padded(m.out_features, _BLOCK_N)
        if (k_pad, n_pad) != (k, n):
            raise ValueError(f"SVDQW4A4Linear: in_features {m.in_features} / out_features {m.out_features} "
                             f"pad to {k_pad} / {n_pad}, but '{prefix}qweight' {tuple(qweight.shape)} holds "
                             f"{k} / {n}")
        return m

    @classmethod
    def from_store(cls, prefix: str, in_features: int | None = None, out_features: int | None = None, *,
                   device=None, session=None, tensors: dict | None = None) -> "SVDQW4A4Linear":
        """A module over the weight-store entries ``prefix`` + tensor name (as :func:`publish_quantized` or a
        checkpoint published with ``store.publish_file`` names them), attached read-only: no copy in this
        process. Geometry as :meth:`from_state_dict` takes it from the tensors. ``tensors``: attached tensors
        by name already (``store.attach_many``), else they are attached here."""
        from . import store

        if tensors is None:
            tensors = store.attach_many(prefix, device=device, session=session)
        mine = {name: t for name, t in tensors.items()
                if name.startswith(prefix) and name[len(prefix):] in _STATE_KEYS}
        if prefix + "qweight" not in mine:
            raise KeyError(f"SVDQW4A4Linear.from_store: the store holds no '{prefix}qweight' this process may read "
                           f"(entries under '{prefix}': {sorted(n for n in tensors if n.startswith(prefix))[:12]})")
        return cls._shaped_like(mine, in_features, out_features, prefix, "meta")._adopt(mine, prefix)

    def _adopt(self, tensors: dict, prefix: str) -> "SVDQW4A4Linear":
        """Makes this module's parameters the given tensors themselves (no copy: attached store memory)."""
        for name, p in list(self.named_parameters(recurse=False)):
            t = tensors.get(prefix + name)
            if t is None:
                raise KeyError(f"SVDQW4A4Linear: no '{prefix}{name}' to hold")
            if t.shape != p.shape or t.dtype != p.dtype:
                raise ValueError(f"SVDQW4A4Linear: '{prefix}{name}' is {t.dtype} {tuple(t.shape)}, the layer needs "
                                 f"{p.dtype} {tuple(p.shape)}")
            setattr(self, name, nn.Parameter(t, requires_grad=False))
        return self

    def _check_loaded_dtypes(self, state_dict, prefix, *args, **kwargs):
        for key in _FP4_KEYS:
            if prefix + key in state_dict:
                raise ValueError(f"SVDQW4A4Linear: '{prefix}{key}' is an NVFP4 checkpoint tensor; only INT4 "
                                 f"checkpoints are served")
        for name, p in self.named_parameters(recurse=False):
            t = state_dict.get(prefix + name)
            if t is not None and t.dtype != p.dtype:
                raise ValueError(f"SVDQW4A4Linear: '{prefix}{name}' must be {p.dtype}, got {t.dtype}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"SVDQW4A4Linear: input's last dim must be in_features={self.in_features}, got "
                             f"shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        rows = x.shape[0]
        k = self.qweight.shape[1] * 2
        if k != self.in_features:
            x = nn.functional.pad(x, (0, k - self.in_features))
        lora = self.rank > 0
        act, ascales, lora_act = kernels.svdq_quantize_w4a4_act_fuse_lora(
            x.contiguous(), self.proj_down if lora else None, self.smooth_factor, pad_size=_PAD_ROWS)
        y = kernels.svdq_gemm_w4a4(act, self.qweight, ascales, self.wscales, lora_act if lora else None,
                                   self.proj_up if lora else None, self.bias, output_dtype=self.torch_dtype)
        return y[:rows, :self.out_features].reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
                f"bias={self.bias is not None}, torch_dtype={self.torch_dtype}")


def load_quantized(model: nn.Module, state_dict: dict, prefix: str = "", device=None) -> list[str]:
    """Replaces each ``nn.Linear`` of ``model`` that ``state_dict`` holds quantized (a ``<prefix><name>.qweight``
    key) by an SVDQW4A4Linear of the linear's sizes loaded from those tensors; returns the names replaced.

    A checkpoint layer that is no ``nn.Linear`` of the model (a checkpoint of another model) is an error
    naming it, and so is a prefix under which the checkpoint holds no quantized layer.
    """
    names = sorted(k[len(prefix):-len(".qweight")] for k in state_dict
                   if k.startswith(prefix) and k.endswith(".qweight"))
    if not names:
        raise ValueError(f"load_quantized: the checkpoint holds no '<name>.qweight' under prefix '{prefix}' "
                         f"(its first keys: {sorted(state_dict)[:4]})")
    modules = dict(model.named_modules())
    missing = [n for n in names if not isinstance(modules.get(n), nn.Linear)]
    if missing:
        raise ValueError(f"load_quantized: checkpoint layers that are no nn.Linear of the model: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''} (prefix '{prefix}')")
    for name in names:
        lin = modules[name]
        q = SVDQW4A4Linear.from_state_dict(state_dict, lin.in_features, lin.out_features,
                                           prefix=f"{prefix}{name}.", device=device or lin.weight.device)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, q)
    return names


def publish_quantized(model: nn.Module, prefix: str, readers=(), *, session=None) -> list:
    """Publishes every SVDQW4A4Linear of ``model`` (its state dict) into the daemon's weight store as one set,
    each tensor named ``prefix + <module path>.<tensor name>``; the daemon copies them, so the model may be
    freed afterwards. ``readers``: uids besides this process's that may attach them. Returns the entries."""
    from . import store

    tensors = {f"{name}.{k}": t for name, m in model.named_modules() if isinstance(m, SVDQW4A4Linear)
               for k, t in m.state_dict().items()}
    if not tensors:
        raise ValueError(f"publish_quantized: {type(model).__name__} has no SVDQW4A4Linear")
    device = next(iter(tensors.values())).device
    return store.publish(tensors, prefix, readers, device=device, session=session)


def attach_quantized(model: nn.Module, prefix: str, *, device=None, session=None) -> list[str]:
    """Replaces each ``nn.Linear`` of ``model`` that the weight store holds quantized under ``prefix`` (a
    ``<prefix><name>.qweight`` entry) by an SVDQW4A4Linear over the stored tensors, attached read-only (no
    copy in this process); returns the names replaced. The mirror of :func:`load_quantized` for weights that
    live in the daemon: a store entry that is no ``nn.Linear`` of the model is an error naming it."""
    from . import store

    tensors = store.attach_many(prefix, device=device, session=session)
    names = sorted(n[len(prefix):-len(".qweight")] for n in tensors if n.endswith(".qweight"))
    if not names:
        raise KeyError(f"attach_quantized: the store holds no '{prefix}<name>.qweight' this process may read")
    modules = dict(model.named_modules())
    missing = [n for n in names if not isinstance(modules.get(n), (nn.Linear, SVDQW4A4Linear))]
    if missing:
        raise ValueError(f"attach_quantized: store layers that are no linear of the model: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''} (prefix '{prefix}')")
    for name in names:
        lin = modules[name]
        q = SVDQW4A4Linear.from_store(f"{prefix}{name}.", lin.in_features, lin.out_features, tensors=tensors)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, q)
    return names


def load_safetensors(path: str | os.PathLike, device="cpu") -> dict:
    """The tensors of a ``.safetensors`` file; ValueError naming the file when it is not a valid one
    (truncated, a header that lies about sizes), FileNotFoundError when it is missing."""
    try:
        from safetensors import SafetensorError
        from safetensors.torch import load_file
    except ImportError as e:
        raise ImportError("cache_dit_opd.nn.load_safetensors needs the safetensors package "
                          "(pip install safetensors)") from e
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_safetensors: no such file: {path}")
    try:
        return load_file(path, device=str(device))
    except SafetensorError as e:
        raise ValueError(f"load_safetensors: {path} is not a valid safetensors file: {e}") from e
