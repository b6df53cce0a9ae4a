"""The window: its clear and age bounds (both exclusive) honoured by every reader, and
the clears of a thread, a scope and an agent hiding earlier messages only in what they
clear."""

from __future__ import annotations

import pytest

from contextd.domain.clock import ManualClock
from contextd.domain.errors import NotFound
from contextd.domain.model import AgentSettings
from contextd.domain.window import WindowSpec, window_spec
from contextd.ports.store import Store

from .support import (
    BIG,
    DAY,
    HOUR,
    MINUTE,
    assert_every_reader_sees,
    batch,
    every_reader,
    history,
    key,
    summary,
    where,
)

EVERYTHING = WindowSpec(0, 0)


def test_the_age_bound_is_each_messages_own_time(store: Store, clock: ManualClock) -> None:
    now = clock.now_us()
    for text, source in (("a day old", now - DAY), ("at the bound", now - HOUR)):
        store.append(key(), batch(text, source_time_us=source), AgentSettings())
    store.append(key(), batch("a second inside", source_time_us=now - HOUR + 1), AgentSettings())
    store.append(key(), batch("untimed"), AgentSettings())
    window = WindowSpec(clear_after_us=0, age_after_us=now - HOUR)
    assert_every_reader_sees(store, key(), window, ["a second inside", "untimed"])
    assert_every_reader_sees(store, key(), EVERYTHING, history(store, key()))
    counts = store.context_counts(where(key()), window)
    assert counts[0] == 2 and counts[2] == 4 and counts[6] == 1
    clock.advance(2 * HOUR)
    later = WindowSpec(0, clock.now_us() - HOUR)
    assert_every_reader_sees(store, key(), later, [])
    assert store.thread_activity("default", "a1", "", later, BIG) == []


def test_the_clear_bound_compares_commit_times_only(store: Store, clock: ManualClock) -> None:
    now = clock.now_us()
    [before] = store.append(key(), batch("before"), AgentSettings())
    [at] = store.append(key(), batch("at the bound"), AgentSettings())
    [late] = store.append(key(), batch("late report", source_time_us=now - MINUTE), AgentSettings())
    window = WindowSpec(clear_after_us=at.create_time_us, age_after_us=now - HOUR)
    assert before.create_time_us < at.create_time_us < late.create_time_us
    assert_every_reader_sees(store, key(), window, ["late report"])


def test_a_thread_clear_hides_only_that_threads_earlier_messages(
    store: Store, clock: ManualClock
) -> None:
    neighbours = [key("t2"), key("t1", scope="dm:1"), key("t1", agent="a2")]
    for k in [key(), *neighbours]:
        store.append(k, batch("old"), AgentSettings())
    marker = store.clear_thread(key())
    assert marker <= clock.now_us()
    store.append(key(), batch("new"), AgentSettings())
    thread = store.get_thread(key())
    assert thread is not None and thread.last_clear_time_us == marker
    ref = store.context_ref(key())
    assert ref is not None and ref.last_clear_time_us == marker
    assert_every_reader_sees(store, key(), EVERYTHING, ["new"])
    for k in neighbours:
        assert_every_reader_sees(store, k, EVERYTHING, ["old"])
        other = store.get_thread(k)
        assert other is not None and other.last_clear_time_us is None
    assert history(store, key()) == ["old", "new"]  # a clear deletes nothing


def test_clearing_a_thread_without_messages_is_not_found(store: Store) -> None:
    store.append(key(), batch("hello"), AgentSettings())
    with pytest.raises(NotFound) as missing:
        store.clear_thread(key("t2"))
    assert missing.value.reason == "THREAD_NOT_FOUND"
    with pytest.raises(NotFound) as no_agent:
        store.clear_thread(key(agent="a2"))
    assert no_agent.value.reason == "AGENT_NOT_FOUND"
    assert store.get_thread(key("t2")) is None


def test_a_scope_clear_hides_every_thread_of_that_scope_only(store: Store) -> None:
    cleared = [key("t1", scope="dm:1"), key("t2", scope="dm:1")]
    kept = [key("t1"), key("t1", scope="dm:10"), key("t1", scope="dm:1", agent="a2")]
    for k in cleared + kept:
        store.append(k, batch("old"), AgentSettings())
    marker = store.clear_scope("default", "a1", "dm:1")
    store.append(cleared[0], batch("new"), AgentSettings())
    assert_every_reader_sees(store, cleared[0], EVERYTHING, ["new"])
    assert_every_reader_sees(store, cleared[1], EVERYTHING, [])
    assert [
        t.last_clear_time_us for t in store.list_threads("default", "a1", "dm:1", None, BIG)
    ] == [
        marker,
        marker,
    ]
    for k in kept:
        assert_every_reader_sees(store, k, EVERYTHING, ["old"])


