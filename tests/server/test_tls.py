"""TLS and mTLS on a real server: the gRPC listener and ``/metrics``, every kind of client.

Each module run makes its own throwaway CAs with the ``openssl`` command line
(:mod:`kvsvc.tools.devcerts`): ``good`` (the server's CA, and the CA of good client
certificates) and ``other`` (a CA nobody here trusts). Every refusal is checked against a
server that at the same moment serves a correctly configured client, so a refusal means
the TLS settings were wrong, not that the server was down.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from kvsvc_client import ClientOptions, KVCacheClient, RequestStart, UnavailableError

from kvsvc.server.config import (
    ConfigError,
    ConfigFileError,
    PoolConfig,
    ServerConfig,
    server_config_from_dict,
)
from kvsvc.tls import (
    TLS_CA_ENV,
    TLS_CERT_ENV,
    TLS_KEY_ENV,
    ClientTls,
    ServerTls,
    TlsError,
    TlsFileError,
    client_tls,
    open_channel,
)
from kvsvc.tools.devcerts import DevCerts, find_openssl, make_dev_certs
from kvsvc.v1 import worker_pb2_grpc
from tests.server.harness import FakeRank, ServerThread, llama_like_specs, running_server
from tests.tooling import missing

REPO = Path(__file__).resolve().parents[2]
POOL = "p"
SERVE = (sys.executable, "-m", "kvsvc", "serve", "--pool", POOL, "--listen", "127.0.0.1:0")
TLS_ENV = (
    TLS_CA_ENV,
    TLS_CERT_ENV,
    TLS_KEY_ENV,
    "KVSVC_TLS_SERVER_NAME",
    "KVSVC_METRICS_TLS_CERT",
    "KVSVC_METRICS_TLS_KEY",
    "KVSVC_METRICS_TLS_CLIENT_CA",
)


@pytest.fixture(autouse=True)
def _no_tls_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's own KVSVC_TLS_* must not decide what these tests' clients do."""
    for name in TLS_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, DevCerts]:
    if find_openssl() is None:
        missing("the openssl command line", "apt-get install openssl")
    root = tmp_path_factory.mktemp("certs")
    return {name: make_dev_certs(root / name) for name in ("good", "other")}


def pool() -> PoolConfig:
    return PoolConfig(name=POOL, world_size=1, max_model_len=1024)


def tls_kwargs(c: DevCerts, mutual: bool = False) -> dict[str, str]:
    out = {"tls_cert": str(c.server_cert), "tls_key": str(c.server_key)}
    if mutual:
        out["tls_client_ca"] = str(c.ca)
    return out


def trusting(c: DevCerts, client: DevCerts | None = None, **kwargs: object) -> ClientOptions:
    """Client options that trust ``c``'s CA (and present ``client``'s certificate)."""
    return ClientOptions(
        tls_ca=str(c.ca),
        tls_cert=str(client.client_cert) if client else None,
        tls_key=str(client.client_key) if client else None,
        **kwargs,  # type: ignore[arg-type]
    )


def quick(options: ClientOptions) -> ClientOptions:
    """The same options with a short deadline and no retries (refusals are expected)."""
    return ClientOptions(
        timeout=3.0,
        retries=0,
        tls_ca=options.tls_ca,
        tls_cert=options.tls_cert,
        tls_key=options.tls_key,
        tls_server_name=options.tls_server_name,
    )


def bring_up_over(server: ServerThread, tls: ClientTls | None, pool_name: str = POOL) -> FakeRank:
    """One fake rank registered, planned and reported over a (TLS) channel: the pool READY."""
    rank = FakeRank(server.address, pool_name, 0, 1, llama_like_specs(), 4 << 20)
    rank.channel.close()
    rank.channel = open_channel(server.address, tls)
    rank.stub = worker_pb2_grpc.WorkerServiceStub(rank.channel)
    return rank.join()


def list_pools(address: str, options: ClientOptions) -> list[str]:
    with KVCacheClient(address, POOL, options=options) as kv:
        return [p.name for p in kv.list_pools()]


def scrape(url: str, context: ssl.SSLContext | None = None) -> str:
    with urllib.request.urlopen(url, timeout=10, context=context) as response:
        return str(response.read().decode())


def https_context(c: DevCerts, client: DevCerts | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(c.ca))
    if client is not None:
        context.load_cert_chain(str(client.client_cert), str(client.client_key))
    return context


