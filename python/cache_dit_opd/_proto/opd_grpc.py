"""Client stub for service cache_dit_opd.v1.OperatorDaemon.

Written by hand instead of generated: the *_grpc.py files that recent
grpcio-tools emit refuse to import under an older grpcio runtime, and the
client must run with whatever grpcio the host has. ``METHODS`` is checked
against the service descriptor in opd_pb2 by tests/python/test_client_proto.py.
"""

from __future__ import annotations

from . import opd_pb2 as pb

SERVICE = "cache_dit_opd.v1.OperatorDaemon"

# method name -> (request type, reply type)
METHODS = {
    "GetVersion": (pb.VersionRequest, pb.VersionReply),
    "OpenSession": (pb.OpenSessionRequest, pb.OpenSessionReply),
    "CloseSession": (pb.CloseSessionRequest, pb.CloseSessionReply),
    "RegisterRegion": (pb.RegisterRegionRequest, pb.RegisterRegionReply),
    "UnregisterRegion": (pb.UnregisterRegionRequest, pb.UnregisterRegionReply),
    "Call": (pb.CallRequest, pb.CallReply),
    "GetStats": (pb.StatsRequest, pb.StatsReply),
    "PublishFile": (pb.PublishFileRequest, pb.PublishReply),
    "PublishTensors": (pb.PublishTensorsRequest, pb.PublishReply),
    "ListStore": (pb.ListStoreRequest, pb.ListStoreReply),
    "DeleteStore": (pb.DeleteStoreRequest, pb.DeleteStoreReply),
}


class OperatorDaemonStub:
    """One callable attribute per RPC, e.g. ``stub.Call(request, timeout=...)``."""

    def __init__(self, channel):
        for name, (req, rep) in METHODS.items():
            setattr(
                self,
                name,
                channel.unary_unary(
                    f"/{SERVICE}/{name}",
                    request_serializer=req.SerializeToString,
                    response_deserializer=rep.FromString,
                ),
            )
