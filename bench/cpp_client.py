"""Case 1 (C++ client): ``<build>/tests/cpp/client/opd_client_bench`` against this run's daemon.

The tool times CallPrepared (the C++ client's call, once over gRPC and once
through the call ring) and, through ``opd_ref_tool`` in its own process, the
same op called in-process through the c10 dispatcher; it prints one JSON
object (remote and in-process p50/p99 and their difference). Run at the FLUX
per-rank shape, like the Python latency.
"""

from __future__ import annotations

import json

from bench.common import MERGE, QUANT, SHAPES

SHAPE = "flux_rank"
TRANSPORTS = ("grpc", "ring")


def params(quick: bool) -> dict:
    return {"shape": SHAPE, "ops": [QUANT] if quick else [QUANT, MERGE],
            "iters": 300 if quick else 2000, "warmup": 100 if quick else 200}


def _parse(stdout: str) -> dict | None:
    """The last line that is a JSON object (diagnostics may precede it)."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def run(r) -> dict:
    p = params(r.s.quick)
    binary = r.s.build / "tests" / "cpp" / "client" / "opd_client_bench"
    ref_tool = r.s.build / "tests" / "cpp" / "client" / "opd_ref_tool"
    out = {"params": p, "binary": str(binary), "runs": []}
    if not binary.is_file():
        return dict(out, status="skipped", error=f"{binary} is not built")
    _, s, h, _ = SHAPES[SHAPE]
    for transport in TRANSPORTS:
        for op in p["ops"]:
            out["runs"].append(_one(r, binary, ref_tool, transport, op, s, h, p))
    ok = any(e["status"] == "ok" for e in out["runs"])
    return dict(out, status="ok" if ok else "error", **({} if ok else {"error": "every C++ client run failed"}))


def _one(r, binary, ref_tool, transport: str, op: str, s: int, h: int, p: dict) -> dict:
    cmd = [str(binary), "--device", str(r.s.device), "--address", r.daemon.address, "--op", op,
           "--shape", f"1,{s},{h},128", "--iters", str(p["iters"]), "--warmup", str(p["warmup"]),
           "--ref-tool", str(ref_tool) if ref_tool.is_file() else "none", "--transport", transport]
    res = r.command(cmd, timeout=120, name=f"cpp-{transport}-{op}",
                    extra_env={"CACHE_DIT_OPD_BUILD_DIR": str(r.s.build)})
    data = _parse(res["stdout"])
    entry = {"op": op, "shape": SHAPE, "transport": transport, "command": cmd, "rc": res["rc"],
             "timed_out": res["timed_out"], "wall_s": res["wall_s"]}
    if data is None or res["rc"] != 0 or "error" in data:
        entry.update(status="error", error=(data or {}).get("error") or "no JSON on stdout",
                     stderr_tail=res["stderr_tail"])
    else:
        entry.update(status="ok", result=data)
    return entry
