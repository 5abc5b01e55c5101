"""How the worker agent sorts a failed call: fatal, stale session, or retry after a backoff.

The agent's error rules (:mod:`kvsvc.worker.agent`) in one place: the status codes that
stop the agent, the ones that say its session is gone, the exception that ends a session
for a retry, and the jittered exponential delay between attempts.
"""

from __future__ import annotations

import random

import grpc

# The server said no, whatever the session: the agent stops.
FATAL_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
# After registering: the server does not know the session (any more): register again.
STALE_SESSION_CODES = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION})


def backoff_delay(
    attempt: int, initial: float, maximum: float, rng: random.Random | None = None
) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): ``initial * 2**attempt`` capped at
    ``maximum``, scaled by a random factor in [0.5, 1] so many agents do not retry in step."""
    base = min(maximum, initial * (2 ** min(attempt, 62)))
    return base * (0.5 + 0.5 * (rng or random).random())


class RetrySession(Exception):
    """The session ended for a reason worth retrying (the message says which).

    ``resumable``: the server may still hold the session (a broken connection), so the
    next attempt reopens its plan stream before registering anew. ``immediate``: the server
    is up and said the session is gone: register at once instead of backing off.
    """

    def __init__(self, reason: str, *, resumable: bool = True, immediate: bool = False) -> None:
        super().__init__(reason)
        self.resumable = resumable
        self.immediate = immediate


def rpc_summary(err: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    """A failed call's status code and details (the code's name when the server gave none)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    return code, details or code.name


__all__ = [
    "FATAL_CODES",
    "STALE_SESSION_CODES",
    "RetrySession",
    "backoff_delay",
    "rpc_summary",
]
