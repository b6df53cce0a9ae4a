"""Bounded reads: every list_* returns at most `limit` items, and paging on from the last
item (its name, key, position or id) visits each item once, in order."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from contextd.domain.context import StatusEntry, StatusKind
from contextd.domain.model import AgentSettings
from contextd.domain.window import WindowSpec
from contextd.ports.store import Store

from .support import BIG, batch, key, where

T = TypeVar("T")
LIMIT = 3


def _pages(read: Callable[[T | None], list[T]]) -> list[list[T]]:
    """Pages of at most LIMIT items, each read after the last item of the one before."""
    pages: list[list[T]] = []
    after: T | None = None
    while page := read(after):
        assert len(page) <= LIMIT
        pages.append(page)
        after = page[-1]
    return pages


def _fill(store: Store) -> None:
    for n in range(4):
        store.append(key(f"t{n}"), batch(f"t{n}-a", f"t{n}-b"), AgentSettings())
        store.append(key("t0"), batch(f"t0-{n}"), AgentSettings())
        store.record_event(key("t0"), "e", {"n": n})
        store.set_status("default", "a1", "", StatusEntry(f"k{n}", StatusKind.THREAD, "", "", 0))
        store.create_agent("default", f"b{n}", AgentSettings())


def test_messages_of_a_thread_and_of_a_scope(store: Store) -> None:
    _fill(store)
    thread = _pages(
        lambda m: store.list_messages(
            where(key("t0")), None, None if m is None else (m.sequence, m.id), LIMIT
        )
    )
    assert [len(p) for p in thread] == [3, 3]
    assert [m.sequence for p in thread for m in p] == list(range(1, 7))
    scope = _pages(
        lambda m: store.list_messages(
            where(key(), all_threads=True),
            WindowSpec(0, 0),
            None if m is None else (m.create_time_us, m.id),
            LIMIT,
        )
    )
    listed = [m.content for p in scope for m in p]
    assert [len(p) for p in scope] == [3, 3, 3, 3]
    assert listed == [
        m.content for m in store.list_messages(where(key(), all_threads=True), None, None, BIG)
    ]
    assert len(set(listed)) == 12


def test_agents_threads_status_and_events(store: Store) -> None:
    _fill(store)
    agents = _pages(lambda a: store.list_agents("default", None if a is None else a.name, LIMIT))
    assert [a.name for p in agents for a in p] == ["a1", "b0", "b1", "b2", "b3"]
    assert [len(p) for p in agents] == [3, 2]
    threads = _pages(
        lambda t: store.list_threads("default", "a1", "", None if t is None else t.thread, LIMIT)
    )
    assert [t.thread for p in threads for t in p] == ["t0", "t1", "t2", "t3"]
    status = _pages(
        lambda s: store.list_status("default", "a1", "", None if s is None else s.key, LIMIT, None)
    )
    assert [s.key for p in status for s in p] == ["k0", "k1", "k2", "k3"]
    events = _pages(
        lambda e: store.list_events(
            where(key("t0")), "", None, None, 0 if e is None else e.id, LIMIT
        )
    )
    assert [e.data for p in events for e in p] == [f'{{"n":{n}}}' for n in range(4)]
    assert [len(p) for p in events] == [3, 1]


def test_thread_activity(store: Store) -> None:
    _fill(store)
    activity = store.thread_activity("default", "a1", "", WindowSpec(0, 0), LIMIT)
    assert [a.thread for a in activity] == ["t0", "t3", "t2"]  # t0 was appended to last
    assert len(store.thread_activity("default", "a1", "", WindowSpec(0, 0), BIG)) == 4
