"""The weight store on the GPU, through the real daemon: attached tensors are the published bytes, every op
reads them and none writes them, a client's write through its read-only mapping faults in that client only,
and a layer over attached weights computes what the same layer over its own copy computes, bit for bit.

Each test runs its client in a child process (CUDA state stays out of pytest's process)."""

from __future__ import annotations

import textwrap

import pytest

import _client_fixtures as fx

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def store_daemon():
    d = fx.daemon(None, "--max-store-bytes", "8G", fake=False)
    yield d
    d.stop()


def run(code: str, d, timeout: float = 300) -> str:
    r = fx.run_python(textwrap.dedent(code), timeout=timeout, CACHE_DIT_OPD_ADDRESS=d.address)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
    return r.stdout


def test_attached_tensors_are_the_published_bytes_read_by_every_op_written_by_none(store_daemon, tmp_path):
    run(f"""
        import torch, safetensors.torch as st
        from cache_dit_opd import kernels, store
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 128, generator=g).to(torch.bfloat16)
        rec = torch.randint(0, 255, (64, 130), dtype=torch.uint8, generator=g)
        st.save_file({{"x": x, "rec": rec, "empty": torch.zeros(0, 4)}}, "{tmp_path}/w.safetensors")
        store.publish_file("{tmp_path}/w.safetensors", prefix="gpu/file/")
        xs, es = store.attach("gpu/file/x"), store.attach("gpu/file/empty")
        assert xs.is_cuda and xs.dtype == torch.bfloat16 and torch.equal(xs.cpu(), x)
        assert es.shape == (0, 4) and es.is_cuda
        # Uploaded from this process's memory, which is then freed and overwritten.
        y = (torch.randn(32, 128, generator=g) * 3).to("cuda", torch.bfloat16)
        want_y = y.cpu()
        store.publish({{"y": y}}, prefix="gpu/up/")
        y.fill_(0)
        del y
        torch.cuda.empty_cache()
        ys = store.attach("gpu/up/y")
        assert torch.equal(ys.cpu(), want_y)
        # Read by an op as any tensor: the result equals the op on a copy of this process.
        for src in (xs, ys):
            out = torch.empty(src.shape[0], 130, dtype=torch.float8_e4m3fn, device="cuda")
            torch.ops.cache_dit_cuda_ops.fp8_comm_per_token_quant.out(src, out=out)
            ref = kernels.fp8_comm_per_token_quant(src.clone())
            assert torch.equal(out.view(torch.uint8).cpu(), ref.view(torch.uint8).cpu())
        # Never written: an output in the store is refused before launch, naming it; the bytes stay.
        recs = store.attach("gpu/file/rec").view(torch.float8_e4m3fn)
        try:
            torch.ops.cache_dit_cuda_ops.fp8_comm_per_token_quant.out(xs, out=recs)
            raise AssertionError("an output in the store was accepted")
        except ValueError as e:
            assert "weight-store memory, which no op may write" in str(e), e
        torch.cuda.synchronize()
        assert torch.equal(recs.view(torch.uint8).cpu(), rec)
        print("ok")
    """, store_daemon)


def test_a_write_through_the_mapping_faults_in_the_writer_only(store_daemon, tmp_path):
    run(f"""
        import subprocess, sys, textwrap, torch, safetensors.torch as st
        from cache_dit_opd import store
        w = torch.arange(4096, dtype=torch.int32)
        st.save_file({{"w": w}}, "{tmp_path}/rw.safetensors")
        store.publish_file("{tmp_path}/rw.safetensors", prefix="gpu/rw/")
        child = textwrap.dedent('''
            import torch
            from cache_dit_opd import store
            t = store.attach("gpu/rw/w")
            assert int(t[7]) == 7
            t.fill_(-1)
            torch.cuda.synchronize()
        ''')
        r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "illegal" in r.stderr.lower(), (r.returncode, r.stderr[-2000:])
        # The daemon's memory and this client's session are untouched.
        t = store.attach("gpu/rw/w")
        assert torch.equal(t.cpu(), w)
        out = torch.empty(64, 130, dtype=torch.float8_e4m3fn, device="cuda")
        torch.ops.cache_dit_cuda_ops.fp8_comm_per_token_quant.out(torch.ones(64, 128, dtype=torch.bfloat16,
                                                                             device="cuda"), out=out)
        torch.cuda.synchronize()
        print("child:", r.stderr.strip().splitlines()[-1][:200])
        print("ok")
    """, store_daemon)


def test_a_layer_over_attached_weights_computes_what_its_own_copy_computes(store_daemon):
    run("""
        import sys, torch
        sys.path.insert(0, "tests/python")
        import test_client_nn as t
        from cache_dit_opd import nn as opd_nn, store
        from cache_dit_opd.nn import SVDQW4A4Linear
        model = torch.nn.Sequential(torch.nn.Linear(300, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 300))
        sd = {}
        for idx, (i, o, r) in (("0", (300, 1024, 32)), ("2", (1024, 300, 16))):
            sd.update({f"{idx}.{k}": v for k, v in t.quantized(i, o, r)[1].items()})
        opd_nn.load_quantized(model, sd, device="cuda")
        own = model
        entries = opd_nn.publish_quantized(own, "gpu/mlp/")
        assert len({e.set_id for e in entries}) == 1  # one set, one block
        shared = torch.nn.Sequential(torch.nn.Linear(300, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 300))
        assert opd_nn.attach_quantized(shared, "gpu/mlp/") == ["0", "2"]
        q = shared[0]
        assert isinstance(q, SVDQW4A4Linear) and torch.equal(q.qweight.cpu(), sd["0.qweight"])
        x = torch.randn(3, 77, 300, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)
        a, b = own(x), shared(x)
        assert torch.equal(a, b), (a.float() - b.float()).abs().max()
        # The attached layer holds no weight of this process's allocator.
        assert sum(p.numel() for p in shared.parameters()) > 0
        assert all(p.data_ptr() not in (o.data_ptr() for o in own.parameters()) for p in shared.parameters())
        listed = {e.name: e.refs for e in store.list_entries("gpu/mlp/")}
        assert listed["gpu/mlp/0.qweight"] == 1, listed
        print("ok")
    """, store_daemon)
