"""bench/svdq.py's schedule comparison on the CPU: each schedule's GEMM times come from a child process run
with CACHE_DIT_SVDQ_GEMM set to that schedule (the variable is read once per process), and each is reported
against the default schedule timed the same way, in a child before the others and one after them. The child
itself needs a GPU; here it is replaced by one that answers with fixed times, so what is checked is the
hand-off, the order and the arithmetic."""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from bench import svdq  # noqa: E402


def rows():
    return [{"m": 4608, "k": 3072, "n": 3072, "us": {"gemm": 180.0}},
            {"m": 256, "k": 3072, "n": 3072, "us": {"gemm": 36.0}}]


def test_each_schedule_runs_in_a_child_between_two_default_children_and_is_compared_to_their_mean(monkeypatch):
    calls = []
    # the default's second child is 10% slower on the first shape than its first (drift)
    default_runs = iter([[100e-6, 36e-6], [110e-6, 36e-6]])

    def fake_run(cmd, check, env):
        assert check
        shapes = json.loads(cmd[cmd.index("--gemm-only") + 1])
        name = env["CACHE_DIT_SVDQ_GEMM"]
        # multicast halves the first shape's default time, persistent slows the second down 2x
        times = next(default_runs) if name == "sm90" else {
            "sm90-multicast": [52.5e-6, 36e-6], "sm90-persistent": [105e-6, 72e-6]}[name]
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(times[:len(shapes)]))
        calls.append((name, shapes))

    monkeypatch.setattr(svdq.subprocess, "run", fake_run)
    r = rows()
    svdq.schedule_rows(Path("lib.so"), r, 5, ["sm90-persistent", "sm90-multicast"])
    both = [[4608, 3072, 3072], [256, 3072, 3072]]
    assert calls == [("sm90", both), ("sm90-persistent", both), ("sm90-multicast", both), ("sm90", both)]
    assert abs(r[0]["default_child"]["gemm_us"] - 105.0) < 1e-9 and abs(r[0]["default_child"]["drift"] - 1.1) < 1e-9
    mc = r[0]["schedules"]["sm90-multicast"]
    assert abs(mc["gemm_us"] - 52.5) < 1e-9 and abs(mc["vs_default"] - 2.0) < 1e-9
    assert abs(mc["tflops"] - 2 * 4608 * 3072 * 3072 / 52.5e-6 / 1e12) < 1e-6
    assert abs(r[1]["schedules"]["sm90-persistent"]["vs_default"] - 0.5) < 1e-9

    table = svdq.schedule_table(r).splitlines()
    # columns in SCHEDULES' order, whatever order they were run in; the parent's own GEMM time (180 us) is not
    # the baseline
    assert table[0] == ("| M | K | N | default GEMM us (after / before) | sm90-multicast us (x default) | "
                        "sm90-persistent us (x default) |")
    assert table[2] == "| 4608 | 3072 | 3072 | 105.0 (1.10) | 52.5 (2.00) | 105.0 (1.00) |"
    assert table[3] == "| 256 | 3072 | 3072 | 36.0 (1.00) | 36.0 (1.00) | 72.0 (0.50) |"


def test_no_schedules_no_children_no_table(monkeypatch):
    monkeypatch.setattr(svdq.subprocess, "run", lambda *a, **k: pytest.fail("no child without schedules"))
    r = rows()
    svdq.schedule_rows(Path("lib.so"), r, 5, [])
    assert "default_child" not in r[0]
    assert svdq.schedule_table(r) == ""
