"""What an engine's call runs as: its namespace of request ids, and the pools it may use.

A named engine (``ENGINE_NAME TOKEN`` in the engine token file) keeps its request ids in
its own namespace: the server stores ``ENGINE_NAME + NUL + request_id``, so two engines
may use the same ids without seeing each other's requests, and no id an engine sends can
reach another's (request ids may not contain NUL). Unnamed engine tokens and the all-roles
token use the default namespace: the id as sent.

Both listeners (:mod:`kvsvc.server.transports`) set :data:`current_engine` for the call;
the servicers scope ids with :func:`scoped_request_id` and strip the prefix again from
every message that goes back (:func:`unscope_message`).

An engine token may name its pools (``pools=a,b``): the listeners set
:data:`current_pools` too, and every engine call that names a pool resolves it through
:func:`check_pool_allowed` first (the servicers' ``Pools.get``), so a call on another
pool is PERMISSION_DENIED before it reads or changes anything, whichever method it is.
"""

from __future__ import annotations

import contextvars

from kvsvc.errors import PermissionDenied, quoted

NAMESPACE_SEPARATOR = "\x00"
# How the separator looks inside a message that quotes an id: kvsvc.errors.quoted (JSON
# escaping, what messages to clients use) writes \u0000; repr() writes \x00.
_QUOTED_SEPARATORS = ("\\u0000", "\\x00")

# The engine of the call being served ("" = the default namespace).
current_engine: contextvars.ContextVar[str] = contextvars.ContextVar("kvsvc_engine", default="")


def scoped_request_id(request_id: str, engine: str | None = None) -> str:
    """The id under which the server keeps ``request_id`` of ``engine`` (default: the
    calling engine)."""
    if engine is None:
        engine = current_engine.get()
    # An empty id stays empty, so the "must not be empty" checks still see it.
    return f"{engine}{NAMESPACE_SEPARATOR}{request_id}" if engine and request_id else request_id


def unscope_message(message: str, engine: str | None = None) -> str:
    """``message`` with the engine's namespace prefix removed from the request ids it
    quotes, however they were quoted (engine names need no escaping, the separator does:
    see ``_QUOTED_SEPARATORS``), so an engine reads back the id it sent."""
    if engine is None:
        engine = current_engine.get()
    if not engine:
        return message
    for separator in (*_QUOTED_SEPARATORS, NAMESPACE_SEPARATOR):
        message = message.replace(engine + separator, "")
    return message


# The pools the call's engine token may use (None: every pool; operators, agents,
# unscoped engine tokens).
current_pools: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar(
    "kvsvc_pools", default=None
)


def check_pool_allowed(pool: str) -> None:
    """Raise PermissionDenied, naming ``pool``, when the calling engine's token does not
    name it (checked before the pool is looked up: a scoped token learns nothing of the
    pools it may not use, not even whether they exist)."""
    allowed = current_pools.get()
    if allowed is not None and pool not in allowed:
        raise PermissionDenied(
            f"this engine token may not use pool {quoted(pool)}; it is scoped to "
            f"{', '.join(quoted(p) for p in sorted(allowed))} (pools= in its token file "
            "line)"
        )
