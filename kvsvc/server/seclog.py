"""The security log: one line per event an operator must see, never a secret.

Logger ``kvsvc.security``: auth refusals (rate-limited per peer), rank takeovers (refused,
or another agent taking a rank this server saw), bounds hit (rate-limited per bound).
Ranks lost, ranks back with the tensors they had, pool state changes and stops are
operations: the ordinary log (``kvsvc.server``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

security_log = logging.getLogger("kvsvc.security")


class RateLimitedLog:
    """At most one line per ``interval`` seconds per key; the lines suppressed are counted
    in the next one (a flood of bad calls must not flood the log)."""

    def __init__(self, interval: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self._interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, key: str, message: str, *args: Any) -> None:
        now = self._clock()
        with self._lock:
            if now - self._last.get(key, -self._interval) < self._interval:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return
            if len(self._last) >= 10_000:  # many peers: forget them rather than grow
                self._last.clear()
                self._suppressed.clear()
            self._last[key] = now
            suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            message += f" ({suppressed} more like it in the last {self._interval:g} s)"
        security_log.warning(message, *args)
