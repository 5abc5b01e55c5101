"""A transport that can send a call's reply before the handler returns says so here.

An engine call's reply is ready once the core has applied it; what the handler does after
(moving the change's KV events into the replay log, keeping the reply for a retry of the
same call id, the call's accounting) changes nothing the reply says. The framed transport
writes the reply at that point, so the caller's round trip does not wait for that
bookkeeping (the client decodes the reply while the server does it). gRPC sends a reply
only when the handler returns, and leaves this unset.

Only a change that needs no journal is answered early: with persistence the reply waits
until the change is durable. Nothing runs on the server's loop between the write and the
bookkeeping, so no other call (this caller's next one included) sees the pool before its
events are in the log.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

# For the call running in this context: writes its OK reply now and returns the reply's
# serialized message (kept for a retry of the call id); None where the transport cannot.
early_reply: contextvars.ContextVar[Callable[[Any], bytes] | None] = contextvars.ContextVar(
    "kvsvc_early_reply", default=None
)
