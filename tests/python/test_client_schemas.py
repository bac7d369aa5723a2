"""The client's proxy schemas equal the catalog contract and the kernel library's registrations.

The kernel library is loaded only in a child process: its TORCH_LIBRARY block
and the client's definitions must never share a process.
"""

import json
import os

import pytest
import torch

import _client_fixtures as fx

import cache_dit_opd  # noqa: F401

# The contract (DESIGN.md section 3), written out once more on purpose.
EXPECTED = {
    "fused_merge_attn_states":
        "(Tensor prev_out, Tensor prev_lse, Tensor suff_out, Tensor suff_lse) -> (Tensor out, Tensor lse)",
    "fused_merge_attn_states.out":
        "(Tensor prev_out, Tensor prev_lse, Tensor suff_out, Tensor suff_lse, *, Tensor(a!) out, Tensor(b!) lse)"
        " -> (Tensor(a!) out, Tensor(b!) lse)",
    "fp8_comm_per_token_quant": "(Tensor x) -> Tensor",
    "fp8_comm_per_token_quant.out": "(Tensor x, *, Tensor(a!) out) -> Tensor(a!)",
    "fp8_comm_per_token_dequant": "(Tensor x) -> Tensor",
    "fp8_comm_per_token_dequant.out": "(Tensor x, *, Tensor(a!) out) -> Tensor(a!)",
    "fp8_comm_qkv_permute_quant": "(Tensor x) -> Tensor",
    "fp8_comm_qkv_permute_quant.out": "(Tensor x, *, Tensor(a!) out) -> Tensor(a!)",
    "fp8_comm_qkv_permute_dequant": "(Tensor quant_x) -> Tensor",
    "fp8_comm_qkv_permute_dequant.out": "(Tensor quant_x, *, Tensor(a!) out) -> Tensor(a!)",
}

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


def test_client_schemas_are_the_contract():
    assert _client_schemas() == {k: _full(k, v) for k, v in EXPECTED.items()}


def test_domain_tables_are_the_contract():
    from cache_dit_opd import _attn, _comm

    assert {**_attn._SCHEMAS, **_comm._SCHEMAS} == EXPECTED


def test_client_in_a_fresh_process_defines_exactly_these():
    got = _dump("import cache_dit_opd")
    assert got == _client_schemas()


def test_schemas_equal_the_kernel_library():
    lib = fx.kernel_library_path()
    if not os.path.exists(lib):
        pytest.skip(f"kernel library not built: {lib} (set CACHE_DIT_OPD_BUILD_DIR to the CMake build dir)")
    theirs = _dump(f"torch.ops.load_library({lib!r})")
    ours = _client_schemas()
    for full, schema in ours.items():
        assert full in theirs, f"the kernel library does not define cache_dit_cuda_ops::{full}"
        assert theirs[full] == schema, f"{full}:\n  client:  {schema}\n  library: {theirs[full]}"
    # every attn/comm op of the library is proxied by the client
    served = {k for k in theirs if k.split(".")[0] in {n.split(".")[0] for n in EXPECTED}}
    assert served == set(ours)
