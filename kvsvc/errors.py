"""One error taxonomy for the whole service.

Domain code (specs, planner, core) raises these; the server maps each class to one gRPC
status code in exactly one place (``kvsvc.server.errors``). Messages are written for the
person who sent the bad input: they name the field and say what would be accepted.
"""

from __future__ import annotations


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
