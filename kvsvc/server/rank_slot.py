"""A registered rank as its pool holds it: the slot of its current session (registration,
session secret, plan streams, heartbeats, allocation) and what the pool knows of its KV
tensors across sessions."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import Any

from kvsvc.server.registration import Registration


@dataclass(slots=True)
class RankMemory:
    """What the pool knows of a rank's KV tensors: whether it allocated its plan, and the
    identity it reported for them ("" when it gave none: then a new agent cannot be told
    from a reconnecting one, and is taken to be new)."""

    allocated: bool = False
    allocation_id: str = ""


@dataclass(slots=True)
class RankSlot:
    """One rank's current session: what it registered, its session secret, its open plan
    streams, its last heartbeat and what it reported of its allocation."""

    registration: Registration
    session_id: str
    registered_at: float
    last_seen: float
    available_bytes: int
    allocation_id: str = ""
    open_streams: int = 0
    ever_streamed: bool = False
    allocated: bool = False
    allocated_bytes: int = 0
    memory_free_bytes: int = 0
    views: list[Any] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.registration.rank


def same_secret(expected: str, given: str) -> bool:
    """Whether ``given`` is the session ``expected``, compared in constant time (as bytes:
    a non-ASCII string from a client is just wrong)."""
    return hmac.compare_digest(expected.encode(), given.encode())
