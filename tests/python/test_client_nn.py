"""cache_dit_opd.nn.SVDQW4A4Linear: checkpoint compatibility, loading, fakes under torch.compile (CPU), and
its forward through the daemon against the kernel-faithful reference (GPU)."""

import struct
import textwrap

import pytest
import safetensors.torch as safetensors_torch
import torch

import _client_fixtures as fx
from _client_fixtures import sq
from cache_dit_opd import nn as opd_nn
from cache_dit_opd.nn import SVDQW4A4Linear, load_safetensors


def quantized(in_features, out_features, rank, bias=True, dtype=torch.bfloat16, seed=0, device="cpu"):
    """(float nn.Linear, its state dict as SVDQW4A4Linear holds it): the layer zero-padded to multiples of
    128 and quantized by the reference's offline quantizer (smoothing from Gaussian calibration data) on
    ``device``; the layer and its state dict stay there."""
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(in_features, out_features, bias=bias)
    torch.nn.init.normal_(lin.weight, std=in_features ** -0.5, generator=g)
    if bias:
        torch.nn.init.normal_(lin.bias, std=0.1, generator=g)
    lin = lin.to(dtype)
    k, n = opd_nn._padded(in_features), opd_nn._padded(out_features, opd_nn._BLOCK_N)
    w = torch.zeros(n, k)
    w[:out_features, :in_features] = lin.weight.float()
    b = None
    if bias:
        b = torch.zeros(n)
        b[:out_features] = lin.bias.float()
    amax = torch.zeros(k)
    amax[:in_features] = torch.randn(64, in_features, generator=g).abs().amax(0)
    w, b, amax = (t.to(device) if t is not None else None for t in (w, b, amax))
    return lin.to(device), sq.quantize_linear(w, b, rank, dtype, act_amax=amax)