@pytest.fixture(scope="module")
def tls_server(certs: dict[str, DevCerts]) -> Iterator[ServerThread]:
    """TLS, no client certificates required; its pool READY over a TLS worker channel."""
    with running_server(
        pool(),
        PoolConfig(name="agent", world_size=1, max_model_len=1024),
        metrics_listen="127.0.0.1:0",
        heartbeat_timeout_s=600,
        **tls_kwargs(certs["good"]),
    ) as server:
        rank = bring_up_over(server, ClientTls(ca=str(certs["good"].ca)))
        yield server
        rank.close()


@pytest.fixture(scope="module")
def mtls_server(certs: dict[str, DevCerts]) -> Iterator[ServerThread]:
    """mTLS: client certificates signed by the good CA required."""
    with running_server(
        pool(),
        metrics_listen="127.0.0.1:0",
        heartbeat_timeout_s=600,
        **tls_kwargs(certs["good"], mutual=True),
    ) as server:
        yield server


# ---------------------------------------------------------------- TLS


def test_a_client_that_trusts_the_ca_allocates_frees_and_reads_usage(
    tls_server: ServerThread, certs: dict[str, DevCerts]
) -> None:
    with KVCacheClient(tls_server.address, POOL, options=trusting(certs["good"])) as kv:
        result = kv.allocate("r1", list(range(40)), 40, start=RequestStart())
        assert result.ok and result.new_block_ids[0]
        assert kv.usage().num_requests == 1
        assert kv.free("r1")
        assert kv.usage().num_requests == 0


def test_the_asyncio_client_speaks_tls_too(
    tls_server: ServerThread, certs: dict[str, DevCerts]
) -> None:
    from kvsvc_client import AsyncKVCacheClient

    async def usage() -> int:
        options = trusting(certs["good"])
        async with AsyncKVCacheClient(tls_server.address, POOL, options=options) as kv:
            return (await kv.usage()).num_blocks

    assert asyncio.run(usage()) > 0


# What the clients add to gRPC's bare "Socket closed" (kvsvc_client.errors.connection_hint).
PLAINTEXT_HINT = (
    "; if the server uses TLS, give the client the CA that signed its certificate "
    "(--tls-ca or KVSVC_TLS_CA; ClientOptions(tls_ca=...))"
)
NO_CERTIFICATE_HINT = (
    "; if the server requires client certificates (mTLS), give the client one "
    "(--tls-cert and --tls-key, or KVSVC_TLS_CERT and KVSVC_TLS_KEY; "
    "ClientOptions(tls_cert=..., tls_key=...))"
)


def test_a_plaintext_client_is_refused(tls_server: ServerThread) -> None:
    with pytest.raises(UnavailableError) as refused:
        list_pools(tls_server.address, quick(ClientOptions()))
    assert str(refused.value).endswith("Socket closed" + PLAINTEXT_HINT)
    assert refused.value.details.endswith("Socket closed")  # gRPC's own, unchanged


def test_a_client_that_does_not_trust_the_servers_ca_is_refused(
    tls_server: ServerThread, certs: dict[str, DevCerts]
) -> None:
    with pytest.raises(UnavailableError):
        list_pools(tls_server.address, quick(trusting(certs["other"])))
    assert POOL in list_pools(tls_server.address, quick(trusting(certs["good"])))


def test_the_certificate_must_name_the_server(
    tls_server: ServerThread, certs: dict[str, DevCerts]
) -> None:
    """The override replaces the target's host in the check: a name not on the
    certificate is refused, one on it is accepted while connecting to 127.0.0.1."""
    good = trusting(certs["good"])
    wrong = ClientOptions(timeout=3, retries=0, tls_ca=good.tls_ca, tls_server_name="wrong.test")
    with pytest.raises(UnavailableError):
        list_pools(tls_server.address, wrong)
    named = ClientOptions(timeout=3, retries=0, tls_ca=good.tls_ca, tls_server_name="localhost")
    assert POOL in list_pools(tls_server.address, named)


def test_the_environment_configures_clients_and_an_empty_value_turns_it_off(
    tls_server: ServerThread, certs: dict[str, DevCerts], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TLS_CA_ENV, str(certs["good"].ca))
    assert POOL in list_pools(tls_server.address, quick(ClientOptions()))
    with pytest.raises(UnavailableError):
        list_pools(tls_server.address, quick(ClientOptions(tls_ca="")))


