"""PostgreSQL builds read the window newest first, and build exactly what reading it all
builds.

A differential test: random histories (turns of random lengths, tool turns whose results
come at once, later or never, stray results, thread clears, compactions, time passing
out of the rolling window) in one PostgreSQL database; after every few steps each build
(random budgets, truncation, elision) runs twice on the same state: through the
newest-first read (`ContextBuilder._load_tail`, with tiny pages and a tiny number of held
ids so that short histories take its paged and counted paths) and with the store's
`window_bounds` answering None (the whole window read, as before). Every answer must be
the same: the context, the renderings, the stats (dropped_ids compared by count and by
the ids a response would list, the rest field by field), the orphans, the loaded count.

PostgreSQL only: the embedded engine answers every build from its whole-window columns
(its `window_bounds` is None), so there is nothing to compare there.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import psycopg
import pytest

from contextd.adapters.postgres.store import PostgresStore
from contextd.app.build import builder, window_extension, window_loading
from contextd.app.build.build_types import BuildRequest, BuildResult
from contextd.app.build.builder import ContextBuilder
from contextd.app.build.summarizer import ExtractiveSummarizer
from contextd.app.service import ContextService
from contextd.domain.clock import ManualClock
from contextd.domain.context import IdList
from contextd.domain.errors import FailedPrecondition
from contextd.domain.model import AgentSettings, BuildOverrides, ContextKey, NewMessage, Role
from contextd.domain.window import WindowSpec

TENANT, AGENT = "default", "a1"
THREADS = ("t1", "t2")
HOUR_US = 3_600 * 1_000_000
HELD = 9  # ids held of what a build leaves out, in this test (a response lists 10,000)


@pytest.fixture
def store(postgres_dsn: str) -> Iterator[PostgresStore]:
    store = PostgresStore.open(postgres_dsn, clock=ManualClock(1_700_000_000_000_000))
    yield store
    store.close()


@pytest.fixture
def service(store: PostgresStore) -> ContextService:
    service = ContextService(store, ExtractiveSummarizer())
    service.create_agent(TENANT, AGENT, AgentSettings(rolling_window_us=2 * HOUR_US))
    return service


def set_read_bound(monkeypatch: pytest.MonkeyPatch, name: str, value: int) -> None:
    """Set a bound of the newest-first read (`FIRST_PAGE`, `HELD_DROPPED_IDS`) in every
    module that reads it (each holds its own binding): the builder's plan, which sends it
    to the store, and the loading and the extension of a window."""
    for module in (builder, window_loading, window_extension):
        monkeypatch.setattr(module, name, value)


def _history_step(
    service: ContextService, clock: ManualClock, rng: random.Random, tools: float, calls: list[str]
) -> None:
    """One random change of the store."""
    thread = rng.choice(THREADS)
    assert isinstance(clock, ManualClock)

    def append(*messages: NewMessage) -> None:
        service.append_messages(TENANT, AGENT, "", thread, list(messages), create_agent=True)

    roll = rng.random()
    if roll < tools:
        ids = [f"c{rng.randrange(10**9)}" for _ in range(rng.randint(1, 3))]
        body = [{"id": c, "name": "grep", "input": {"q": c}} for c in ids]
        append(NewMessage(role=Role.TOOL_USE, content="", tool_calls=json.dumps(body)))
        for call in ids:
            fate = rng.random()
            if fate < 0.7:
                append(
                    NewMessage(
                        role=Role.TOOL_RESULT,
                        content="out " * rng.randint(1, 400),
                        tool_call_id=call,
                    )
                )
            elif fate < 0.9:
                calls.append(call)
    elif roll < tools + 0.02 and calls:
        call = calls.pop(rng.randrange(len(calls)))
        append(NewMessage(role=Role.TOOL_RESULT, content="late", tool_call_id=call))
    elif roll < tools + 0.03:
        append(NewMessage(role=Role.TOOL_RESULT, content="stray", tool_call_id="nobody"))
    elif roll < tools + 0.04:
        try:
            service.clear_context(TENANT, AGENT, "", thread)
        except Exception as exc:  # a thread with no messages yet has nothing to clear
            assert type(exc).__name__ == "NotFound", exc
    elif roll < tools + 0.07:
        try:
            service.compact_context(
                TENANT,
                AGENT,
                "",
                thread,
                "",
                BuildOverrides(keep_recent_tokens=rng.randint(0, 300)),
            )
        except FailedPrecondition:
            pass
        except Exception as exc:  # NotFound: the thread has no messages yet
            assert type(exc).__name__ == "NotFound", exc
    elif roll < tools + 0.10:
        clock.advance(rng.randint(1, 40) * 60 * 1_000_000)  # older turns leave the window
    else:
        role = rng.choice([Role.USER, Role.USER, Role.ASSISTANT])
        n = rng.choice([1, 2, 5, 20, 60, 200, 1_500])
        append(*[NewMessage(role=role, content=rng.choice(["alpha ", "naïve ", "東京 "]) * n)])


def _same(new: BuildResult, old: BuildResult) -> None:
    a, b = new.context.stats, old.context.stats
    assert isinstance(b.dropped_ids, IdList)
    assert len(a.dropped_ids) == len(b.dropped_ids)
    listed = min(HELD, len(a.dropped_ids))
    if listed:
        assert a.dropped_ids[-listed:] == b.dropped_ids[-listed:]
    assert replace(a, dropped_ids=()) == replace(b, dropped_ids=())
    assert new.context.history == old.context.history
    assert new.renderings == old.renderings
    assert new.orphaned_ids == old.orphaned_ids
    assert new.messages_loaded == old.messages_loaded
    assert new.stamps == old.stamps


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tools", [0.0, 0.15])
def test_newest_first_builds_what_the_whole_window_builds(
    store: PostgresStore,
    service: ContextService,
    monkeypatch: pytest.MonkeyPatch,
    seed: int,
    tools: float,
) -> None:
    set_read_bound(monkeypatch, "FIRST_PAGE", 3)
    set_read_bound(monkeypatch, "HELD_DROPPED_IDS", HELD)
    served: list[int] = []  # how many window messages each newest-first build left unread
    load_tail = ContextBuilder._load_tail

    def counting(self: ContextBuilder, *args: Any) -> Any:
        window = load_tail(self, *args)
        if window is not None:
            served.append(window.hidden)
        return window

    monkeypatch.setattr(ContextBuilder, "_load_tail", counting)
    clock = store.clock
    assert isinstance(clock, ManualClock)
    whole_window = store.window_bounds
    ordinal_of = store.window_ordinal
    found: list[int] = []  # ordinals of messages a build checked a run of ids with

    def finding(*args: Any) -> int | None:
        ordinal = ordinal_of(*args)
        if ordinal is not None:
            found.append(ordinal)
        return ordinal

    monkeypatch.setattr(store, "window_ordinal", finding)
    rng = random.Random(seed)
    calls: list[str] = []
    builds = 0
    for step in range(120):
        _history_step(service, clock, rng, tools, calls)
        if step % 4:
            continue
        for thread in THREADS:
            overrides = BuildOverrides(
                budget_tokens=rng.choice([40, 120, 400, 1_500, 6_000]),
                truncate=rng.random() < 0.5,
                max_chars_per_message=rng.choice([None, 300]),
                elide_tool_results=rng.random() < 0.5,
                elide_threshold_chars=200,
            )
            request = BuildRequest(
                TENANT, AGENT, "", thread, overrides=overrides, formats=("openai",)
            )
            try:
                new = service.build_context(request)
            except Exception as exc:  # no agent/thread yet, or a budget below the prompt
                assert type(exc).__name__ in ("NotFound", "InvalidArgument"), exc
                continue
            monkeypatch.setattr(store, "window_bounds", lambda *a: None)
            old = service.build_context(request)
            monkeypatch.setattr(store, "window_bounds", whole_window)
            _same(new, old)
            builds += 1
    assert builds > 40
    # The newest-first read served most builds, and some of them left part of the window
    # unread (counted, not read); with tool turns throughout, some of those held tool
    # rows in the unread part and asked the store for its orphans instead of reading it.
    assert len(served) > builds // 2
    if tools:
        assert service._builder.unread_tool_builds > 0
    assert any(h > 0 for h in served)
    assert found  # some runs of held ids were checked, not read


@pytest.mark.parametrize("budget", [2_200, 6_500])
def test_a_window_of_short_turns_loading_over_a_thousand_is_extended_and_built_the_same(
    store: PostgresStore, service: ContextService, postgres_dsn: str, budget: int
) -> None:
    """In a thread of short turns a budget of a few thousand tokens loads thousands of
    messages (the candidates the trimmer walks, by their stored counts); an append to it
    still extends the window the builder keeps (the appended rows read with the
    thread's row) instead of reading the window afresh at every build (tens of
    milliseconds), and what the build answers is what a whole-window read of another
    replica answers."""
    for start in (0, 6_000):
        turns = [
            NewMessage(role=(Role.USER, Role.ASSISTANT)[i % 2], content=f"ok {i}")
            for i in range(start, start + 6_000)
        ]
        service.append_messages(TENANT, AGENT, "", "t1", turns)
    request = BuildRequest(TENANT, AGENT, "", "t1", overrides=BuildOverrides(budget_tokens=budget))
    first = service.build_context(request)
    # More loaded than four first pages (where the extension stopped before), less than
    # the three pages a fresh read reads (256 + 1,024 + 4,096).
    page = window_loading.FIRST_PAGE
    assert 4 * page < first.messages_loaded < 21 * page
    whole = PostgresStore.open(postgres_dsn, clock=ManualClock(store.clock.now_us()))
    try:
        whole.window_bounds = lambda *a: None  # type: ignore[method-assign]
        whole_service = ContextService(whole, ExtractiveSummarizer())
        for i in range(8):
            # Some short, some long enough to move where the loaded part starts.
            content = f"more {i} " + "and more words " * (40 * (i % 3))
            service.append_messages(
                TENANT, AGENT, "", "t1", [NewMessage(role=Role.USER, content=content)]
            )
            extended = service._builder.window_extensions
            new = service.build_context(request)
            assert service._builder.window_extensions == extended + 1
            assert new.context.history[-1].content == content
            assert isinstance(whole.clock, ManualClock)
            whole.clock.set(store.clock.now_us())
            _same(new, whole_service.build_context(request))
    finally:
        whole.close()


def test_the_held_ids_cover_what_a_response_lists() -> None:
    from contextd.api.convert import MAX_LISTED_DROPPED_IDS

    assert window_loading.HELD_DROPPED_IDS >= MAX_LISTED_DROPPED_IDS


def test_an_id_list_with_unlisted_ids_serves_its_length_and_newest_ids() -> None:
    ids = IdList([7, 8], [9], unlisted=5)
    assert len(ids) == 8 and ids
    assert ids[-3:] == (7, 8, 9) and ids[-1] == 9 and ids[5] == 7
    assert ids == IdList([7, 8, 9], unlisted=5) and ids != IdList([7, 8, 9], unlisted=4)
    for read in (lambda: list(ids), lambda: ids[-4:], lambda: ids[0], lambda: ids.array()):
        with pytest.raises(ValueError):
            read()


def test_a_database_from_before_the_running_counts_migrates_to_them(
    postgres_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Migration 9 backfills every message's running counts and each thread's totals to
    what appends write; builds after it take the newest-first read and answer as the
    whole read does."""
    clock = ManualClock(1_700_000_000_000_000)
    store = PostgresStore.open(postgres_dsn, clock=clock)
    service = ContextService(store, ExtractiveSummarizer())
    service.create_agent(TENANT, AGENT, AgentSettings(rolling_window_us=2 * HOUR_US))
    rng = random.Random(7)
    calls: list[str] = []
    for _ in range(150):
        _history_step(service, clock, rng, 0.15, calls)
    counts = "SELECT context_id, sequence, ordinal, tools_total FROM messages ORDER BY 1, 2"
    totals = "SELECT context_id, ordinal_total, tools_total, totals_through FROM threads ORDER BY 1"
    with store._reading() as conn:
        written = (conn.execute(counts).fetchall(), conn.execute(totals).fetchall())
        assert all(row[2] is not None for row in written[0])
    store.close()
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:  # back to version 8
        conn.execute("DROP INDEX messages_by_time")
        conn.execute("ALTER TABLE messages DROP COLUMN ordinal, DROP COLUMN tools_total")
        conn.execute(
            "ALTER TABLE threads DROP COLUMN ordinal_total, DROP COLUMN tools_total, "
            "DROP COLUMN totals_through, DROP COLUMN outputs_expired_through_us"  # and 12's
        )
        conn.execute("DROP TABLE tool_open")  # and 13's
        conn.execute("ALTER TABLE threads DROP COLUMN tool_span")
        conn.execute("DROP TRIGGER messages_tool_open_insert ON messages")
        conn.execute("DROP TRIGGER messages_tool_open_delete ON messages")
        conn.execute("DROP FUNCTION contextd_tool_open_insert, contextd_tool_open_delete")
        for event in ("insert", "update", "delete", "truncate"):  # and 14's
            conn.execute(f"DROP TRIGGER messages_touch_threads_{event} ON messages")
        conn.execute("DROP FUNCTION contextd_touch_threads")
        conn.execute("ALTER TABLE threads DROP COLUMN rewrites")  # and 15's
        conn.execute("DELETE FROM schema_migrations WHERE version >= 9")
    store = PostgresStore.open(postgres_dsn, clock=clock)
    try:
        with store._reading() as conn:
            assert (conn.execute(counts).fetchall(), conn.execute(totals).fetchall()) == written
        service = ContextService(store, ExtractiveSummarizer())
        set_read_bound(monkeypatch, "HELD_DROPPED_IDS", HELD)
        whole_window = store.window_bounds
        served = 0
        for thread in THREADS:
            request = BuildRequest(
                TENANT, AGENT, "", thread, overrides=BuildOverrides(budget_tokens=200)
            )
            new = service.build_context(request)
            monkeypatch.setattr(store, "window_bounds", lambda *a: None)
            old = service.build_context(request)
            monkeypatch.setattr(store, "window_bounds", whole_window)
            _same(new, old)
            ref = store.context_ref(ContextKey(TENANT, AGENT, "", thread))
            assert ref is not None
            summary = store.latest_summary(ref)
            last = summary.summarized_ids[1] if summary and summary.summarized_ids else 0
            served += store.window_bounds(ref, WindowSpec(0, 0), last) is not None
        assert served == len(THREADS)
    finally:
        store.close()


