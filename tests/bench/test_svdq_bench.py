"""bench/svdq.py's schedule comparison on the CPU: each schedule's GEMM times come from a child process run
with CACHE_DIT_SVDQ_GEMM set to that schedule (the variable is read once per process), and each is reported
against the default schedule's time of the same run. The child itself needs a GPU; here it is replaced by one
that answers with fixed times, so what is checked is the hand-off and the arithmetic."""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from bench import svdq  # noqa: E402


def rows():
    return [{"m": 4608, "k": 3072, "n": 3072, "us": {"gemm": 180.0}},
            {"m": 256, "k": 3072, "n": 3072, "us": {"gemm": 36.0}}]


def test_each_schedule_runs_in_a_child_with_its_variable_and_is_compared_to_the_default(monkeypatch):
    calls = []

    def fake_run(cmd, check, env):
        assert check
        shapes = json.loads(cmd[cmd.index("--gemm-only") + 1])
        # multicast halves the time of the first shape, persistent slows the second down 2x
        times = {"sm90-multicast": [90e-6, 36e-6], "sm90-persistent": [180e-6, 72e-6]}[env["CACHE_DIT_SVDQ_GEMM"]]
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(times[:len(shapes)]))
        calls.append((env["CACHE_DIT_SVDQ_GEMM"], shapes))

    monkeypatch.setattr(svdq.subprocess, "run", fake_run)
    r = rows()
    svdq.schedule_rows(Path("lib.so"), r, 5, ["sm90-persistent", "sm90-multicast"])
    assert calls == [("sm90-persistent", [[4608, 3072, 3072], [256, 3072, 3072]]),
                     ("sm90-multicast", [[4608, 3072, 3072], [256, 3072, 3072]])]
    mc = r[0]["schedules"]["sm90-multicast"]
    assert abs(mc["gemm_us"] - 90.0) < 1e-9 and abs(mc["vs_default"] - 2.0) < 1e-9
    assert abs(mc["tflops"] - 2 * 4608 * 3072 * 3072 / 90e-6 / 1e12) < 1e-6
    assert abs(r[1]["schedules"]["sm90-persistent"]["vs_default"] - 0.5) < 1e-9

    table = svdq.schedule_table(r).splitlines()
    # columns in SCHEDULES' order, whatever order they were run in
    assert table[0] == "| M | K | N | default GEMM us | sm90-multicast us (x default) | sm90-persistent us (x default) |"
    assert table[2] == "| 4608 | 3072 | 3072 | 180.0 | 90.0 (2.00) | 180.0 (1.00) |"
    assert table[3] == "| 256 | 3072 | 3072 | 36.0 | 36.0 (1.00) | 72.0 (0.50) |"


def test_no_schedules_no_table():
    assert svdq.schedule_table(rows()) == ""
