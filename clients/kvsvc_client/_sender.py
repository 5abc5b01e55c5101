"""The thread that sends a client's Steps for :meth:`SyncStep.send_future`.

An engine hands each scheduling step's Step to this thread and goes on with its forward
pass; the reply is waited for at the start of the next step. The hand-off is on the
engine's critical path, so it is a queue put and a latch (a few microseconds), not a
``concurrent.futures`` executor's future, locks and condition (several times that). Work
on the reply that the engine would otherwise do once it has it (checking it) can run here
too, while the engine computes (``then``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


class StepSlot:
    """One Step handed to the sender: filled once, on the sender thread; waited for on any."""

    __slots__ = ("_latch", "_then", "error", "finished", "results", "then_error", "then_value")

    def __init__(self, then: Callable[[Any], Any] | None) -> None:
        # Held until the slot is filled: a waiter blocks on acquiring it.
        self._latch = threading.Lock()
        self._latch.acquire()
        self._then = then
        self.finished = False
        self.results: Any = None
        self.error: BaseException | None = None
        self.then_value: Any = None
        self.then_error: BaseException | None = None

    def fill(self, send: Callable[[], Any]) -> None:
        """Send the Step (``send()``), run ``then`` on its results, and let waiters go."""
        try:
            self.results = send()
        except BaseException as exc:  # the waiter's to see
            self.error = exc
        else:
            if self._then is not None:
                try:
                    self.then_value = self._then(self.results)
                except BaseException as exc:  # the waiter's to see
                    self.then_error = exc
        self.finished = True
        self._latch.release()

    def wait(self) -> None:
        """Block until the slot is filled."""
        if not self.finished:
            with self._latch:  # released by fill(); released again for other waiters
                pass


class StepSender:
    """One thread sending Steps in the order they were handed to it."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], StepSlot] | None] = (
            queue.SimpleQueue()
        )
        # A daemon thread: an engine that never closes its client must still exit.
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, send: Callable[[], Any], then: Callable[[Any], Any] | None) -> StepSlot:
        """Queue ``send`` (and ``then`` on its results); returns the slot to wait on."""
        slot = StepSlot(then)
        self._queue.put((send, slot))
        return slot

    def shutdown(self) -> None:
        """Send what was queued, then end the thread (waits for it)."""
        self._queue.put(None)
        self.thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            send, slot = item
            slot.fill(send)
