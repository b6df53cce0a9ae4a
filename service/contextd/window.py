"""The rolling window: where a context's history starts.

Seed 000: the window holds the messages strictly after
max(agent clear, thread clear, now - rolling window). Clears only move markers; nothing
is deleted, so the same history serves both the window and history queries.
"""

from __future__ import annotations


def window_start_us(
    now_us: int,
    rolling_window_us: int,
    agent_clear_us: int,
    thread_clear_us: int | None = None,
) -> int:
    """The exclusive lower bound of the window; the latest of the markers wins."""
    start = max(now_us - rolling_window_us, agent_clear_us)
    if thread_clear_us is not None:
        start = max(start, thread_clear_us)
    return start
