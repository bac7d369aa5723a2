"""Coexistence with other owners of cache_dit_cuda_ops (docs/DESIGN.md section 6).

Each case runs in a fresh interpreter: a namespace's registrations cannot be
undone within one process. "Upstream" is a stand-in package named cache_dit
that registers ops the way upstream cache-dit does (a DEF library, as its
TORCH_LIBRARY block is).
"""

import os
import textwrap

import pytest

import _client_fixtures as fx

MERGE = "(Tensor prev_out, Tensor prev_lse, Tensor suff_out, Tensor suff_lse) -> (Tensor out, Tensor lse)"
QUANT = "(Tensor x) -> Tensor"


def _upstream(tmp_path, body: str) -> str:
    pkg = tmp_path / "cache_dit"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import kernels\n")
    (pkg / "kernels.py").write_text(textwrap.dedent("""
        import torch
        _lib = torch.library.Library("cache_dit_cuda_ops", "DEF")
        _lib.define("svdq_set_log_level_op(Tensor x) -> Tensor")
    """) + textwrap.dedent(body))
    return str(tmp_path)


def _run(tmp_path, code: str):
    return fx.run_python(textwrap.dedent(code), PYTHONPATH=tmp_path, CUDA_VISIBLE_DEVICES="")


def test_identical_definition_without_kernel_is_adopted(tmp_path):
    path = _upstream(tmp_path, f"""
        _lib.define("fused_merge_attn_states{MERGE}")
        _lib.define("fp8_comm_per_token_quant{QUANT}")
    """)
    r = _run(path, """
        import torch, cache_dit, cache_dit_opd
        q = "cache_dit_cuda_ops::fp8_comm_per_token_quant"
        dump = torch._C._dispatch_dump(q)
        assert "cache_dit/kernels.py" in dump.split("CUDA:")[0], dump      # the schema stays upstream's
        ours = "functional_kernel.cpp" if cache_dit_opd._native.library() is not None else "_comm.py"
        assert ours in dump.split("CUDA:")[1].splitlines()[0], dump  # the CUDA impl is ours
        x = torch.empty(3, 8, dtype=torch.bfloat16, device="meta")
        assert cache_dit_opd.kernels.fp8_comm_per_token_quant(x).shape == (3, 10)   # our fake
        assert torch.ops.cache_dit_cuda_ops.svdq_set_log_level_op.default is not None
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_identical_definition_with_upstream_fake_keeps_it(tmp_path):
    path = _upstream(tmp_path, f"""
        _lib.define("fp8_comm_per_token_quant{QUANT}")
        @torch.library.register_fake("cache_dit_cuda_ops::fp8_comm_per_token_quant", lib=_lib)
        def upstream_fake(x):
            return x.new_empty((*x.shape[:-1], x.shape[-1] + 2), dtype=torch.float8_e4m3fn)
    """)
    r = _run(path, """
        import torch, cache_dit, cache_dit_opd
        from torch._library.simple_registry import singleton
        k = singleton.find("cache_dit_cuda_ops::fp8_comm_per_token_quant").fake_impl.kernel
        assert "cache_dit/kernels.py" in k.source, k.source
        assert torch._C._dispatch_has_kernel_for_dispatch_key("cache_dit_cuda_ops::fp8_comm_per_token_quant", "CUDA")
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_different_schema_fails_naming_op_and_owner(tmp_path):
    path = _upstream(tmp_path, """
        _lib.define("fp8_comm_per_token_quant(Tensor x, int group_size) -> Tensor")
    """)
    r = _run(path, """
        import cache_dit
        try:
            import cache_dit_opd
        except RuntimeError as e:
            print("ERR", type(e).__name__, e)
    """)
    assert "ERR NamespaceConflictError" in r.stdout, r.stdout + r.stderr
    assert "cache_dit_cuda_ops::fp8_comm_per_token_quant" in r.stdout
    assert "int group_size" in r.stdout and "cache_dit/kernels.py" in r.stdout
    assert "imported modules: cache_dit" in r.stdout


def test_identical_schema_with_cuda_kernel_fails(tmp_path):
    path = _upstream(tmp_path, f"""
        _lib.define("fused_merge_attn_states{MERGE}")
        @torch.library.impl("cache_dit_cuda_ops::fused_merge_attn_states", "CUDA", lib=_lib)
        def upstream_cuda(a, b, c, d):
            return c, d
    """)
    r = _run(path, """
        import cache_dit
        try:
            import cache_dit_opd
        except RuntimeError as e:
            print("ERR", type(e).__name__, e)
    """)
    assert "ERR NamespaceConflictError" in r.stdout, r.stdout + r.stderr
    assert "cache_dit_cuda_ops::fused_merge_attn_states already has a CUDA kernel" in r.stdout
    assert "cache_dit/kernels.py" in r.stdout


def test_unrelated_ops_before_and_after(tmp_path):
    # upstream's svdq ops (DEF) before us, and a second DEF-style owner of other names after us
    path = _upstream(tmp_path, "")
    r = _run(path, """
        import torch, cache_dit, cache_dit_opd
        lib = torch.library.Library("cache_dit_cuda_ops", "FRAGMENT")
        lib.define("svdq_gemm_w4a4_stub(Tensor x) -> Tensor")
        assert torch.ops.cache_dit_cuda_ops.svdq_gemm_w4a4_stub.default is not None
        assert torch.ops.cache_dit_cuda_ops.fused_merge_attn_states.out is not None
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_client_first_then_upstream_svdq_library(tmp_path):
    path = _upstream(tmp_path, "")
    r = _run(path, """
        import torch, cache_dit_opd, cache_dit   # upstream's TORCH_LIBRARY-like DEF block loads second
        assert torch.ops.cache_dit_cuda_ops.svdq_set_log_level_op.default is not None
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_kernel_library_in_process_is_refused():
    lib = fx.kernel_library_path()
    if not os.path.exists(lib):
        pytest.skip(f"kernel library not built ({lib}); set CACHE_DIT_OPD_BUILD_DIR")
    r = fx.run_python(f"""
import torch
torch.ops.load_library({lib!r})
try:
    import cache_dit_opd
except RuntimeError as e:
    print("ERR", type(e).__name__, e)
""")
    assert "ERR NamespaceConflictError" in r.stdout, r.stdout + r.stderr
    assert "libcache_dit_cuda_ops" in r.stdout or "kernels/" in r.stdout
