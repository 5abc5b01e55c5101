"""One error taxonomy for the whole service.

Domain code (specs, planner, core) raises these; the server maps each class to one gRPC
status code in exactly one place (``kvsvc.server.errors``). Messages are written for the
person who sent the bad input: they name the field and say what would be accepted. Values
the caller sent (request ids, pool names, ...) are quoted with :func:`quoted`, the same in
every client language.
"""

from __future__ import annotations

import json


def quoted(value: str) -> str:
    """``value`` as a double-quoted string with JSON's escaping, for messages clients read.

    Python's ``repr`` picks single or double quotes by content and escapes as Python does
    (``'r\\x00'``); an engine in Go or JavaScript reads ``"r1"`` as a string literal of its
    own. Non-ASCII text stays as it is; quotes, backslashes and control characters (NUL
    among them: ``\\u0000``) are escaped, so the message stays one unambiguous line.
    """
    return json.dumps(value, ensure_ascii=False)


class KvsvcError(Exception):
    """Base class of every error kvsvc reports to a caller."""


class InvalidArgument(KvsvcError, ValueError):
    """The caller sent something malformed; ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class NotFound(KvsvcError, LookupError):
    """An unknown pool, request or rank."""


class AlreadyExists(KvsvcError):
    """Something that must be unique already exists (e.g. a live request id)."""


class FailedPrecondition(KvsvcError):
    """The call is valid but the target is not in a state to serve it (pool not READY)."""


class Unauthenticated(KvsvcError):
    """Missing or wrong credentials."""


class PermissionDenied(KvsvcError):
    """Valid credentials of a role that may not make this call (an engine token on the
    Worker API, a foreign engine's request, ...)."""


class ResourceExhausted(KvsvcError):
    """A bound was hit (live requests, subscribers, ...); nothing changed. The message names
    the bound and the setting that raises it."""


class Unavailable(KvsvcError):
    """Transient: the target cannot serve right now but will (a pool restored from its
    state waits for its ranks; its state could not be written). Retry with backoff."""


class PlanningError(KvsvcError, ValueError):
    """The memory plan cannot be made (specs disagree, memory too small, ...)."""
