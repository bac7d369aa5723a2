"""Python client and daemon-process tests (never loads the kernel library in-process)."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

# Before anything imports grpc: grpcio's core registers fork handlers (pthread_atfork) by default, and every
# fork() of this process with channels live then runs them; one (subprocess with a preexec_fn, opdctl run as
# another uid) hung the suite in gRPC's prepare-fork handler. The tests fork only to exec or to run code that
# makes channels of its own, which needs no fork support; without it gRPC registers no handler.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device and the built daemon")


@pytest.fixture(scope="module")
def gpu_daemon():
    """The real daemon (not fake device ops) on GPU 0, one per test module; its address for child processes."""
    import _client_fixtures as fx

    d = fx.daemon(None, fake=False)
    yield d
    d.stop()
