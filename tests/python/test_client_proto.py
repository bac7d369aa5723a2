"""The committed protocol code (python/cache_dit_opd/_proto) is in step with proto/."""

import os
import shutil
import subprocess
import sys

import pytest

import _client_fixtures as fx

PROTO_ROOT = os.path.join(fx.REPO, "proto")
PROTO = os.path.join(PROTO_ROOT, "cache_dit_opd", "v1", "opd.proto")
PB2 = os.path.join(fx.PACKAGE_DIR, "_proto", "opd_pb2.py")


def _protoc_321():
    exe = os.environ.get("PROTOC") or shutil.which("protoc")
    if not exe:
        return None
    out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.split()
    return exe if len(out) == 2 and out[1].startswith("3.21.") else None


def _fresh_descriptor(tmp_path):
    """FileDescriptorProto of opd.proto compiled now, by protoc or grpc_tools' bundled protoc."""
    from google.protobuf import descriptor_pb2

    out = tmp_path / "opd.desc"
    args = ["-I" + PROTO_ROOT, "--descriptor_set_out=" + str(out), PROTO]
    exe = os.environ.get("PROTOC") or shutil.which("protoc")
    if exe:
        subprocess.run([exe, *args], check=True)
    else:
        grpc_tools = pytest.importorskip("grpc_tools.protoc", reason="neither protoc nor grpcio-tools is installed")
        assert grpc_tools.main(["protoc", *args]) == 0
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    assert len(fds.file) == 1
    return fds.file[0]


def _strip_json_names(messages):
    for m in messages:
        for f in m.field:
            f.ClearField("json_name")
        _strip_json_names(m.nested_type)


def test_committed_descriptor_equals_proto(tmp_path):
    from google.protobuf import descriptor_pb2

    from cache_dit_opd._proto import opd_pb2

    committed = descriptor_pb2.FileDescriptorProto.FromString(opd_pb2.DESCRIPTOR.serialized_pb)
    fresh = _fresh_descriptor(tmp_path)
    for fd in (committed, fresh):
        fd.ClearField("source_code_info")
        _strip_json_names(fd.message_type)  # --descriptor_set_out adds them, --python_out does not
    assert committed == fresh, "proto/ changed: run python/tools/gen_proto.sh"


def test_regenerating_reproduces_the_file(tmp_path):
    exe = _protoc_321()
    if exe is None:
        pytest.skip("protoc 3.21.x not installed (python/tools/gen_proto.sh needs it)")
    subprocess.run([exe, "-I" + PROTO_ROOT, "--python_out=" + str(tmp_path), PROTO], check=True)
    fresh = (tmp_path / "cache_dit_opd" / "v1" / "opd_pb2.py").read_text()
    assert fresh == open(PB2).read(), "run python/tools/gen_proto.sh"


def test_stub_methods_equal_service():
    from cache_dit_opd._proto import opd_grpc, opd_pb2

    service = opd_pb2.DESCRIPTOR.services_by_name["OperatorDaemon"]
    assert opd_grpc.SERVICE == service.full_name
    want = {m.name: (m.input_type.full_name, m.output_type.full_name) for m in service.methods}
    got = {name: (req.DESCRIPTOR.full_name, rep.DESCRIPTOR.full_name) for name, (req, rep) in opd_grpc.METHODS.items()}
    assert got == want
    for m in service.methods:
        assert not m.client_streaming and not m.server_streaming, m.name  # the stub is unary only


def test_stub_builds_on_a_channel():
    grpc = pytest.importorskip("grpc")
    from cache_dit_opd._proto import opd_grpc

    with grpc.insecure_channel("unix:/nonexistent/x.sock") as ch:
        stub = opd_grpc.OperatorDaemonStub(ch)
        for name in opd_grpc.METHODS:
            assert callable(getattr(stub, name))


def test_pb2_imports_without_warnings_or_version_checks():
    code = "import cache_dit_opd._proto.opd_pb2 as p; p.CallRequest(op='x').SerializeToString(); print('ok')"
    r = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True,
                       env=fx.subprocess_env())
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
    text = open(PB2).read()
    # a runtime version check (protoc >= 3.26 output) would break older protobuf runtimes
    assert "runtime_version" not in text.split("DESCRIPTOR =")[0]
    assert "ValidateProtobufRuntimeVersion" not in text
    assert "builder as _builder" in text
