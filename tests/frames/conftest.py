"""The fixtures the framed client tests share: one READY server per module with a Unix
socket and a TCP port, and each test run over both (a module that needs another server
defines its own ``server``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.frames.helpers import live_requests, target_of, unix_and_tcp_server
from tests.server.harness import ServerThread


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with unix_and_tcp_server() as srv:
        yield srv


@pytest.fixture(params=["unix", "tcp"])
def target(request: pytest.FixtureRequest, server: ServerThread) -> Iterator[str]:
    yield target_of(request.param, server)
    assert live_requests(server) == [], "a test left requests live"
