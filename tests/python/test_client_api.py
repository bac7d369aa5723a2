"""Public surface, import safety and the CUDA-only guards of the Python client."""

import ast
import inspect
import os
import re

import pytest
import torch

import _client_fixtures as fx

import cache_dit_opd
from cache_dit_opd import _attn, _comm, kernels

DOMAINS = (_attn, _comm)
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


def test_every_domain_has_its_accessors():
    for mod, family in ((_attn, "attn"), (_comm, "comm")):
        assert callable(getattr(mod, f"{family}_extension_is_available"))
        assert callable(getattr(mod, f"{family}_get_load_error"))
        assert callable(getattr(mod, f"_get_required_{family}_session"))


def test_package_top_level_all():
    assert sorted(cache_dit_opd.__all__) == sorted(
        n for n in _public_names(cache_dit_opd) if n not in ("annotations",))
    assert re.fullmatch(r"\d+\.\d+\.\d+", cache_dit_opd.__version__)


def test_version_matches_pyproject():
    text = open(os.path.join(fx.PYTHON_DIR, "pyproject.toml")).read()
    assert f'version = "{cache_dit_opd.__version__}"' in text


@pytest.mark.parametrize("op", OPS)
def test_wrapper_calls_torch_ops(op):
    fn = getattr(kernels, op)
    src = inspect.getsource(fn)
    assert f"torch.ops.cache_dit_cuda_ops.{op}(" in src
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


def test_domain_modules_hold_no_mutable_policy_state():
    # Module-level state is limited to the Library handle and static tables (seed conventions).
    for mod in DOMAINS:
        tree = ast.parse(inspect.getsource(mod))
        assigned = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                    if isinstance(t, ast.Name)}
        assert assigned <= {"__all__", "_FAMILY", "_SCHEMAS", "_OUT_DTYPES", "_LSE_DTYPES", "_LIB", "_FAKE_PRESENT",
                            "_FP8", "_PER_TOKEN_SCALE_BYTES", "_QKV_SCALE_BYTES"}, assigned


# -- regression guards: one CUDA path ---------------------------------------------------------


def _package_files():
    for root, _, files in os.walk(fx.PACKAGE_DIR):
        for f in files:
            if f.endswith(".py"):
                yield os.path.join(root, f)


def test_no_ops_py_registry_or_backend_modules():
    names = {os.path.relpath(p, fx.PACKAGE_DIR) for p in _package_files()}
    for bad in ("ops.py", "backend.py", "_ops_registery.py", "_ops_registry.py", "registry.py", "_registry.py"):
        assert bad not in names, bad
    assert not any("regist" in n for n in names), names
    for sub in ("triton", "cutedsl", "cute", "cuda", "backends"):
        assert not os.path.isdir(os.path.join(fx.PACKAGE_DIR, sub)), sub


def test_no_triton_cutedsl_or_backend_selector_code():
    pattern = re.compile(
        r"^\s*(import|from)\s+(triton|cutlass|cuda\.cute|nvidia_cutlass_dsl)\b"
        r"|KernelBackend|_resolve_backend|_select_\w*backend|_KERNEL_BE_SELECTOR_MAP|cache_dit_triton_ops"
        r"|cache_dit_cutedsl_ops", re.M)
    for p in _package_files():
        hits = pattern.findall(open(p).read())
        assert not hits, (p, hits)


def test_only_one_namespace():
    for p in _package_files():
        for ns in re.findall(r'Library\(\s*"?(\w+)', open(p).read()):
            assert ns in ("_proxy", "NAMESPACE"), (p, ns)
    from cache_dit_opd import _proxy

    assert _proxy.NAMESPACE == "cache_dit_cuda_ops"


def test_example_calls_every_op_and_says_how_to_start_the_daemon():
    path = os.path.join(fx.REPO, "examples", "quickstart.py")
    src = open(path).read()
    compile(src, path, "exec")
    doc = ast.get_docstring(ast.parse(src))
    assert "cache-dit-opd --device 0" in doc and "pip install ./python" in doc
    for op in OPS:
        assert f"{op}(" in src, op
