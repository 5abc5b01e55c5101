"""The request bytes a server holds, counted before they are read: one budget for both
listeners.

A request's bytes cost memory from the moment the server reads them, not from when a
handler runs: gRPC reads a unary call's whole message (up to ``max_message_bytes``)
before any handler sees it, and parsing it costs more again. Sixteen concurrent 60 MiB
calls held 3.2 GB that way, whatever a bound on the calls then running said. So a
listener reserves a request's bytes here *before* it reads them, and reads only once the
reservation is granted:

- the gRPC listener does not know a message's size before reading it, so it reserves
  ``max_message_bytes`` (what the message may be), and once the message is in, keeps
  only its real size (:meth:`RequestBudget.received`);
- the framed listener knows it from the frame's prefix and reserves exactly that.

What it bounds:

- bytes being read: what the reads in progress reserved, every caller together, at
  most ``total`` (``max_inflight_request_bytes``), and one caller's at most
  ``per_caller`` (``max_message_bytes``): a caller reads one gRPC message at a time (its
  size is not known), so a client that sends many large messages at once has them read
  one after another, and cannot take the reads from the others. A caller is a
  credential on one host (every connection of one token from that host, on either
  transport; without tokens, the host): one client reads one large request at a time,
  whichever transport it sends it on. :meth:`RequestBudget.reserve` waits until both
  hold;
- a caller's large requests (over 1 MiB) read and running count with its reads: the
  caller reads its next large request once the last has run (a client whose large
  requests are refused back to back, or that sends them on both transports at once, has
  one in memory at a time); its small ones are read and run beside them;
- bytes held by calls in flight, their requests read: at most ``total`` too; a request
  that would pass it once read is refused (:meth:`RequestBudget.received` says so), as
  a call past a bound is: nothing runs with it. Reads do not wait for held bytes, so a
  small call (a heartbeat, a Step) is never kept waiting by large ones running.

So the request bytes a server holds stay under twice ``total`` (what a message costs
parsed comes on top: up to 4-5 times its bytes for a run of small varints).

A read that waits holds only what flow control lets its sender push unasked (gRPC: the
HTTP/2 stream window, 64 KiB with BDP probing off; frames: the socket's buffer). Waiting
is in arrival order, except that a request blocked by its own caller's reads does not
hold up other callers' (and none overtakes one blocked by the total).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

# A request over this is large: its caller reads and runs one at a time.
LARGE_REQUEST_BYTES = 1 << 20


@dataclass(slots=True)
class _Waiter:
    caller: Hashable
    size: int
    leave: int
    granted: asyncio.Future[None]


class RequestBudget:
    """Request bytes being read and held, both listeners together (one event loop)."""

    def __init__(self, total: int, per_caller: int, large: int = LARGE_REQUEST_BYTES) -> None:
        assert 0 < per_caller <= total, "a request of per_caller bytes must fit the total"
        self.total = total
        self.per_caller = per_caller
        self.large = large
        self.reading_total = 0  # reserved for reads in progress
        # Per caller: its reads in progress, and its large requests (over ``large``)
        # read and running: a caller reads and runs one large request at a time.
        self.reading: dict[Hashable, int] = {}
        self.held = 0  # requests read, their calls in flight
        self.peak_reading = 0  # the most reserved for reads at once (tests, benchmarks)
        self.peak_held = 0
        self.num_waited = 0  # reservations that had to wait
        self.num_refused = 0  # requests read that would have passed the held bound
        self._waiters: deque[_Waiter] = deque()

    def _fits(self, caller: Hashable, size: int, leave: int) -> bool:
        return (
            self.reading_total + size + leave <= self.total
            and self.reading.get(caller, 0) + size <= self.per_caller
        )

    def _take(self, caller: Hashable, size: int) -> None:
        self.reading_total += size
        self.reading[caller] = self.reading.get(caller, 0) + size
        self.peak_reading = max(self.peak_reading, self.reading_total)

    def try_reserve(self, caller: Hashable, size: int, leave: int = 0) -> bool:
        """Reserve at once if nothing waits and both bounds hold (no await: the framed
        listener's fast path); False: :meth:`reserve` must wait."""
        if self._waiters or not self._fits(caller, size, leave):
            return False
        self._take(caller, size)
        return True

    async def reserve(self, caller: Hashable, size: int, leave: int = 0) -> None:
        """Reserve ``size`` bytes for ``caller``'s next read; waits until both read bounds
        hold, with ``leave`` bytes of the total still free after it (the framed listener
        leaves one gRPC read's worth: a gRPC message's size is not known before it is
        read, so large frames taking the whole total would stop every gRPC call).
        Cancelled while waiting, it leaves nothing reserved."""
        assert 0 <= size <= self.per_caller
        if self.try_reserve(caller, size, leave):
            return
        waiter = _Waiter(caller, size, leave, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._wake()
        if waiter.granted.done():  # only its own caller's others were waiting
            return
        self.num_waited += 1
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self.cancel(caller, size)  # granted just as it was cancelled
            else:
                self._waiters.remove(waiter)
                self._wake()  # it may have held up others
            raise

    def received(self, caller: Hashable, reserved: int, size: int) -> bool:
        """The read of ``reserved`` bytes is done and brought ``size`` bytes. True: the
        call holds them until :meth:`release`; False: they would pass the held bound, the
        call must be refused (nothing is held). A large request stays its caller's until
        it is released: the caller's next large one is not read before."""
        if self.held + size > self.total and self.held:
            self.num_refused += 1
            self.cancel(caller, reserved)
            return False
        self.held += size
        self.peak_held = max(self.peak_held, self.held)
        self.cancel(caller, reserved, keep=size if size > self.large else 0)
        return True

    def cancel(self, caller: Hashable, reserved: int, keep: int = 0) -> None:
        """The read of ``reserved`` bytes is over (or did not happen): give it back (but
        ``keep`` of the caller's, a large request now running)."""
        left = self.reading[caller] - reserved + keep
        if left:
            self.reading[caller] = left
        else:
            del self.reading[caller]
        self.reading_total -= reserved
        self._wake()

    def release(self, caller: Hashable, size: int) -> None:
        """``caller``'s call that held ``size`` request bytes is done."""
        self.held -= size
        if size > self.large:
            self.cancel(caller, 0, keep=-size)

    def _wake(self) -> None:
        """Grant the waiters that fit now, in arrival order; one that waits for its own
        caller's reads (or for room it must leave) is passed over, one that waits for the
        total stops the rest."""
        for waiter in list(self._waiters):
            if waiter.granted.done():  # cancelled: its task removes it
                continue
            if self.reading_total + waiter.size > self.total:
                return
            if self.reading_total + waiter.size + waiter.leave > self.total:
                continue  # what it must leave free is taken: those after it may fit
            if self.reading.get(waiter.caller, 0) + waiter.size > self.per_caller:
                continue
            self._waiters.remove(waiter)
            self._take(waiter.caller, waiter.size)
            waiter.granted.set_result(None)
