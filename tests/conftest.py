"""Shared by every suite under tests/: the build folder's path is made absolute before any test runs, so
that the processes tests start from other working directories (children of a test, daemons, tools) find
the same build as this one (`CACHE_DIT_OPD_BUILD_DIR=build pytest tests/kernels` from the repository
root, say)."""

import os

for _name in ("CACHE_DIT_OPD_BUILD_DIR", "CACHE_DIT_OPD_LIBRARY_BUILD_DIR"):
    if os.environ.get(_name):
        os.environ[_name] = os.path.abspath(os.environ[_name])
