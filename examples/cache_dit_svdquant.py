"""cache-dit's SVDQuant W4A4 on a small FLUX transformer, through the daemon (needs a GPU and a daemon).

    build/server/cache-dit-opd --device 0 &
    python examples/cache_dit_svdquant.py [--layers 2 --single-layers 4 --tokens 1024 --rank 32] [--out FILE.md]

Builds a diffusers FluxTransformer2DModel from its config with random weights
(nothing can be downloaded), quantizes every linear of its transformer blocks
with cache-dit's own PTQ (``quantize_linear_svdq_w4a4``, calibrated on one BF16
forward), then runs the quantized model with cache-dit's ``SVDQW4A4Linear``
after ``cache_dit_opd.integrations.cache_dit.enable()``: cache-dit's code
unchanged, its svdq ops served by the daemon. Prints the error against the BF16
forward (relative L2, cosine), the time per forward of both, and the calls the
daemon ran by op.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def build_model(layers: int, single_layers: int, device: str):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    # FLUX.1's block geometry (24 heads of 128: inner dim 3072), fewer blocks.
    model = FluxTransformer2DModel(num_layers=layers, num_single_layers=single_layers, attention_head_dim=128,
                                   num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                                   in_channels=64)
    return model.to(device, torch.bfloat16).eval()


def make_inputs(tokens: int, text_tokens: int, device: str) -> dict:
    g = torch.Generator().manual_seed(1)
    bf16 = dict(dtype=torch.bfloat16)
    return {
        "hidden_states": torch.randn(1, tokens, 64, generator=g, **bf16).to(device),
        "encoder_hidden_states": torch.randn(1, text_tokens, 4096, generator=g, **bf16).to(device),
        "pooled_projections": torch.randn(1, 768, generator=g, **bf16).to(device),
        "timestep": torch.tensor([0.5], **bf16).to(device),
        "img_ids": torch.zeros(tokens, 3, **bf16).to(device),
        "txt_ids": torch.zeros(text_tokens, 3, **bf16).to(device),
        "return_dict": False,
    }


def quantize_blocks(model, inputs: dict, rank: int) -> int:
    """Replaces every nn.Linear of the transformer blocks by cache-dit's PTQ of it; returns how many."""
    from cache_dit.quantization.svdquant import quantize_linear_svdq_w4a4

    linears = {name: m for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and "transformer_blocks" in name}
    seen: dict[str, list] = {name: [] for name in linears}
    hooks = [m.register_forward_pre_hook(lambda m, args, name=name: seen[name].append(args[0].detach()))
             for name, m in linears.items()]
    with torch.no_grad():
        model(**inputs)
    for h in hooks:
        h.remove()
    for name, lin in linears.items():
        q = quantize_linear_svdq_w4a4(lin, seen.pop(name), rank=rank, torch_dtype=torch.bfloat16,
                                      device=lin.weight.device)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, q)
    return len(linears)


def time_forward(model, inputs: dict, iters: int) -> float:
    with torch.no_grad():
        for _ in range(2):
            model(**inputs)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            model(**inputs)
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e3


def op_calls() -> dict:
    import cache_dit_opd

    calls: dict = {}
    for o in cache_dit_opd.daemon_stats()["ops"]:
        calls[o["name"]] = calls.get(o["name"], 0) + o["calls"]
    return calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--single-layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--text-tokens", type=int, default=256)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", help="also write the table (markdown) here")
    a = p.parse_args()

    import cache_dit
    import cache_dit_opd
    import cache_dit_opd.integrations.cache_dit as opd_cache_dit

    model = build_model(a.layers, a.single_layers, "cuda")
    inputs = make_inputs(a.tokens, a.text_tokens, "cuda")
    with torch.no_grad():
        want = model(**inputs)[0].float()
    bf16_ms = time_forward(model, inputs, a.iters)

    served = opd_cache_dit.enable()
    n = quantize_blocks(model, inputs, a.rank)
    before = op_calls()
    with torch.no_grad():
        got = model(**inputs)[0].float()
    cache_dit_opd.synchronize()
    after = op_calls()
    w4a4_ms = time_forward(model, inputs, a.iters)

    rel = ((got - want).norm() / want.norm()).item()
    cos = F.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
    calls = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    rows = [
        f"cache-dit {cache_dit.__version__}, FluxTransformer2DModel ({a.layers} + {a.single_layers} blocks, inner dim "
        f"3072), {a.tokens} image + {a.text_tokens} text tokens, {n} linears quantized (rank {a.rank}), "
        f"{torch.cuda.get_device_name()}",
        "",
        "| forward | time per forward (ms) | rel. L2 vs BF16 | cosine vs BF16 |",
        "| --- | --- | --- | --- |",
        f"| BF16, in-process | {bf16_ms:.2f} | 0 | 1 |",
        f"| SVDQuant W4A4, cache-dit's SVDQW4A4Linear through the daemon | {w4a4_ms:.2f} | {rel:.4f} | {cos:.5f} |",
        "",
        "Daemon calls in one quantized forward: " + ", ".join(f"{k} {v}" for k, v in sorted(calls.items())),
        "",
        "Served by the daemon: " + ", ".join(k for k, v in sorted(served.items()) if v == "daemon"),
    ]
    print("\n".join(rows))
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
