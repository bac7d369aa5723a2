"""Builds the Python client, with its native engine when this machine can build it.

    pip install --no-build-isolation ./python    # against the torch already installed (the engine links it)

The native engine (``libcache_dit_opd_native.so``: client/core/ and client/python/ of this repository) is
built with the repository's CMake project, daemon, kernels and tests off, against the ``torch`` the
installing interpreter imports, and lands in the package folder, where ``_native`` loads it first. It
needs CMake, a C++20 compiler, the CUDA toolkit and torch. Without them (or from an sdist, which has no
C++ sources) the install is the pure-Python client, which runs calls over gRPC and says so once at run
time. ``CACHE_DIT_OPD_NATIVE_BUILD``: ``auto`` (default), ``1`` (fail the install when the engine does not
build), ``0`` (do not try).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LIB = "libcache_dit_opd_native.so"
TARGET = "cache_dit_opd_native"


def _say(msg: str) -> None:
    print(f"cache_dit_opd setup: {msg}", file=sys.stderr, flush=True)


def _why_not() -> str | None:
    """Why the engine cannot be built here (None: try)."""
    if not (REPO / "CMakeLists.txt").is_file() or not (REPO / "client" / "python").is_dir():
        return f"no C++ sources at {REPO} (an sdist, or a copy of python/ alone)"
    if shutil.which("cmake") is None:
        return "cmake is not on PATH"
    if not any(shutil.which(c) for c in (os.environ.get("CXX", ""), "c++", "g++", "clang++") if c):
        return "no C++ compiler on PATH (c++, g++, clang++ or $CXX)"
    try:
        import torch  # noqa: F401
    except ImportError as e:
        return f"torch is not importable by {sys.executable} ({e}); install with --no-build-isolation"
    return None


def _build_engine(build_temp: Path, dest: Path) -> None:
    import torch

    build = build_temp / f"native-torch{torch.__version__}"
    configure = ["cmake", "-S", str(REPO), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                 "-DCACHE_DIT_BUILD_KERNELS=OFF", "-DCACHE_DIT_BUILD_DAEMON=OFF", "-DCACHE_DIT_BUILD_TESTS=OFF",
                 "-DCACHE_DIT_BUILD_NATIVE_CLIENT=ON", f"-DCACHE_DIT_PYTHON={sys.executable}"]
    if shutil.which("ninja") and not (build / "CMakeCache.txt").exists():
        configure += ["-G", "Ninja"]
    log = build_temp / "native-build.log"
    build_temp.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        for cmd in (configure, ["cmake", "--build", str(build), "--target", TARGET, "-j", str(os.cpu_count() or 2)]):
            r = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
            if r.returncode != 0:
                tail = log.read_text(errors="replace").splitlines()[-25:]
                raise RuntimeError(f"{' '.join(cmd[:3])}... failed (exit {r.returncode}); the end of {log}:\n"
                                   + "\n".join(tail))
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(build / "client" / "python" / LIB, dest / LIB)
    # What the engine was built against: _native refuses to load it under another torch (C++ ABI).
    (dest / "_native_build.json").write_text(json.dumps(
        {"torch": torch.__version__, "torch_cuda": torch.version.cuda}, indent=1) + "\n")


class BuildPyWithEngine(build_py):
    def run(self):
        super().run()
        pkg = Path(self.build_lib) / "cache_dit_opd"
        for stale in (pkg / LIB, pkg / "_native_build.json"):  # an earlier build's, in an in-tree build folder
            stale.unlink(missing_ok=True)
        mode = os.environ.get("CACHE_DIT_OPD_NATIVE_BUILD", "auto").strip().lower()
        if mode in ("0", "off", "no", "false"):
            _say("native engine not built (CACHE_DIT_OPD_NATIVE_BUILD=0): the pure-Python client (gRPC calls)")
            return
        why = _why_not()
        if why is None:
            try:
                build_temp = Path(self.get_finalized_command("build").build_temp)
                _build_engine(build_temp, pkg)
                _say(f"native engine built into the package ({LIB})")
                return
            except Exception as e:  # noqa: BLE001  (auto: any failure leaves the pure-Python client)
                why = str(e)
        if mode in ("1", "on", "yes", "true"):
            raise SystemExit(f"cache_dit_opd setup: the native engine did not build (CACHE_DIT_OPD_NATIVE_BUILD=1):"
                             f" {why}")
        _say(f"WARNING: native engine not built: {why}. Installed the pure-Python client: calls run over gRPC "
             f"(slower; see python/README.md, Install)")


class PlatformDistribution(Distribution):
    """The wheel may carry the engine (a shared object of this platform): never a py3-none-any wheel."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyWithEngine}, distclass=PlatformDistribution)
