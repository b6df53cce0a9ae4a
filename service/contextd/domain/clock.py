"""The server's one clock: commit times, clear markers and "now" for windows and expiry.

Two events the server orders (a clear, then an append) must never share a timestamp, or
the window's strict lower bound could hide or show the wrong message. Wall clocks repeat
and step back; this clock never does, and it starts above every time already stored (the
store advances it when it opens), so it never goes back across restarts either.

Only server-made times ever move it: a client's `source_time` is data, never a reading of
this clock, so one client's fast clock cannot push everyone else's commits into the future.

Everything that needs the time gets this one object (the store owns it; the service and
the builder read `store.clock`), and `create_server(settings, clock=...)` lets tests pass
a `ManualClock` they advance by hand instead of sleeping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def wall_clock_us() -> int:
    return time.time_ns() // 1_000


class MonotonicClock:
    """A microsecond clock over `source` (the wall clock by default) that never goes back.

    `now_us()` reads the time (for window ages, expiry, validation); `tick()` issues a
    commit time, strictly above every time issued or read before.
    """

    def __init__(self, source: Callable[[], int] = wall_clock_us) -> None:
        self._source = source
        self._last = 0
        self._lock = threading.Lock()

    def advance_to(self, floor_us: int) -> None:
        """Never issue a time at or below `floor_us` (e.g. the newest stored time)."""
        with self._lock:
            self._last = max(self._last, floor_us)

    def now_us(self) -> int:
        """The current time: never below a time already issued, but not a new stamp."""
        with self._lock:
            self._last = max(self._last, self._source())
            return self._last

    def tick(self) -> int:
        """A new commit time, strictly later than every time issued or read before."""
        with self._lock:
            self._last = max(self._last + 1, self._source())
            return self._last


class ManualClock(MonotonicClock):
    """A clock that moves only when told to (tests): `advance` by a span, or `set` a time.

    Its commit stamps still step one microsecond per tick, so a clear and a following
    append stay strictly ordered while the manual time stands still.
    """

    def __init__(self, start_us: int) -> None:
        self._manual = start_us
        super().__init__(lambda: self._manual)

    def advance(self, us: int) -> int:
        """Move the time to `us` microseconds after its current reading (which counts the
        stamps already issued), so everything stamped so far is at least `us` old;
        returns the new time."""
        if us < 0:
            raise ValueError("a clock never goes back")
        self._manual = self.now_us() + us
        return self.now_us()

    def set(self, us: int) -> int:
        """Move the time forward to `us` (never back); returns the new time."""
        self._manual = max(self._manual, us)
        return self.now_us()
