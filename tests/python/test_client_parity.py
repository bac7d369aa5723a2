"""The client's fakes validate as the kernel library's Meta kernels do: same exception, same message.

One table of bad inputs (tests/python/_bad_inputs.py) runs here through the client's fakes (meta
tensors reach the fake of each op) and, in a child process, through the kernel library's Meta kernels,
which call the same check function as its CUDA launchers. The two namespaces cannot share a process.
"""

import json

import pytest
import torch

import _bad_inputs as bad
import _client_fixtures as fx

import cache_dit_opd  # noqa: F401  (defines the proxy ops and their fakes)

CHILD = """
import json, sys, torch
sys.path.insert(0, {here!r})
torch.ops.load_library({lib!r})
import _bad_inputs as bad
print("PARITY" + json.dumps({{c[0]: bad.run(torch.ops.cache_dit_cuda_ops, c) for c in bad.CASES}}))
"""


@pytest.fixture(scope="module")
def library_results():
    lib = fx.built(fx.kernel_library_path())
    r = fx.run_python(CHILD.format(here=fx.HERE, lib=lib))
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(l for l in r.stdout.splitlines() if l.startswith("PARITY"))
    return json.loads(line[len("PARITY"):])


@pytest.mark.parametrize("case", bad.CASES, ids=[c[0] for c in bad.CASES])
def test_fake_and_meta_kernel_reject_alike(case, library_results):
    ours = bad.run(torch.ops.cache_dit_cuda_ops, case)
    theirs = tuple(library_results[case[0]])
    assert ours[0] == theirs[0] == "ValueError", (ours, theirs)
    assert ours[1] == theirs[1], f"\n  client fake: {ours[1]}\n  Meta kernel: {theirs[1]}"
    assert case[3] in ours[1], f"the message does not name {case[3]!r}: {ours[1]}"
