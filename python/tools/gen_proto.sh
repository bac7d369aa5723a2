#!/usr/bin/env bash
# Regenerates python/cache_dit_opd/_proto/opd_pb2.py from proto/cache_dit_opd/v1/opd.proto.
#
# The generated file is committed, so installing the client needs no protoc.
# It must come from protoc 3.21.x (Debian/Ubuntu `protobuf-compiler`): that
# protoc emits the builder-API module that the protobuf runtimes 3.20 through
# 7.x all import without a version check. grpcio-tools' bundled protoc is newer
# and emits a runtime version check that fails on older protobuf runtimes, so
# it is not used here. The gRPC stub (opd_grpc.py) is written by hand for the
# same reason (generated *_grpc.py files check the grpcio version).
#
# tests/python/test_client_proto.py fails when the committed file and proto/
# disagree. Usage: python/tools/gen_proto.sh [path/to/protoc]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
protoc="${1:-${PROTOC:-protoc}}"
version="$("$protoc" --version | awk '{print $2}')"
case "$version" in
  3.21.*) ;;
  *) echo "gen_proto.sh: need protoc 3.21.x (apt install protobuf-compiler on Debian 12 / Ubuntu 24.04), got $version" >&2
     exit 1 ;;
esac
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$protoc" -I"$root/proto" --python_out="$tmp" "$root/proto/cache_dit_opd/v1/opd.proto"
cp "$tmp/cache_dit_opd/v1/opd_pb2.py" "$root/python/cache_dit_opd/_proto/opd_pb2.py"
echo "wrote python/cache_dit_opd/_proto/opd_pb2.py (protoc $version)"
