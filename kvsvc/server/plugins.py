"""What plugins above the server give it: event sinks, each fed by the pools' event logs.

The server never imports its plugins (``make lint``'s import contracts forbid it): the
composition root (``kvsvc serve``, :func:`kvsvc.commands.serve.build_server`) hands
:class:`~kvsvc.server.app.KvsvcServer` a factory per config setting that a sink serves,
and the server attaches what it was given after the pools' saved states are replayed (a
sink sees only what happens from then on).

A setting that only a sink can serve (:data:`SINK_SETTINGS`) and that no given factory
serves is refused before anything starts: a config asking for vLLM-format KV events from a
server built without their publisher is an error, not a silent drop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

from kvsvc.server.config import ConfigError, ServerConfig

if TYPE_CHECKING:
    from kvsvc.server.pool import Pool


class EventSink(Protocol):
    """A consumer of the pools' event batches, attached by its :data:`EventSinkFactory`
    (which adds a listener to each pool's event log it serves, before any event exists).

    The server calls :meth:`start` before it serves (an ``OSError`` then fails the start),
    :meth:`close` after its last call is answered (from a worker thread: it may block
    while the last batches go out), and :meth:`describe` for the lines ``kvsvc serve``
    prints before its serving line.
    """

    def start(self) -> None:
        """Open what the sink sends to.

        Raises:
            OSError: it cannot be opened (nothing of this sink is left open then).
        """

    def close(self) -> None:
        """Send what is queued, then release everything the sink holds."""

    def describe(self) -> list[str]:
        """One line per destination: where the events go (actual ports once started)."""


# A sink attached to the server's pools for its config (the pools are not serving yet).
EventSinkFactory = Callable[[ServerConfig, Iterable["Pool"]], EventSink]

# The config settings only an event sink serves -> the factory that serves it, to name in
# the refusal of a server built without one.
SINK_SETTINGS: Mapping[str, str] = MappingProxyType(
    {"kv_events_zmq": "kvsvc.integrations.vllm.events.ZmqKVEvents.attach"}
)
NO_EVENT_SINKS: Mapping[str, EventSinkFactory] = MappingProxyType({})


def check_event_sinks(config: ServerConfig, factories: Mapping[str, EventSinkFactory]) -> None:
    """Refuse a config whose sink settings no given factory serves.

    Raises:
        ConfigError: naming the setting and the factory to pass for it.
    """
    for setting, factory in SINK_SETTINGS.items():
        if getattr(config, setting) is not None and setting not in factories:
            raise ConfigError(
                f"{setting} is set, but this server was given no event sink for it: pass "
                f"event_sinks={{{setting!r}: {factory}}} to KvsvcServer (kvsvc serve "
                "does: kvsvc.commands.serve.build_server)"
            )


class EventSinks:
    """The sinks attached to one server's pools, started and closed together."""

    def __init__(self, sinks: list[EventSink]) -> None:
        self.sinks = sinks

    @classmethod
    def attach(
        cls,
        config: ServerConfig,
        pools: Iterable[Pool],
        factories: Mapping[str, EventSinkFactory],
    ) -> EventSinks:
        """One sink per factory whose setting the config sets (call before any event)."""
        pools = list(pools)
        return cls(
            [
                factory(config, pools)
                for setting, factory in factories.items()
                if getattr(config, setting) is not None
            ]
        )

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def start(self) -> None:
        """Start every sink, in order.

        Raises:
            OSError: one could not start (those already started are closed again).
        """
        for started, sink in enumerate(self.sinks):
            try:
                sink.start()
            except OSError:
                for earlier in self.sinks[:started]:
                    earlier.close()
                raise

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def describe(self) -> list[str]:
        return [line for sink in self.sinks for line in sink.describe()]
