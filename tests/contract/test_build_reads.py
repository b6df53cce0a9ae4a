"""What a build reads for its status block: `status_and_activity` answers exactly what
`list_status` and `thread_activity` answer (one read on PostgreSQL, two on DuckDB)."""

from __future__ import annotations

import pytest

from contextd.domain.clock import ManualClock
from contextd.domain.context import StatusEntry, StatusKind
from contextd.domain.model import AgentSettings
from contextd.domain.window import WindowSpec
from contextd.ports.store import Store, status_and_activity

from .support import BIG, DAY, HOUR, MINUTE, batch, key


def _fill(store: Store, clock: ManualClock) -> int:
    now = clock.now_us()
    store.append(key("quiet"), batch("old only", source_time_us=now - DAY), AgentSettings())
    for i, thread in enumerate(("b", "a", "c", "cleared", "d")):
        store.append(key(thread), batch(*[f"{thread}{n}" for n in range(i + 1)]), AgentSettings())
        clock.advance(MINUTE)
    store.clear_thread(key("cleared"))
    store.append(key("a", scope="dm:1"), batch("elsewhere"), AgentSettings())
    for name, expires in (("zeta", None), ("alpha", now + DAY), ("gone", now + 1), ("mid", None)):
        entry = StatusEntry(name, StatusKind.PROCESS, "running", f"{name} runs", 0, expires)
        store.set_status("default", "a1", "", entry)
    store.set_status(
        "default", "a1", "dm:1", StatusEntry("other", StatusKind.THREAD, "idle", "", 0)
    )
    clock.advance(MINUTE)
    return clock.now_us()


@pytest.mark.parametrize(("entries", "threads"), [(BIG, BIG), (2, 2), (1, 1), (100, 30)], ids=str)
def test_status_and_activity_answer_what_the_two_reads_answer(
    store: Store, clock: ManualClock, entries: int, threads: int
) -> None:
    start = clock.now_us()
    now = _fill(store, clock)
    for window in (WindowSpec(0, 0), WindowSpec(0, start - HOUR), WindowSpec(start + MINUTE, 0)):
        both = status_and_activity(store, "default", "a1", "", now, entries, window, threads)
        assert both == (
            store.list_status("default", "a1", "", None, entries, now),
            store.thread_activity("default", "a1", "", window, threads),
        )
    statuses, activity = status_and_activity(
        store, "default", "a1", "", now, BIG, WindowSpec(0, start - HOUR), BIG
    )
    assert [s.key for s in statuses] == ["alpha", "mid", "zeta"]  # "gone" expired
    assert [(a.thread, a.window_message_count) for a in activity] == [
        ("d", 5),
        ("c", 3),
        ("a", 2),
        ("b", 1),
    ]


def test_status_and_activity_of_an_agent_without_either(store: Store) -> None:
    assert status_and_activity(store, "default", "nobody", "", 0, BIG, WindowSpec(0, 0), BIG) == (
        [],
        [],
    )
