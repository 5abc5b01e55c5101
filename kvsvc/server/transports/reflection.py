"""gRPC server reflection under both names clients use: ``grpc.reflection.v1`` and
``grpc.reflection.v1alpha``.

grpcio-reflection ships only the v1alpha service; strict v1 clients (grpcurl's newer
builds, Node and Go reflection clients) fail against it. The two protocols are the same
messages under another package, so one servicer answers both: v1 requests are parsed with
the v1alpha classes (wire-identical), and a v1 file descriptor derived from the v1alpha one
is added to the descriptor pool so that reflection can describe the v1 service itself.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1ALPHA_PACKAGE = "grpc.reflection.v1alpha"
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1ALPHA_SERVICE_NAME: str = reflection.SERVICE_NAME


def _register_v1_descriptor() -> None:
    """Add ``grpc/reflection/v1/reflection.proto`` to the default pool (once)."""
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(V1_SERVICE_NAME)
        return
    except KeyError:
        pass
    file = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(file)
    file.name = "grpc/reflection/v1/reflection.proto"
    file.package = V1_PACKAGE
    file.ClearField("options")
    old, new = f".{V1ALPHA_PACKAGE}.", f".{V1_PACKAGE}."
    for message in file.message_type:
        for field in message.field:
            if field.type_name.startswith(old):
                field.type_name = new + field.type_name[len(old) :]
    for service in file.service:
        for method in service.method:
            method.input_type = new + method.input_type[len(old) :]
            method.output_type = new + method.output_type[len(old) :]
    pool.Add(file)


def reflection_services(
    service_names: Iterable[str],
) -> list[tuple[str, dict[str, grpc.RpcMethodHandler]]]:
    """Both reflection services, describing ``service_names`` and themselves: (name,
    method handlers) each, for the server to register (behind its gate: reflection is
    open to anyone, and its requests are read under the same budget as every other)."""
    _register_v1_descriptor()
    names = (*service_names, V1ALPHA_SERVICE_NAME, V1_SERVICE_NAME)
    from grpc_reflection.v1alpha import _async

    servicer = _async.ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    return [
        (name, {"ServerReflectionInfo": handler})
        for name in (V1ALPHA_SERVICE_NAME, V1_SERVICE_NAME)
    ]
