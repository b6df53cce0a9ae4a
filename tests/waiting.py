"""Waiting for what another process or thread does, in tests.

Time in tests comes from an injected clock wherever the code under test reads one. Some
things happen on their own schedule instead: a server process writing to its log, a
store's background thread merging or checkpointing, appends flowing from other threads
before a kill -9. A test waits for those by polling the condition it needs, with a
deadline that only turns a hang into a failure naming what never happened; it never
sleeps a fixed time and hopes the condition holds by then.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# Long enough for the slowest CI machine to do what any of these waits for; reached only
# when the awaited thing never happens.
DEADLINE_S = 60.0
_POLL_S = 0.01


def wait_until(
    condition: Callable[[], bool],
    what: str | Callable[[], str],
    timeout_s: float = DEADLINE_S,
) -> None:
    """Return once `condition()` holds; fail naming `what` if it does not within
    `timeout_s` seconds (a callable `what` is asked then, e.g. for a log's last lines)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout_s:g} s waiting until {said}")
        time.sleep(_POLL_S)
