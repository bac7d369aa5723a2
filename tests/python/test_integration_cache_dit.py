"""cache_dit_opd beside the real PyPI cache-dit (pinned by deploy/install.sh), and its one-line integration.

Each case runs in a fresh interpreter: registrations cannot be undone within
one process, and the order of imports is what is tested. No GPU: calls go to
meta tensors, so they reach the fakes (this package's or cache-dit's), and a
dispatch recorder tells which op ran. cache-dit's backend selector asks
torch.cuda.is_available() before each svdq call; where a case calls cache-dit's
svdq wrappers it answers "CUDA" for that selector only.
"""

import textwrap

import pytest

import _client_fixtures as fx

PRELUDE = textwrap.dedent("""
    import sys, torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Dispatched(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.name())
            return func(*args, **(kwargs or {}))

    def ran(fn, *args, **kwargs):
        '''The cache_dit ops that fn dispatches, and its result.'''
        with Dispatched() as d:
            out = fn(*args, **kwargs)
        return [o for o in d.ops if o.startswith("cache_dit")], out

    def gpu_for_cache_dit_selector():
        from cache_dit.kernels.backend import KernelBackend
        orig = KernelBackend.is_supported
        KernelBackend.is_supported = classmethod(lambda cls, b: b is KernelBackend.CUDA or orig(b))

    def op_calls():
        # Calls the daemon ran, by op name (every overload and transport).
        import cache_dit_opd
        calls = {}
        for o in cache_dit_opd.daemon_stats()["ops"]:
            calls[o["name"]] = calls.get(o["name"], 0) + o["calls"]
        return calls

    META = dict(dtype=torch.bfloat16, device="meta")
    def act_layout(*args):
        out, ascales, lora_act = torch.ops.cache_dit_cuda_ops.svdq_quantize_w4a4_act_fuse_lora(*args)
        return (tuple(out.shape), out.dtype)
""")


