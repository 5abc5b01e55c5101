"""TLS on a TCP frames listener: the server's certificate (kvsvc.tools.devcerts), a
client that trusts its CA is served; a plaintext client or one trusting another CA is
refused UNAVAILABLE while the listener goes on serving the good one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kvsvc_client import ClientOptions, KVCacheClient, UnavailableError

from kvsvc.tls import TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, client_tls, open_channel
from kvsvc.tools.devcerts import DevCerts, find_openssl, make_dev_certs
from kvsvc.v1 import worker_pb2_grpc
from tests.frames.helpers import BYTES_PER_BLOCK, POOL, frames_server, short_dir
from tests.server.harness import FakeRank, ServerThread, llama_like_specs
from tests.tooling import missing


@pytest.fixture(autouse=True)
def _no_tls_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's own KVSVC_TLS_* must not decide what these clients do."""
    for name in (TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, "KVSVC_TLS_SERVER_NAME"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def certs() -> Iterator[dict[str, DevCerts]]:
    if find_openssl() is None:
        missing("the openssl command line", "apt-get install openssl")
    with short_dir() as root:
        yield {name: make_dev_certs(root / name) for name in ("good", "other")}


@pytest.fixture(scope="module")
def server(certs: dict[str, DevCerts]) -> Iterator[ServerThread]:
    good = certs["good"]
    with (
        short_dir() as tmp,
        frames_server(
            f"127.0.0.1:0,unix:{tmp}/t.sock",
            ready=False,
            tls_cert=str(good.server_cert),
            tls_key=str(good.server_key),
        ) as srv,
    ):
        # The pool's one rank registers over the gRPC listener, which is TLS too.
        rank = FakeRank(srv.address, POOL, 0, 1, llama_like_specs(), 64 * BYTES_PER_BLOCK)
        rank.channel.close()
        rank.channel = open_channel(srv.address, client_tls(str(good.ca)))
        rank.stub = worker_pb2_grpc.WorkerServiceStub(rank.channel)
        try:
            rank.register()
            rank.open_stream()
            assert not rank.wait_for_config().error
            rank.report()
            yield srv
        finally:
            rank.close()


def test_a_client_trusting_the_ca_is_served(
    server: ServerThread, certs: dict[str, DevCerts]
) -> None:
    options = ClientOptions(tls_ca=str(certs["good"].ca), retries=0)
    with KVCacheClient(
        f"frames:127.0.0.1:{server.server.frames_port}", POOL, options=options
    ) as kv:
        assert kv.usage().pool == POOL
        assert kv.allocate("t1", [1, 2, 3], 3, start=True).ok
        assert kv.block_table("t1").num_tokens == 3
        assert kv.free("t1") >= 0
        assert kv.epoch is not None


@pytest.mark.parametrize("kind", ["plaintext", "other-ca"])
def test_a_client_without_the_right_tls_is_unavailable(
    server: ServerThread, certs: dict[str, DevCerts], kind: str
) -> None:
    target = f"frames:127.0.0.1:{server.server.frames_port}"
    options = ClientOptions(
        tls_ca="" if kind == "plaintext" else str(certs["other"].ca), retries=0, timeout=3
    )
    with KVCacheClient(target, POOL, options=options) as kv, pytest.raises(UnavailableError):
        kv.usage()
    good = ClientOptions(tls_ca=str(certs["good"].ca), retries=0)
    with KVCacheClient(target, POOL, options=good) as kv:
        assert kv.usage().pool == POOL


def test_tls_settings_do_not_apply_to_a_unix_target(
    server: ServerThread, certs: dict[str, DevCerts]
) -> None:
    """The framed transport's Unix sockets are plaintext (their directory guards them): a
    client whose TLS settings come from its environment still reaches the sidecar's
    socket, while the same settings make its TCP target TLS (and a plaintext client is
    refused there)."""
    options = ClientOptions(tls_ca=str(certs["good"].ca), retries=0)
    (unix,) = [a for a in server.server.frames_addresses if a.startswith("unix:")]
    with KVCacheClient(f"frames:{unix}", POOL, options=options) as kv:
        assert kv.usage().pool == POOL
    tcp = f"frames:127.0.0.1:{server.server.frames_port}"
    with KVCacheClient(tcp, POOL, options=options) as kv:
        assert kv.usage().pool == POOL
    plain = ClientOptions(tls_ca="", retries=0, timeout=3)
    with (
        KVCacheClient(tcp, POOL, options=plain) as kv,
        pytest.raises(UnavailableError),
    ):
        kv.usage()
