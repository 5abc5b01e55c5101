"""Server reflection answers under grpc.reflection.v1 and v1alpha, and describes every
service (the kvsvc ones, health and both reflection services) without any .proto file."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2

from kvsvc.server.config import PoolConfig
from tests.server.harness import running_server

EXPECTED = {
    "kvsvc.v1.KVCacheService",
    "kvsvc.v1.WorkerService",
    "kvsvc.v1.AdminService",
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
}


def _ask(channel: grpc.Channel, package: str, request: reflection_pb2.ServerReflectionRequest):
    # v1 and v1alpha messages are the same on the wire: the v1alpha classes parse both.
    call = channel.stream_stream(
        f"/{package}.ServerReflection/ServerReflectionInfo",
        reflection_pb2.ServerReflectionRequest.SerializeToString,
        reflection_pb2.ServerReflectionResponse.FromString,
    )
    (response,) = list(call(iter([request]), timeout=10))
    return response


@pytest.mark.parametrize("package", ["grpc.reflection.v1", "grpc.reflection.v1alpha"])
def test_reflection_lists_and_describes_every_service(package: str) -> None:
    with (
        running_server(PoolConfig(name="p", max_model_len=64)) as srv,
        grpc.insecure_channel(srv.address) as channel,
    ):
        listed = _ask(channel, package, reflection_pb2.ServerReflectionRequest(list_services=""))
        names = {s.name for s in listed.list_services_response.service}
        assert names == EXPECTED
        for name in sorted(EXPECTED):
            reply = _ask(
                channel,
                package,
                reflection_pb2.ServerReflectionRequest(file_containing_symbol=name),
            )
            assert reply.WhichOneof("message_response") == "file_descriptor_response", name
            files = [
                descriptor_pb2.FileDescriptorProto.FromString(raw)
                for raw in reply.file_descriptor_response.file_descriptor_proto
            ]
            services = {f"{f.package}.{s.name}" for f in files for s in f.service}
            assert name in services
