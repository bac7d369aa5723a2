"""The benchmark of issue 7: ``bench/run.sh [--quick] [--build DIR] [--out DIR]`` (= ``python -m bench``).

Starts its own daemon from the build directory (private socket in a temporary
directory), records the environment, runs the cases one after the other, each
in child processes with timeouts (a failing case records its error and the run
goes on), and writes ``<out>/<date>-<gpu>[-quick].json`` after every case, then
the markdown table and the PNG plot beside it, and prints the table. A full
run also updates bench/README.md's latest-results section.

Cases (bench/README.md says how each is measured): latency (Python client per
mode and in-process), cpp_client, pipelined, regions, kernels, scaling, svdq
(the W4A4 linear in-process and through the daemon).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import cpp_client, kernel_case, latency, mps, regions, report, scaling, svdq_case, throughput  # noqa: E402
from bench.common import REPO, error_text, log, write_json  # noqa: E402
from bench.daemon import Daemon, DaemonError  # noqa: E402
from bench.runner import Runner, Settings, start_daemon  # noqa: E402

# In order of what the targets need most, the most expensive of them last, then what no target
# covers (svdq: reported): when the time budget runs out, what is cut is recorded as skipped.
CASES = {
    "latency": latency.run,
    "cpp_client": cpp_client.run,
    "pipelined": throughput.run,
    "regions": regions.run,
    "kernels": kernel_case.run,
    "scaling": scaling.run,
    "svdq": svdq_case.run,
}
SCHEMA = "cache-dit-opd-bench/1"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench/run.sh", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", type=Path, help="build directory (default: build-gpu if it exists, else build)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="results directory")
    ap.add_argument("--quick", action="store_true", help="fewer calls, shapes and processes (about 2 minutes)")
    ap.add_argument("--device", type=int, default=0, help="CUDA ordinal (default 0)")
    ap.add_argument("--only", help=f"comma-separated cases to run, of: {', '.join(CASES)}")
    ap.add_argument("--budget-s", type=float, help="wall-time budget: cases past it are skipped and children "
                                                    "are cut (default 300, --quick 180)")
    ap.add_argument("--scaling-window-s", type=float, help="seconds each many-process phase runs "
                                                           "(default 2.5, --quick 1)")
    ap.add_argument("--daemon-args", default="", help="extra daemon flags, one string (e.g. '--spin-us 100')")
    ap.add_argument("--mps", action="store_true", help="run the daemon and every client under a private MPS "
                                                        "server (bench/mps.py); results get a -mps suffix")
    ap.add_argument("--no-readme", action="store_true", help="do not update bench/README.md")
    ap.add_argument("--keep-tmp", action="store_true", help="keep the temporary directory (logs of every child)")
    args = ap.parse_args(argv)
    if args.only:
        unknown = sorted(set(args.only.split(",")) - set(CASES))
        if unknown:
            ap.error(f"--only: unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    return args


def fail(msg: str, code: int = 2) -> int:
    print(f"bench: {msg}", file=sys.stderr)
    return code


def check_cuda(device: int):
    """torch, or a sentence saying why this machine cannot run the benchmark."""
    try:
        import torch
    except ImportError as e:
        return None, f"PyTorch is not importable ({e}); run on the CUDA host with torch installed"
    if not torch.cuda.is_available():
        return None, "no CUDA device is visible (torch.cuda.is_available() is False); run this on the GPU host"
    if device >= torch.cuda.device_count():
        return None, f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible"
    return torch, None


def default_build() -> Path:
    return REPO / "build-gpu" if (REPO / "build-gpu").is_dir() else REPO / "build"


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200'; 'NVIDIA GeForce RTX 4090' -> 'geforce-rtx-4090'."""
    s = re.sub(r"^nvidia\s+", "", name.strip().lower())
    return re.sub(r"[^a-z0-9]+", "-", s).strip("-") or "gpu"