def test_state_dict_is_cache_dits_and_nunchakus():
    """Same keys, shapes and dtypes as PyPI cache-dit 1.5.3's SVDQW4A4Linear (nunchaku's names), padded the
    same way, for aligned and unaligned geometries, with and without bias and LoRA."""
    cases = [(300, 200, 32, True), (3072, 12288, 0, False), (128, 128, 16, True)]
    r = fx.run_python(textwrap.dedent(f"""
        import torch
        from cache_dit.quantization.svdquant.linear import SVDQW4A4Linear as Theirs
        from cache_dit_opd.nn import SVDQW4A4Linear as Ours
        for i, o, r, b in {cases}:
            kw = dict(rank=r, bias=b, torch_dtype=torch.bfloat16, device="meta")
            a = {{k: (tuple(v.shape), v.dtype) for k, v in Theirs(i, o, **kw).state_dict().items()}}
            c = {{k: (tuple(v.shape), v.dtype) for k, v in Ours(i, o, **kw).state_dict().items()}}
            assert a == c, (i, o, r, b, a, c)
        print("ok")
    """), CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_from_state_dict_takes_the_geometry_of_the_tensors():
    _, sd = quantized(300, 200, 32)
    m = SVDQW4A4Linear.from_state_dict({"blk.ff." + k: v for k, v in sd.items()}, 300, 200, prefix="blk.ff.")
    assert (m.in_features, m.out_features, m.rank, m.bias is not None, m.torch_dtype) == (
        300, 200, 32, True, torch.bfloat16)
    for k, v in m.state_dict().items():
        assert torch.equal(v, sd[k]), k
    m0 = SVDQW4A4Linear.from_state_dict(quantized(256, 128, 0, bias=False)[1])
    assert (m0.in_features, m0.out_features, m0.rank, m0.bias) == (256, 128, 0, None)


def test_safetensors_round_trip(tmp_path):
    _, sd = quantized(384, 256, 16)
    path = tmp_path / "layer.safetensors"
    safetensors_torch.save_file({"transformer.l0." + k: v.contiguous() for k, v in sd.items()}, str(path))
    m = SVDQW4A4Linear.from_state_dict(load_safetensors(path), prefix="transformer.l0.")
    for k, v in m.state_dict().items():
        assert v.dtype == sd[k].dtype and torch.equal(v, sd[k]), k


@pytest.mark.parametrize("geometry", [(300, 200, 32, True), (256, 128, 0, False)])
def test_forward_traces_with_the_fakes_under_compile(geometry):
    """fullgraph=True on meta tensors: the graph holds the two daemon ops and nothing unexpected; the output
    has the logical shape (padding in, cut off out) and the model dtype."""
    i, o, r, b = geometry
    m = SVDQW4A4Linear(i, o, rank=r, bias=b, device="meta")
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    y = torch.compile(m, backend=backend, fullgraph=True)(torch.empty(2, 7, i, dtype=torch.bfloat16, device="meta"))
    assert y.shape == (2, 7, o) and y.dtype == torch.bfloat16
    targets = sorted({str(n.target) for g in graphs for n in g.graph.nodes
                      if n.op == "call_function" and "cache_dit" in str(n.target)})
    assert targets == ["cache_dit_cuda_ops.svdq_gemm_w4a4", "cache_dit_cuda_ops.svdq_quantize_w4a4_act_fuse_lora"]


def test_bad_constructions_and_inputs_name_the_value():
    with pytest.raises(ValueError, match="rank must be a non-negative multiple of 16, got 24"):
        SVDQW4A4Linear(128, 128, rank=24)
    with pytest.raises(ValueError, match="torch_dtype must be .* got torch.float32"):
        SVDQW4A4Linear(128, 128, torch_dtype=torch.float32)
    with pytest.raises(ValueError, match="in_features and out_features must be >= 1, got 0, 5"):
        SVDQW4A4Linear(0, 5)
    m = SVDQW4A4Linear(300, 200, device="meta")
    with pytest.raises(ValueError, match=r"in_features=300, got shape \(4, 256\)"):
        m(torch.empty(4, 256, dtype=torch.bfloat16, device="meta"))


def test_bad_checkpoints_are_refused_naming_the_tensor():
    _, sd = quantized(256, 256, 16)
    m = SVDQW4A4Linear(256, 256, rank=16)
    with pytest.raises(ValueError, match="'qweight' must be torch.int8, got torch.float32"):
        m.load_state_dict({**sd, "qweight": sd["qweight"].float()})
    with pytest.raises(ValueError, match="'wtscale' is an NVFP4 checkpoint tensor"):
        m.load_state_dict({**sd, "wtscale": torch.ones(())})
    with pytest.raises(RuntimeError, match="size mismatch for proj_up"):
        m.load_state_dict({**sd, "proj_up": torch.zeros(256, 32, dtype=torch.bfloat16)})
    with pytest.raises(KeyError, match="no 'l.qweight'"):
        SVDQW4A4Linear.from_state_dict({k: v for k, v in sd.items() if k != "qweight"}, prefix="l.")
    with pytest.raises(ValueError, match=r"in_features 100 / out_features 256 pad to 128 / 256, but 'qweight' "
                                         r"\(256, 128\) holds 256 / 256"):
        SVDQW4A4Linear.from_state_dict(sd, in_features=100)


def test_bad_safetensors_files_are_refused_naming_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file: .*missing.safetensors"):
        load_safetensors(tmp_path / "missing.safetensors")
    good = tmp_path / "good.safetensors"
    safetensors_torch.save_file({"qweight": torch.zeros(128, 64, dtype=torch.int8)}, str(good))
    data = good.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[:-100])
    (header_len,) = struct.unpack("<Q", data[:8])
    lying = tmp_path / "lying.safetensors"  # the header claims more bytes than the file holds
    header = data[8:8 + header_len].replace(b"[0,8192]", b"[0,9999999]")
    assert header != data[8:8 + header_len]
    lying.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + header_len:])
    for bad in (truncated, lying):
        with pytest.raises(ValueError, match=f"{bad.name} is not a valid safetensors file"):
            load_safetensors(bad)


# -- on the GPU, through the daemon ------------------------------------------------------------------------


