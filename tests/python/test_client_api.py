"""Public surface, import safety and the CUDA-only guards of the Python client."""

import inspect
import os
import re

import pytest
import torch

import _client_fixtures as fx

import cache_dit_opd
from cache_dit_opd import _attn, _comm, _svdquant, kernels

DOMAINS = (_attn, _comm, _svdquant)
OPS = (
    "fused_merge_attn_states",
    "fp8_comm_per_token_quant",
    "fp8_comm_per_token_dequant",
    "fp8_comm_qkv_permute_quant",
    "fp8_comm_qkv_permute_dequant",
)


def _public_names(mod):
    return {n for n in vars(mod) if not n.startswith("_")}


# -- import safety ---------------------------------------------------------------------------


def test_import_needs_no_cuda_no_daemon_no_grpc(tmp_path):
    # grpc and google.protobuf are made unimportable: the package must not need them to import.
    code = f"""
import sys
sys.modules["grpc"] = None
sys.modules["google.protobuf"] = None
import torch
import cache_dit_opd
from cache_dit_opd import kernels
assert not torch.cuda.is_available()
for op in {OPS!r}:
    packet = getattr(torch.ops.cache_dit_cuda_ops, op)
    assert set(packet.overloads()) == {{"default", "out"}}, packet.overloads()
assert cache_dit_opd._cuda_driver._driver is None, "libcuda must load lazily"
assert kernels.attn_extension_is_available() is False
assert kernels.comm_extension_is_available() is False
err = kernels.comm_get_load_error()
assert isinstance(err, RuntimeError), err
assert "cache-dit-opd --device" in str(err), err
x = torch.empty(2, 8, dtype=torch.bfloat16, device="meta")
assert kernels.fp8_comm_per_token_quant(x).shape == (2, 10)
print("ok")
"""
    r = fx.run_python(code, CUDA_VISIBLE_DEVICES="", CACHE_DIT_OPD_ADDRESS=f"unix:{tmp_path}/none.sock")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok" in r.stdout


def test_driver_load_failure_is_clear():
    from cache_dit_opd import _cuda_driver

    with pytest.raises(OSError):
        _cuda_driver.Driver("libcuda-does-not-exist.so.1")


# -- API surface -------------------------------------------------------------------------------


def test_kernels_all_equals_public_names():
    assert sorted(kernels.__all__) == sorted(_public_names(kernels))
    assert len(set(kernels.__all__)) == len(kernels.__all__)


def test_domain_all_lists_their_public_wrappers():
    for mod in DOMAINS:
        funcs = {n for n, v in vars(mod).items() if not n.startswith("_") and inspect.isfunction(v)
                 and v.__module__ == mod.__name__}
        assert sorted(mod.__all__) == sorted(funcs), mod.__name__


def test_public_api_is_reexported_from_domain_module():
    owners = {name: mod for mod in DOMAINS for name in mod.__all__}
    assert set(owners) == set(kernels.__all__)
    for name in kernels.__all__:
        assert getattr(kernels, name) is getattr(owners[name], name), name


@pytest.mark.parametrize("mod,family", [(_attn, "attn"), (_comm, "comm"), (_svdquant, "svdq")])
def test_every_domain_says_how_to_start_a_daemon_when_none_serves(mod, family, monkeypatch, tmp_path):
    monkeypatch.setenv("CACHE_DIT_OPD_ADDRESS", f"unix:{tmp_path}/none.sock")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert getattr(mod, f"{family}_extension_is_available")() is False
    err = getattr(mod, f"{family}_get_load_error")()
    assert isinstance(err, RuntimeError) and "cache-dit-opd --device" in str(err), err
    with pytest.raises(RuntimeError, match="cache-dit-opd --device"):
        getattr(mod, f"_get_required_{family}_session")()


def test_package_top_level_all():
    assert sorted(cache_dit_opd.__all__) == sorted(
        n for n in _public_names(cache_dit_opd) if n not in ("annotations",))
    assert re.fullmatch(r"\d+\.\d+\.\d+", cache_dit_opd.__version__)


def test_version_matches_pyproject():
    text = open(os.path.join(fx.PYTHON_DIR, "pyproject.toml")).read()
    assert f'version = "{cache_dit_opd.__version__}"' in text


def _meta_args(op):
    m = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    return {
        "fused_merge_attn_states": (m(1, 4, 2, 8), m(1, 4, 2, 1, dtype=torch.float32), m(1, 4, 2, 8),
                                    m(1, 4, 2, 1, dtype=torch.float32)),
        "fp8_comm_per_token_quant": (m(4, 8),),
        "fp8_comm_per_token_dequant": (m(4, 10, dtype=torch.float8_e4m3fn),),
        "fp8_comm_qkv_permute_quant": (m(1, 4, 2, 3, 8),),
        "fp8_comm_qkv_permute_dequant": (m(4, 1, 3, 12, dtype=torch.float8_e4m3fn),),
    }[op]


@pytest.mark.parametrize("op", OPS)
def test_wrapper_is_one_call_of_its_torch_op(op):
    # Traced, the public wrapper is exactly one call of torch.ops.cache_dit_cuda_ops.<op> (no bridge around it).
    from torch.fx.experimental.proxy_tensor import make_fx

    fn = getattr(kernels, op)
    graph = make_fx(fn)(*_meta_args(op)).graph
    ops = [n.target for n in graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]
    assert ops == [getattr(torch.ops.cache_dit_cuda_ops, op).default], ops
    assert fn.__doc__ and ":param" in fn.__doc__


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("overload", ["default", "out"])
def test_registration(op, overload):
    qual = f"cache_dit_cuda_ops::{op}" + (".out" if overload == "out" else "")
    opov = getattr(getattr(torch.ops.cache_dit_cuda_ops, op), overload)
    assert torch.Tag.cudagraph_unsafe in opov.tags
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CUDA")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "Meta")
    from torch._library.simple_registry import singleton

    fake = singleton.find(qual).fake_impl.kernel
    assert fake is not None
    func = fake.func
    if func.__name__ == "inner":  # torch wraps fakes in a one-time pystub check
        func = inspect.getclosurevars(func).nonlocals.get("func", func)
    expected = f"_fake_{op}" + ("_out" if overload == "out" else "")
    mod = _attn if "merge" in op else _comm
    assert func.__name__ == expected
    assert getattr(mod, expected) is func
    assert os.path.basename(mod.__file__) in fake.source, fake.source
    dump = torch._C._dispatch_dump(qual)
    assert os.path.basename(mod.__file__) in dump, dump  # definitions are attributed to the domain module


# -- one CUDA path, one namespace --------------------------------------------------------------


def test_import_defines_ops_in_one_namespace_and_loads_no_other_backend():
    code = """
import sys, torch
before = set(torch._C._dispatch_get_all_op_names())
import cache_dit_opd
added = set(torch._C._dispatch_get_all_op_names()) - before
print("NS", sorted({q.split("::")[0] for q in added}))
print("MODS", sorted(m for m in ("triton", "cutlass", "cuda.cute", "nvidia_cutlass_dsl") if m in sys.modules))
"""
    r = fx.run_python(code, CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "NS ['cache_dit_cuda_ops']" in r.stdout, r.stdout
    assert "MODS []" in r.stdout, r.stdout
