"""bench/scaling.py's executor sweep on the CPU: each count gets a daemon of its own (the fake-device daemon
here, with the run's daemon's flags), the group runs against it, and the run's daemon is back afterwards."""

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from bench import scaling  # noqa: E402
from bench.daemon import Daemon  # noqa: E402

FAKE_DAEMON = Path(os.environ.get("CACHE_DIT_OPD_BUILD_DIR", REPO / "build")) / "tests" / "fake_daemon" / "opd_fake_daemon"


def executor_threads_of(pid: int) -> list[str]:
    names = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        name = (task / "comm").read_text().strip()
        if name.startswith("opd-exec"):
            names.append(name)
    return sorted(names)


def test_run_daemon_threads_reads_the_last_flag_given():
    assert scaling.run_daemon_threads([]) == 1
    assert scaling.run_daemon_threads(["--spin-us", "0", "--executor-threads", "3"]) == 3
    assert scaling.run_daemon_threads(["--executor-threads", "3", "--executor-threads=2"]) == 2


def test_each_count_gets_a_daemon_of_its_own_and_the_runs_daemon_comes_back(tmp_path, monkeypatch):
    if not FAKE_DAEMON.exists():
        if os.environ.get("CACHE_DIT_OPD_REQUIRE_BUILD") == "1":
            pytest.fail(f"{FAKE_DAEMON} is not built")
        pytest.skip(f"{FAKE_DAEMON} is not built")
    main = Daemon(FAKE_DAEMON, tmp_path / "main", extra_flags=["--spin-us", "0"]).start(timeout=60)
    try:
        seen = []

        def fake_group(r, mode, nprocs, phases, window, tag=""):
            d = r.daemon
            seen.append({"address": d.address, "flags": d.flags, "threads": executor_threads_of(d.pid),
                         "mode": mode, "nprocs": nprocs, "phases": phases, "tag": tag})
            return {"status": "ok", "phases": []}

        monkeypatch.setattr(scaling, "group", fake_group)
        r = SimpleNamespace(daemon=main, tmp=tmp_path, remaining=lambda: 1000.0)
        out = scaling.executor_sweep(r, 8, [2, 3], 1.0)
        assert r.daemon is main and main.alive()
        assert set(out) == {"2", "3"} and all(g["status"] == "ok" for g in out.values())
        assert [s["threads"] for s in seen] == [["opd-exec-0", "opd-exec-1"],
                                                 ["opd-exec-0", "opd-exec-1", "opd-exec-2"]]
        for s, t in zip(seen, (2, 3)):
            assert s["address"] != main.address
            assert s["flags"][-4:] == ["--spin-us", "0", "--executor-threads", str(t)]
            assert (s["mode"], s["nprocs"], s["phases"], s["tag"]) == (scaling.CLIENT, 8, [scaling.SWEEP_LOAD],
                                                                         f"-executors-{t}")
        assert executor_threads_of(main.pid) == ["opd-exec"]  # one thread: the name alone
        busy = main.executor_busy_ns()  # GetStats: one figure per executor thread
        assert isinstance(busy, list) and len(busy) == 1 and busy[0] >= 0, busy
        assert main.stage_p50_us() == {}  # GetStats' stages: none before the first call
        out = scaling.executor_sweep(SimpleNamespace(daemon=main, tmp=tmp_path / "late", remaining=lambda: 10.0),
                                     8, [2], 1.0)
        assert out == {"2": {"status": "skipped", "error": "time budget spent"}}
    finally:
        main.kill()


def test_a_phase_reports_each_executor_threads_busy_share_of_its_window():
    rows = [{"calls": 10, "t_done": 2.0, "t_issue_end": 1.9}, {"calls": 30, "t_done": 1.5, "t_issue_end": 1.4}]
    out = scaling.aggregate({"bound": "launch"}, rows, 0.0, 2.0, 1.0, [1.0, 0.5])
    assert out["executor_busy_pct"] == [50.0, 25.0] and out["daemon_cpu_pct"] == 50.0
    assert out["calls"] == 40 and out["calls_per_s"] == 20.0
    assert abs(out["executor_busy_us_per_call"] - 1.5 / 2.0 / 20.0 * 1e6) < 1e-6  # 0.75 s busy a second, 20 calls
    assert scaling.aggregate({"bound": "launch"}, rows, 0.0, 2.0, None)["executor_busy_pct"] is None
    stages = {"accept": 3.0, "inputs_wait": 50.0, "run": 9.0}
    assert scaling.aggregate({"bound": "launch"}, rows, 0.0, 2.0, 1.0, [1.0], stages)["stage_p50_us"] == stages


def test_a_phase_with_a_window_of_its_own_is_measured_over_it(tmp_path):
    # The idle phase's window is its own (the daemon's CPU counts in 10 ms ticks: a longer window reads
    # an idle daemon finer); the group's window is for the loads.
    cpu = iter([1.0, 1.05])
    def no_stages():
        raise AssertionError("an idle phase's stages would be the previous load's")

    r = SimpleNamespace(daemon=SimpleNamespace(cpu_seconds=lambda: next(cpu), executor_busy_ns=lambda: [0],
                                               stage_p50_us=no_stages))
    t = time.monotonic()
    out = scaling.run_phase(r, tmp_path, 0, {"bound": "idle", "op": None, "window_s": 0.2}, [], 1.0, 5.0)
    assert 0.2 <= time.monotonic() - t < 1.0
    assert out["window_s"] == 0.2 and abs(out["daemon_cpu_pct"] - 25.0) < 1e-9
    assert scaling.IDLE["window_s"] > scaling.params(True, None)["window_s"]
