"""Settings shared by the sync and asyncio clients."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import grpc

# Calls that change nothing may be retried after UNAVAILABLE; Allocate, Free and Step are
# never retried by the client (a lost reply would make a retry apply twice).
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
)


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """Attributes:
    timeout: deadline of each unary call, seconds.
    retries: extra attempts of a side-effect-free call after UNAVAILABLE.
    backoff: first retry delay, seconds (doubles, with jitter, up to ``max_backoff``).
    token: bearer token sent as ``authorization`` metadata (default: $KVSVC_AUTH_TOKEN).
    """

    timeout: float = 10.0
    retries: int = 3
    backoff: float = 0.05
    max_backoff: float = 2.0
    token: str | None = None

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        token = self.token if self.token is not None else os.environ.get("KVSVC_AUTH_TOKEN")
        return (("authorization", f"Bearer {token}"),) if token else None

    def delay(self, attempt: int) -> float:
        base = min(self.max_backoff, self.backoff * (2**attempt))
        return base * (0.5 + random.random() / 2)
