"""The soak of issue 17: many clients, random shapes, bad inputs, killed clients, killed daemons, a full GPU.

    source deploy/offline/use-prefix.sh .offline/debs   # offline hosts: the daemon's libraries
    python3 -m bench.soak [--build DIR] [--minutes 10] [--clients 16] [--out DIR]

One real daemon (``<build>/server/cache-dit-opd``) serves ``--clients`` worker processes (this file with
``--worker``), each calling every op of the catalog through the public wrappers (``cache_dit_opd.kernels``)
with random shapes, synchronously, with a bad input mixed in at ``--bad-rate`` (1%). One call in
``--check-every`` is compared with the PyTorch reference (kernels/reference.py, kernels/svdq_reference.py).
The schedule, in seconds from the start (every worker has made a call by then):

- every ``--kill-every`` s (30): one worker SIGKILLed, whatever it is doing (it calls without pause, so
  nearly always mid-call), and started again; the daemon must drop the dead session and its mappings;
- at 35% and 55% of the run: the daemon SIGKILLed under load and started again (as its supervisor would);
  the workers' next calls fail with DaemonUnavailable / SessionFailed until it serves, then reconnect;
- at 75%: a filler process allocates the GPU's memory in 1 GiB, then 64 MiB, blocks until allocation fails,
  holds it for ``--fill-hold`` s (15), and exits; workers' own allocations fail meanwhile (CUDA OOM).

Each second the orchestrator samples the daemon (VmRSS, open descriptors, GetStats: sessions, mapped bytes,
calls, rejections) and every worker's counters (each writes its own file; a killed worker's last file
stays counted). Every error a worker sees is one of a closed list of kinds; a kind is expected only where
the schedule explains it (a bad input rejected, the daemon down, the GPU full). The report
(``<out>/soak.md``, ``<out>/soak.json``) has per-minute calls, wrong results, errors by kind, RSS, mapped
bytes, sessions and descriptors; each client kill's cleanup time; each daemon restart's recovery time.
Exit status 1 when a result was wrong, an error was unexpected, a bad input was accepted, a dead client's
session outlived it, or the daemon died outside the schedule.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, child_env, kill_group, log, spawn, tail, write_json  # noqa: E402

# Error kinds a worker can record; anything else is "unexpected".
BAD_REJECTED = "bad_input_rejected"  # a bad input raised (ValueError, or RuntimeError/TypeError of torch's checks)
BAD_ACCEPTED = "bad_input_accepted"  # a bad input ran: a finding
DAEMON_DOWN = "daemon_unavailable"   # DaemonUnavailableError: no daemon serves (killed, starting)
SESSION_FAILED = "session_failed"    # SessionFailedError: the session broke (its daemon died)
CLIENT_OOM = "client_oom"            # torch.OutOfMemoryError in the worker's own allocation
UNEXPECTED = "unexpected"
WRONG = "wrong_result"
EXPECTED_WHEN = {DAEMON_DOWN: "daemon_restart", SESSION_FAILED: "daemon_restart", CLIENT_OOM: "memory_fill"}


# -- worker ------------------------------------------------------------------------------------------


def _load_references():
    sys.path.insert(0, str(REPO / "kernels"))
    import reference as ref
    import svdq_reference as sq

    sys.path.pop(0)
    return ref, sq


class Cases:
    """Random calls of every op: ``next(rng) -> (op, args, bad, check)``; ``check(got)`` raises on a wrong result.

    Tolerances: the soak looks for results computed from the wrong bytes (a stale or foreign region, a torn
    ring record, a call run twice or on the wrong stream), whose errors are of the size of the values
    themselves; rounding-level numerics are the kernel suites' (tests/kernels). So the checks are the
    contract's exact ones where the op is exact (dequant, the weight quantizer, the activation quantizer's
    codes and scales, the GEMM without LoRA) and a few ulps of the output dtype elsewhere.
    """

    def __init__(self, torch, kernels, seed: int):
        self.t, self.k = torch, kernels
        self.ref, self.sq = _load_references()
        self.g = torch.Generator().manual_seed(seed)
        self.layers = [self._layer(dtype, k, n, rank) for dtype, k, n, rank in
                       ((torch.bfloat16, 256, 256, 32), (torch.float16, 512, 128, 16), (torch.bfloat16, 128, 256, 0))]

    def _rn(self, *shape, dtype=None, scale=1.0, device="cuda"):
        t = self.t
        return (t.randn(*shape, generator=self.g) * scale).to(dtype or t.bfloat16).to(device)

    def _layer(self, dtype, k, n, rank):
        sq, t = self.sq, self.t
        s = (t.rand(k, generator=self.g) + 0.5).to(dtype)
        q, scales = sq.quantize_weight(t.randn(n, k, generator=self.g) * 0.05, dtype)
        layer = {"dtype": dtype, "k": k, "n": n, "rank": rank, "smooth_cpu": s,
                 "smooth": sq.pack_channel_vector(s).cuda(), "qweight": sq.pack_qweight(q).cuda(),
                 "wscales": sq.pack_wscales(scales).cuda(), "down": None, "up": None,
                 "bias": sq.pack_channel_vector((t.randn(n, generator=self.g) * 0.1).to(dtype)).cuda()}
        if rank:
            layer["down"] = sq.pack_lowrank((t.randn(rank, k, generator=self.g) * 0.1 / s.float()).to(dtype),
                                            down=True).cuda()
            layer["up"] = sq.pack_lowrank((t.randn(n, rank, generator=self.g) * 0.1).to(dtype), down=False).cuda()
        layer["q"], layer["scales"] = sq.unpack_qweight(layer["qweight"].cpu()), sq.unpack_wscales(layer["wscales"].cpu())
        return layer

    def next(self, rng: random.Random, bad: bool):
        name = rng.choice(("merge", "quant", "dequant", "qkv_quant", "qkv_dequant", "svdq_act", "svdq_gemm",
                           "svdq_wgt"))
        return getattr(self, "_" + name)(rng, bad)

    # attention-state merge
    def _merge(self, rng, bad):
        t = self.t
        b, s, h, d = rng.randint(1, 2), rng.randint(1, 200), rng.randint(1, 16), rng.choice((64, 128))
        dtype = rng.choice((t.bfloat16, t.float16))
        po, so = self._rn(b, s, h, d, dtype=dtype), self._rn(b, s, h, d + (8 if bad else 0), dtype=dtype)
        pl = self._rn(b, s, h, 1, dtype=t.float32, scale=4)
        sl = self._rn(b, s, h, 1, dtype=t.float32, scale=4)

        def check(got):
            out, lse = got
            want_out, want_lse = self.ref.merge_attn_states(po, pl, so, sl)
            # one rounding to the dtype (half an ulp) of an fp32 result a few fp32 ulps off (fast exp/log)
            _close(t, out, want_out.to(dtype), 2 * t.finfo(dtype).eps, atol=1e-5)
            _close(t, lse, want_lse.float(), 1e-5, atol=1e-5)
        return "fused_merge_attn_states", (po, pl, so, sl), check

    # FP8 per-token records
    def _quant(self, rng, bad):
        t = self.t
        shape = (rng.randint(1, 512), rng.choice((64, 128, 130, 1024))) if rng.random() < 0.7 else \
            (rng.randint(1, 8), rng.randint(1, 64), rng.choice((72, 128)))
        x = self._rn(*shape, dtype=t.float64 if bad else t.bfloat16, scale=3)

        def check(got):
            _fp8_roundtrip(t, self.ref.per_token_dequant(got), x)
        return "fp8_comm_per_token_quant", (x,), check

    def _dequant(self, rng, bad):
        t = self.t
        x = self._rn(rng.randint(1, 512), rng.choice((64, 128, 1024)), scale=3)
        rec = self.ref.per_token_quant(x)
        if bad:
            rec = rec[..., :1]  # a record shorter than its 2 scale bytes

        def check(got):
            _close(t, got, self.ref.per_token_dequant(rec), 2 ** -7)  # as tests/python/test_client_gpu.py
        return "fp8_comm_per_token_dequant", (rec,), check

    def _qkv_shape(self, rng):
        return rng.randint(1, 2), rng.randint(1, 64), rng.choice((1, 3)), rng.randint(1, 8), rng.choice((64, 128))

    def _qkv_quant(self, rng, bad):
        t = self.t
        b, s, p, n, d = self._qkv_shape(rng)
        x = self._rn(b, s, p, n, d, scale=2)
        if bad:
            x = x[..., 0]  # 4 dims

        def check(got):
            for i in range(p):
                _fp8_roundtrip(t, self.ref.qkv_permute_dequant(got[i]), x[:, :, i])
        return "fp8_comm_qkv_permute_quant", (x,), check

    def _qkv_dequant(self, rng, bad):
        t = self.t
        b, s, p, n, d = self._qkv_shape(rng)
        rec = self.ref.qkv_permute_quant(self._rn(b, s, p, n, d, scale=2))[p - 1]
        if bad:
            rec = rec.to(t.bfloat16)  # not records

        def check(got):
            _close(t, got, self.ref.qkv_permute_dequant(rec), 2 ** -7)
        return "fp8_comm_qkv_permute_dequant", (rec,), check

    # SVDQuant W4A4
    def _svdq_x(self, rng, layer):
        return self._rn(rng.randint(1, 300), layer["k"], dtype=layer["dtype"], scale=2)

    def _svdq_act(self, rng, bad):
        layer = rng.choice(self.layers)
        x = self._svdq_x(rng, layer)
        pad = rng.choice((1, 128, 256))
        args = (x, layer["down"], layer["smooth"] if layer["rank"] else None, False, False, -pad if bad else pad)

        def check(got):
            act, ascales, lora_act = got
            want_act, want_scales = self.sq.quantized_act_outputs(
                x.cpu(), layer["smooth_cpu"] if layer["rank"] else None, pad)
            _bitwise(act, want_act, "act")
            _bitwise(ascales, want_scales, "ascales")
            if layer["rank"]:
                t = self.t
                down = self.sq.unpack_lowrank(layer["down"].cpu(), down=True).double()
                want = x.cpu().double() @ down.t()
                err = (lora_act[:x.shape[0]].cpu().double() - want).abs()
                bound = 4 * x.shape[1] * t.finfo(t.float32).eps * (x.cpu().double().abs() @ down.abs().t())
                if not bool((err <= bound + 1e-30).all()):
                    raise AssertionError(f"lora_act: error {err.max():.3g}")
        return "svdq_quantize_w4a4_act_fuse_lora", args, check

    def _svdq_gemm(self, rng, bad):
        t, sq = self.t, self.sq
        layer = rng.choice(self.layers)
        x = self._svdq_x(rng, layer)
        act, ascales = (v.cuda() for v in sq.quantized_act_outputs(
            x.cpu(), layer["smooth_cpu"] if layer["rank"] else None, rng.choice((1, 256))))
        lora = layer["rank"] and rng.random() < 0.5
        lora_act = None
        if lora:
            lora_act = self._rn(act.shape[0], layer["rank"], dtype=t.float32)
        out_dtype = rng.choice((t.float16, t.bfloat16, t.float32))
        wgt = layer["qweight"][:, :-8] if bad else layer["qweight"]  # K that is no multiple of 64
        args = (act, wgt, ascales, layer["wscales"], lora_act, layer["up"] if lora else None, layer["bias"])

        def check(got):
            acc = sq.group_sum_faithful(act.cpu().float().to(t.int64), ascales.cpu().t(), layer["q"],
                                        layer["scales"]) + sq.unpack_channel_vector(layer["bias"].cpu()).float()
            if not lora:
                _bitwise(got, acc.to(out_dtype), "out")
                return
            la = lora_act.cpu().to(layer["dtype"]).double()
            up = sq.unpack_lowrank(layer["up"].cpu(), down=False).double()
            want = acc.double() + la @ up.t()
            mag = acc.double().abs() + la.abs() @ up.abs().t()
            eps = t.finfo(out_dtype).eps
            bound = 64 * t.finfo(t.float32).eps * mag + eps * want.abs() + t.finfo(out_dtype).smallest_normal
            err = (got.cpu().double() - want).abs()
            if not bool((err <= bound).all()):
                raise AssertionError(f"out ({out_dtype}): error {err.max():.3g}")
        return "svdq_gemm_w4a4", (args, out_dtype), check

    def _svdq_wgt(self, rng, bad):
        t, sq = self.t, self.sq
        dtype = rng.choice((t.bfloat16, t.float16))
        w = self._rn(rng.choice((128, 256)), 128 * rng.randint(1, 4) + (64 if bad else 0), dtype=dtype, scale=0.05)

        def check(got):
            qweight, wscales = got
            q, scales = sq.quantize_weight(w.cpu(), dtype)
            _bitwise(wscales, sq.pack_wscales(scales), "wscales")
            _bitwise(qweight, sq.pack_qweight(q), "qweight")
        return "svdq_quantize_w4a4_wgt", (w,), check


def _close(t, got, want, rel, atol=1e-6):
    got, want = got.float().cpu(), want.float().cpu()
    if got.shape != want.shape:
        raise AssertionError(f"shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    bound = rel * want.abs() + atol
    ok = (got - want).abs() <= bound
    ok |= t.isnan(got) & t.isnan(want)
    ok |= (got == want)  # equal infinities
    if not bool(ok.all()):
        raise AssertionError(f"error {(got - want).abs().nan_to_num(float('inf')).max():.3g} over {rel:.3g} relative")


def _fp8_roundtrip(t, decoded, x):
    """e4m3 keeps 3 mantissa bits (tests/python/test_client_gpu.py states the same bound)."""
    x, decoded = x.float().cpu(), decoded.float().cpu()
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448.0
    bound = x.abs() * (2 ** -4 + 2 ** -7) + scale * 2 ** -8 + 1e-6
    if not bool(((decoded - x).abs() <= bound).all()):
        raise AssertionError(f"fp8 round trip error {(decoded - x).abs().max():.3g}")


def _bitwise(actual, expected, what):
    import torch

    a, e = actual.contiguous().cpu(), expected.contiguous().cpu()
    if a.shape != e.shape or a.dtype != e.dtype:
        raise AssertionError(f"{what}: {tuple(a.shape)} {a.dtype}, expected {tuple(e.shape)} {e.dtype}")
    if not torch.equal(a.reshape(-1).view(torch.uint8), e.reshape(-1).view(torch.uint8)):
        raise AssertionError(f"{what}: bytes differ")


def worker(idx: int, directory: Path, seed: int, bad_rate: float, check_every: int, seconds: float = 0.0) -> None:
    """Calls until killed; writes ``w<idx>.<pid>.json`` (counters) each 0.5 s and appends error events."""
    import torch

    import cache_dit_opd
    from cache_dit_opd import kernels

    torch.set_num_threads(1)  # 16 workers on the host's cores: torch's default (one thread per core) each thrashes
    rng = random.Random(seed)
    pid = os.getpid()
    stats_path = directory / f"w{idx}.{pid}.json"
    events = open(directory / f"w{idx}.{pid}.events.jsonl", "a", buffering=1)
    c = {"idx": idx, "pid": pid, "calls": 0, "ok": 0, "checked": 0, "wrong": 0, "bad": 0, "errors": {},
         "first_ok": None, "last_ok": None}
    failing = 0  # consecutive daemon/session errors (a restart in progress)
    last_write = 0.0

    def event(kind, op, err=None, **extra):
        c["errors"][kind] = c["errors"].get(kind, 0) + 1
        events.write(json.dumps({"t": time.time(), "kind": kind, "op": op,
                                 "error": f"{type(err).__name__}: {str(err)[:300]}" if err else None, **extra}) + "\n")

    # A worker started while the GPU is full (the memory fill) cannot make its CUDA context or its inputs: that
    # is the fill's client_oom, and it tries again (the 10-minute run of 2026-12-04 counted 4 such exits as
    # findings). Past a minute it gives up: the fill holds the memory for seconds.
    give_up = time.time() + 60
    while True:
        try:
            torch.cuda.set_device(0)
            cases = Cases(torch, kernels, seed)
            break
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if "out of memory" not in str(e).lower() or time.time() > give_up:
                raise
            event(CLIENT_OOM, "start", e)
            write_json(stats_path, c)
            time.sleep(0.2)

    end = time.time() + seconds if seconds else float("inf")
    while time.time() < end:
        bad = rng.random() < bad_rate
        op, args, check = cases.next(rng, bad)
        c["calls"] += 1
        try:
            if op == "svdq_gemm_w4a4":
                gemm_args, out_dtype = args
                got = kernels.svdq_gemm_w4a4(*gemm_args, output_dtype=out_dtype)
            else:
                got = getattr(kernels, op)(*args)
        except (cache_dit_opd.DaemonUnavailableError, cache_dit_opd.SessionFailedError) as e:
            failing += 1
            event(DAEMON_DOWN if isinstance(e, cache_dit_opd.DaemonUnavailableError) else SESSION_FAILED, op, e)
            time.sleep(0.05)
            continue
        except torch.OutOfMemoryError as e:
            event(CLIENT_OOM, op, e)
            time.sleep(0.05)
            continue
        except (ValueError, RuntimeError, TypeError) as e:
            if bad:
                c["bad"] += 1
                c["errors"][BAD_REJECTED] = c["errors"].get(BAD_REJECTED, 0) + 1
            elif "out of memory" in str(e).lower():
                event(CLIENT_OOM, op, e)
            else:
                event(UNEXPECTED, op, e)
            continue
        if bad:
            event(BAD_ACCEPTED, op)
            continue
        now = time.time()
        c["ok"] += 1
        c["first_ok"] = c["first_ok"] or now
        c["last_ok"] = now
        if failing:
            events.write(json.dumps({"t": now, "kind": "recovered", "op": op, "after_errors": failing}) + "\n")
            failing = 0
        if c["calls"] % check_every == 0:
            try:
                torch.cuda.synchronize()
                check(got)
                c["checked"] += 1
            except AssertionError as e:
                c["wrong"] += 1
                event(WRONG, op, e)
            except torch.OutOfMemoryError as e:
                event(CLIENT_OOM, op, e)
        if now - last_write > 0.5:
            write_json(stats_path, c)
            last_write = now


def fill_memory(hold: float, result: Path) -> None:
    """Allocates the GPU's memory until allocation fails, holds it, writes what it took, exits."""
    import torch

    torch.cuda.set_device(0)
    blocks, taken, failures = [], 0, {}
    for size in (1 << 30, 64 << 20):
        while True:
            try:
                blocks.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
                taken += size
            except torch.OutOfMemoryError as e:
                failures[str(size)] = str(e).splitlines()[0][:200]
                break
    free, total = torch.cuda.mem_get_info()
    write_json(result, {"taken_bytes": taken, "free_after": free, "total": total, "failures": failures,
                        "t_full": time.time()})
    time.sleep(hold)


