"""Python client and daemon-process tests (never loads the kernel library in-process)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device and the built daemon")


@pytest.fixture(scope="module")
def gpu_daemon():
    """The real daemon (not fake device ops) on GPU 0, one per test module; its address for child processes."""
    import _client_fixtures as fx

    d = fx.daemon(None, fake=False)
    yield d
    d.stop()