def _tool_turns(rng: random.Random, n: int, pending: list[str]) -> list[NewMessage]:
    """`n` messages of tool-using turns: calls answered at once, later (from `pending`)
    or never, stray results, and plain text between."""
    out: list[NewMessage] = []
    while len(out) < n:
        roll = rng.random()
        if roll < 0.3:
            ids = [f"c{rng.randrange(10**9)}" for _ in range(rng.randint(1, 3))]
            body = [{"id": c, "name": "grep", "input": {"q": c}} for c in ids]
            out.append(NewMessage(role=Role.TOOL_USE, content="", tool_calls=json.dumps(body)))
            for call in ids:
                if rng.random() < 0.8:
                    out.append(
                        NewMessage(
                            role=Role.TOOL_RESULT,
                            content="out " * rng.randint(1, 300),
                            tool_call_id=call,
                        )
                    )
                else:
                    pending.append(call)
        elif roll < 0.35 and pending:
            call = pending.pop(rng.randrange(len(pending)))
            out.append(NewMessage(role=Role.TOOL_RESULT, content="late", tool_call_id=call))
        elif roll < 0.37:
            out.append(NewMessage(role=Role.TOOL_RESULT, content="stray", tool_call_id="x"))
        else:
            role = rng.choice([Role.USER, Role.ASSISTANT])
            out.append(NewMessage(role=role, content="word " * rng.randint(1, 120)))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_long_tool_threads_interleaved_read_newest_first_and_build_the_same(
    store: PostgresStore, service: ContextService, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Tool-using threads written in turns with ten others (ids of a thread then jump):
    every build takes the newest-first read, never the whole window (counted), though
    the unread part holds tool rows and orphans, and builds what the whole read builds."""
    set_read_bound(monkeypatch, "FIRST_PAGE", 16)
    set_read_bound(monkeypatch, "HELD_DROPPED_IDS", 40)
    rng = random.Random(seed)
    threads = [f"w{i}" for i in range(12)]
    pending: dict[str, list[str]] = {t: [] for t in threads}
    whole_reads = 0
    window_columns = store.window_columns

    def counting(*args: Any) -> Any:
        nonlocal whole_reads
        whole_reads += 1
        return window_columns(*args)

    monkeypatch.setattr(store, "window_columns", counting)
    asked, read = [0], [0]  # held ids asked for, and those read from the database
    page_ids, read_page_ids = store._page_ids, store._read_page_ids

    def asking(*args: Any) -> Any:
        ids = page_ids(*args)
        asked[0] += len(ids)
        return ids

    def reading(*args: Any) -> Any:
        sequences, ids, ordinals = read_page_ids(*args)
        read[0] += len(ids)
        return sequences, ids, ordinals

    monkeypatch.setattr(store, "_page_ids", asking)
    monkeypatch.setattr(store, "_read_page_ids", reading)
    builds = 0
    for round_ in range(8):
        for thread in threads:
            batch = _tool_turns(rng, rng.randint(5, 40), pending[thread])
            service.append_messages(TENANT, AGENT, "", thread, batch, create_agent=True)
        if round_ < 3:
            continue
        for thread in threads[:4]:
            overrides = BuildOverrides(
                budget_tokens=rng.choice([300, 900, 2_500]),
                truncate=rng.random() < 0.5,
                elide_tool_results=rng.random() < 0.5,
                elide_threshold_chars=200,
            )
            request = BuildRequest(
                TENANT, AGENT, "", thread, overrides=overrides, formats=("anthropic",)
            )
            tool_builds = service._builder.unread_tool_builds
            new = service.build_context(request)
            assert whole_reads == 0, "a build read the whole window"
            builds += service._builder.unread_tool_builds > tool_builds
            monkeypatch.setattr(store, "window_bounds", lambda *a: None)
            old = service.build_context(request)
            monkeypatch.setattr(
                store, "window_bounds", store.__class__.window_bounds.__get__(store)
            )
            whole_reads = 0
            _same(new, old)
            assert old.orphaned_ids  # the unread part had orphans to list
    assert builds >= 10  # tool rows in the unread part, answered by the store
    # A hot thread: the ids of its older messages (not contiguous: other threads wrote
    # between) come from the replica's run of them after a first read, and only those
    # of what was appended since are read; the build stays the whole read's.
    set_read_bound(monkeypatch, "HELD_DROPPED_IDS", 200)
    request = BuildRequest(TENANT, AGENT, "", "w0", overrides=BuildOverrides(budget_tokens=300))
    service.build_context(request)
    text = [NewMessage(role=Role.USER, content="word " * 60)] * 2
    service.append_messages(TENANT, AGENT, "", "w0", text)
    asked[0] = read[0] = 0
    new = service.build_context(request)
    assert asked[0] > 20 and read[0] <= 2
    monkeypatch.setattr(store, "window_bounds", lambda *a: None)
    _same(new, service.build_context(request))


def test_a_build_on_one_replica_sees_what_another_appended(postgres_dsn: str) -> None:
    """Two stores over one database (two replicas): each build reads what the other just
    appended, a tool result written on one answers a call written on the other, and the
    newest-first read of either equals the whole read."""
    clock = ManualClock(1_700_000_000_000_000)
    one = PostgresStore.open(postgres_dsn, clock=clock)
    two = PostgresStore.open(postgres_dsn, clock=clock)
    try:
        a, b = (
            ContextService(one, ExtractiveSummarizer()),
            ContextService(two, ExtractiveSummarizer()),
        )
        a.create_agent(TENANT, AGENT, AgentSettings())
        rng = random.Random(3)
        request = BuildRequest(TENANT, AGENT, "", "r", overrides=BuildOverrides(budget_tokens=400))
        a.append_messages(TENANT, AGENT, "", "r", _tool_turns(rng, 200, []))
        for step in range(6):
            writer, reader = (a, b) if step % 2 else (b, a)
            body = [{"id": f"k{step}", "name": "grep", "input": {}}]
            (call,) = writer.append_messages(
                TENANT,
                AGENT,
                "",
                "r",
                [NewMessage(role=Role.TOOL_USE, content="", tool_calls=json.dumps(body))],
            )
            before = reader.build_context(request)
            last = before.context.history[-1].id
            assert last == call.id  # the call, seen by the other replica's next build
            assert last in before.orphaned_ids  # not answered yet
            reader.append_messages(
                TENANT,
                AGENT,
                "",
                "r",
                [NewMessage(role=Role.TOOL_RESULT, content=f"r{step}", tool_call_id=f"k{step}")],
            )
            after = writer.build_context(request)
            assert after.context.history[-1].content == f"r{step}"
            assert last not in after.orphaned_ids  # answered, on the other replica
            assert after.context.history[-2].id == last
            assert after.context.history[-2].tool_calls  # a call again, with its result
            # An agent changed on one replica: the other's next build uses the change
            # (its cached agent is checked against the row's version in the build's read).
            prompt = f"prompt {step}"
            writer.update_agent(
                TENANT, AGENT, AgentSettings(system_prompt=prompt), ["system_prompt"]
            )
            assert reader.build_context(request).context.system_prompt == prompt
            assert writer.build_context(request).context.system_prompt == prompt
        a.delete_agent(TENANT, AGENT)
        b.create_agent(TENANT, AGENT, AgentSettings(system_prompt="again"))
        a.append_messages(TENANT, AGENT, "", "r", [NewMessage(role=Role.USER, content="hi")])
        assert a.build_context(request).context.system_prompt == "again"
    finally:
        one.close()
        two.close()


def test_tool_open_kept_by_the_triggers_is_what_migration_13_backfills(
    postgres_dsn: str,
) -> None:
    """tool_open and each thread's tool_span, as the insert trigger keeps them append by
    append (schema 16 returns at once when no inserted row is a tool row), equal what
    migration 13 computes from the stored messages: after one-message appends of calls,
    results (answered, late, stray) and plain messages, and after batches mixing them."""
    from contextd.adapters.postgres.schema import MIGRATIONS

    backfill = next(s for s in dict(MIGRATIONS)[13] if "INSERT INTO tool_open" in s)
    expected_open = backfill.replace("INSERT INTO tool_open", "", 1)
    expected_span = (
        "SELECT context_id, coalesce(max(sequence - group_start), 0) FROM messages "
        "WHERE role = 4 AND NOT is_summary AND group_id >= 0 AND group_id <> id "
        "AND group_start IS NOT NULL GROUP BY context_id"
    )
    store = PostgresStore.open(postgres_dsn)
    try:
        service = ContextService(store, ExtractiveSummarizer())
        service.create_agent(TENANT, AGENT, AgentSettings())
        rng = random.Random(16)
        pending: list[str] = []
        for step in range(40):
            thread = f"t{step % 2}"
            turns = _tool_turns(rng, rng.choice([1, 1, 1, 4]), pending)
            if len(turns) == 1 or step % 3:
                for message in turns:  # one-message appends (the one statement)
                    service.append_messages(TENANT, AGENT, "", thread, [message])
            else:
                service.append_messages(TENANT, AGENT, "", thread, turns)
        unanswered = json.dumps([{"id": "never", "name": "grep", "input": {}}])
        call = NewMessage(role=Role.TOOL_USE, content="", tool_calls=unanswered)
        service.append_messages(TENANT, AGENT, "", "t0", [call])
        service.append_messages(TENANT, AGENT, "", "t0", [NewMessage(Role.USER, "plain")])
        with psycopg.connect(postgres_dsn) as conn:
            kept = conn.execute(
                "SELECT tenant, context_id, sequence, id, kind FROM tool_open"
            ).fetchall()
            computed = conn.execute(expected_open).fetchall()
            spans = conn.execute(
                "SELECT context_id, tool_span FROM threads WHERE tool_span > 0"
            ).fetchall()
            computed_spans = conn.execute(expected_span).fetchall()
        assert sorted(kept) == sorted(computed)
        assert {k for k in kept if k[4] == "c"} and {k for k in kept if k[4] == "s"}
        assert sorted(spans) == sorted(s for s in computed_spans if s[1] > 0)
    finally:
        store.close()