def run(code: str):
    r = fx.run_python(PRELUDE + textwrap.dedent(code), timeout=240, CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
    return r


# cache-dit's own act layout (uint8 nibbles [M_pad, K/2]) and this project's (e4m3 codes [M_pad, K]).
CACHE_DIT_ACT = "((256, 128), torch.uint8)"
OPD_ACT = "((256, 256), torch.float8_e4m3fn)"


@pytest.mark.parametrize("first", ["cache_dit_opd", "cache-dit's registry"])
def test_importing_cache_dit_opd_never_changes_cache_dit(first):
    """Either import order: cache-dit's registry imports, its svdq ops are its own (kernel and fake), its FP8
    and merge ops dispatch to its Triton backend; this client keeps its .out overloads and its wrappers name
    the way to serve cache-dit's op."""
    run(f"""
        if {first == "cache_dit_opd"}:
            import cache_dit_opd
            import cache_dit.kernels.cuda
        else:
            import cache_dit.kernels.cuda
            import cache_dit_opd
        import cache_dit.kernels as ck
        from cache_dit_opd import _proxy
        assert ck.svdq_extension_is_available() is False
        x = torch.empty(256, 256, **META)
        assert str(act_layout(x, None, None, False, False, 256)) == "{CACHE_DIT_ACT}"
        q = "cache_dit_cuda_ops::svdq_gemm_w4a4"
        assert "cache_dit/kernels/cuda/_ops_registery.py" in _proxy.owner_of(q), _proxy.owner_of(q)
        assert "cache_dit_opd" not in torch._C._dispatch_dump(q), torch._C._dispatch_dump(q)
        # The .out overloads stay this client's, with its fakes.
        out = torch.empty(256, 256, dtype=torch.float8_e4m3fn, device="meta")
        sc = torch.empty(4, 256, **META)
        la = torch.empty(256, 0, dtype=torch.float32, device="meta")
        torch.ops.cache_dit_cuda_ops.svdq_quantize_w4a4_act_fuse_lora.out(
            x, None, None, False, False, 256, output=out, oscales=sc, lora_act_out=la)
        try:
            cache_dit_opd.kernels.svdq_quantize_w4a4_wgt(x)
            raise SystemExit("cache-dit's op ran through this client's wrapper")
        except RuntimeError as e:
            assert "cache_dit_opd.integrations.cache_dit.enable()" in str(e) and "svdq_quantize_w4a4_wgt" in str(e), e
        ops, _ = ran(ck.fp8_comm_per_token_quant, torch.empty(2, 3, 4, 128, **META))
        assert ops == ["cache_dit_triton_ops::fp8_comm_per_token_quant"], ops
        # The ops this client serves alone are untouched.
        assert cache_dit_opd.kernels.fp8_comm_per_token_quant(torch.empty(3, 8, **META)).shape == (3, 10)
        print("ok")
    """)


def test_the_table_of_cache_dits_cuda_ops_matches_the_package():
    run("""
        import cache_dit.kernels.cuda
        theirs = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("cache_dit_cuda_ops::")}
        from cache_dit_opd import _proxy
        assert theirs == set(_proxy.CACHE_DIT_OPS), sorted(theirs ^ set(_proxy.CACHE_DIT_OPS))
        print("ok")
    """)


def test_enable_serves_cache_dits_ops_and_disable_gives_them_back():
    run(f"""
        import cache_dit_opd
        import cache_dit_opd.integrations.cache_dit as integ
        import cache_dit.kernels as ck
        gpu_for_cache_dit_selector()
        assert not integ.enabled() and integ.status() == {{}}
        x4 = torch.empty(2, 3, 4, 128, **META)
        calls = [
            (ck.fp8_comm_per_token_quant, (x4,)),
            (ck.fp8_comm_per_token_dequant, (torch.empty(2, 3, 4, 130, dtype=torch.float8_e4m3fn, device="meta"),)),
            (ck.fp8_comm_qkv_permute_quant, (torch.empty(2, 5, 3, 4, 64, **META),)),
            (ck.fp8_comm_qkv_permute_dequant, (torch.empty(5, 2, 4, 68, dtype=torch.float8_e4m3fn,
                                                           device="meta"),)),
            (ck.fused_merge_attn_states, (x4, torch.empty(2, 3, 4, 1, dtype=torch.float32, device="meta"),
                                          x4, torch.empty(2, 3, 4, 1, dtype=torch.float32, device="meta"))),
        ]
        before = [ran(f, *a)[0] for f, a in calls]
        assert all(o[0].startswith("cache_dit_triton_ops::") for o in before), before

        st = integ.enable()
        assert integ.enable() == st and integ.enabled()  # idempotent
        assert set(st.values()) == {{"daemon"}} and len(st) == 8, st
        for (f, a), b in zip(calls, before):
            ops, _ = ran(f, *a)
            assert ops == [b[0].replace("cache_dit_triton_ops", "cache_dit_cuda_ops")], (ops, b)
        assert ck.svdq_extension_is_available() is True and ck.svdq_get_load_error() is None
        # cache-dit's svdq wrappers reach its cuda ops, now with this client's kernel and fake.
        x = torch.empty(256, 256, **META)
        ops, (act, ascales, lora_act) = ran(ck.svdq_quantize_w4a4_act_fuse_lora, x, None, None, False, False, 256)
        assert ops == ["cache_dit_cuda_ops::svdq_quantize_w4a4_act_fuse_lora"], ops
        assert str((tuple(act.shape), act.dtype)) == "{OPD_ACT}"
        wgt = torch.empty(128, 128, dtype=torch.int8, device="meta")
        ops, y = ran(ck.svdq_gemm_w4a4, act, wgt, ascales, torch.empty(4, 128, **META), None, None, None, False,
                     1.0, None, False)
        assert ops == ["cache_dit_cuda_ops::svdq_gemm_w4a4"] and y.shape == (256, 128) and y.dtype == torch.bfloat16
        assert "cache_dit_opd" in torch._C._dispatch_dump("cache_dit_cuda_ops::svdq_gemm_w4a4")
        # This client's own wrapper now serves cache-dit's op too.
        q, s = cache_dit_opd.kernels.svdq_quantize_w4a4_wgt(torch.empty(128, 256, **META))
        assert q.shape == (128, 128) and s.shape == (4, 128)

        assert integ.disable() == {{}} and integ.disable() == {{}} and not integ.enabled()
        assert [ran(f, *a)[0] for f, a in calls] == before
        assert ck.svdq_extension_is_available() is False
        assert str(act_layout(x, None, None, False, False, 256)) == "{CACHE_DIT_ACT}"
        assert "cache_dit_opd" not in torch._C._dispatch_dump("cache_dit_cuda_ops::svdq_gemm_w4a4")
        try:
            cache_dit_opd.kernels.svdq_quantize_w4a4_wgt(x)
            raise SystemExit("served after disable()")
        except RuntimeError as e:
            assert "enable()" in str(e)
        assert integ.enable() == st  # and again
        print("ok")
    """)


def test_cache_dits_modules_compile_through_the_fakes_when_enabled():
    """cache-dit's own SVDQW4A4Linear (padding 300 -> 384 in, 200 -> 256 out) and FP8 wrapper under
    torch.compile(fullgraph=True): the graph holds this client's ops, shapes come from its fakes."""
    run("""
        import cache_dit_opd
        import cache_dit_opd.integrations.cache_dit as integ
        integ.enable()
        gpu_for_cache_dit_selector()
        import cache_dit.kernels as ck
        from cache_dit.quantization.svdquant.linear import SVDQW4A4Linear
        graphs = []
        def backend(gm, inputs):
            graphs.append(gm)
            return gm.forward
        m = SVDQW4A4Linear(300, 200, rank=32, bias=True, torch_dtype=torch.bfloat16, device="meta")
        y = torch.compile(m, backend=backend, fullgraph=True)(torch.empty(3, 5, 300, **META))
        assert y.shape == (3, 5, 200) and y.dtype == torch.bfloat16, (y.shape, y.dtype)
        f = torch.compile(lambda x: ck.fp8_comm_per_token_dequant(ck.fp8_comm_per_token_quant(x)), backend=backend,
                          fullgraph=True)
        assert f(torch.empty(6, 128, **META)).shape == (6, 128)
        targets = sorted({str(n.target) for g in graphs for n in g.graph.nodes
                          if n.op == "call_function" and "cache_dit" in str(n.target)})
        assert targets == ["cache_dit_cuda_ops.fp8_comm_per_token_dequant", "cache_dit_cuda_ops.fp8_comm_per_token_quant",
                           "cache_dit_cuda_ops.svdq_gemm_w4a4",
                           "cache_dit_cuda_ops.svdq_quantize_w4a4_act_fuse_lora"], targets
        print("ok")
    """)


def test_enable_refuses_another_cache_dit_version_and_changes_nothing():
    run("""
        import cache_dit, cache_dit_opd
        import cache_dit_opd.integrations.cache_dit as integ
        import cache_dit.kernels as ck
        cache_dit.__version__ = "1.5.4"
        try:
            integ.enable()
            raise SystemExit("enabled for 1.5.4")
        except integ.IntegrationError as e:
            msg = str(e)
        assert "1.5.4" in msg and "tested against 1.5.3" in msg and "svdq_gemm_w4a4" in msg, msg
        assert not integ.enabled()
        ops, _ = ran(ck.fp8_comm_per_token_quant, torch.empty(2, 128, **META))
        assert ops == ["cache_dit_triton_ops::fp8_comm_per_token_quant"], ops
        print("ok")
    """)


def test_enable_refuses_a_schema_that_differs_naming_both():
    """The comparison is symmetric; the differing side here is this client's table (a cache-dit with another
    schema is another version, refused before)."""
    run("""
        import cache_dit_opd
        import cache_dit_opd.integrations.cache_dit as integ
        import cache_dit.kernels as ck
        integ._SCHEMA["fp8_comm_per_token_dequant"] = "(Tensor x, int group) -> Tensor"
        try:
            integ.enable()
            raise SystemExit("enabled with a differing schema")
        except integ.IntegrationError as e:
            msg = str(e)
        assert "fp8_comm_per_token_dequant: cache-dit (cache_dit_triton_ops) (Tensor x) -> Tensor" in msg, msg
        assert "cache_dit_opd (Tensor x, int group) -> Tensor" in msg and "nothing was taken over" in msg, msg
        assert not integ.enabled() and ck.svdq_extension_is_available() is False
        ops, _ = ran(ck.fp8_comm_per_token_quant, torch.empty(2, 128, **META))
        assert ops == ["cache_dit_triton_ops::fp8_comm_per_token_quant"], ops
        print("ok")
    """)


def test_a_failed_cache_dit_registry_import_gives_the_ops_back_to_this_client():
    run(f"""
        import cache_dit_opd
        sys.modules["cache_dit.kernels.cuda._svdquant"] = None  # cache-dit's registry imports it first
        try:
            import cache_dit.kernels.cuda
            raise SystemExit("imported")
        except ImportError:
            pass
        x = torch.empty(256, 256, **META)
        assert str(act_layout(x, None, None, False, False, 256)) == "{OPD_ACT}"
        q, s = cache_dit_opd.kernels.svdq_quantize_w4a4_wgt(torch.empty(128, 256, **META))
        assert q.shape == (128, 128)
        print("ok")
    """)


# -- cache-dit's PTQ, read by this project's layouts -------------------------------------------------------

PTQ_MLP = textwrap.dedent("""
    sys.path.insert(0, "kernels")
    import svdq_reference as sq
    from cache_dit.quantization.svdquant import quantize_linear_svdq_w4a4
    F = torch.nn.functional

    def rel_l2_cos(a, b):
        a, b = a.float().flatten(), b.float().flatten()
        return ((a - b).norm() / b.norm()).item(), F.cosine_similarity(a, b, dim=0).item()

    def mlp(k, h, m, device):
        '''Two linears with a GELU, random weights, and cache-dit's PTQ of each on calibration inputs.'''
        g = torch.Generator().manual_seed(0)
        fc1, fc2 = torch.nn.Linear(k, h), torch.nn.Linear(h, k)
        for lin in (fc1, fc2):
            torch.nn.init.normal_(lin.weight, std=lin.in_features ** -0.5, generator=g)
            torch.nn.init.normal_(lin.bias, std=0.1, generator=g)
        fc1, fc2 = fc1.to(device, torch.bfloat16), fc2.to(device, torch.bfloat16)
        x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
        hid = F.gelu(fc1(x), approximate="tanh")
        return fc1, fc2, x, hid
""")


def test_cache_dits_ptq_checkpoints_are_read_right_by_the_reference():
    """cache-dit's own PTQ (smoothing, SVD split, residual INT4, packing) on CPU, run by this project's
    kernel-faithful reference from the unpacked checkpoint tensors: per-layer error is what INT4 W4A4 gives
    on Gaussian data (measured 0.13 rel. L2 at K = 1024; a wrong layout reading gives ~1.4), and it does not
    grow with rank."""
    run(PTQ_MLP + textwrap.dedent("""
        fc1, fc2, x, hid = mlp(512, 2048, 256, "cpu")
        for rank in (0, 32):
            errs = []
            for lin, inp in ((fc1, x), (fc2, hid)):
                q = quantize_linear_svdq_w4a4(lin, inp, rank=rank, torch_dtype=torch.bfloat16, device="cpu")
                t = sq.unpack_linear(q.state_dict())
                assert (t["up"] is None) == (rank == 0), rank
                errs.append(rel_l2_cos(sq.linear_faithful(inp, **t), lin(inp)))
            assert all(e < 0.2 and c > 0.98 for e, c in errs), (rank, errs)
        print("ok")
    """))


@pytest.mark.gpu
def test_cache_dits_svdquant_mlp_runs_through_the_daemon(gpu_daemon):
    """cache-dit's PTQ on the GPU, its SVDQW4A4Linear forward after enable(): rank 0 equals the
    kernel-faithful reference bit for bit (the GEMM without LoRA is exact: kernels/svdq/svdq.h), rank 32
    within 1e-2 of it (LoRA-up's fp32 sums in another order); error vs BF16 as on CPU; the daemon counted
    the calls."""
    r = fx.run_python(PRELUDE + PTQ_MLP + textwrap.dedent("""
        import cache_dit_opd, cache_dit_opd.integrations.cache_dit as integ
        integ.enable()
        fc1, fc2, x, hid = mlp(1024, 4096, 300, "cuda")
        before = op_calls()
        for rank in (0, 32):
            q1 = quantize_linear_svdq_w4a4(fc1, x, rank=rank, torch_dtype=torch.bfloat16, device="cuda")
            q2 = quantize_linear_svdq_w4a4(fc2, hid, rank=rank, torch_dtype=torch.bfloat16, device="cuda")
            for q, inp in ((q1, x), (q2, hid)):
                got = q(inp).cpu()
                want = sq.linear_faithful(inp.cpu(), **sq.unpack_linear({k: v.cpu() for k, v in q.state_dict().items()}))
                if rank == 0:
                    assert torch.equal(got, want.to(got.dtype)), rel_l2_cos(got, want)
                else:
                    assert rel_l2_cos(got, want)[0] < 1e-2, rel_l2_cos(got, want)
            y = q2(F.gelu(q1(x), approximate="tanh"))
            e, c = rel_l2_cos(y, fc2(hid))
            print(f"rank {rank}: MLP rel. L2 {e:.4f}, cosine {c:.5f}")
            # cosine ~ 1/sqrt(1 + e^2) for an uncorrelated error: 0.958 at e = 0.3 (H200, rank 0: 0.250, 0.970).
            assert e < 0.3 and c > 0.95, (e, c)
        cache_dit_opd.synchronize()
        delta = {k: v - before.get(k, 0) for k, v in op_calls().items()}
        # Per rank: each layer once alone, once in the MLP.
        assert delta["svdq_gemm_w4a4"] == 8 and delta["svdq_quantize_w4a4_act_fuse_lora"] == 8, delta
        print("ok")
    """), timeout=600, CACHE_DIT_OPD_ADDRESS=gpu_daemon.address)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


@pytest.mark.gpu
def test_cache_dits_fp8_and_merge_calls_go_to_the_daemon(gpu_daemon):
    """cache-dit's own wrappers after enable(): the same bytes as this client's ops, counted by the daemon."""
    r = fx.run_python(PRELUDE + textwrap.dedent("""
        import cache_dit_opd, cache_dit_opd.integrations.cache_dit as integ
        import cache_dit.kernels as ck
        from cache_dit_opd import kernels as k
        integ.enable()
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(2, 64, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        qkv = torch.randn(2, 64, 3, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        lse = lambda: torch.randn(2, 64, 8, 1, device="cuda", dtype=torch.float32, generator=g)
        p, s = lse(), lse()
        before = op_calls()
        pairs = [(ck.fp8_comm_per_token_quant(x), k.fp8_comm_per_token_quant(x)),
                 (ck.fp8_comm_qkv_permute_quant(qkv), k.fp8_comm_qkv_permute_quant(qkv)),
                 (ck.fused_merge_attn_states(x, p, x, s), k.fused_merge_attn_states(x, p, x, s))]
        q = k.fp8_comm_per_token_quant(x)
        pairs.append((ck.fp8_comm_per_token_dequant(q), k.fp8_comm_per_token_dequant(q)))
        for a, b in pairs:
            a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
            assert all(torch.equal(u.view(torch.uint8), v.view(torch.uint8)) for u, v in zip(a, b))
        cache_dit_opd.synchronize()
        by_op = {k: v - before.get(k, 0) for k, v in op_calls().items()}
        assert by_op["fp8_comm_per_token_quant"] == 3 and by_op["fp8_comm_qkv_permute_quant"] == 2, by_op
        assert by_op["fused_merge_attn_states"] == 2 and by_op["fp8_comm_per_token_dequant"] == 2, by_op
        print("ok")
    """), timeout=300, CACHE_DIT_OPD_ADDRESS=gpu_daemon.address)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
