"""Adaptive busy polling of the server's event loop.

An engine's calls come back to back: a reply, then the next call tens of microseconds
later. A server that blocks in ``epoll_wait`` between them pays for sleeping each time:
the kernel deschedules its thread, the vCPU halts, and the next call wakes it cold. On
the 2-core VM the benchmarks run on, a framed 2048-token ``Allocate``'s handler ran ~1.8x
its in-process time and a framed ``Step`` ~1.5x (``docs/performance.md``). Polling for
the next call for up to 200 us instead of sleeping took 10-13% off a framed ``Allocate``
(0.86-0.91x -> 0.78-0.82x of vLLM's in-process admission, in the same runs) and 6-11% off
a framed ``Step`` (0.30-0.315x -> 0.276-0.283x of vLLM's 256 in-process decodes). The
default is 500 us: on a slower moment of the machine a Python client took over 200 us
between a 256-request ``Step``'s reply and its next one (building it), the window closed
and the ``Step`` gained 0-5%; at 500 us, 6-16% in the same conditions.

Spinning is only worth its CPU while calls do come that soon, so the window adapts as
the guest-side ``haltpoll`` cpuidle governor of Linux does for a VM's idle vCPU:

- a wait that ended with an event within ``max_window_s`` of going idle says a window
  that long would have caught it: the window grows to twice that wait (at most
  ``max_window_s``; a shorter wait leaves a longer window as it is);
- a wait longer than ``max_window_s`` says the spin was spent for nothing: the window
  halves, and under ``MIN_WINDOW_S`` it closes (plain blocking waits, no CPU spent).

A window grows to what the waits it saw need, not by doubling itself: one call's own
events come microseconds apart (a frame's parts, gRPC's completion queue waking the loop
several times a call), and a window doubled by each of them was open to its bound when
the call ended, to be spun in full before the engine's next step came milliseconds later
(vllm_bench: the server's CPU per output token 11-17 -> 22 us over frames). Grown only to
twice those waits, it stays at ``MIN_WINDOW_S`` within a call and closes after the next
long wait: an engine stepping every few milliseconds costs ~25 us of spinning a step,
while a client calling back to back keeps the window at twice its turnaround.

While spinning, each poll is followed by ``sched_yield``, so a process or thread that
needs the CPU gets it (the spin takes only what would have been idle), and the window
bounds how long any other thread of this process waits for the GIL meanwhile.
``kvsvc_busy_poll_seconds_total`` and ``kvsvc_busy_poll_wakeups_total{outcome}`` on
``/metrics`` say what the spinning cost and caught (:class:`BusyPollMetrics`).
"""

from __future__ import annotations

import asyncio
import os
import selectors
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

DEFAULT_MAX_WINDOW_US = 500
# The largest window a config may ask for: past a few milliseconds the spin would keep a
# core busy between an engine's steps, which is no longer "the next call is about to come".
MAX_WINDOW_US_LIMIT = 10_000
# A window shorter than this is not worth opening (a poll and a yield take ~2 us).
MIN_WINDOW_S = 25e-6
# The CPU to whatever else wants it between two polls (where the platform has it).
_yield_cpu: Callable[[], None] = getattr(os, "sched_yield", lambda: None)

_Ready = list[tuple[selectors.SelectorKey, int]]


class PollStats:
    """What the spinning of this process's selectors did (plain numbers: the selector
    writes them on the event loop's thread, ``/metrics`` reads them)."""

    def __init__(self) -> None:
        self.spins = 0  # waits that began with a spin
        self.hits = 0  # spins an event ended
        self.spin_seconds = 0.0  # time spent spinning, caught or not
        self.window_s = 0.0  # the last window set


