"""Weights in the daemon: N worker processes serving one 4-bit model through one daemon, (a) each with its own
copy of the weights (``nn.load_quantized`` from the checkpoint file) and (b) attached to the daemon's weight
store (``nn.attach_quantized``; the daemon read the file once with ``store.publish_file``).

The model: ``--blocks`` MLP blocks of FLUX.1's FF sizes (3072 -> 12288 -> GELU -> 3072), each linear W4A4 at
rank 32. Its two layers' packed tensors are drawn once (``_client_fixtures.svdq_layer``: a valid checkpoint
without the SVD, which would only cost time) and repeated for every block, each block under its own names:
the store holds one copy per block, as a real checkpoint would.

Per mode: device memory in use once every worker holds its weights and has run its first forward
(``torch.cuda.mem_get_info`` in this process, against before the workers started; CUDA contexts included),
the weights in the workers' own allocators (``torch.cuda.memory_allocated`` after loading) and in the daemon's
store (``GetStats``), the time from a worker's process start (``Popen``) to its first forward's output, and
whether every worker's output equals every other's, in both modes, bit for bit.

    python -m bench.store_workers --build build --out /tmp/sw [--workers 4] [--blocks 12]

Writes ``store-workers.json`` and ``store-workers.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
K, H, RANK = 3072, 12288, 32
ROWS = 4608  # tokens of a FLUX.1 1024x1024 image


def _fixtures():
    sys.path[:0] = [str(REPO / "python"), str(REPO / "tests" / "python")]
    import _client_fixtures as fx

    return fx


def make_checkpoint(path: Path, blocks: int) -> int:
    """Writes the model's checkpoint (nunchaku's names, ``blocks.<i>.ff.{0,2}.<tensor>``); its bytes."""
    import torch
    from safetensors.torch import save_file

    fx = _fixtures()
    g = torch.Generator().manual_seed(0)
    layers = {}
    for idx, (k, n) in (("0", (K, H)), ("2", (H, K))):
        t = fx.svdq_layer(g, torch.bfloat16, 8, k, n, RANK)
        layers[idx] = {name: v for name, v in t.items() if name != "x" and v is not None}
        layers[idx]["smooth_factor_orig"] = t["smooth_factor"]
    sd = {f"blocks.{b}.ff.{idx}.{name}": v.clone() for b in range(blocks) for idx, ts in layers.items()
          for name, v in ts.items()}
    save_file(sd, str(path))
    return sum(v.numel() * v.element_size() for v in sd.values())


def model(blocks: int):
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ff = torch.nn.Sequential(torch.nn.Linear(K, H), torch.nn.GELU(approximate="tanh"),
                                          torch.nn.Linear(H, K))

        def forward(self, x):
            return x + self.ff(x)

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.Sequential(*[Block() for _ in range(blocks)])

        def forward(self, x):
            return self.blocks(x)

    with torch.device("meta"):  # the float layers are replaced: never allocate them
        return Stack()


def worker(mode: str, checkpoint: str, prefix: str, blocks: int, out: str, ready: str, go: str, started: float):
    """One worker: weights (own copy or attached), the first forward, its output; waits for ``go`` to exit."""
    import torch

    from cache_dit_opd import nn as opd_nn

    torch.cuda.init()
    base = torch.cuda.memory_allocated()
    m = model(blocks)
    t0 = time.time()
    if mode == "own":
        opd_nn.load_quantized(m, opd_nn.load_safetensors(checkpoint), device="cuda")
    else:
        opd_nn.attach_quantized(m, prefix, device=0)
    torch.cuda.synchronize()
    weights_s = time.time() - t0
    weights = torch.cuda.memory_allocated() - base
    x = torch.randn(ROWS, K, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    with torch.no_grad():
        y = m(x)
    torch.cuda.synchronize()
    first = time.time() - started
    torch.save(y.cpu(), out)
    Path(ready).write_text(json.dumps({"first_forward_s": first, "weights_s": weights_s, "own_weight_bytes": weights}))
    while not Path(go).exists():
        time.sleep(0.01)


def run_mode(mode: str, workers: int, checkpoint: Path, prefix: str, blocks: int, tmp: Path, env: dict) -> dict:
    import torch

    free0, total = torch.cuda.mem_get_info(0)
    go = tmp / f"{mode}.go"
    procs, files = [], []
    for i in range(workers):
        out, ready = tmp / f"{mode}-{i}.pt", tmp / f"{mode}-{i}.json"
        files.append((out, ready))
        code = (f"import sys; sys.path[:0] = {[str(REPO), str(REPO / 'python')]!r}; from bench.store_workers import "
                f"worker; worker({mode!r}, {str(checkpoint)!r}, {prefix!r}, {blocks}, {str(out)!r}, {str(ready)!r}, "
                f"{str(go)!r}, {time.time()!r})")
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env))
    deadline = time.monotonic() + 600
    while not all(r.exists() for _, r in files):
        if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise RuntimeError(f"{mode}: a worker failed or did not finish (exit codes {[p.poll() for p in procs]})")
        time.sleep(0.05)
    time.sleep(0.2)
    free1, _ = torch.cuda.mem_get_info(0)
    go.write_text("")
    for p in procs:
        p.wait(60)
    reports = [json.loads(r.read_text()) for _, r in files]
    outputs = [torch.load(o) for o, _ in files]
    return {"device_bytes_in_use": free0 - free1, "total_device_bytes": total,
            "own_weight_bytes": [r["own_weight_bytes"] for r in reports],
            "first_forward_s": [r["first_forward_s"] for r in reports],
            "weights_s": [r["weights_s"] for r in reports], "outputs": outputs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=str(REPO / "build"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=12)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    from bench.daemon import Daemon

    import torch

    tmp = Path(tempfile.mkdtemp(prefix="store-workers-"))
    checkpoint = tmp / "model.safetensors"
    t0 = time.monotonic()
    ckpt_bytes = make_checkpoint(checkpoint, a.blocks)
    d = Daemon(Path(a.build) / "server" / "cache-dit-opd", tmp / "daemon", 0, ["--max-store-bytes", "64G"]).start()
    env = {**os.environ, "CACHE_DIT_OPD_ADDRESS": d.address, "CACHE_DIT_OPD_BUILD_DIR": str(Path(a.build).resolve()),
           "PYTHONPATH": os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")])}
    try:
        torch.cuda.init()
        own = run_mode("own", a.workers, checkpoint, "", a.blocks, tmp, env)
        # The daemon reads the file once (from a client of its own, which then exits).
        pub = subprocess.run([sys.executable, "-c", "from cache_dit_opd import store; import sys; "
                              f"store.publish_file({str(checkpoint)!r}, prefix='flux-mlp/'); print('published')"],
                             env=env, capture_output=True, text=True, timeout=600)
        if pub.returncode != 0:
            raise RuntimeError(f"publish_file failed: {pub.stderr[-2000:]}")
        store_bytes = d.stats().store_bytes
        shared = run_mode("attached", a.workers, checkpoint, "flux-mlp/", a.blocks, tmp, env)
        after_bytes = d.stats().store_bytes
    finally:
        d.stop()
    ref = own["outputs"][0]
    identical = all(torch.equal(ref, y) for y in own["outputs"] + shared["outputs"])
    gib = 1 << 30
    result = {
        "gpu": torch.cuda.get_device_name(0), "workers": a.workers, "blocks": a.blocks, "rows": ROWS,
        "checkpoint_bytes": ckpt_bytes, "store_bytes": store_bytes, "store_bytes_after_workers": after_bytes,
        "outputs_bit_identical": identical, "wall_s": time.monotonic() - t0,
        "own": {k: v for k, v in own.items() if k != "outputs"},
        "attached": {k: v for k, v in shared.items() if k != "outputs"},
    }
    (out / "store-workers.json").write_text(json.dumps(result, indent=1))
    rows = []
    for name, r, daemon_bytes in (("(a) own copy per worker", own, 0), ("(b) attached to the store", shared,
                                                                         store_bytes)):
        weights = sum(r["own_weight_bytes"]) + daemon_bytes
        ff, ws = sorted(r["first_forward_s"]), sorted(r["weights_s"])
        rows.append(f"| {name} | {weights / gib:.2f} GiB ({weights / ckpt_bytes:.2f}x the checkpoint) | "
                    f"{sum(r['own_weight_bytes']) / gib:.2f} | {daemon_bytes / gib:.2f} | "
                    f"{r['device_bytes_in_use'] / gib:.2f} | {ws[0]:.3f} / {ws[len(ws) // 2]:.3f} / {ws[-1]:.3f} | "
                    f"{ff[0]:.2f} / {ff[len(ff) // 2]:.2f} / {ff[-1]:.2f} |")
    md = [f"# Weights in the daemon: {a.workers} workers, one {a.blocks}-block W4A4 MLP stack ({result['gpu']})", "",
          f"Command: `python -m bench.store_workers --workers {a.workers} --blocks {a.blocks}`; checkpoint "
          f"{ckpt_bytes / gib:.2f} GiB (FLUX.1 FF 3072 -> 12288 -> 3072 per block, rank 32, bf16 scales); input "
          f"[{ROWS}, {K}] bf16.", "",
          "| mode | weights on the GPU | in the workers' allocators (GiB) | in the daemon's store (GiB) | device memory "
          "in use, all workers, contexts included (GiB) | getting the weights, s (min / median / max) | process start "
          "to first output, s (min / median / max) |",
          "| --- | --- | ---: | ---: | ---: | --- | --- |", *rows, "",
          f"Outputs of every worker in both modes bit-identical: **{identical}**. The store after the attached "
          f"workers exited: {after_bytes / gib:.2f} GiB (it outlives its clients).", "",
          "(a) loads the checkpoint from a file in the page cache (written by this run), so its time is a lower "
          "bound for a cold disk; (b) maps the daemon's copy (one descriptor per published set)."]
    (out / "store-workers.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
