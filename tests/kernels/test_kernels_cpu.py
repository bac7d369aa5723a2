"""Kernel library on a machine without a GPU: loading, schemas, Meta kernels.

Everything here runs through the library's Meta kernels, which call the same
per-op check functions as the CUDA launchers.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from conftest import library_path

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


def _op_table() -> dict:
    """The one op table (kernels/ops.def), as its generated Python copy states it.

    Loaded by path: importing the cache_dit_opd package would define the namespace this process
    gets from the kernel library.
    """
    path = os.path.join(os.path.dirname(__file__), "..", "..", "python", "cache_dit_opd", "_schemas.py")
    spec = importlib.util.spec_from_file_location("_opd_schemas", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return {k: f"{mod.NAMESPACE}::{k}{v}" for family in mod.SCHEMAS.values() for k, v in family.items()}


SCHEMAS = _op_table()


def meta(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def overload(ops, qualified):
    name, _, ov = qualified.partition(".")
    return getattr(getattr(ops, name), ov or "default")


# ---- loading and registration ---------------------------------------------------


def test_library_loads_in_a_fresh_process_without_cuda(ops):
    # The library links cudart, never libcuda, so it loads where no driver is.
    code = (
        "import torch; torch.ops.load_library(%r); "
        "print(torch.cuda.is_available(), len(torch.ops.cache_dit_cuda_ops.fp8_comm_per_token_quant.overloads()))"
        % str(library_path())
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[1] == "2"


def test_library_does_not_link_libcuda():
    out = subprocess.run(["readelf", "-d", str(library_path())], capture_output=True, text=True).stdout
    needed = [l for l in out.splitlines() if "NEEDED" in l]
    assert needed, out
    assert not any("libcuda.so" in l for l in needed), needed


@pytest.mark.parametrize("qualified", sorted(SCHEMAS))
def test_schema_exact(ops, qualified):
    assert str(overload(ops, qualified)._schema) == SCHEMAS[qualified]


@pytest.mark.parametrize("qualified", sorted(SCHEMAS))
@pytest.mark.parametrize("key", ["CUDA", "Meta"])
def test_kernel_registered_per_key(ops, qualified, key):
    name = "cache_dit_cuda_ops::" + qualified
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, key)


def test_no_other_ops_in_namespace(ops):
    names = {str(s.name) + ("." + s.overload_name if s.overload_name else "")
             for s in torch._C._jit_get_all_schemas() if s.name.startswith("cache_dit_cuda_ops::")}
    assert names == {"cache_dit_cuda_ops::" + q for q in SCHEMAS}


# ---- shapes through Meta kernels -------------------------------------------------


@pytest.mark.parametrize("shape", [(1,), (7,), (2, 3, 128), (4, 5, 6, 127), (0, 64)])
def test_per_token_shapes(ops, shape):
    q = ops.fp8_comm_per_token_quant(meta(*shape))
    assert q.shape == (*shape[:-1], shape[-1] + 2) and q.dtype == FP8 and q.is_contiguous()
    y = ops.fp8_comm_per_token_dequant(q)
    assert y.shape == shape and y.dtype == BF16 and y.is_contiguous()


@pytest.mark.parametrize("shape", [(2, 4, 3, 5, 64), (1, 1152, 4, 6, 128), (2, 3, 1, 1, 1)])
def test_qkv_shapes(ops, shape):
    B, S, P, N, D = shape
    q = ops.fp8_comm_qkv_permute_quant(meta(*shape))
    assert q.shape == (P, S, B, N, D + 4) and q.dtype == FP8 and q.is_contiguous()
    y = ops.fp8_comm_qkv_permute_dequant(q.flatten(0, 1))
    assert y.shape == (B, P * S, N, D) and y.dtype == BF16 and y.is_contiguous()


def test_qkv_quant_accepts_strided_bsp(ops):
    x = meta(4, 2, 3, 5, 64).transpose(0, 1)  # B/S transposed
    assert ops.fp8_comm_qkv_permute_quant(x).shape == (3, 4, 2, 5, 68)
    x = meta(2, 4, 6, 5, 64)[:, :, ::2]  # strided P
    assert ops.fp8_comm_qkv_permute_quant(x).shape == (3, 4, 2, 5, 68)


@pytest.mark.parametrize("out_dtype", [torch.float16, BF16, torch.float32])
@pytest.mark.parametrize("lse_dtype", [torch.float32, BF16])
def test_merge_shapes_and_dtypes(ops, out_dtype, lse_dtype):
    B, S, H, D = 2, 9, 3, 80
    prev = meta(B, S, H, D, dtype=torch.float32)
    suff = meta(B, S, H, D, dtype=out_dtype)
    plse = meta(B, H, S, dtype=torch.float32).permute(0, 2, 1).unsqueeze(-1)  # flash-attn view
    slse = meta(B, S, H, 1, dtype=lse_dtype)
    out, lse = ops.fused_merge_attn_states(prev, plse, suff, slse)
    assert out.shape == (B, S, H, D) and out.dtype == out_dtype and out.is_contiguous()
    assert lse.shape == (B, S, H, 1) and lse.dtype == lse_dtype and lse.is_contiguous()


def test_out_overloads_return_their_outputs(ops):
    x = meta(3, 64)
    out = meta(3, 66, dtype=FP8)
    assert ops.fp8_comm_per_token_quant.out(x, out=out) is out
    p = meta(1, 2, 3, 8)
    l = meta(1, 2, 3, 1, dtype=torch.float32)
    o, ol = meta(1, 2, 3, 8), meta(1, 2, 3, 1, dtype=torch.float32)
    r = ops.fused_merge_attn_states.out(p, l, p, l, out=o, lse=ol)
    assert r[0] is o and r[1] is ol


# ---- rejections: ValueError naming the value --------------------------------------

BAD = [
    ("fp8_comm_per_token_quant", lambda: (meta(2, 8, dtype=torch.float16),), "must be torch.bfloat16, got torch.float16"),
    ("fp8_comm_per_token_quant", lambda: (meta(2, 0),), "D must be >= 1, got shape [2, 0]"),
    ("fp8_comm_per_token_quant", lambda: (meta(4, 8).t(),), "must be contiguous, got shape [8, 4] with strides [1, 8]"),
    ("fp8_comm_per_token_quant", lambda: (meta(()),), "at least 1 dims"),
    ("fp8_comm_per_token_dequant", lambda: (meta(2, 8),), "must be torch.float8_e4m3fn, got torch.bfloat16"),
    ("fp8_comm_per_token_dequant", lambda: (meta(2, 2, dtype=FP8),), "D + 2 with D >= 1, got shape [2, 2]"),
    ("fp8_comm_qkv_permute_quant", lambda: (meta(2, 4, 3, 64),), "must have 5 dims [B, S, P, N, D], got shape [2, 4, 3, 64]"),
    ("fp8_comm_qkv_permute_quant", lambda: (meta(2, 4, 3, 64, 5).transpose(3, 4),), "each [N, D] block of x must be contiguous"),
    ("fp8_comm_qkv_permute_quant", lambda: (meta(2, 4, 3, 5, 64, dtype=torch.float32),), "must be torch.bfloat16, got torch.float32"),
    ("fp8_comm_qkv_permute_dequant", lambda: (meta(4, 2, 5, 68),), "must be torch.float8_e4m3fn, got torch.bfloat16"),
    ("fp8_comm_qkv_permute_dequant", lambda: (meta(4, 2, 5, 4, dtype=FP8),), "D + 4 with D >= 1, got shape [4, 2, 5, 4]"),
    ("fp8_comm_qkv_permute_dequant", lambda: (meta(4, 2, 68, dtype=FP8),), "must have 4 dims [S, B, N, D + 4]"),
    ("fp8_comm_qkv_permute_dequant", lambda: (meta(2, 4, 5, 68, dtype=FP8).transpose(0, 1),), "quant_x must be contiguous"),
    ("fused_merge_attn_states", lambda: (meta(1, 2, 3, 8), meta(1, 2, 3, 1), meta(1, 2, 3, 9), meta(1, 2, 3, 1)),
     "prev_out and suff_out must have the same shape, got [1, 2, 3, 8] and [1, 2, 3, 9]"),
    ("fused_merge_attn_states", lambda: (meta(1, 2, 3, 8), meta(1, 2, 3), meta(1, 2, 3, 8), meta(1, 2, 3, 1)),
     "prev_lse must have 4 dims [B, S, H, 1], got shape [1, 2, 3]"),
    ("fused_merge_attn_states", lambda: (meta(1, 2, 3, 8), meta(1, 3, 2, 1), meta(1, 2, 3, 8), meta(1, 2, 3, 1)),
     "prev_lse must have shape [1, 2, 3, 1]"),
    ("fused_merge_attn_states", lambda: (meta(1, 2, 3, 8, dtype=torch.int32), meta(1, 2, 3, 1), meta(1, 2, 3, 8), meta(1, 2, 3, 1)),
     "prev_out must be one of {torch.float16, torch.bfloat16, torch.float32}, got torch.int32"),
    ("fused_merge_attn_states", lambda: (meta(1, 2, 8, 3).transpose(2, 3), meta(1, 2, 3, 1), meta(1, 2, 3, 8), meta(1, 2, 3, 1)),
     "prev_out must have a contiguous last dim (stride 1)"),
    ("fused_merge_attn_states", lambda: (meta(1, 2, 3, 0), meta(1, 2, 3, 1), meta(1, 2, 3, 0), meta(1, 2, 3, 1)),
     "head dim D must be >= 1"),
    ("fused_merge_attn_states", lambda: (meta(1, 2, 3, 8), meta(1, 2, 3, 1), torch.empty(1, 2, 3, 8, dtype=BF16), meta(1, 2, 3, 1)),
     "must be a CUDA tensor, got device cpu"),
]


@pytest.mark.parametrize("name,make_args,message", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_rejects_bad_input_with_value_error(ops, name, make_args, message):
    with pytest.raises(ValueError) as info:
        getattr(ops, name)(*make_args())
    assert message in str(info.value)
    assert str(info.value).startswith(name)


BAD_OUT = [
    ("fp8_comm_per_token_quant", (meta(2, 8),), {"out": meta(2, 9, dtype=FP8)}, "output out must have shape [2, 10], got [2, 9]"),
    ("fp8_comm_per_token_quant", (meta(2, 8),), {"out": meta(2, 10)}, "output out must be torch.float8_e4m3fn, got torch.bfloat16"),
    ("fp8_comm_per_token_quant", (meta(2, 8),), {"out": meta(10, 2, dtype=FP8).t()}, "must be contiguous and non-overlapping, got strides [1, 2]"),
    # A zero stride would let a dense write run past the view.
    ("fp8_comm_per_token_quant", (meta(2, 8),), {"out": meta(1, 10, dtype=FP8).expand(2, 10)}, "must be contiguous and non-overlapping, got strides [0, 1]"),
    ("fp8_comm_per_token_dequant", (meta(2, 10, dtype=FP8),), {"out": meta(2, 8, dtype=torch.float16)}, "output out must be torch.bfloat16, got torch.float16"),
    ("fp8_comm_qkv_permute_quant", (meta(2, 4, 3, 5, 64),), {"out": meta(2, 4, 3, 5, 68, dtype=FP8)}, "must have shape [3, 4, 2, 5, 68], got [2, 4, 3, 5, 68]"),
    ("fp8_comm_qkv_permute_dequant", (meta(4, 2, 5, 68, dtype=FP8),), {"out": meta(4, 2, 5, 64)}, "must have shape [2, 4, 5, 64], got [4, 2, 5, 64]"),
    ("fused_merge_attn_states", (meta(1, 2, 3, 8), meta(1, 2, 3, 1), meta(1, 2, 3, 8), meta(1, 2, 3, 1)),
     {"out": meta(1, 2, 3, 8, dtype=torch.float32), "lse": meta(1, 2, 3, 1)}, "output out must be torch.bfloat16, got torch.float32"),
    ("fused_merge_attn_states", (meta(1, 2, 3, 8), meta(1, 2, 3, 1), meta(1, 2, 3, 8), meta(1, 2, 3, 1)),
     {"out": meta(1, 2, 3, 8), "lse": meta(1, 2, 3, 2)}, "output lse must have shape [1, 2, 3, 1], got [1, 2, 3, 2]"),
]


@pytest.mark.parametrize("name,args,kwargs,message", BAD_OUT, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_OUT)])
def test_out_overload_rejects_bad_outputs(ops, name, args, kwargs, message):
    with pytest.raises(ValueError) as info:
        getattr(ops, name).out(*args, **kwargs)
    assert message in str(info.value)


# ---- opcheck on the Meta path ------------------------------------------------------


def _samples():
    g = torch.Generator().manual_seed(0)

    def rnd(*s, dtype=BF16):
        return torch.randn(*s, generator=g).to(dtype).to("meta")

    m = (rnd(2, 5, 3, 16), rnd(2, 5, 3, 1, dtype=torch.float32), rnd(2, 5, 3, 16), rnd(2, 5, 3, 1, dtype=torch.float32))
    return [
        ("fp8_comm_per_token_quant", (rnd(3, 4, 64),), {"out": rnd(3, 4, 66, dtype=FP8)}),
        ("fp8_comm_per_token_dequant", (rnd(3, 66, dtype=FP8),), {"out": rnd(3, 64)}),
        ("fp8_comm_qkv_permute_quant", (rnd(2, 3, 2, 4, 32),), {"out": rnd(2, 3, 2, 4, 36, dtype=FP8)}),
        ("fp8_comm_qkv_permute_dequant", (rnd(6, 2, 4, 36, dtype=FP8),), {"out": rnd(2, 6, 4, 32)}),
        ("fused_merge_attn_states", m, {"out": rnd(2, 5, 3, 16), "lse": rnd(2, 5, 3, 1, dtype=torch.float32)}),
    ]


@pytest.mark.parametrize("name,args,out_kwargs", _samples(), ids=[s[0] for s in _samples()])
def test_opcheck_meta(ops, name, args, out_kwargs):
    op = getattr(ops, name)
    torch.library.opcheck(op.default, args)
    torch.library.opcheck(op.out, args, out_kwargs)
