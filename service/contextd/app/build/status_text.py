"""The status preamble: the block that tells a thread what else its agent is doing.

It is built from the live status entries and the agent's thread activity
(`status_preamble`, `status_body`, `status_with_time`), with its time phrases ("3m ago",
"expires in 2h") and the first time each reads otherwise, so the builder can keep a body
until then; and shortened line by line when the budget is tight (`shrink_status`). Kept
apart from assembly: the builder makes the block itself (and keeps its body between
builds), and assembly only fits the finished block into the budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from contextd.domain.context import StatusEntry, ThreadActivity, TokenCounter

__all__ = ["STATUS_NOTE", "shrink_status", "status_body", "status_preamble", "status_with_time"]

STATUS_NOTE = "- … (status shortened to fit the context)"


def status_preamble(
    entries: Sequence[StatusEntry],
    activity: Sequence[ThreadActivity],
    now_us: int,
    current_thread: str,
    *,
    max_entries: int = 30,
    max_threads: int = 30,
) -> str:
    """The status block: live thread/process entries plus the agent's threads with
    messages in the window, so each thread knows what else is happening.

    Expired entries are dropped (a stale "running" is worse than none). Threads are the
    service's own view (message counts, last activity), the current one first. Returns ""
    when nothing else is going on, so a lone thread pays no tokens for it.
    """
    body, _until = status_body(
        entries, activity, now_us, current_thread, max_entries=max_entries, max_threads=max_threads
    )
    return status_with_time(body, now_us)


def status_with_time(body: str | None, now_us: int) -> str:
    """The status block of a `status_body` at ``now_us``: its "as of" line heads it."""
    if body is None:
        return ""
    as_of = datetime.fromtimestamp(now_us / 1_000_000, UTC).isoformat(timespec="seconds")
    return f"Status as of {as_of}:\n{body}"


def status_body(
    entries: Sequence[StatusEntry],
    activity: Sequence[ThreadActivity],
    now_us: int,
    current_thread: str,
    *,
    max_entries: int = 30,
    max_threads: int = 30,
) -> tuple[str | None, int]:
    """The status block but its "as of" line (None: no block), and the first time after
    ``now_us`` at which it reads otherwise (an entry expires, an "ago" or "expires in"
    shows another number): from ``now_us`` until then the same inputs give the same
    body, so a caller may keep it (the builder: an agent's builds within a second)."""
    live = sorted(
        (e for e in entries if e.is_live(now_us)), key=lambda e: (-e.update_time_us, e.key)
    )
    threads = sorted(
        (a for a in activity if a.window_message_count > 0 or a.thread == current_thread),
        key=lambda a: (a.thread != current_thread, -a.last_message_time_us, a.thread),
    )
    others = [a for a in threads if a.thread != current_thread]
    # An entry that expires later is no longer live then (the block may then be empty).
    until = min((e.expire_time_us for e in live if e.expire_time_us is not None), default=_NEVER)
    if not live and not others:
        return None, until
    lines: list[str] = []
    if threads:
        lines.append("Threads of this agent with messages in the context window:")
        for a in threads[:max_threads]:
            mark = " (this thread)" if a.thread == current_thread else ""
            lines.append(
                f"- {a.thread}{mark}: {a.window_message_count} messages, "
                f"last {_ago(now_us - a.last_message_time_us)}"
            )
            until = min(
                until, a.last_message_time_us + _ago_changes(now_us - a.last_message_time_us)
            )
        if len(threads) > max_threads:
            lines.append(f"- … {len(threads) - max_threads} more threads")
    if live:
        lines.append("Thread and process status:")
        for e in live[:max_entries]:
            when = f"updated {_ago(now_us - e.update_time_us)}"
            until = min(until, e.update_time_us + _ago_changes(now_us - e.update_time_us))
            if e.expire_time_us is not None:
                when += f", expires in {_span(e.expire_time_us - now_us)}"
                until = min(until, e.expire_time_us - _span_holds(e.expire_time_us - now_us))
            lines.append(
                f"- [{e.kind.value}] {_one_line(e.key, 80)} — {_one_line(e.state, 40)}: "
                f"{_one_line(e.summary, 200)} ({when})"
            )
        if len(live) > max_entries:
            lines.append(f"- … {len(live) - max_entries} more entries")
    return "\n".join(lines), until


_NEVER = 1 << 62


def shrink_status(status: str, max_tokens: int, count: TokenCounter) -> tuple[str, int]:
    """The status cut line by line from its end (with a note) to fit ``max_tokens``;
    ``("", 0)`` when not even its first two lines fit."""
    lines = status.split("\n")
    for k in range(len(lines) - 1, 1, -1):
        cand = "\n".join([*lines[:k], STATUS_NOTE])
        c = count([cand])[0]
        if c <= max_tokens:
            return cand, c
    return "", 0


def _ago(delta_us: int) -> str:
    return "just now" if delta_us < 1_000_000 else _span(delta_us) + " ago"


def _unit(seconds: int) -> int:
    """The unit `_span` shows ``seconds`` in, in seconds."""
    for size in (86_400, 3_600, 60):
        if seconds >= size:
            return size
    return 1


def _ago_changes(delta_us: int) -> int:
    """The least delta after ``delta_us`` at which `_ago` reads otherwise (it grows with
    the clock): the next whole second under a second ("just now"), else the next whole
    unit `_span` shows."""
    if delta_us < 1_000_000:
        return 1_000_000
    s = delta_us // 1_000_000
    size = _unit(s)
    return (s // size + 1) * size * 1_000_000


def _span_holds(delta_us: int) -> int:
    """For a delta that shrinks with the clock ("expires in"): the largest delta below
    ``delta_us`` at which `_span` reads otherwise, as the time before the end it is
    reached at (the block changes at ``end - _span_holds(...)``)."""
    s = max(0, delta_us) // 1_000_000
    size = _unit(s)
    # Shows s // size units while the delta is at least (s // size) * size seconds.
    return (s // size) * size * 1_000_000 - 1


def _span(delta_us: int) -> str:
    s = max(0, delta_us) // 1_000_000
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


def _one_line(text: str, limit: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
