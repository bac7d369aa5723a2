"""The client's proxy schemas: generated from the one op table, and equal to what the kernel library registers.

kernels/ops.def is the only place the schemas are written; python/cache_dit_opd/_schemas.py is what
kernels/tools/schemas_py.cc prints from it (committed, so a pure-Python install needs no compiler).
The kernel library is loaded only in a child process: its TORCH_LIBRARY block and the client's
definitions must never share a process.
"""

import json
import os
import subprocess

import torch

import _client_fixtures as fx

import cache_dit_opd  # noqa: F401

from cache_dit_opd import _schemas

# Every schema, from the one table (kernels/ops.def, through the generated _schemas.py).
EXPECTED = {k: v for family in _schemas.SCHEMAS.values() for k, v in family.items()}

DUMP = """
import json, sys, torch
{load}
out = {{}}
for q in torch._C._dispatch_get_all_op_names():
    if not q.startswith("cache_dit_cuda_ops::"):
        continue
    name, _, ov = q.split("::", 1)[1].partition(".")
    out[name + ("." + ov if ov else "")] = str(torch._C._get_schema(q.split(".")[0], ov))
print("SCHEMAS" + json.dumps(out))
"""


def _dump(load: str) -> dict:
    r = fx.run_python(DUMP.format(load=load))
    assert r.returncode == 0, r.stdout + r.stderr
    line = [l for l in r.stdout.splitlines() if l.startswith("SCHEMAS")][0]
    return json.loads(line[len("SCHEMAS"):])


def _full(name: str, sig: str) -> str:
    return str(torch._C.parse_schema(f"cache_dit_cuda_ops::{name}{sig}"))


def _client_schemas() -> dict:
    out = {}
    for full in EXPECTED:
        name, _, ov = full.partition(".")
        out[full] = str(getattr(getattr(torch.ops.cache_dit_cuda_ops, name), ov or "default")._schema)
    return out


def test_committed_schemas_are_what_the_op_table_generates():
    gen = fx.built(os.path.join(fx.build_dir(), "kernels", "opd_schemas_py"))
    fresh = subprocess.run([gen], capture_output=True, text=True, check=True).stdout
    with open(_schemas.__file__) as f:
        assert f.read() == fresh, ("python/cache_dit_opd/_schemas.py is stale: regenerate it with "
                                   "build/kernels/opd_schemas_py > python/cache_dit_opd/_schemas.py")


def test_client_schemas_are_the_contract():
    assert _client_schemas() == {k: _full(k, v) for k, v in EXPECTED.items()}


def test_client_in_a_fresh_process_defines_exactly_these():
    got = _dump("import cache_dit_opd")
    assert got == _client_schemas()


def test_schemas_equal_the_kernel_library():
    lib = fx.built(fx.kernel_library_path())
    theirs = _dump(f"torch.ops.load_library({lib!r})")
    ours = _client_schemas()
    for full, schema in ours.items():
        assert full in theirs, f"the kernel library does not define cache_dit_cuda_ops::{full}"
        assert theirs[full] == schema, f"{full}:\n  client:  {schema}\n  library: {theirs[full]}"
    # every attn/comm op of the library is proxied by the client
    served = {k for k in theirs if k.split(".")[0] in {n.split(".")[0] for n in EXPECTED}}
    assert served == set(ours)
