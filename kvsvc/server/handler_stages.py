"""Where the server's time in its pool-changing handlers goes, for ``/metrics``.

``grpc_server_handling_seconds`` says how long a method's handler took; an operator whose
Steps got slower, and a benchmark that compares a handler with the same work run in one
process, also need to know which part: decoding the request, the pool's work, sending the
reply, draining the events it made, journaling it. Measured in the server, those stages
of a framed 256-decode Step read ~20 / ~185-215 / ~25 / ~20 us (rpc_bench's means), where
the same functions run back to back in one process take ~16 / ~90-95 / ~25 / -: the
pool's work is the part that differs, because between two calls the machine's other work
evicts the core's data from the CPU's caches, and a server's pool holds more than one
engine's requests (docs/performance.md).

Exported as ``kvsvc_handler_stage_seconds_total{method, stage}``, a counter per stage of
``Allocate``, ``Free`` and ``Step``; a stage's mean per call is its rate over the rate of
``grpc_server_handling_seconds_count`` of the same method. The stages:

- ``decode``: the request's fields to the core's arguments (after the transport parsed
  the bytes: that parse is the transport's, outside every handler);
- ``apply``: the pool's work, the reply's bytes included where the handler writes them
  (a Step's);
- ``reply``: sending the reply ahead of the bookkeeping (the framed transport, no
  journal: :mod:`kvsvc.server.reply_early`); over gRPC the reply is sent after the
  handler returns, by gRPC;
- ``events``: draining the call's KV events into the pool's event log;
- ``journal``: the journal's record and the retry cache's entry, where the call has them.

Timing costs a clock read and an addition per stage (under a microsecond a call); the sums
are plain floats that the collector reads when Prometheus scrapes. One table per process,
shared by every server in it (as :mod:`kvsvc.server.busy_poll`'s counts are).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

STAGES: Final = ("decode", "apply", "reply", "events", "journal")
METHODS: Final = ("Allocate", "Free", "Step")


class HandlerStages:
    """Seconds spent so far per method and stage (the methods and stages above only)."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {method: [0.0] * len(STAGES) for method in METHODS}

    def table(self, method: str) -> list[float]:
        """The running sums of ``method``, in the order of :data:`STAGES` (the handler
        adds to them in place: no lookup per stage)."""
        return self.seconds[method]


class HandlerStageMetrics(Collector):
    """``/metrics`` family of :class:`HandlerStages`."""

    def __init__(self, stages: HandlerStages) -> None:
        self.stages = stages

    def collect(self) -> Iterator[Any]:
        family = CounterMetricFamily(
            "kvsvc_handler_stage_seconds",
            "Time the pool-changing handlers spent in each stage: decode (the request to "
            "the core's arguments), apply (the pool's work), reply (sent ahead of the "
            "bookkeeping: framed transport), events (draining the call's KV events), "
            "journal (its record and retry-cache entry).",
            labels=("method", "stage"),
        )
        for method, sums in self.stages.seconds.items():
            for stage, seconds in zip(STAGES, sums, strict=True):
                family.add_metric([method, stage], seconds)
        yield family


_stages: HandlerStages | None = None


def handler_stages() -> HandlerStages:
    """This process's stage sums (every server in it shares them)."""
    global _stages
    if _stages is None:
        _stages = HandlerStages()
    return _stages