def _out(*cmd) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def environment(torch, device: int, lib: Path) -> dict:
    """GPU, driver, CUDA, torch, git commit (kernels.environment) and the host around them."""
    env: dict = {}
    try:
        from bench import kernels

        env.update(kernels.environment(str(lib)))
        env.pop("timing", None)  # the kernels case records its own
    except Exception as e:  # noqa: BLE001  (the run is still worth having)
        env["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
    env["gpu"] = torch.cuda.get_device_name(device)
    env["device"] = device
    env["git_dirty"] = bool(_out("git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"))
    env["python"] = platform.python_version()
    env["cpu"] = _cpu_model()
    env["cpu_count"] = os.cpu_count()
    env["pytorch_cuda_alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + " (unset in children)"
    return env


def case_status(out: dict) -> str:
    """ok / partial / error from the children's statuses under a case's result."""
    subs = []
    for key in ("modes", "remote", "shapes"):
        if isinstance(out.get(key), dict):
            subs += [v for v in out[key].values() if isinstance(v, dict)]
    subs += [v for v in out.get("runs") or [] if isinstance(v, dict)]
    if isinstance(out.get("inproc"), dict):
        subs.append(out["inproc"])
    states = {("error" if "error" in s or s.get("status") == "error" else "ok") for s in subs}
    if not subs:
        return "error" if "error" in out else "ok"
    return "ok" if states == {"ok"} else ("error" if states == {"error"} else "partial")


def run_case(r: Runner, name: str, fn) -> dict:
    if r.remaining() < 10:
        log(f"== {name}: skipped (time budget spent)")
        return {"status": "skipped", "error": "time budget spent"}
    log(f"== {name}")
    t0 = time.monotonic()
    try:
        r.ensure_daemon()
        out = fn(r)
        out["status"] = out.get("status") if out.get("status") in ("skipped", "error") else case_status(out)
    except Exception as e:  # noqa: BLE001  (this case fails; the next one runs)
        out = {"status": "error", "error": error_text(e)}
    finally:
        r.kill_all()
    out["case_wall_s"] = round(time.monotonic() - t0, 1)
    if not r.daemon.alive():
        out["daemon_died"] = {"exit_status": r.daemon.proc.returncode if r.daemon.proc else None,
                              "log_tail": r.daemon.log_tail()}
    log(f"== {name}: {out['status']} in {out['case_wall_s']:.1f} s")
    return out


def _stats(daemon: Daemon):
    from bench.daemon import message_to_dict

    try:
        return message_to_dict(daemon.stats())
    except Exception as e:  # noqa: BLE001
        return {"error": str(e)[:300]}


def _interrupt(signum, _frame):
    """SIGTERM/SIGHUP end the run like Ctrl-C: children and daemon stopped, the JSON written."""
    raise KeyboardInterrupt(f"signal {signum}")


def result_path(args, gpu: str, date: str) -> Path:
    """<out>/<date>-<gpu>[-quick][-mps][-<cases>].json (a quick, MPS or partial run never overwrites a full
    one)."""
    stem = f"{date}-{gpu_slug(gpu)}" + ("-quick" if args.quick else "") + ("-mps" if args.mps else "") + (
        "-" + args.only.replace(",", "+") if args.only else "")
    args.out.mkdir(parents=True, exist_ok=True)
    return args.out.resolve() / f"{stem}.json"


def run_cases(args, res: dict, json_path: Path, runner: Runner) -> None:
    """Every selected case in order; the JSON is rewritten after each (an interrupted run keeps them)."""
    selected = args.only.split(",") if args.only else list(CASES)
    for name in (n for n in CASES if n in selected):
        res["cases"][name] = run_case(runner, name, CASES[name])
        write_json(json_path, res)
    res["daemon"]["stats_at_end"] = _stats(runner.daemon) if runner.daemon.alive() else None


def finalize(res: dict, daemon: Daemon, runner: Runner | None, t_start: float) -> None:
    """Children and daemon stopped, what they left recorded, the targets evaluated."""
    if runner is not None:
        runner.kill_all()
        res["daemon"]["restarts"] = runner.restarts
    res["daemon"]["exit_status"] = daemon.stop()
    if res["daemon"].get("restarts") or res["daemon"]["exit_status"] not in (0, None):
        res["daemon"]["log_tail"] = daemon.log_tail()
    res["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    res["wall_s"] = round(time.monotonic() - t_start, 1)
    res["targets"] = report.evaluate(res)


def publish(args, res: dict, json_path: Path) -> None:
    """The markdown and the plot beside the JSON, the README's latest section (full runs), the table."""
    md = report.render(json_path)
    if not (args.quick or args.only or args.no_readme) and json_path.parent == (REPO / "bench" / "results").resolve():
        report.update_readme(json_path)
    print(md)
    errors = [n for n, c in res["cases"].items() if c.get("status") != "ok"]
    log(f"done in {res['wall_s']:.0f} s: {json_path.with_suffix('.md').name}, {json_path.with_suffix('.png').name}"
        + (f"; not ok: {', '.join(errors)} (see the Errors section)" if errors else ""))


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.mps:
        return run(args, argv, None)
    # The control socket's path must stay under 107 bytes; the folder is left for the control daemon, which
    # quits after this process exits (bench/mps.py).
    tmp = Path(tempfile.mkdtemp(prefix="cdo-mps-", dir="/tmp"))
    try:
        with mps.private_mps(tmp) as info:  # before any CUDA context, this process's included
            return run(args, argv, info)
    except mps.MpsError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        return fail(str(e))


def run(args, argv, mps_info: dict | None) -> int:
    t_start = time.monotonic()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    torch, why = check_cuda(args.device)
    if torch is None:
        return fail(why)
    build = (args.build or default_build()).resolve()
    lib, binary = build / "kernels" / "libcache_dit_cuda_ops.so", build / "server" / "cache-dit-opd"
    missing = [str(p) for p in (binary, lib) if not p.is_file()]
    if missing:
        return fail(f"not built: {', '.join(missing)} (build first, or pass --build DIR)")
    # --quick runs take 95-125 s on the H200 hosts: a 120 s budget left the last case (svdq) seconds.
    budget = args.budget_s or (180.0 if args.quick else 300.0)
    gpu, date = torch.cuda.get_device_name(args.device), datetime.date.today().isoformat()
    json_path = result_path(args, gpu, date)
    tmp = Path(tempfile.mkdtemp(prefix="cdo-bench-", dir="/tmp"))  # short: AF_UNIX paths are <= 107 bytes
    log(f"{'quick' if args.quick else 'full'} run on {gpu}: results -> {json_path}; logs in {tmp}")
    res = {"schema": SCHEMA, "suite": "quick" if args.quick else "full", "date": date,
           "started": datetime.datetime.now().isoformat(timespec="seconds"),
           "command": " ".join(["bench/run.sh", *(argv if argv is not None else sys.argv[1:])]),
           "build": str(build), "budget_s": budget, "env": {}, "daemon": {}, "cases": {}}
    daemon = Daemon(binary, tmp, args.device, shlex.split(args.daemon_args))
    runner, code = None, 0
    try:
        res["daemon"] = start_daemon(daemon)
        res["env"] = environment(torch, args.device, lib)
        res["env"]["mps"] = f"private server ({mps_info['cuda_mps_pipe_directory']})" if mps_info else "off"
        write_json(json_path, res)
        runner = Runner(Settings(quick=args.quick, device=args.device, build=build, lib=lib,
                                 scaling_window_s=args.scaling_window_s), daemon, tmp, deadline=t_start + budget)
        run_cases(args, res, json_path, runner)
    except DaemonError as e:
        res["daemon"] = {"command": daemon.command, "error": str(e)}
        log(f"cannot start the daemon: {e}")
        code = 1
    except KeyboardInterrupt:
        log("interrupted: writing what was measured")
        res["interrupted"] = True
        code = 130
    finally:
        finalize(res, daemon, runner, t_start)
        write_json(json_path, res)
        if args.keep_tmp:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if code != 1:
        publish(args, res, json_path)
    return code


if __name__ == "__main__":
    sys.exit(main())