class PollWindow:
    """How long the next idle wait spins first: the haltpoll rule (module docstring).

    Args:
        max_window_s: the longest window; 0 never spins.
    """

    def __init__(self, max_window_s: float) -> None:
        if max_window_s < 0:
            raise ValueError(f"max_window_s must be >= 0, not {max_window_s}")
        self.max_window_s = max_window_s
        self.window_s = 0.0

    def after_wait(self, idle_s: float, woken: bool) -> None:
        """Adapt after an idle wait (spin and block together) of ``idle_s``; ``woken``:
        it ended with an event (not a timer's timeout)."""
        if idle_s > self.max_window_s:
            half = self.window_s / 2
            self.window_s = half if half >= MIN_WINDOW_S else 0.0
        elif woken:
            grown = max(self.window_s, 2 * idle_s, MIN_WINDOW_S)
            self.window_s = min(self.max_window_s, grown)
        # A timer's timeout within the window says nothing of when calls come.


class BusyPollSelector(selectors.DefaultSelector):
    """The platform's default selector, spinning for up to its :class:`PollWindow` before
    each idle wait.

    Args:
        max_window_s: the longest spin (``PollWindow``).
        stats: where to count (default: this process's, :func:`poll_stats`).
    """

    def __init__(self, max_window_s: float, stats: PollStats | None = None) -> None:
        super().__init__()
        self.window = PollWindow(max_window_s)
        self.stats = stats if stats is not None else poll_stats()

    def select(self, timeout: float | None = None) -> _Ready:
        if timeout is not None and timeout <= 0:  # the loop has work ready: a plain poll
            return super().select(timeout)
        clock = time.perf_counter
        started = clock()
        window = self.window.window_s
        if window > 0:
            stats = self.stats
            stats.spins += 1
            limit = window if timeout is None or timeout > window else timeout
            deadline = started + limit
            while True:
                ready = super().select(0)
                now = clock()
                if ready:
                    stats.hits += 1
                    stats.spin_seconds += now - started
                    return ready
                if now >= deadline:
                    break
                _yield_cpu()  # the CPU to whatever else wants it, the GIL too
            stats.spin_seconds += now - started
            if timeout is not None:
                timeout = max(0.0, timeout - (now - started))
        ready = super().select(timeout)
        self.window.after_wait(clock() - started, bool(ready))
        self.stats.window_s = self.window.window_s
        return ready


def loop_factory(max_window_us: int) -> Callable[[], asyncio.AbstractEventLoop]:
    """An event loop factory for ``asyncio.Runner``: a selector loop that busy-polls for
    up to ``max_window_us`` (0: asyncio's default loop, which never spins)."""
    if max_window_us <= 0:
        return asyncio.new_event_loop

    def make() -> asyncio.AbstractEventLoop:
        return asyncio.SelectorEventLoop(BusyPollSelector(max_window_us / 1e6))

    return make


class BusyPollMetrics(Collector):
    """``/metrics`` families of :class:`PollStats`."""

    def __init__(self, stats: PollStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        stats = self.stats
        spent = CounterMetricFamily(
            "kvsvc_busy_poll_seconds",
            "Time the server's event loop spent polling for the next call instead of "
            "sleeping (CPU it used while idle; see busy_poll_us).",
        )
        spent.add_metric([], stats.spin_seconds)
        wakeups = CounterMetricFamily(
            "kvsvc_busy_poll_wakeups",
            "Idle waits that began with a spin: hit, a call or other event came during "
            "it; miss, the loop went to sleep after it.",
            labels=("outcome",),
        )
        wakeups.add_metric(["hit"], stats.hits)
        wakeups.add_metric(["miss"], stats.spins - stats.hits)
        window = GaugeMetricFamily(
            "kvsvc_busy_poll_window_seconds",
            "How long the next idle wait will spin first (0: it sleeps at once).",
        )
        window.add_metric([], stats.window_s)
        yield spent
        yield wakeups
        yield window


_stats: PollStats | None = None


def poll_stats() -> PollStats:
    """This process's spin counts (one event loop serves; every server in it shares)."""
    global _stats
    if _stats is None:
        _stats = PollStats()
    return _stats
