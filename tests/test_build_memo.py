"""A build's result remembered by what it read (`ContextBuilder._read`, the hot store's
`build_token`): a build whose reads, request and status block match an earlier one's
answers that result, and no change of the store, the agent or the clock serves a stale
one. Each step compares the remembering builder with one that never remembers, over the
same store at the same point.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_hot_build import _same

from contextd.adapters.duckdb.hot_activity import by_recency, newest_of
from contextd.adapters.duckdb.hot_entries import ScopeThread
from contextd.adapters.duckdb.store import Store
from contextd.app.build.build_types import BuildRequest, BuildResult
from contextd.app.build.summarizer import ExtractiveSummarizer
from contextd.app.service import ContextService
from contextd.domain.clock import ManualClock
from contextd.domain.context import StatusEntry, StatusKind
from contextd.domain.model import AgentSettings, BuildOverrides, NewMessage, Role
from contextd.domain.window import MAX_SOURCE_LEAD_US, WindowSpec

pytestmark = pytest.mark.duckdb_only

TENANT, AGENT, THREAD = "default", "a1", "main"
START_US = 1_700_000_000_000_000
SECOND_US = 1_000_000
HOUR_US = 3_600 * SECOND_US


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(tmp_path / "x.duckdb", clock=ManualClock(START_US))
    yield s
    s.close()


def _services(store: Store) -> tuple[ContextService, ContextService]:
    remembering = ContextService(store, ExtractiveSummarizer())
    plain = ContextService(store, ExtractiveSummarizer())
    plain._builder.remember_results = False
    return remembering, plain


def _texts(n: int, start: int = 0) -> list[NewMessage]:
    return [
        NewMessage(role=Role.USER if i % 2 else Role.ASSISTANT, content=f"message {i} " * 30)
        for i in range(start, start + n)
    ]


REQUEST = BuildRequest(
    TENANT, AGENT, "", THREAD, overrides=BuildOverrides(budget_tokens=1_500), formats=("openai",)
)


def test_a_repeated_build_is_answered_from_what_it_read(store: Store) -> None:
    hot, plain = _services(store)
    hot.create_agent(TENANT, AGENT, AgentSettings(system_prompt="be brief"))
    hot.append_messages(TENANT, AGENT, "", THREAD, _texts(200))
    hot.build_context(REQUEST)  # loads the thread into the cache (reads by SQL)
    first = hot.build_context(REQUEST)
    assert hot._builder.memo_hits == 0
    again = hot.build_context(REQUEST)
    assert hot._builder.memo_hits == 1 and again is first
    _same(again, plain.build_context(REQUEST))
    # Another request (budget, formats, user message) is another result.
    other = BuildRequest(TENANT, AGENT, "", THREAD, overrides=BuildOverrides(budget_tokens=900))
    _same(hot.build_context(other), plain.build_context(other))
    assert hot._builder.memo_hits == 1


def _clock(store: Store) -> ManualClock:
    clock = store.clock
    assert isinstance(clock, ManualClock)
    return clock


def _changes(store: Store, hot: ContextService) -> list[tuple[str, Callable[[], object]]]:
    """Changes after each of which a remembered result would be stale."""
    clock = _clock(store)
    status = StatusEntry("job-1", StatusKind.PROCESS, "running", "indexing the docs", 0)
    return [
        ("append", lambda: hot.append_messages(TENANT, AGENT, "", THREAD, _texts(3, 500))),
        (
            "another thread's append (the status block)",
            lambda: hot.append_messages(TENANT, AGENT, "", "side", _texts(2, 900)),
        ),
        ("status entry", lambda: hot.set_status(TENANT, AGENT, "", status, None)),
        ("a second on the clock (the status block's times)", lambda: clock.advance(SECOND_US)),
        (
            "system prompt",
            lambda: hot.update_agent(
                TENANT, AGENT, AgentSettings(system_prompt="be terse"), ["system_prompt"]
            ),
        ),
        (
            "model",
            lambda: hot.update_agent(TENANT, AGENT, AgentSettings(model="gpt-4o"), ["model"]),
        ),
        (
            "compaction (a stored summary)",
            lambda: hot.compact_context(
                TENANT, AGENT, "", THREAD, "", BuildOverrides(keep_recent_tokens=200)
            ),
        ),
        (
            "the rolling window leaves messages behind",
            lambda: clock.advance(2 * HOUR_US - 30 * SECOND_US),
        ),
        ("clear", lambda: hot.clear_context(TENANT, AGENT, "", THREAD)),
        (
            "append after the clear",
            lambda: hot.append_messages(TENANT, AGENT, "", THREAD, _texts(4, 700)),
        ),
    ]


def test_no_change_serves_a_remembered_result(store: Store) -> None:
    hot, plain = _services(store)
    hot.create_agent(TENANT, AGENT, AgentSettings(rolling_window_us=2 * HOUR_US))
    clock = _clock(store)
    hot.append_messages(TENANT, AGENT, "", THREAD, _texts(150))
    clock.advance(HOUR_US)
    hot.append_messages(TENANT, AGENT, "", THREAD, _texts(100, 150))
    hot.append_messages(TENANT, AGENT, "", "side", _texts(2, 800))
    builder = hot._builder
    for name, change in _changes(store, hot):
        hot.build_context(REQUEST)  # a change may have dropped cache entries: reloads
        before: BuildResult = hot.build_context(REQUEST)
        hits = builder.memo_hits
        assert hot.build_context(REQUEST) is before, f"before {name}: not remembered"
        assert builder.memo_hits == hits + 1
        change()
        after = hot.build_context(REQUEST)
        assert builder.memo_hits == hits + 1, f"after {name}: a remembered result served"
        # The first build after a change may read by SQL (the change dropped entries)
        # and remember nothing; the next ones are served from the cache.
        for _ in range(2):
            assert after is not before, f"after {name}: the result before it served"
            _same(after, plain.build_context(REQUEST))
            after = hot.build_context(REQUEST)


def test_a_build_with_excerpts_is_not_remembered(store: Store) -> None:
    hot, plain = _services(store)
    hot.create_agent(TENANT, AGENT, AgentSettings())
    hot.append_messages(TENANT, AGENT, "", THREAD, _texts(50))
    asking = BuildRequest(
        TENANT,
        AGENT,
        "",
        THREAD,
        user_message="what about the docs?",
        overrides=BuildOverrides(budget_tokens=1_500, tool_output_excerpts=2),
    )
    for _ in range(2):
        _same(hot.build_context(asking), plain.build_context(asking))
    assert hot._builder.memo_hits == 0
    # Without excerpts a user message is part of the request like any other.
    plain_ask = BuildRequest(TENANT, AGENT, "", THREAD, user_message="and now?")
    hot.build_context(plain_ask)
    first = hot.build_context(plain_ask)
    hits = hot._builder.memo_hits
    assert hot.build_context(plain_ask) is first and hot._builder.memo_hits == hits + 1


def test_a_store_without_the_cache_never_remembers(tmp_path: Path) -> None:
    cold = Store.open(tmp_path / "c.duckdb", clock=ManualClock(START_US), hot_cache_bytes=0)
    try:
        service = ContextService(cold, ExtractiveSummarizer())
        service.create_agent(TENANT, AGENT, AgentSettings())
        service.append_messages(TENANT, AGENT, "", THREAD, _texts(20))
        first = service.build_context(REQUEST)
        again = service.build_context(REQUEST)
        assert service._builder.memo_hits == 0 and again is not first
        _same(again, first)
    finally:
        cold.close()


def test_a_lone_thread_whose_window_moves_is_built_again(store: Store) -> None:
    """Without a status block the clock reaches a build only through its window: the
    remembered result is keyed by the messages the window selects, not by its bounds."""
    hot, plain = _services(store)
    hot.create_agent(TENANT, AGENT, AgentSettings(rolling_window_us=2 * HOUR_US))
    clock = _clock(store)
    hot.append_messages(TENANT, AGENT, "", THREAD, _texts(6))
    clock.advance(HOUR_US)
    hot.append_messages(TENANT, AGENT, "", THREAD, _texts(4, 6))
    roomy = BuildRequest(TENANT, AGENT, "", THREAD, overrides=BuildOverrides(budget_tokens=50_000))
    hot.build_context(roomy)
    before = hot.build_context(roomy)
    assert before.context.status == "" and len(before.context.history) == 10
    clock.advance(SECOND_US)  # the bounds move, the messages they select do not
    hits = hot._builder.memo_hits
    assert hot.build_context(roomy) is before and hot._builder.memo_hits == hits + 1
    clock.advance(HOUR_US)  # the first six leave the window
    after = hot.build_context(roomy)
    assert len(after.context.history) == 4
    _same(after, plain.build_context(roomy))


def test_a_status_block_that_changes_reuses_the_window_read(store: Store) -> None:
    """The status block names other threads' ages in seconds, so it changes often: the
    window's part of the build is remembered apart from it, and the build is still the
    one a builder that remembers nothing makes."""
    hot, plain = _services(store)
    hot.create_agent(TENANT, AGENT, AgentSettings())
    hot.append_messages(TENANT, AGENT, "", THREAD, _texts(120))
    hot.append_messages(TENANT, AGENT, "", "side", _texts(3))
    hot.build_context(REQUEST)
    before = hot.build_context(REQUEST)
    builder = hot._builder
    for _ in range(3):
        hits, windows = builder.memo_hits, builder.window_hits
        _clock(store).advance(5 * SECOND_US)
        after = hot.build_context(REQUEST)
        assert after.context.status != before.context.status
        assert builder.memo_hits == hits and builder.window_hits == windows + 1
        # From the second on, assembly also reuses the window made ready to fit.
        _same(after, plain.build_context(REQUEST))
        before = after


_times = st.integers(0, 50)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(_times, _times, _times, st.none() | _times, st.none() | _times, _times),
        max_size=40,
    ),
    _times,
    _times,
    st.integers(1, 12),
)
def test_threads_kept_in_recency_order_choose_what_filtering_each_time_chooses(
    rows: list[tuple[int, int, int, int | None, int | None, int]],
    clear_after: int,
    age_after: int,
    limit: int,
) -> None:
    """The scope's threads sorted once per row set (`by_recency`) and cut per window
    (`newest_of`) are the threads filtering and sorting them for each build chose."""
    threads = [
        ScopeThread(f"t{i % 7}-{i}", i, last, count, create, source, clear)
        for i, (last, create, count, source, clear, _) in enumerate(rows)
    ]
    window = WindowSpec(clear_after, age_after + MAX_SOURCE_LEAD_US)

    def clear_of(t: ScopeThread) -> int:
        marker = window.clear_after_us if t.last_clear_us is None else t.last_clear_us
        return max(window.clear_after_us, marker)

    oldest_commit = window.age_after_us - MAX_SOURCE_LEAD_US
    expected = sorted(
        (
            t
            for t in threads
            if t.last_message_time_us > clear_of(t) and t.last_message_time_us > oldest_commit
        ),
        key=lambda t: (-t.last_message_time_us, t.thread),
    )[:limit]
    assert newest_of(by_recency(threads, window), window, limit) == expected


def test_another_agents_commit_reuses_the_window_read_and_the_threads_own_do_not(
    store: Store,
) -> None:
    """A commit moves the store's generation, so no result is answered after it; the
    window's part is the thread's alone (its view's serial in the token) and is reused
    after another agent's commit, never after one of the thread's own."""
    hot, plain = _services(store)
    for agent in (AGENT, "a2"):
        hot.create_agent(TENANT, agent, AgentSettings())
    hot.append_messages(TENANT, AGENT, "", THREAD, _texts(120))
    builder = hot._builder
    hot.build_context(REQUEST)
    hot.build_context(REQUEST)
    own: list[Callable[[], object]] = [
        lambda: hot.append_messages(TENANT, AGENT, "", THREAD, _texts(1, 300)),
        lambda: hot.compact_context(
            TENANT, AGENT, "", THREAD, "", BuildOverrides(keep_recent_tokens=200)
        ),
        lambda: hot.clear_context(TENANT, AGENT, "", THREAD),
        lambda: hot.append_messages(TENANT, AGENT, "", THREAD, _texts(2, 400)),
    ]
    for i, change in enumerate(own):
        hits, windows = builder.memo_hits, builder.window_hits
        hot.append_messages(TENANT, "a2", "", THREAD, _texts(1, 1_000 + i))
        _same(hot.build_context(REQUEST), plain.build_context(REQUEST))
        assert builder.memo_hits == hits and builder.window_hits == windows + 1
        change()
        hot.append_messages(TENANT, "a2", "", THREAD, _texts(1, 2_000 + i))
        _same(hot.build_context(REQUEST), plain.build_context(REQUEST))
        assert builder.window_hits == windows + 1, f"change {i}: the old window served"
        hot.build_context(REQUEST)  # after a reload by SQL: the window is remembered