@pytest.mark.gpu
def test_forward_equals_the_kernel_faithful_reference(gpu_daemon):
    """Rank 0 bit for bit (the GEMM without LoRA is exact: kernels/svdq/svdq.h), rank 32 within the fp32
    rounding of LoRA-up's sums; unaligned sizes (padding in, cut off out) and a 3-D input."""
    r = fx.run_python(textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, "tests/python")
        import test_client_nn as t
        from test_client_nn import sq
        from cache_dit_opd.nn import SVDQW4A4Linear
        for i, o, rank in ((300, 200, 0), (1024, 4096, 32)):
            _, sd = t.quantized(i, o, rank)
            m = SVDQW4A4Linear.from_state_dict(sd, i, o, device="cuda")
            x = torch.randn(3, 100, i, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
            got = m(x.cuda()).cpu()
            xp = torch.nn.functional.pad(x.reshape(-1, i), (0, m.qweight.shape[1] * 2 - i))
            want = sq.linear_faithful(xp, **sq.unpack_linear(sd))[:, :o].reshape(3, 100, o)
            if rank == 0:
                assert torch.equal(got, want), (got.float() - want.float()).abs().max()
            else:
                err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                assert err < 1e-2, err
        print("ok")
    """), timeout=300, CACHE_DIT_OPD_ADDRESS=gpu_daemon.address)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


@pytest.mark.gpu
def test_flux_mlp_accuracy_against_bf16(gpu_daemon):
    """FLUX.1's FF sizes (3072 -> 12288 -> 3072, GELU) quantized at ranks 0/16/32, upstream's metrics
    (relative L2, cosine) against the BF16 MLP: INT4 W4A4 on Gaussian weights measures about 0.2 rel. L2
    for the two layers (tests/python/test_integration_cache_dit.py, on CPU). An error uncorrelated with the
    signal gives cosine 1/sqrt(1 + relL2^2): the bound rel. L2 < 0.3 means cosine > 0.958, so the cosine bound
    is 0.95 (H200, rank 0: rel. L2 0.254, cosine 0.969)."""
    r = fx.run_python(textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, "tests/python")
        import test_client_nn as t
        from cache_dit_opd.nn import SVDQW4A4Linear
        F = torch.nn.functional
        for rank in (0, 16, 32):
            l1, s1 = t.quantized(3072, 12288, rank, seed=1, device="cuda")  # the SVDs on the GPU: seconds
            l2, s2 = t.quantized(12288, 3072, rank, seed=2, device="cuda")
            q1, q2 = (SVDQW4A4Linear.from_state_dict(s, device="cuda") for s in (s1, s2))
            x = torch.randn(1024, 3072, generator=torch.Generator().manual_seed(3)).to("cuda", torch.bfloat16)
            want = l2(F.gelu(l1(x), approximate="tanh")).float()
            got = q2(F.gelu(q1(x), approximate="tanh")).float()
            rel = ((got - want).norm() / want.norm()).item()
            cos = F.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
            print(f"rank {rank}: rel. L2 {rel:.4f}, cosine {cos:.5f}")
            assert rel < 0.3 and cos > 0.95, (rank, rel, cos)
        print("ok")
    """), timeout=600, CACHE_DIT_OPD_ADDRESS=gpu_daemon.address)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_load_quantized_replaces_the_linears_a_checkpoint_holds():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ff = torch.nn.Sequential(torch.nn.Linear(300, 512), torch.nn.GELU(), torch.nn.Linear(512, 300))
            self.norm = torch.nn.LayerNorm(300)

    model = torch.nn.ModuleDict({"b0": Block(), "b1": Block()})
    sd = {}
    for blk in ("b0", "b1"):
        for idx, (i, o) in (("0", (300, 512)), ("2", (512, 300))):
            sd.update({f"transformer.{blk}.ff.{idx}.{k}": v for k, v in quantized(i, o, 16)[1].items()})
    names = opd_nn.load_quantized(model, sd, prefix="transformer.")
    assert names == ["b0.ff.0", "b0.ff.2", "b1.ff.0", "b1.ff.2"]
    q = model["b1"].ff[2]
    assert isinstance(q, SVDQW4A4Linear) and (q.in_features, q.out_features, q.rank) == (512, 300, 16)
    assert torch.equal(q.qweight, sd["transformer.b1.ff.2.qweight"])
    assert isinstance(model["b0"].norm, torch.nn.LayerNorm)
    with pytest.raises(ValueError, match="holds no '<name>.qweight' under prefix 'model.'"):
        opd_nn.load_quantized(model, sd, prefix="model.")
    with pytest.raises(ValueError, match=r"no nn.Linear of the model: \['b0.norm'\]"):
        opd_nn.load_quantized(torch.nn.ModuleDict({"b0": Block()}),
                              {f"b0.norm.{k}": v for k, v in quantized(256, 256, 0)[1].items()})