def test_an_agent_clear_moves_the_agents_marker_for_every_scope(
    store: Store, clock: ManualClock
) -> None:
    """An agent's clear marker is what its windows start after (the window is made from
    it); other agents keep theirs."""
    mine = [key("t1"), key("t2", scope="dm:1")]
    for k in [*mine, key("t1", agent="a2")]:
        store.append(k, batch("old"), AgentSettings())
    marker = store.clear_agent("default", "a1")
    agent = store.get_agent("default", "a1")
    assert agent.last_clear_time_us == marker <= clock.now_us()
    assert store.get_agent("default", "a2").last_clear_time_us < marker
    store.append(mine[0], batch("new"), AgentSettings())
    window = window_spec(clock.now_us(), agent.rolling_window_us, agent.last_clear_time_us)
    assert_every_reader_sees(store, mine[0], window, ["new"])
    assert_every_reader_sees(store, mine[1], window, [])
    other = store.get_agent("default", "a2")
    other_window = window_spec(clock.now_us(), other.rolling_window_us, other.last_clear_time_us)
    assert_every_reader_sees(store, key("t1", agent="a2"), other_window, ["old"])


def test_the_later_of_the_agents_and_the_threads_marker_applies(store: Store) -> None:
    store.append(key("t1"), batch("t1 old"), AgentSettings())
    store.append(key("t2"), batch("t2 old"), AgentSettings())
    agent_marker = store.clear_agent("default", "a1")
    store.append(key("t1"), batch("t1 mid"), AgentSettings())
    store.append(key("t2"), batch("t2 mid"), AgentSettings())
    store.clear_thread(key("t2"))
    store.append(key("t2"), batch("t2 new"), AgentSettings())
    window = WindowSpec(agent_marker, 0)
    assert_every_reader_sees(store, key("t1"), window, ["t1 mid"])
    assert_every_reader_sees(store, key("t2"), window, ["t2 new"])
    everything = store.list_messages(where(key(), all_threads=True), window, None, BIG)
    assert [m.content for m in everything] == ["t1 mid", "t2 new"]
    counts = store.context_counts(where(key(), all_threads=True), window)
    assert (counts[0], counts[2], counts[6]) == (2, 5, 2)


def test_thread_activity_lists_threads_with_a_window_most_recent_first(
    store: Store, clock: ManualClock
) -> None:
    now = clock.now_us()
    store.append(key("quiet"), batch("old only", source_time_us=now - DAY), AgentSettings())
    store.append(key("early"), batch("a", "b"), AgentSettings())
    store.append(key("late"), batch("c"), AgentSettings())
    store.append(key("cleared"), batch("d"), AgentSettings())
    store.clear_thread(key("cleared"))
    store.append(key("late", scope="dm:1"), batch("elsewhere"), AgentSettings())
    window = WindowSpec(0, now - HOUR)
    activity = store.thread_activity("default", "a1", "", window, BIG)
    assert [(a.thread, a.window_message_count) for a in activity] == [("late", 1), ("early", 2)]
    [newest] = store.thread_activity("default", "a1", "", window, 1)
    assert newest.thread == "late"
    thread = store.get_thread(key("late"))
    assert thread is not None and newest.last_message_time_us == thread.last_message_time_us


def test_summaries_are_listed_but_left_out_of_the_builds_reads(store: Store) -> None:
    """A stored summary becomes the thread's latest; the build reads it on its own, not
    among the window's messages."""
    receipts = store.append(key(), batch("one", "two"), AgentSettings())
    [stored] = store.append(
        key(), summary("so far", receipts[0].id, receipts[1].id), AgentSettings()
    )
    store.append(key(), batch("three"), AgentSettings())
    ref = store.context_ref(key())
    assert ref is not None and ref.latest_summary_id == stored.id
    found = store.latest_summary(ref)
    assert found is not None and found.is_summary and found.content == "so far"
    assert found.summarized_ids == (receipts[0].id, receipts[1].id)
    listed = store.list_messages(where(key()), EVERYTHING, None, BIG)
    assert [(m.content, m.is_summary) for m in listed] == [
        ("one", False),
        ("two", False),
        ("so far", True),
        ("three", False),
    ]
    seen = every_reader(store, key(), EVERYTHING)
    assert seen["columns"] == seen["loaded"] == ["one", "two", "three"]
    other = store.context_ref(key("t2"))
    assert other is None
    store.append(key("t2"), batch("no summary"), AgentSettings())
    fresh = store.context_ref(key("t2"))
    assert (
        fresh is not None and fresh.latest_summary_id == 0 and store.latest_summary(fresh) is None
    )


def test_a_window_read_loads_only_the_planned_range(store: Store) -> None:
    """`window_messages_from` returns the window's messages from a sequence on, within
    the planned ids: what was appended after the plan stays out."""
    store.append(key(), batch("m1", "m2", "m3", "m4"), AgentSettings())
    ref = store.context_ref(key())
    assert ref is not None
    table = store.window_columns(ref, EVERYTHING)
    ids = table.column("id").to_pylist()
    assert table.column("sequence").to_pylist() == [1, 2, 3, 4]
    store.append(key(), batch("after the plan"), AgentSettings())
    loaded = store.window_messages_from(ref, EVERYTHING, 3, (min(ids), max(ids)))
    assert [(m.content, m.sequence) for m in loaded] == [("m3", 3), ("m4", 4)]
