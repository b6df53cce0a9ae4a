"""The status block a build carries, kept between builds: the builder keeps a thread's
block (but its "as of" line) until its inputs change or the clock reaches a time at which
it reads otherwise (`status_body`), and the DuckDB hot cache keeps an agent's thread
activity until its threads change or the window's age reaches a row (`ActivityKept`).
Neither may show a stale block: every build is checked against one made afresh (a store
without the hot cache, a builder that remembers nothing), on both engines over gRPC.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf import duration_pb2
from hypothesis import given, settings
from hypothesis import strategies as st
from test_hot_build import _same

from conftest import Client
from contextd.adapters.duckdb.hot_activity import (
    activity_kept,
    activity_of,
    by_recency,
    newest_of,
    partial_threads,
)
from contextd.adapters.duckdb.hot_entries import ScopeThread
from contextd.adapters.duckdb.store import Store
from contextd.app.build.build_types import BuildRequest
from contextd.app.build.status_text import status_body, status_preamble
from contextd.app.build.summarizer import ExtractiveSummarizer
from contextd.app.service import ContextService
from contextd.domain.clock import ManualClock
from contextd.domain.context import StatusEntry, StatusKind, ThreadActivity
from contextd.domain.model import AgentSettings, BuildOverrides, NewMessage, Role
from contextd.domain.window import MAX_SOURCE_LEAD_US, WindowSpec
from contextd.v1 import context_service_pb2 as pb

TENANT, AGENT, THREAD = "default", "a1", "main"
START_US = 1_700_000_000_000_000
SECOND_US = 1_000_000
MINUTE_US = 60 * SECOND_US
HOUR_US = 60 * MINUTE_US
NEVER = 1 << 62


# ----------------------------------------------------------------- the body's lifetime

_offsets = st.integers(-2 * 86_400 * SECOND_US, 2 * 86_400 * SECOND_US)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), _offsets, st.integers(0, 3)), max_size=6),
    st.lists(st.tuples(_offsets, st.none() | _offsets), max_size=4),
    st.integers(0, 3 * 86_400 * SECOND_US),
    st.integers(1, 3),
)
def test_a_status_body_reads_the_same_until_the_time_it_names(
    threads: list[tuple[int, int, int]],
    entries: list[tuple[int, int | None]],
    later: int,
    max_lines: int,
) -> None:
    """From `now` until the returned time every later clock gives the same body, and at
    that time it reads otherwise (an "ago" or "expires in" shows another number, an entry
    expires): the builder keeps a body for exactly that long."""
    now = START_US
    activity = [
        ThreadActivity(f"t{name}", now - back, count)
        for name, back, count in {t[0]: t for t in threads}.values()
    ]
    status = [
        StatusEntry(
            f"k{i}",
            StatusKind.PROCESS,
            "running",
            "work",
            now - back,
            None if expires is None else now + expires,
        )
        for i, (back, expires) in enumerate(entries)
    ]

    def body(at: int) -> str | None:
        return status_body(
            status, activity, at, "t0", max_entries=max_lines, max_threads=max_lines
        )[0]

    first, until = status_body(
        status, activity, now, "t0", max_entries=max_lines, max_threads=max_lines
    )
    assert until > now
    if now + later < until:
        assert body(now + later) == first
    assert body(until - 1) == first
    if until < NEVER:
        assert body(until) != first
    # The block is the body under its "as of" line.
    text = status_preamble(
        status, activity, now, "t0", max_entries=max_lines, max_threads=max_lines
    )
    assert (text == "") == (first is None)
    if first is not None:
        assert text.startswith("Status as of 2023-11-14T22:13:20+00:00:\n") and text.endswith(first)


# ----------------------------------------------------------------- the kept activity

_times = st.integers(0, 60)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(_times, _times, st.integers(0, 3), st.none() | _times, st.none() | _times),
        max_size=12,
    ),
    _times,
    _times,
    st.integers(1, 6),
    st.integers(0, 80),
)
def test_kept_thread_activity_is_what_the_threads_give_within_its_ages(
    rows: list[tuple[int, int, int, int | None, int | None]],
    clear_after: int,
    age_after: int,
    limit: int,
    step: int,
) -> None:
    """An activity answer made from the thread rows alone is kept for the ages it names:
    at any of them the rows give no thread to count from its messages and the same
    answer (`thread_activity` of the hot cache, step by step)."""
    threads = {
        f"t{i}": ScopeThread(f"t{i}", i, last, count, create, source, clear)
        for i, (last, create, count, source, clear) in enumerate(rows)
    }
    lead = MAX_SOURCE_LEAD_US

    def answer(age: int) -> tuple[list[ScopeThread], list[ThreadActivity], WindowSpec]:
        window = WindowSpec(clear_after, age + lead)
        newest = newest_of(by_recency(threads.values(), window), window, limit)
        partial = partial_threads(newest, window)
        return partial, activity_of(newest, {}) if not partial else [], window

    partial, activity, window = answer(age_after)
    if partial:
        return  # answered by counting messages: never kept
    newest = newest_of(by_recency(threads.values(), window), window, limit)
    kept = activity_kept(threads, window, limit, newest, activity)
    assert kept is not None and kept.answers(threads, window, limit)
    later = WindowSpec(clear_after, age_after + lead + step)
    if kept.answers(threads, later, limit):
        partial_then, activity_then, _ = answer(age_after + step)
        assert partial_then == [] and activity_then == activity
    # Other rows (a copy: rows are replaced on every change), bounds or limits: not kept.
    assert not kept.answers(dict(threads), window, limit)
    assert not kept.answers(threads, WindowSpec(clear_after + 1, age_after + lead), limit)
    assert not kept.answers(threads, WindowSpec(clear_after, age_after + lead - 1), limit)
    assert not kept.answers(threads, window, limit + 1)
    retained = WindowSpec(clear_after, age_after + lead, max_messages=5)
    assert activity_kept(threads, retained, limit, newest, activity) is None


# ----------------------------------------------------------------- hot against cold


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[tuple[Store, Store]]:
    hot = Store.open(tmp_path / "hot" / "x.duckdb", clock=ManualClock(START_US))
    cold = Store.open(
        tmp_path / "cold" / "x.duckdb", clock=ManualClock(START_US), hot_cache_bytes=0
    )
    yield hot, cold
    hot.close()
    cold.close()


def _texts(n: int, start: int) -> list[NewMessage]:
    return [
        NewMessage(role=Role.USER if i % 2 else Role.ASSISTANT, content=f"message {i} " * 20)
        for i in range(start, start + n)
    ]


REQUEST = BuildRequest(
    TENANT, AGENT, "", THREAD, overrides=BuildOverrides(budget_tokens=3_000), formats=("openai",)
)


@pytest.mark.duckdb_only
@pytest.mark.parametrize("seed", range(4))
def test_a_kept_status_block_is_the_one_made_afresh_after_any_change(
    stores: tuple[Store, Store], seed: int
) -> None:
    """Random changes of an agent with several threads (appends to this and other
    threads, new threads, status entries with and without expiry, clears, the clock by
    a fraction of a second to hours): every build of the hot store with a remembering
    builder is the build of a store without the cache by a builder that keeps nothing,
    and the block shows the other threads and live entries."""
    hot = ContextService(stores[0], ExtractiveSummarizer())
    cold = ContextService(stores[1], ExtractiveSummarizer())
    cold._builder.remember_results = False
    services = (hot, cold)
    clocks = [s.clock for s in stores]
    for service in services:
        service.create_agent(TENANT, AGENT, AgentSettings(rolling_window_us=2 * HOUR_US))
        service.append_messages(TENANT, AGENT, "", THREAD, _texts(40, 0))
        for k in range(4):
            service.append_messages(TENANT, AGENT, "", f"side-{k}", _texts(2, 100 + k))
    rng = random.Random(seed)
    n = 1_000
    kinds = ["append", "side", "new", "status", "expiring", "clear", "tick", "tick", "wait"]
    shown = 0
    for step in range(120):
        kind = rng.choice(kinds)
        n += 1
        if kind in ("tick", "wait"):
            us = rng.randrange(SECOND_US) if kind == "tick" else rng.randrange(3 * HOUR_US)
            for clock in clocks:
                assert isinstance(clock, ManualClock)
                clock.advance(us)
        side = f"side-{rng.randrange(4)}"
        ttl = rng.randrange(1, 90) * SECOND_US if kind == "expiring" else None
        for service in services:
            if kind == "append":
                service.append_messages(TENANT, AGENT, "", THREAD, _texts(1, n))
            elif kind == "side":
                service.append_messages(TENANT, AGENT, "", side, _texts(1, n))
            elif kind == "new":
                service.append_messages(TENANT, AGENT, "", f"new-{n}", _texts(1, n))
            elif kind in ("status", "expiring"):
                entry = StatusEntry(f"job-{n % 3}", StatusKind.PROCESS, "running", f"step {n}", 0)
                service.set_status(TENANT, AGENT, "", entry, ttl)
            elif kind == "clear":
                service.clear_context(TENANT, AGENT, "", side)
        for _ in range(3):  # the later builds are answered from what the first kept
            built = hot.build_context(REQUEST)
            fresh = cold.build_context(REQUEST)
            _same(built, fresh)
        shown += bool(built.context.status)
        assert built.context.status.count("(this thread)") <= 1, step
    assert shown > 0


# ----------------------------------------------------------------- over gRPC, both engines


def _status(client: Client) -> str:
    response = client.stub.BuildContext(pb.BuildContextRequest(agent="a1", thread="t1"))
    again = client.stub.BuildContext(pb.BuildContextRequest(agent="a1", thread="t1"))
    assert again.status == response.status
    status: str = response.status
    return status


def _line(status: str, thread: str) -> str:
    return next(line for line in status.splitlines() if line.startswith(f"- {thread}"))


def test_the_status_block_shows_each_change_after_it_was_kept(
    client: Client, clock: ManualClock
) -> None:
    """Builds of a thread whose status block was kept: a new thread of the agent, a
    status entry, its new state, another thread's append and clear, the clock's
    seconds and minutes, an entry's expiry: each shows up in the next build."""
    client.append("a1", "working on the parser", thread="t1")
    client.append("a1", "deploying", thread="t2")
    first = _status(client)
    assert "- t2: 1 messages, last just now" in first
    client.append("a1", "a third thread", thread="t3")
    status = _status(client)
    assert "- t3: 1 messages" in status and "- t2: 1 messages" in status
    client.append("a1", "more deploying", thread="t2")
    assert "- t2: 2 messages" in _status(client)
    entry = pb.StatusEntry(
        key="build-42", kind=pb.STATUS_KIND_PROCESS, state="running", summary="cargo build"
    )
    client.stub.SetStatus(pb.SetStatusRequest(agent="a1", entry=entry))
    assert "build-42 — running" in _status(client)
    entry.state = "done"
    client.stub.SetStatus(pb.SetStatusRequest(agent="a1", entry=entry))
    status = _status(client)
    assert "build-42 — done" in status and "running" not in status
    expiring = pb.StatusEntry(key="probe", kind=pb.STATUS_KIND_PROCESS, state="up", summary="x")
    client.stub.SetStatus(
        pb.SetStatusRequest(agent="a1", entry=expiring, ttl=duration_pb2.Duration(seconds=90))
    )
    assert "expires in 1m" in _status(client)
    clock.advance(SECOND_US // 2)
    assert "expires in 1m" in _status(client)
    clock.advance(SECOND_US * 6 // 10)  # over a second since the threads' messages
    status = _status(client)
    assert "last 1s ago" in _line(status, "t3") and "expires in 1m" in status
    clock.advance(29 * SECOND_US)
    status = _status(client)
    assert "last 30s ago" in _line(status, "t3") and "expires in 59s" in status
    clock.advance(30 * SECOND_US)
    status = _status(client)
    assert "last 1m ago" in _line(status, "t3") and "expires in 29s" in status
    clock.advance(30 * SECOND_US)  # past the entry's expiry
    status = _status(client)
    assert "probe" not in status and "build-42 — done" in status
    client.stub.ClearContext(pb.ClearContextRequest(agent="a1", thread="t2"))
    status = _status(client)
    assert "- t2" not in status and "- t3" in status


@pytest.mark.duckdb_only
def test_the_hot_cache_keeps_an_agents_thread_activity_until_its_threads_change(
    stores: tuple[Store, Store],
) -> None:
    """From the second read over the same thread rows on, the same answer (the very
    list) until a commit to one of the agent's threads; the window's age moving within
    the rows' times keeps it, and every answer is what the store without the cache
    reads."""
    hot_store, cold_store = stores
    services = [ContextService(s, ExtractiveSummarizer()) for s in stores]
    for service in services:
        service.create_agent(TENANT, AGENT, AgentSettings(rolling_window_us=2 * HOUR_US))
        for k in range(3):
            service.append_messages(TENANT, AGENT, "", f"t{k}", _texts(2, 10 * k))

    def read(store: Store, age_us: int = 0) -> list[ThreadActivity]:
        assert isinstance(store.clock, ManualClock)
        window = WindowSpec(0, store.clock.now_us() - 2 * HOUR_US + age_us)
        with store.snapshot():
            return store.thread_activity(TENANT, AGENT, "", window, 30)

    first = read(hot_store)
    assert first == read(cold_store) and [a.window_message_count for a in first] == [2, 2, 2]
    second = read(hot_store)
    assert read(hot_store) is second and read(hot_store, SECOND_US) is second
    for service in services:
        service.append_messages(TENANT, AGENT, "", "t1", _texts(1, 99))
    after = read(hot_store)
    assert after is not second and after == read(cold_store)
    assert (after[0].thread, after[0].window_message_count) == ("t1", 3)