# -- orchestrator ------------------------------------------------------------------------------------


def _rss_and_fds(pid):
    try:
        rss = next(int(line.split()[1]) * 1024 for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("VmRSS:"))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration, TypeError):
        return None, None
    return rss, fds


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"


class Soak:
    def __init__(self, a):
        from bench.daemon import Daemon

        self.a = a
        self.out = Path(a.out)
        self.work = self.out / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        self.daemon = Daemon(Path(a.build) / "server" / "cache-dit-opd", self.work / "daemon", extra_flags=["--max-sessions", "64"])
        self.env = child_env(True, self.daemon.address, extra={"CACHE_DIT_OPD_BUILD_DIR": str(a.build)})
        self.workers: dict[int, object] = {}
        self.seed = 0
        self.samples, self.kills, self.restarts, self.fills, self.findings = [], [], [], [], []
        self.t0 = None

    def spawn_worker(self, idx):
        self.seed += 1
        cmd = [sys.executable, "-m", "bench.soak", "--worker", str(idx), "--dir", str(self.work),
               "--seed", str(1000 * idx + self.seed), "--bad-rate", str(self.a.bad_rate),
               "--check-every", str(self.a.check_every)]
        self.workers[idx] = spawn(cmd, self.env, self.work / f"w{idx}.log")

    def counters(self):
        total = {"calls": 0, "ok": 0, "checked": 0, "wrong": 0, "bad": 0, "errors": {}}
        latest = {}
        for f in self.work.glob("w*.json"):
            try:
                c = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            latest[(c["idx"], c["pid"])] = c
            for k in ("calls", "ok", "checked", "wrong", "bad"):
                total[k] += c[k]
            for k, v in c["errors"].items():
                total["errors"][k] = total["errors"].get(k, 0) + v
        return total, latest

    def events(self):
        out = []
        for f in self.work.glob("w*.events.jsonl"):
            for line in f.read_text().splitlines():
                try:
                    e = json.loads(line)
                except ValueError:
                    continue  # the last line of a worker killed while writing it
                e["worker"] = f.name.split(".")[0]
                out.append(e)
        return sorted(out, key=lambda e: e["t"])

    def sample(self):
        t = time.time()
        rss, fds = _rss_and_fds(self.daemon.pid) if self.daemon.alive() else (None, None)
        s = {"t": t, "daemon_pid": self.daemon.pid, "daemon_starts": self.daemon.starts, "rss": rss, "fds": fds}
        try:
            st = self.daemon.stats(timeout=2.0)
            s.update(sessions=st.sessions, mapped_bytes=st.mapped_bytes, regions=st.regions, calls=st.calls,
                     rejected=st.errors, session_pids=[x.client_pid for x in st.session])
            s["session_mapped"] = {x.client_pid: x.mapped_bytes for x in st.session}
        except Exception as e:  # noqa: BLE001  (down while restarting)
            s["stats_error"] = type(e).__name__
        s["counters"], _ = self.counters()
        # A session whose client died must be gone within the daemon's detection time (it watches the
        # session channel: at once). One sample of grace for a kill in flight.
        s["dead_client_sessions"] = [p for p in s.get("session_pids", []) if p and not _alive(p)]
        self.samples.append(s)
        return s

    def wait_cleanup(self, pid, timeout=10.0):
        t = time.time()
        while time.time() - t < timeout:
            try:
                st = self.daemon.stats(timeout=2.0)
            except Exception:  # noqa: BLE001
                time.sleep(0.02)
                continue
            if all(x.client_pid != pid for x in st.session):
                return time.time() - t, st
            time.sleep(0.005)
        return None, None

    def kill_worker(self, now):
        idx = random.Random(int(now)).choice(sorted(self.workers))
        p = self.workers[idx]
        before = self.daemon.stats(timeout=2.0)
        mapped_by_pid = {x.client_pid: x.mapped_bytes for x in before.session}
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        cleanup_s, after = self.wait_cleanup(p.pid)
        rec = {"t": now - self.t0, "worker": idx, "pid": p.pid, "cleanup_s": cleanup_s,
               "its_mapped_bytes": mapped_by_pid.get(p.pid), "sessions_before": before.sessions,
               "mapped_before": before.mapped_bytes}
        if after is not None:
            others_now = sum(x.mapped_bytes for x in after.session)
            rec.update(sessions_after=after.sessions, mapped_after=after.mapped_bytes,
                       mapped_consistent=after.mapped_bytes == others_now)
        else:
            self.findings.append(f"the session of killed worker {idx} (pid {p.pid}) was still open 10 s later")
        self.spawn_worker(idx)
        self.kills.append(rec)
        log(f"soak: killed worker {idx} (pid {p.pid}); session gone after "
            f"{'-' if cleanup_s is None else f'{cleanup_s * 1e3:.0f} ms'}")

    def restart_daemon(self, now):
        pid = self.daemon.pid
        self.daemon.kill()
        t_kill = time.time()
        self.daemon.start(timeout=120)
        t_serving = time.time()
        rec = {"t": now - self.t0, "old_pid": pid, "new_pid": self.daemon.pid, "kill": t_kill,
               "serving_after_s": t_serving - t_kill}
        self.restarts.append(rec)
        log(f"soak: daemon SIGKILLed and started again; serving after {rec['serving_after_s']:.1f} s")

    def run(self):
        a = self.a
        self.daemon.start(timeout=120)
        log(f"soak: daemon pid {self.daemon.pid}; starting {a.clients} workers")
        for i in range(a.clients):
            self.spawn_worker(i)
        deadline = time.time() + 300
        while time.time() < deadline:
            _, latest = self.counters()
            if sum(1 for c in latest.values() if c["ok"]) >= a.clients:
                break
            time.sleep(0.5)
        else:
            raise SystemExit("soak: not every worker made a call within 300 s; see " + str(self.work))
        self.t0 = time.time()
        log("soak: every worker calls; the clock starts")
        duration = a.minutes * 60
        daemon_kills = [duration * f for f in (0.35, 0.55)][:a.daemon_kills]
        fill_at = duration * 0.75
        next_kill = a.kill_every
        fill = None
        while (now := time.time()) - self.t0 < duration:
            el = now - self.t0
            self.sample()
            if daemon_kills and el >= daemon_kills[0]:
                daemon_kills.pop(0)
                self.restart_daemon(now)
            elif el >= next_kill:
                next_kill += a.kill_every
                # Not next to a daemon restart (the kill would count in its recovery), and not while the GPU
                # is full or about to be (the restarted worker could not create its CUDA context: the runs of
                # 2026-12-04 killed a worker in the second the fill started).
                quiet = not any(abs(el - r["t"]) < 10 for r in self.restarts) and (
                    fill_at - el > 10 if fill is None
                    else "end" in self.fills[-1] and time.time() > self.fills[-1]["end"] + 5)
                if quiet and self.daemon.alive():
                    try:
                        self.kill_worker(now)
                    except Exception as e:  # noqa: BLE001  (GetStats failed: say so, go on)
                        self.findings.append(f"client kill at {el:.0f} s: {type(e).__name__}: {e}")
            if fill is None and el >= fill_at:
                fill_result = self.work / "fill.json"
                fill = spawn([sys.executable, "-m", "bench.soak", "--fill-memory", str(fill_result), "--fill-hold",
                              str(a.fill_hold)], self.env, self.work / "fill.log")
                self.fills.append({"t": el, "start": now, "result": str(fill_result)})
                log("soak: a client fills the GPU's memory")
            if fill is not None and fill.poll() is not None and "end" not in self.fills[-1]:
                self.fills[-1].update(end=time.time(), exit=fill.returncode)
            for idx, p in list(self.workers.items()):
                if p.poll() is not None:
                    said = tail(self.work / f"w{idx}.log").strip().splitlines() or ["(empty log)"]
                    self.findings.append(f"worker {idx} (pid {p.pid}) exited by itself with status {p.returncode}: "
                                         + said[-1][:300])
                    self.spawn_worker(idx)
            if not self.daemon.alive():
                self.findings.append(f"the daemon exited outside the schedule (status {self.daemon.proc.returncode})")
                self.daemon.start(timeout=120)
            time.sleep(max(0.0, 1.0 - (time.time() - now)))
        self.sample()
        for p in self.workers.values():
            kill_group(p)
        if fill is not None:
            kill_group(fill)
        time.sleep(1.0)
        final = self.sample()
        self.daemon.stop()
        return self.report(final)

    def report(self, final):
        a = self.a
        events = self.events()
        windows = {"daemon_restart": [], "memory_fill": []}
        # A restart's window: from its kill until every worker has called again (each worker's first
        # recovery after this kill and before the next one), plus a second.
        kills = [r["kill"] for r in self.restarts] + [float("inf")]
        for r, next_kill in zip(self.restarts, kills[1:]):
            per_worker = {}
            for e in events:
                if e["kind"] == "recovered" and r["kill"] < e["t"] < next_kill:
                    per_worker.setdefault(e["worker"], e["t"])
            end = max(per_worker.values()) if per_worker else r["kill"] + 60
            r["workers_recovered"] = len(per_worker)
            r["all_recovered_after_s"] = (end - r["kill"]) if per_worker else None
            windows["daemon_restart"].append((r["kill"] - 1, end + 1))
        for f in self.fills:
            try:
                f.update(json.loads(Path(f["result"]).read_text()))
            except (OSError, ValueError):
                self.findings.append("the memory filler wrote no result")
            windows["memory_fill"].append((f["start"], f.get("end", time.time()) + 2))
        unexplained = {}
        for e in events:
            if e["kind"] == "recovered":
                continue
            win = EXPECTED_WHEN.get(e["kind"])
            if win and any(lo <= e["t"] <= hi for lo, hi in windows[win]):
                continue
            unexplained.setdefault(e["kind"], []).append(e)
        for kind, es in unexplained.items():
            self.findings.append(f"{len(es)} × {kind} outside any window that explains it; first: {es[0]}")
        # A kill in flight may show in one sample; a dead client's session in two consecutive ones is a leak.
        dead_twice = set()
        for s0, s1 in zip(self.samples, self.samples[1:]):
            dead_twice |= set(s0["dead_client_sessions"]) & set(s1["dead_client_sessions"])
        if dead_twice:
            self.findings.append(f"sessions of dead clients seen in consecutive samples: {sorted(dead_twice)}")
        minutes = self.per_minute(events)
        rss_check = self.rss_drift()
        total = final["counters"]
        summary = {"clients": a.clients, "minutes": a.minutes, "calls": total["calls"], "ok": total["ok"],
                   "checked": total["checked"], "wrong": total["wrong"], "bad_inputs": total["bad"],
                   "errors": total["errors"], "client_kills": len(self.kills), "daemon_restarts": len(self.restarts),
                   "final_sessions": final.get("sessions"), "final_mapped_bytes": final.get("mapped_bytes"),
                   "final_regions": final.get("regions"), "rss": rss_check, "findings": self.findings}
        data = {"summary": summary, "per_minute": minutes, "kills": self.kills, "restarts": self.restarts,
                "fills": self.fills, "samples": self.samples,
                "unexpected_events": [e for es in unexplained.values() for e in es][:200]}
        write_json(self.out / "soak.json", data)
        text = self.markdown(summary, minutes)
        (self.out / "soak.md").write_text(text)
        print(text)
        return 1 if self.findings or total["wrong"] else 0

    def per_minute(self, events):
        rows = []
        n = int(self.a.minutes)
        for m in range(n):
            lo, hi = self.t0 + 60 * m, self.t0 + 60 * (m + 1)
            ss = [s for s in self.samples if lo <= s["t"] < hi]
            if not ss:
                continue
            first = max((s for s in self.samples if s["t"] < lo), key=lambda s: s["t"], default=ss[0])
            c0, c1 = first["counters"], ss[-1]["counters"]
            kinds = {}
            for e in events:
                if lo <= e["t"] < hi and e["kind"] != "recovered":
                    kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
            bad = c1["errors"].get(BAD_REJECTED, 0) - c0["errors"].get(BAD_REJECTED, 0)
            if bad:
                kinds[BAD_REJECTED] = bad
            rss = [s["rss"] for s in ss if s.get("rss")]
            rows.append({"minute": m + 1, "calls": c1["calls"] - c0["calls"], "wrong": c1["wrong"] - c0["wrong"],
                         "checked": c1["checked"] - c0["checked"], "errors": kinds,
                         "rss_mib": (sum(rss) / len(rss) / 2 ** 20) if rss else None,
                         "mapped_mib": ss[-1].get("mapped_bytes", 0) / 2 ** 20, "sessions": ss[-1].get("sessions"),
                         "fds": ss[-1].get("fds"), "daemon_starts": ss[-1]["daemon_starts"]})
        return rows

    def rss_drift(self):
        """Per daemon start: VmRSS of its first full minute against its last (mean of the samples in each)."""
        out = []
        for start in sorted({s["daemon_starts"] for s in self.samples}):
            ss = [s for s in self.samples if s["daemon_starts"] == start and s.get("rss")]
            if len(ss) < 2:
                continue
            t0 = ss[0]["t"]
            first = [s["rss"] for s in ss if t0 + 60 <= s["t"] < t0 + 120]
            last = [s["rss"] for s in ss if s["t"] >= ss[-1]["t"] - 60]
            if not first or ss[-1]["t"] - t0 < 180:
                out.append({"start": start, "lived_s": ss[-1]["t"] - t0, "note": "lived under 3 minutes"})
                continue
            f, l_ = sum(first) / len(first), sum(last) / len(last)
            out.append({"start": start, "lived_s": ss[-1]["t"] - t0, "minute2_mib": f / 2 ** 20,
                        "last_minute_mib": l_ / 2 ** 20, "change": l_ / f - 1})
        return out

    def markdown(self, s, minutes):
        lines = [f"# Soak: {s['clients']} clients, {s['minutes']} minutes",
                 "",
                 f"calls {s['calls']}, succeeded {s['ok']}, checked against the reference {s['checked']}, "
                 f"**wrong {s['wrong']}**, bad inputs rejected {s['bad_inputs']}; client kills {s['client_kills']}, "
                 f"daemon restarts {s['daemon_restarts']}",
                 "",
                 "| minute | calls | checked | wrong | errors by kind | daemon RSS MiB | mapped MiB | sessions | fds | daemon start |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in minutes:
            errs = ", ".join(f"{k} {v}" for k, v in sorted(r["errors"].items())) or "-"
            lines.append(f"| {r['minute']} | {r['calls']} | {r['checked']} | {r['wrong']} | {errs} | "
                         f"{r['rss_mib'] or 0:.1f} | {r['mapped_mib']:.1f} | {r['sessions']} | {r['fds']} | "
                         f"{r['daemon_starts']} |")
        lines += ["", "Client kills (SIGKILL mid-call): the dead session gone after",
                  "", "| t s | worker | its mapped MiB | session gone after ms | sessions before/after | mapped = sum of sessions |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for k in self.kills:
            gone = "never" if k["cleanup_s"] is None else f"{k['cleanup_s'] * 1e3:.0f}"
            lines.append(f"| {k['t']:.0f} | {k['worker']} | {(k['its_mapped_bytes'] or 0) / 2 ** 20:.1f} | {gone} | "
                         f"{k['sessions_before']}/{k.get('sessions_after', '-')} | {k.get('mapped_consistent', '-')} |")
        lines += ["", "Daemon restarts (SIGKILL under load, started again at once):", "",
                  "| t s | serving again after s | every worker calling again after s | workers recovered |",
                  "| --- | --- | --- | --- |"]
        for r in self.restarts:
            allr = r.get("all_recovered_after_s")
            lines.append(f"| {r['t']:.0f} | {r['serving_after_s']:.2f} | {'-' if allr is None else f'{allr:.2f}'} | "
                         f"{r.get('workers_recovered')} |")
        for f in self.fills:
            lines += ["", f"GPU memory filled at {f['t']:.0f} s: {f.get('taken_bytes', 0) / 2 ** 30:.1f} GiB taken, "
                      f"{f.get('free_after', 0) / 2 ** 20:.0f} MiB left free; held {self.a.fill_hold:.0f} s"]
        lines += ["", "Daemon RSS per start (mean of its second minute against its last):", ""]
        for r in s["rss"]:
            if "change" in r:
                lines.append(f"- start {r['start']}: {r['minute2_mib']:.1f} MiB -> {r['last_minute_mib']:.1f} MiB "
                             f"({r['change'] * 100:+.2f}%) over {r['lived_s']:.0f} s")
            else:
                lines.append(f"- start {r['start']}: {r['note']} ({r['lived_s']:.0f} s)")
        lines += ["", f"Final: sessions {s['final_sessions']}, regions {s['final_regions']}, mapped bytes "
                  f"{s['final_mapped_bytes']} (every worker killed 1 s before)", "",
                  "Findings: " + ("none" if not s["findings"] else ""), *[f"- {f}" for f in s["findings"]], ""]
        return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", default=str(REPO / "build"), help="build directory (default <repo>/build)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "soak"), help="report and work directory")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--kill-every", type=float, default=30.0, help="seconds between client kills")
    p.add_argument("--daemon-kills", type=int, default=2)
    p.add_argument("--fill-hold", type=float, default=15.0)
    p.add_argument("--bad-rate", type=float, default=0.01)
    p.add_argument("--check-every", type=int, default=8)
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--fill-memory", help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, default=0.0, help=argparse.SUPPRESS)  # a worker's run time (0: until killed)
    a = p.parse_args(argv)
    if a.worker is not None:
        worker(a.worker, Path(a.dir), a.seed, a.bad_rate, a.check_every, a.seconds)
        return 0
    if a.fill_memory:
        fill_memory(a.fill_hold, Path(a.fill_memory))
        return 0
    return Soak(a).run()


if __name__ == "__main__":
    sys.exit(main())
