"""The committed protobuf stubs are the one generated copy: they must match protos/."""

from __future__ import annotations

import pytest

pytest.importorskip("grpc_tools")

from kvsvc.tools import protogen


def test_committed_stubs_match_protos() -> None:
    assert protogen.main(["--check"]) == 0, "run `make proto` and commit the result"


def test_stubs_import_under_the_package() -> None:
    from kvsvc.v1 import admin_pb2_grpc, kvcache_pb2_grpc, specs_pb2, worker_pb2_grpc

    assert specs_pb2.DESCRIPTOR.package == "kvsvc.v1"
    for module, service in (
        (kvcache_pb2_grpc, "KVCacheServiceStub"),
        (worker_pb2_grpc, "WorkerServiceStub"),
        (admin_pb2_grpc, "AdminServiceStub"),
    ):
        assert hasattr(module, service)
