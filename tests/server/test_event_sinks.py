"""Event sinks (kvsvc.server.plugins): the server attaches what it is given, and refuses a
config that asks for a sink it was not given."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import pytest

from kvsvc.server.app import KvsvcServer, create_server
from kvsvc.server.config import ConfigError, PoolConfig, ServerConfig
from kvsvc.server.pool import Pool


def test_kv_events_without_their_sink_are_refused_naming_what_to_pass() -> None:
    config = ServerConfig(pools=(PoolConfig("p"),), metrics_listen=None, kv_events_zmq="tcp://*:1")
    with pytest.raises(ConfigError) as refused:
        KvsvcServer(config)
    message = str(refused.value)
    assert "kv_events_zmq is set" in message
    assert "event_sinks={'kv_events_zmq': kvsvc.integrations.vllm.events.ZmqKVEvents.attach}" in (
        message
    )
    assert "kvsvc.commands.serve.build_server" in message


class RecordingSink:
    """An event sink that notes what the server does with it."""

    def __init__(self, pools: Iterable[Pool], calls: list[str]) -> None:
        self.pools = [pool.name for pool in pools]
        self.calls = calls

    def start(self) -> None:
        self.calls.append("start")

    def close(self) -> None:
        self.calls.append("close")

    def describe(self) -> list[str]:
        return [f"recording pools {', '.join(self.pools)}"]


def test_a_given_sink_is_attached_started_described_and_closed() -> None:
    calls: list[str] = []
    sinks: list[RecordingSink] = []

    def attach(config: ServerConfig, pools: Iterable[Pool]) -> RecordingSink:
        sinks.append(RecordingSink(pools, calls))
        return sinks[-1]

    config = ServerConfig(
        pools=(PoolConfig("a"), PoolConfig("b")),
        listen="127.0.0.1:0",
        metrics_listen=None,
        kv_events_zmq="tcp://*:1",
    )

    async def run() -> None:
        server, _ = await create_server(config, event_sinks={"kv_events_zmq": attach})
        assert calls == ["start"]
        assert server.event_sinks.describe() == ["recording pools a, b"]
        await server.stop(grace=0)

    asyncio.run(run())
    assert calls == ["start", "close"]
    assert len(sinks) == 1


def test_a_sink_whose_setting_is_unset_is_not_attached() -> None:
    def attach(config: ServerConfig, pools: Iterable[Pool]) -> RecordingSink:
        raise AssertionError("attached without kv_events_zmq")

    config = ServerConfig(pools=(PoolConfig("p"),), metrics_listen=None)
    server = KvsvcServer(config, event_sinks={"kv_events_zmq": attach})
    assert not server.event_sinks
    assert server.event_sinks.describe() == []
