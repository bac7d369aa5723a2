"""bench/mps.py on the CPU: a stand-in nvidia-cuda-mps-control on PATH records how the run starts and stops
its private MPS server and what environment the run's processes see."""

import json
import os
import stat
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from bench import mps  # noqa: E402
from bench.__main__ import main, result_path  # noqa: E402

# Appends {"argv", "stdin", "pipe", "log"} to $MPS_FAKE_LOG; `-d` exits with $MPS_FAKE_RC (default 0); a
# command read from stdin is answered after $MPS_FAKE_QUIT_S seconds (the real `quit` answers only once every
# MPS client has exited).
FAKE = """#!/usr/bin/env python3
import json, os, sys, time
stdin = "" if "-d" in sys.argv[1:] else sys.stdin.read()
with open(os.environ["MPS_FAKE_LOG"], "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "stdin": stdin, "pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
                        "log": os.environ.get("CUDA_MPS_LOG_DIRECTORY")}) + "\\n")
if "-d" in sys.argv[1:] and os.environ.get("MPS_FAKE_RC", "0") != "0":
    print("An instance of this daemon is already running", file=sys.stderr)
    sys.exit(int(os.environ["MPS_FAKE_RC"]))
if stdin:
    time.sleep(float(os.environ.get("MPS_FAKE_QUIT_S", "0")))
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / mps.CONTROL
    exe.write_text(FAKE)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("MPS_FAKE_LOG", str(log))
    for k in mps.ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    def calls(at_least: int = 0) -> list[dict]:
        """The stand-in's calls so far, waiting up to 10 s for `at_least` of them (the quit is not waited for)."""
        deadline = time.monotonic() + 10
        while True:
            got = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
            if len(got) >= at_least or time.monotonic() > deadline:
                return got
            time.sleep(0.01)

    return calls


def test_the_run_is_an_mps_client_of_its_own_server_which_quits_at_the_end(tmp_path, fake_control):
    run_dir = tmp_path / "run"
    with mps.private_mps(run_dir) as info:
        inside = {k: os.environ.get(k) for k in mps.ENV_KEYS}
        calls = fake_control()
        assert [c["argv"] for c in calls] == [["-d"]]  # started once, nothing else yet
    assert inside["CUDA_MPS_PIPE_DIRECTORY"] == str(run_dir / "mps-pipe") == info["cuda_mps_pipe_directory"]
    assert inside["CUDA_MPS_LOG_DIRECTORY"] == str(run_dir / "mps-log")
    assert (run_dir / "mps-pipe").is_dir() and (run_dir / "mps-log").is_dir()
    start, stop = fake_control(2)
    assert start["pipe"] == inside["CUDA_MPS_PIPE_DIRECTORY"] and start["log"] == inside["CUDA_MPS_LOG_DIRECTORY"]
    assert stop["argv"] == [] and stop["stdin"].strip() == "quit"
    assert stop["pipe"] == start["pipe"]  # the quit reaches the same control daemon
    assert all(os.environ.get(k) is None for k in mps.ENV_KEYS)  # restored


def test_the_server_quits_and_the_environment_comes_back_when_the_run_fails(tmp_path, fake_control, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps")
    with pytest.raises(KeyboardInterrupt):
        with mps.private_mps(tmp_path / "run"):
            raise KeyboardInterrupt
    assert [c["argv"] for c in fake_control(2)] == [["-d"], []]
    assert os.environ["CUDA_MPS_LOG_DIRECTORY"] == "/var/log/nvidia-mps"
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ


def test_leaving_does_not_wait_for_the_quit_to_be_answered(tmp_path, fake_control, monkeypatch):
    # This process is an MPS client until it exits, so the real quit would never be answered in time.
    monkeypatch.setenv("MPS_FAKE_QUIT_S", "30")
    with mps.private_mps(tmp_path / "run"):
        leaving = time.monotonic()
    assert time.monotonic() - leaving < 10
    assert fake_control(2)[1]["stdin"].strip() == "quit"  # sent, and the stand-in is sleeping on it


def test_a_control_daemon_that_does_not_start_is_an_error_naming_it(tmp_path, fake_control, monkeypatch):
    monkeypatch.setenv("MPS_FAKE_RC", "3")
    with pytest.raises(mps.MpsError, match=r"nvidia-cuda-mps-control -d exited with 3: An instance"):
        with mps.private_mps(tmp_path / "run"):
            pytest.fail("the block ran without a server")
    assert [c["argv"] for c in fake_control()] == [["-d"]]  # nothing to quit
    assert all(os.environ.get(k) is None for k in mps.ENV_KEYS)


def test_no_control_binary_fails_the_run_before_anything_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    assert main(["--mps", "--out", str(tmp_path / "out")]) == 2
    assert "nvidia-cuda-mps-control is not on PATH" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_mps_run_never_overwrites_the_plain_one(tmp_path):
    args = lambda **kw: SimpleNamespace(**{"quick": True, "only": None, "mps": False, "out": tmp_path, **kw})
    name = lambda a: result_path(a, "NVIDIA H200", "2026-12-06").name
    assert name(args()) == "2026-12-06-h200-quick.json"
    assert name(args(mps=True)) == "2026-12-06-h200-quick-mps.json"
    assert name(args(mps=True, only="pipelined,scaling")) == "2026-12-06-h200-quick-mps-pipelined+scaling.json"
