"""``pip install --no-build-isolation ./python``: with the toolchain the engine is in the package, without
it the pure-Python client installs and says once that it is on the slow path (python/setup.py).

Each install goes into a fresh ``--target`` folder and is used from a child interpreter that sees only
that folder (no source tree, no build folder), as after an install on a clean machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import _client_fixtures as fx

LIB = "libcache_dit_opd_native.so"


def pip_install(target: Path, **env) -> subprocess.CompletedProcess:
    e = dict(os.environ, **env)
    for k in ("CACHE_DIT_OPD_BUILD_DIR", "CACHE_DIT_OPD_NATIVE_LIB", "PYTHONPATH"):
        e.pop(k, None)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-v", "--no-build-isolation", "--no-deps", "--no-index",
                        "--target", str(target), fx.PYTHON_DIR], capture_output=True, text=True, timeout=1200, env=e)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def run_installed(target: Path, code: str, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("CACHE_DIT_OPD_")}
    e.update(PYTHONPATH=str(target), **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=e,
                          cwd=target)


@pytest.fixture(scope="module")
def with_engine(tmp_path_factory):
    target = tmp_path_factory.mktemp("with-engine")
    r = pip_install(target, CACHE_DIT_OPD_NATIVE_BUILD="1")  # fails the install when the engine does not build
    assert "native engine built into the package" in r.stderr + r.stdout
    return target


@pytest.fixture(scope="module")
def without_compiler(tmp_path_factory):
    target = tmp_path_factory.mktemp("pure")
    bin_dir = tmp_path_factory.mktemp("bin")  # only the interpreter: no cmake, no compiler
    os.symlink(sys.executable, bin_dir / "python3")
    r = pip_install(target, PATH=str(bin_dir))
    assert "WARNING: native engine not built: cmake is not on PATH" in r.stderr + r.stdout
    return target


def test_the_engine_is_built_into_the_package_and_loaded_from_it(with_engine):
    pkg = with_engine / "cache_dit_opd"
    assert (pkg / LIB).is_file()
    assert json.loads((pkg / "_native_build.json").read_text())["torch"] == torch.__version__
    r = run_installed(with_engine, "from cache_dit_opd import _native; lib = _native.library(); "
                                   "print(lib.path if lib else _native.load_error())")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(pkg / LIB)


def test_an_engine_built_against_another_torch_is_not_loaded(with_engine, tmp_path):
    import shutil

    copy = tmp_path / "site"
    shutil.copytree(with_engine, copy)
    stamp = copy / "cache_dit_opd" / "_native_build.json"
    stamp.write_text(json.dumps({"torch": "2.0.0"}))
    r = run_installed(copy, "from cache_dit_opd import _native; print(_native.library() is None); "
                            "print(_native.load_error())")
    assert r.returncode == 0, r.stderr
    loaded, why = r.stdout.splitlines()[:2]
    assert loaded == "True"
    assert f"built against torch 2.0.0, this process runs torch {torch.__version__}" in why


INFO = r"""
import os
from cache_dit_opd import _session
for _ in range(2):  # a second session: the slow-path warning is said once per process
    s = _session.Session(0, target=os.environ["CACHE_DIT_OPD_ADDRESS"]).open()  # no CUDA here: no get_session
    s.close()
print(s.transport, s.native is not None)
"""


def test_without_a_compiler_the_install_is_the_pure_python_client_and_says_so_once(without_compiler):
    pkg = without_compiler / "cache_dit_opd"
    assert not (pkg / LIB).exists() and (pkg / "_wire.py").is_file()
    d = fx.daemon()
    try:
        r = run_installed(without_compiler, INFO, CACHE_DIT_OPD_ADDRESS=d.address)
    finally:
        d.kill()
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["grpc", "False"]
    assert r.stderr.count("calls go over gRPC (the native engine is not available: ") == 1, r.stderr
    assert "pip install --no-build-isolation ./python" in r.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_installed_engine_serves_the_calls_on_a_gpu(with_engine):
    d = fx.daemon(None, fake=False)
    code = r"""
import torch, cache_dit_opd
from cache_dit_opd import kernels
x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
y = kernels.fp8_comm_per_token_dequant(kernels.fp8_comm_per_token_quant(x))
torch.testing.assert_close(y.float(), x.float(), atol=0.2, rtol=0.1)
info = cache_dit_opd.daemon_info()
print(info["transport"], info["native"])
"""
    try:
        r = run_installed(with_engine, code, CACHE_DIT_OPD_ADDRESS=d.address)
    finally:
        d.stop()
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ring", "True"], r.stdout + r.stderr
    assert "calls go over gRPC" not in r.stderr
