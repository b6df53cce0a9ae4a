"""A strictly increasing microsecond clock for commit times and clear markers.

Two events the server orders (a clear, then an append) must never share a timestamp, or
the window's strict lower bound could hide or show the wrong message. Wall clocks repeat
and step back; this clock never does, and it starts above every time already stored.
"""

from __future__ import annotations

import threading
import time


def wall_clock_us() -> int:
    return time.time_ns() // 1_000


class MonotonicClock:
    def __init__(self) -> None:
        self._last = 0
        self._lock = threading.Lock()

    def advance_to(self, floor_us: int) -> None:
        """Never issue a time at or below `floor_us` (e.g. the newest stored time)."""
        with self._lock:
            self._last = max(self._last, floor_us)

    def tick(self) -> int:
        with self._lock:
            self._last = max(self._last + 1, wall_clock_us())
            return self._last
