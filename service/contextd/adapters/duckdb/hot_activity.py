"""The activity line of the status preamble from a scope's cached thread rows.

Which threads of a scope have messages in a build's window (`by_recency`, `newest_of`),
which of them must be counted from their messages (`partial_threads`), the answer
(`activity_of`) and when a made answer holds for the next build (`ActivityKept`,
`activity_kept`). Pure functions over `ScopeThread` rows: kept apart from the cache
(which stores the rows and the kept answers) and from the reads that call them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from contextd.adapters.duckdb.hot_entries import ScopeThread
from contextd.domain.context import ThreadActivity
from contextd.domain.window import MAX_SOURCE_LEAD_US, WindowSpec


def by_recency(threads: Iterable[ScopeThread], window: WindowSpec) -> list[ScopeThread]:
    """The threads with messages after their clear markers, newest first: what does not
    depend on the window's ages (its clear marker aside), so it is kept per scope row
    set (`HotCache.by_recency`)."""
    rows = [t for t in threads if t.last_message_time_us > _clear(window, t)]
    rows.sort(key=lambda t: (-t.last_message_time_us, t.thread))
    return rows


def newest_of(ordered: Sequence[ScopeThread], window: WindowSpec, limit: int) -> list[ScopeThread]:
    """`ordered` (see `by_recency`) cut to the threads whose newest commit the window
    may hold: a prefix, as they are newest first."""
    oldest_commit = window.age_after_us - MAX_SOURCE_LEAD_US
    out: list[ScopeThread] = []
    for t in ordered:
        if len(out) >= limit or t.last_message_time_us <= oldest_commit:
            break
        out.append(t)
    return out


def activity_of(newest: Sequence[ScopeThread], counts: dict[int, int]) -> list[ThreadActivity]:
    """`thread_activity` over a scope's newest thread rows (`newest_of`), `counts`
    giving the window count of each thread that is not wholly in its window (see
    `partial_threads`)."""
    activity = [
        ThreadActivity(t.thread, t.last_message_time_us, counts.get(t.context_id, t.message_count))
        for t in newest
    ]
    return [a for a in activity if a.window_message_count > 0]


@dataclass(frozen=True, slots=True)
class ActivityKept:
    """A `thread_activity` answer made from a scope's thread rows alone, and the
    windows it answers: the same rows (compared by identity: they are replaced on every
    change), the same bounds but the age, and an age in ``[age_from, age_until)``.

    Within that range no row leaves the newest (`newest_of` cuts at the age less the
    source lead) and every row stays wholly in its window (`partial_threads`: its oldest
    time after the age), so the answer is the same list; a smaller age (a clock set
    back) may take in more rows and is not answered."""

    threads: dict[str, ScopeThread]
    clear_after_us: int
    max_messages: int
    expire_after_us: int | None
    limit: int
    age_from: int
    age_until: int
    activity: list[ThreadActivity]

    def answers(self, threads: dict[str, ScopeThread], window: WindowSpec, limit: int) -> bool:
        return (
            self.threads is threads
            and self.age_from <= window.age_after_us < self.age_until
            and self.clear_after_us == window.clear_after_us
            and self.limit == limit
            and self.max_messages == window.max_messages
            and self.expire_after_us == window.expire_after_us
        )


def activity_kept(
    threads: dict[str, ScopeThread],
    window: WindowSpec,
    limit: int,
    newest: Sequence[ScopeThread],
    activity: list[ThreadActivity],
) -> ActivityKept | None:
    """What `ActivityKept` keeps of an answer made with no partial thread (None: the
    answer read messages, or retention applies, and is not kept)."""
    if window.retains:
        return None
    until = 1 << 62
    for t in newest:
        source = t.create_time_us if t.min_source_time_us is None else t.min_source_time_us
        # Wholly in the window while the age is before the row's oldest time (see
        # `partial_threads`), and among the newest while before its commit plus the lead.
        until = min(
            until, min(t.create_time_us, source), t.last_message_time_us + MAX_SOURCE_LEAD_US
        )
    return ActivityKept(
        threads,
        window.clear_after_us,
        window.max_messages,
        window.expire_after_us,
        limit,
        window.age_after_us,
        until,
        activity,
    )


def partial_threads(newest: Sequence[ScopeThread], window: WindowSpec) -> list[ScopeThread]:
    """The threads of `newest` (`newest_of`) `activity_of` must count from their
    messages: under retention all of them, else those not wholly in their window (as
    `thread_activity` decides in SQL)."""
    out = []
    for t in newest:
        source = t.create_time_us if t.min_source_time_us is None else t.min_source_time_us
        own_oldest = min(t.create_time_us, source)
        whole = t.create_time_us > _clear(window, t) and own_oldest > window.age_after_us
        if window.retains or not whole:
            out.append(t)
    return out


def _clear(window: WindowSpec, t: ScopeThread) -> int:
    marker = window.clear_after_us if t.last_clear_us is None else t.last_clear_us
    return max(window.clear_after_us, marker)
