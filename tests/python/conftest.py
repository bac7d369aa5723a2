"""Python client and daemon-process tests (never loads the kernel library in-process)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device and the built daemon")
