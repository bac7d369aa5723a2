"""Kernel-library tests: the library is loaded IN this process.

The Python client package defines the same namespace (cache_dit_cuda_ops)
through torch.library, and one process can hold only one definition, so these
tests run in their own pytest process, apart from tests/python.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "kernels"))  # reference.py


def build_dir() -> Path:
    return Path(os.environ.get("CACHE_DIT_OPD_BUILD_DIR", REPO / "build"))


def library_path() -> Path:
    return build_dir() / "kernels" / "libcache_dit_cuda_ops.so"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run tests/gpu/run.sh on a GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ops():
    path = library_path()
    if not path.exists():
        if os.environ.get("CACHE_DIT_OPD_REQUIRE_BUILD") == "1":
            pytest.fail(f"kernel library not built: {path}")
        pytest.skip(f"kernel library not built: {path} (run deploy/build.sh)")
    torch.ops.load_library(str(path))
    return torch.ops.cache_dit_cuda_ops