def test_a_worker_agent_registers_and_reports_over_tls(
    tls_server: ServerThread, certs: dict[str, DevCerts]
) -> None:
    pytest.importorskip("torch", reason="the worker agent allocates torch tensors")
    from kvsvc.specs import FullAttentionSpec
    from kvsvc.worker import WorkerAgent, WorkerAgentConfig

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float16")
    config = WorkerAgentConfig(
        server=tls_server.address,
        pool="agent",
        rank=0,
        world_size=1,
        device="cpu",
        kv_cache_memory=4 << 20,
        rpc_timeout=5.0,
        connect_timeout=20.0,
        tls_ca=str(certs["good"].ca),
    )
    agent = WorkerAgent(config, {f"model.layers.{i}.self_attn.attn": spec for i in range(2)})
    try:
        views = agent.start(timeout=30)
        assert views and agent.ready
        with KVCacheClient(tls_server.address, "agent", options=trusting(certs["good"])) as kv:
            (info,) = [p for p in kv.list_pools() if p.name == "agent"]
            assert info.state == "READY" and info.num_registered == 1
    finally:
        agent.stop()


def test_kvsvc_ctl_with_tls_ca_lists_the_pools(
    tls_server: ServerThread, certs: dict[str, DevCerts]
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in TLS_ENV}
    argv = [sys.executable, "-m", "kvsvc", "ctl", "--server", tls_server.address, "--timeout", "5"]
    ok = subprocess.run(
        [*argv, "--tls-ca", str(certs["good"].ca), "pools"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO,
    )
    assert ok.returncode == 0, ok.stderr
    assert POOL in ok.stdout and "READY" in ok.stdout
    plain = subprocess.run(
        [*argv, "pools"], capture_output=True, text=True, timeout=60, env=env, cwd=REPO
    )
    assert plain.returncode == 1
    assert "UNAVAILABLE" in plain.stderr and "--tls-ca" in plain.stderr
    missing = subprocess.run(
        [*argv, "--tls-ca", "/nonexistent/ca.crt", "pools"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO,
    )
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines() == [
        "kvsvc ctl: tls_ca: cannot read /nonexistent/ca.crt: No such file or directory"
    ]


def test_metrics_are_served_over_https_and_plain_http_gets_nothing(
    tls_server: ServerThread, certs: dict[str, DevCerts]
) -> None:
    port = tls_server.server.metrics_port
    text = scrape(f"https://127.0.0.1:{port}/metrics", https_context(certs["good"]))
    assert f'kvsvc_pool_state{{pool="{POOL}",state="READY"}} 1.0' in text
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        scrape(f"http://127.0.0.1:{port}/metrics")
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        scrape(f"https://127.0.0.1:{port}/metrics", https_context(certs["other"]))


def test_an_idle_connection_does_not_hold_up_other_scrapes(
    tls_server: ServerThread, certs: dict[str, DevCerts]
) -> None:
    """A handshake in the accept thread would wait on this silent client forever."""
    port = tls_server.server.metrics_port
    with socket.create_connection(("127.0.0.1", port)) as silent:
        time.sleep(0.2)
        started = time.monotonic()
        text = scrape(f"https://127.0.0.1:{port}/metrics", https_context(certs["good"]))
        assert "kvsvc_pool_blocks" in text
        assert time.monotonic() - started < 5
        assert silent.fileno() >= 0


# ---------------------------------------------------------------- mTLS


def test_mtls_refuses_a_client_without_a_certificate_saying_what_it_lacks(
    mtls_server: ServerThread, certs: dict[str, DevCerts]
) -> None:
    with pytest.raises(UnavailableError) as refused:
        list_pools(mtls_server.address, quick(trusting(certs["good"])))
    assert str(refused.value).endswith("Socket closed" + NO_CERTIFICATE_HINT)

    # The asyncio client says the same.
    from kvsvc_client import AsyncKVCacheClient

    async def pools() -> None:
        options = quick(trusting(certs["good"]))
        async with AsyncKVCacheClient(mtls_server.address, POOL, options=options) as kv:
            await kv.list_pools()

    with pytest.raises(UnavailableError) as refused:
        asyncio.run(pools())
    assert str(refused.value).endswith("Socket closed" + NO_CERTIFICATE_HINT)


def test_mtls_refuses_a_certificate_signed_by_another_ca(
    mtls_server: ServerThread, certs: dict[str, DevCerts]
) -> None:
    with pytest.raises(UnavailableError) as refused:
        list_pools(mtls_server.address, quick(trusting(certs["good"], client=certs["other"])))
    assert "Socket closed" in str(refused.value)
    assert "--tls-" not in str(refused.value)  # it sent a certificate: no hint to give


def test_ctl_over_mtls_hints_and_prints_a_wait_ready_line_that_works(
    certs: dict[str, DevCerts],
) -> None:
    """``ctl pools`` prints the line to wait with, with the TLS flags it was given: the
    line as printed reaches the server (without them it would meet the handshake)."""
    good = certs["good"]
    env = {k: v for k, v in os.environ.items() if k not in TLS_ENV}
    with running_server(pool(), heartbeat_timeout_s=600, **tls_kwargs(good, mutual=True)) as srv:
        ctl = [sys.executable, "-m", "kvsvc", "ctl", "--server", srv.address, "--timeout", "5"]
        tls_flags = ["--tls-ca", str(good.ca)]
        refused = subprocess.run(
            [*ctl, *tls_flags, "pools"], capture_output=True, text=True, timeout=60, env=env
        )
        assert refused.returncode == 1
        assert refused.stderr.strip().endswith("Socket closed" + NO_CERTIFICATE_HINT)
        tls_flags += ["--tls-cert", str(good.client_cert), "--tls-key", str(good.client_key)]
        listed = subprocess.run(
            [*ctl, *tls_flags, "pools"], capture_output=True, text=True, timeout=60, env=env
        )
        assert listed.returncode == 0, listed.stderr
        line = re.search(r"`(kvsvc ctl [^`]*wait-ready[^`]*)` waits for READY", listed.stdout)
        assert line, listed.stdout
        argv = shlex.split(line.group(1))
        assert argv[:4] == ["kvsvc", "ctl", "--server", srv.address]
        assert all(flag in argv for flag in tls_flags)
        rank = bring_up_over(
            srv, ClientTls(str(good.ca), str(good.client_cert), str(good.client_key))
        )
        try:
            waited = subprocess.run(
                [sys.executable, "-m", *argv], capture_output=True, text=True, timeout=90, env=env
            )
        finally:
            rank.close()
        assert waited.returncode == 0, waited.stderr
        assert waited.stdout.startswith(f"pool '{POOL}' is READY")


def test_mtls_serves_a_client_with_a_good_certificate(
    mtls_server: ServerThread, certs: dict[str, DevCerts]
) -> None:
    assert POOL in list_pools(
        mtls_server.address, quick(trusting(certs["good"], client=certs["good"]))
    )
    # Registration too: the Worker API is behind the same handshake.
    tls = ClientTls(
        str(certs["good"].ca), str(certs["good"].client_cert), str(certs["good"].client_key)
    )
    bring_up_over(mtls_server, tls).close()


def test_mtls_metrics_need_a_client_certificate_too(
    mtls_server: ServerThread, certs: dict[str, DevCerts]
) -> None:
    url = f"https://127.0.0.1:{mtls_server.server.metrics_port}/metrics"
    assert "kvsvc_pool_blocks" in scrape(url, https_context(certs["good"], client=certs["good"]))
    for context in (https_context(certs["good"]), https_context(certs["good"], certs["other"])):
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
            scrape(url, context)


# ---------------------------------------------------------------- renewal


def install(source: DevCerts, target: Path, *, key_from: DevCerts | None = None) -> None:
    """Replace the server's files the way a Secret update does: new files, renamed in."""
    for name, path in (
        ("server.crt", source.server_cert),
        ("server.key", (key_from or source).server_key),
        ("ca.crt", source.ca),
    ):
        staged = target / f".{name}.new"
        shutil.copyfile(path, staged)
        os.replace(staged, target / name)


def test_renewed_files_are_picked_up_by_new_connections_and_a_bad_renewal_is_not(
    tmp_path: Path, certs: dict[str, DevCerts]
) -> None:
    live = tmp_path / "live"
    live.mkdir()
    good, other = certs["good"], certs["other"]
    install(good, live)
    with running_server(
        pool(),
        metrics_listen="127.0.0.1:0",
        tls_cert=str(live / "server.crt"),
        tls_key=str(live / "server.key"),
    ) as server:
        metrics = f"https://127.0.0.1:{server.server.metrics_port}/metrics"
        assert POOL in list_pools(server.address, quick(trusting(good)))

        # A key that is not the new certificate's: refused, the old pair stays in use.
        install(other, live, key_from=good)
        assert POOL in list_pools(server.address, quick(trusting(good)))
        assert "kvsvc_pool_blocks" in scrape(metrics, https_context(good))

        install(other, live)
        assert POOL in list_pools(server.address, quick(trusting(other)))
        assert "kvsvc_pool_blocks" in scrape(metrics, https_context(other))
        with pytest.raises(UnavailableError):
            list_pools(server.address, quick(trusting(good)))


# ---------------------------------------------------------------- configuration


def run_serve(*flags: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in TLS_ENV}
    return subprocess.run(
        [*SERVE, "--metrics-listen", "off", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO,
    )


def test_serve_with_a_missing_key_file_exits_1_with_one_clear_line(
    certs: dict[str, DevCerts], tmp_path: Path
) -> None:
    missing = tmp_path / "nope.key"
    result = run_serve("--tls-cert", str(certs["good"].server_cert), "--tls-key", str(missing))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"kvsvc serve: tls_key: cannot read {missing}: No such file or directory"
    ]


def test_serve_refuses_a_key_of_another_certificate(certs: dict[str, DevCerts]) -> None:
    result = run_serve(
        "--tls-cert", str(certs["good"].server_cert), "--tls-key", str(certs["other"].server_key)
    )
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert "does not belong to the certificate" in line and "tls_cert" in line


def test_serve_refuses_a_certificate_without_its_key_as_bad_usage(
    certs: dict[str, DevCerts],
) -> None:
    result = run_serve("--tls-cert", str(certs["good"].server_cert))
    assert result.returncode == 2
    assert "tls_cert needs tls_key" in result.stderr


def test_config_file_keys_and_their_checks(certs: dict[str, DevCerts], tmp_path: Path) -> None:
    good = certs["good"]
    config = server_config_from_dict({"pools": [{"name": POOL}], **tls_kwargs(good, mutual=True)})
    tls = config.server_tls()
    assert tls == ServerTls(str(good.server_cert), str(good.server_key), str(good.ca))
    assert tls.mutual
    assert ServerConfig(pools=(pool(),)).server_tls() is None
    with pytest.raises(ConfigError, match="tls_client_ca needs tls_cert"):
        ServerConfig(pools=(pool(),), tls_client_ca=str(good.ca))
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    with pytest.raises(ConfigFileError, match="holds no PEM certificate"):
        ServerConfig(pools=(pool(),), tls_cert=str(not_pem), tls_key=str(good.server_key))
    with pytest.raises(ConfigFileError, match="holds no PEM private key"):
        ServerConfig(pools=(pool(),), tls_cert=str(good.server_cert), tls_key=str(not_pem))
    with pytest.raises(ConfigFileError, match="tls_client_ca"):
        ServerConfig(pools=(pool(),), **{**tls_kwargs(good), "tls_client_ca": str(not_pem)})


def test_an_encrypted_key_is_refused_without_a_prompt(
    certs: dict[str, DevCerts], tmp_path: Path
) -> None:
    encrypted = tmp_path / "encrypted.key"
    encrypt = ("-aes256", "-passout", "pass:secret", "-out", str(encrypted))
    subprocess.run(
        [find_openssl() or "openssl", "pkey", "-in", str(certs["good"].server_key), *encrypt],
        check=True,
        capture_output=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    with pytest.raises(TlsFileError, match="encrypted private key"):
        ServerTls(str(certs["good"].server_cert), str(encrypted)).load()


def test_client_settings_resolve_flags_then_environment() -> None:
    env = {TLS_CA_ENV: "/env/ca", TLS_CERT_ENV: "/env/crt", TLS_KEY_ENV: "/env/key"}
    assert client_tls(environ={}) is None
    assert client_tls(environ=env) == ClientTls("/env/ca", "/env/crt", "/env/key")
    assert client_tls("/flag/ca", environ=env) == ClientTls("/flag/ca", "/env/crt", "/env/key")
    assert client_tls("", "", "", environ=env) is None
    with pytest.raises(TlsError, match="tls_cert and tls_key go together"):
        client_tls(cert="/a.crt", environ={})
    with pytest.raises(TlsError, match="tls_server_name"):
        client_tls(server_name="x", environ={})
    with pytest.raises(TlsFileError, match="tls_ca: cannot read /nonexistent"):
        KVCacheClient("127.0.0.1:1", POOL, options=ClientOptions(tls_ca="/nonexistent"))


@pytest.mark.e2e
@pytest.mark.torch
def test_demo_runs_over_mtls_and_removes_its_certificates() -> None:
    pytest.importorskip("torch", reason="the demo's agents allocate torch tensors")
    if find_openssl() is None:
        missing("the openssl command line", "apt-get install openssl")
    env = {k: v for k, v in os.environ.items() if k not in TLS_ENV}
    done = subprocess.run(
        [sys.executable, "-m", "kvsvc", "demo", "--tls", "--requests", "20", "--tp", "1"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("mTLS with a throwaway CA in "), first
    assert "metrics at https://" in done.stdout
    assert "requests finished           20" in done.stdout
    assert not Path(first.rsplit(" ", 1)[1]).exists()


def test_vllm_settings_carry_tls_to_the_engine_side_client(
    tls_server: ServerThread, certs: dict[str, DevCerts]
) -> None:
    """additional_config -> KvsvcSettings -> the replica's client (vLLM itself not needed)."""
    from kvsvc.integrations.vllm.config import settings_from_additional_config, vllm_kwargs
    from kvsvc.integrations.vllm.manager import KvsvcError, KvsvcPoolReplica
    from kvsvc.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    kwargs = vllm_kwargs(tls_server.address, POOL, tls_ca=str(certs["good"].ca))
    settings = settings_from_additional_config(kwargs["additional_config"])
    assert settings.tls_ca == str(certs["good"].ca) and settings.tls_cert is None
    with KVCacheClient(tls_server.address, POOL, options=trusting(certs["good"])) as kv:
        (info,) = [p for p in kv.list_pools() if p.name == POOL]
    spec = FullAttentionSpec(
        block_size=info.block_size, num_kv_heads=1, head_size=64, dtype="float16"
    )
    shape = {
        # vLLM counts the null block.
        "config": KVCacheConfig(info.num_blocks + 1, [], [KVCacheGroupSpec(["l0"], spec)]),
        "block_size": info.block_size,
        "max_model_len": info.max_model_len,
        "enable_caching": True,
    }
    KvsvcPoolReplica(settings, **shape).close()
    plain = settings_from_additional_config(
        vllm_kwargs(tls_server.address, POOL)["additional_config"]
    )
    with pytest.raises(KvsvcError, match="UNAVAILABLE"):
        KvsvcPoolReplica(replace(plain, rpc_timeout=3.0), **shape)
    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        vllm_kwargs(tls_server.address, POOL, tls_cert="/c.crt")
    with pytest.raises(ValueError, match="unknown TLS setting"):
        vllm_kwargs(tls_server.address, POOL, tls_certificate="/c.crt")


def test_kvsvc_worker_tls_flag_errors(
    certs: dict[str, DevCerts],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A TLS file that cannot be used exits 1 (the environment), clashing flags 2 (usage)."""
    pytest.importorskip("torch", reason="kvsvc worker imports the agent (torch)")
    from kvsvc.cli import main

    base = ["worker", "--server", "127.0.0.1:1", "--pool", POOL, "--rank", "0"]
    base += ["--world-size", "1", "--device", "cpu", "--model-config", "llama-3.2-1b"]
    base += ["--kv-cache-memory", "64MiB", "--connect-timeout", "1"]
    assert main([*base, "--tls-ca", "/nonexistent/ca.crt"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "kvsvc worker: error: tls_ca: cannot read /nonexistent/ca.crt: No such file or directory"
    )
    assert main([*base, "--tls-cert", str(certs["good"].client_cert)]) == 2
    assert "tls_cert and tls_key go together" in capsys.readouterr().err
    metrics = [
        "--metrics-listen",
        "127.0.0.1:0",
        "--metrics-tls-cert",
        str(certs["good"].server_cert),
    ]
    assert main([*base, *metrics]) == 2
    assert "--metrics-tls-cert and --metrics-tls-key go together" in capsys.readouterr().err
    # The same from the container's environment.
    monkeypatch.setenv("KVSVC_METRICS_TLS_CERT", str(certs["good"].server_cert))
    assert main([*base, "--metrics-listen", "127.0.0.1:0"]) == 2
    assert "--metrics-tls-key" in capsys.readouterr().err
