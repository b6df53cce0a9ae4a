"""The window a PostgreSQL replica remembers (`WindowReadsMixin.build_token`): kept while
the snapshot reads the thread's row at the version it was read under, and the window's
lower bound selects the same messages; every change made through another replica (or
by an operator, in SQL) is in the very next build, which equals the build of a builder
that remembers nothing. And a remembered window costs no read of the window at all.

PostgreSQL only: the embedded engine's remembered windows are its hot cache's
(tests/contract/test_build_reads.py covers them on both engines).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import psycopg
import pytest
from test_pg_build_reads import BOUNDS_BUILD_ROUND_TRIPS, HOT_BUILD_ROUND_TRIPS, _round_trips

from contextd.adapters.postgres.store import PostgresStore
from contextd.app.build.build_types import BuildRequest, BuildResult
from contextd.app.build.summarizer import ExtractiveSummarizer
from contextd.app.service import ContextService
from contextd.domain.batches import prepare_batch
from contextd.domain.clock import ManualClock
from contextd.domain.context import StatusEntry, StatusKind
from contextd.domain.model import (
    AgentSettings,
    BuildOverrides,
    ContextKey,
    NewMessage,
    Role,
)
from contextd.domain.retention import RetentionPolicy
from contextd.domain.window import WindowSpec

TENANT, AGENT = "default", "a1"
SECOND = 1_000_000
HOUR = 3_600 * SECOND


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1_700_000_000_000_000)


@pytest.fixture
def replicas(postgres_dsn: str, clock: ManualClock) -> Iterator[tuple[PostgresStore, ...]]:
    """Three stores on one database: A builds (remembering), B writes, C builds
    remembering nothing (the reference). One clock: the replicas' clocks agree."""
    # A's one connection: its round trips are counted on it.
    stores = tuple(PostgresStore.open(postgres_dsn, clock=clock, pool_size=n) for n in (1, 4, 4))
    yield stores
    for store in stores:
        store.close()


def remembered(service: ContextService) -> int:
    """Builds that took a remembered window, or a remembered result (which holds one)."""
    return service._builder.window_hits + service._builder.memo_hits


def _said(text: str, role: Role = Role.USER) -> NewMessage:
    return NewMessage(role=role, content=text)


def _turns(prefix: str, n: int) -> list[NewMessage]:
    return [
        _said(f"{prefix} {i} " + "w " * 30, (Role.USER, Role.ASSISTANT)[i % 2]) for i in range(n)
    ]


def _services(
    replicas: tuple[PostgresStore, ...], older: int, other: int
) -> tuple[ContextService, ContextService, ContextService, BuildRequest]:
    """The services of the three replicas: `a` builds and remembers, `b` makes the
    changes, `plain` remembers nothing (what every build of `a` must equal); the agent
    (a 10-hour rolling window) with `older` turns on thread "main" and `other` on
    "other", made through `b`; the build request of "main" (800 tokens)."""
    a_store, b_store, c_store = replicas
    a = ContextService(a_store, ExtractiveSummarizer())
    b = ContextService(b_store, ExtractiveSummarizer())
    plain = ContextService(c_store, ExtractiveSummarizer())
    plain._builder.remember_results = False
    b.create_agent(TENANT, AGENT, AgentSettings(rolling_window_us=10 * HOUR))
    b.append_messages(TENANT, AGENT, "", "main", _turns("older", older))
    b.append_messages(TENANT, AGENT, "", "other", _turns("other", other))
    request = BuildRequest(
        TENANT, AGENT, "", "main", overrides=BuildOverrides(budget_tokens=800, truncate=False)
    )
    return a, b, plain, request


def test_every_change_through_another_replica_is_in_the_next_build(
    replicas: tuple[PostgresStore, ...], clock: ManualClock, postgres_dsn: str
) -> None:
    a, b, plain, request = _services(replicas, older=60, other=5)

    def build() -> BuildResult:
        result = a.build_context(request)
        expected = plain.build_context(request)
        assert result.context == expected.context
        assert result.stamps == expected.stamps
        return result

    def hot() -> BuildResult:
        """Two builds of an unchanged state: the second takes the remembered window."""
        build()
        hits = remembered(a)
        result = build()
        assert remembered(a) == hits + 1
        return result

    def changed(change: Callable[[], object]) -> BuildResult:
        """A change through B (or SQL), then A's very next build: never the old window."""
        hot()
        hits = remembered(a)
        clock.advance(SECOND)
        change()
        result = build()
        assert remembered(a) == hits
        return result

    def sql(statement: str, *params: object) -> None:
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(statement, list(params))

    before = hot()
    assert before.context.stats.dropped_ids  # a window longer than the budget
    # Another thread's commit, and time passing inside the window, keep the window.
    b.append_messages(TENANT, AGENT, "", "other", _turns("meanwhile", 2))
    clock.advance(SECOND)
    hits = remembered(a)
    assert build().context.history == before.context.history
    assert remembered(a) == hits + 1

    last = changed(lambda: b.append_messages(TENANT, AGENT, "", "main", [_said("newest")]))
    assert last.context.history[-1].content == "newest"
    changed(
        lambda: b.compact_context(
            TENANT, AGENT, "", "main", "", BuildOverrides(keep_recent_tokens=200)
        )
    )
    kept = hot().context.history
    changed(lambda: sql("UPDATE messages SET content = 'rewritten' WHERE id = %s", kept[-1].id))
    assert hot().context.history[-1].content == "rewritten"
    changed(lambda: sql("DELETE FROM messages WHERE id = %s", kept[-2].id))
    assert kept[-2].id not in [m.id for m in hot().context.history]
    b.append_messages(TENANT, AGENT, "", "main", _turns("more", 4))
    changed(lambda: b.clear_context(TENANT, AGENT, "", "main"))
    assert not hot().context.history
    changed(lambda: b.append_messages(TENANT, AGENT, "", "main", _turns("after clear", 30)))
    changed(lambda: b.clear_context(TENANT, AGENT, "", ""))  # the scope
    changed(lambda: b.append_messages(TENANT, AGENT, "", "main", _turns("again", 30)))
    changed(lambda: b.clear_context(TENANT, AGENT, "", "", all_scopes=True))  # the agent
    changed(lambda: b.append_messages(TENANT, AGENT, "", "main", _turns("third", 30)))
    # The agent's settings: its rolling window narrowed, then widened again.
    changed(
        lambda: b.update_agent(
            TENANT, AGENT, AgentSettings(rolling_window_us=SECOND), ["rolling_window"]
        )
    )
    changed(
        lambda: b.update_agent(
            TENANT, AGENT, AgentSettings(rolling_window_us=10 * HOUR), ["rolling_window"]
        )
    )
    changed(
        lambda: b.update_agent(
            TENANT, AGENT, AgentSettings(system_prompt="be kind"), ["system_prompt"]
        )
    )
    # Messages age out of the rolling window with nothing written: the next build's
    # window is shorter.
    b.append_messages(TENANT, AGENT, "", "main", _turns("later", 10))
    clock.advance(5 * HOUR)
    b.append_messages(TENANT, AGENT, "", "main", _turns("latest", 10))
    full = hot()
    clock.advance(5 * HOUR + SECOND)
    aged = build()
    assert aged.context.stats.messages_before < full.context.stats.messages_before
    # A snapshot restored into the thread.
    info = b.save_snapshot(TENANT, AGENT, "", "main", "cut")
    changed(lambda: b.restore_snapshot(TENANT, AGENT, "", info.id, ""))
    # Retention: a capped window is never remembered; the sweep's deletes, then the cap
    # lifted, are seen.
    b.update_agent(
        TENANT,
        AGENT,
        AgentSettings(retention=RetentionPolicy(max_messages=12, delete_overflow=True)),
        ["retention"],
    )
    build()
    hits = remembered(a)
    build()
    assert remembered(a) == hits
    b.sweep_retention()
    build()
    b.update_agent(TENANT, AGENT, AgentSettings(), ["retention"])
    build()

    # The agent deleted and made again: a new thread of the same name.
    def recreate() -> None:
        b.delete_agent(TENANT, AGENT)
        b.create_agent(TENANT, AGENT, AgentSettings())
        b.append_messages(TENANT, AGENT, "", "main", [_said("a new life")])

    assert [m.content for m in changed(recreate).context.history] == ["a new life"]
    hot()
    # TRUNCATE (an operator's) empties the window of every thread.
    changed(lambda: sql("TRUNCATE messages"))
    # A message's own time (source_time) makes the window no plain cut by commit time.
    b.append_messages(TENANT, AGENT, "", "main", _turns("refill", 30))
    changed(
        lambda: b.append_messages(
            TENANT,
            AGENT,
            "",
            "main",
            [
                NewMessage(
                    role=Role.USER, content="imported", source_time_us=clock.now_us() - 11 * HOUR
                )
            ],
        )
    )
    # ... and no window of that thread is remembered since (each build reads it).
    hits = remembered(a)
    build()
    build()
    assert remembered(a) == hits


def test_a_remembered_window_reads_no_bounds_and_no_messages(
    replicas: tuple[PostgresStore, ...],
) -> None:
    """A build of a state this replica built before sends neither the window's bounds
    nor a read of its messages: the thread's row (with its version) and the status
    block are all it reads. After an append through any replica, the rows appended
    since go with the thread's read, and the snapshot ends with them: one round trip."""
    a_store, b_store, _ = replicas
    a = ContextService(a_store, ExtractiveSummarizer())
    b = ContextService(b_store, ExtractiveSummarizer())
    b.create_agent(TENANT, AGENT, AgentSettings())
    b.append_messages(TENANT, AGENT, "", "main", _turns("m", 400))
    request = BuildRequest(TENANT, AGENT, "", "main", overrides=BuildOverrides(budget_tokens=2_000))
    a.build_context(request)
    statements: list[str] = []
    hits = remembered(a)
    assert _round_trips(a_store, lambda: a.build_context(request), statements) == (
        HOT_BUILD_ROUND_TRIPS
    )
    assert remembered(a) == hits + 1
    assert not [s for s in statements if "FROM messages" in s and "string_agg" in s]
    assert not [s for s in statements if "FROM messages" in s and "ANY(string_to_array" in s]
    # Another replica's append: the next build reads the rows appended since (schema
    # version 15's counter tells nothing else changed), sent with the thread's read,
    # not the window's bounds, and extends the window it keeps.
    b.append_messages(TENANT, AGENT, "", "main", [_said("one more")])
    statements.clear()
    extended = a._builder.window_extensions
    kinds: list[str] = []
    assert _round_trips(a_store, lambda: a.build_context(request), statements, kinds) == (
        HOT_BUILD_ROUND_TRIPS
    )
    assert remembered(a) == hits + 1
    assert a._builder.window_extensions == extended + 1
    assert not [s for s in statements if "FROM messages" in s and "string_agg" in s]
    # One statement (prepared by the hot build before, so sent without its text): the
    # thread's read with the appended rows' join, and the status block.
    assert kinds.count("Execute") == 1
    assert a.build_context(request).context.history[-1].content == "one more"
    assert remembered(a) == hits + 2
    # Its own append: those rows travel with the thread's read (as hot, one round trip).
    a.append_messages(TENANT, AGENT, "", "main", [_said("and mine")])
    statements.clear()
    got: list[BuildResult] = []
    assert _round_trips(a_store, lambda: got.append(a.build_context(request)), statements) == (
        HOT_BUILD_ROUND_TRIPS
    )
    assert a._builder.window_extensions == extended + 2
    assert not [s for s in statements if "FROM messages" in s and "string_agg" in s]
    assert got[0].context.history[-1].content == "and mine"
    # Its own tool turn: no window extends by tool rows, so the bounds go with the
    # thread's read as before (the snapshot ends after them, as the bounds may not be
    # all the build reads), and no round trip asks for the appended rows.
    a.append_messages(
        TENANT,
        AGENT,
        "",
        "main",
        [
            NewMessage(
                role=Role.TOOL_USE,
                content="",
                tool_calls='[{"id": "c1", "name": "ls", "input": {}}]',
            ),
            NewMessage(role=Role.TOOL_RESULT, content="listed", tool_call_id="c1"),
        ],
    )
    statements.clear()
    assert _round_trips(a_store, lambda: a.build_context(request), statements) == (
        BOUNDS_BUILD_ROUND_TRIPS
    )
    assert a._builder.window_extensions == extended + 2
    assert not [s for s in statements if ".sequence > $" in s and "sequence LIMIT" in s]
    a.append_messages(TENANT, AGENT, "", "main", [_said("plain again")])
    newest = a.build_context(request).context.history[-1]
    assert newest.content == "plain again"
    assert a._builder.window_extensions == extended + 3
    # A raw INSERT (not the service's append) moves the counter: read afresh, and seen.
    with a_store._reading() as conn:
        conn.execute(
            "INSERT INTO messages SELECT tenant, context_id, sequence + 1, nextval('message_ids'), "
            "role, 'inserted', tool_calls, tool_call_id, external_id, metadata, token_estimate, "
            "create_time_us + 1, source_time_us, token_count, tokenizer, chars, group_id, "
            "tool_call_ids, is_summary, first_summarized_id, last_summarized_id, restored_from, "
            "group_start, NULL, NULL, NULL FROM messages WHERE id = %s",
            [newest.id],
        )
        conn.commit()
    assert a.build_context(request).context.history[-1].content == "inserted"
    assert a._builder.window_extensions == extended + 3


@pytest.mark.parametrize("n", [1, 10])
def test_an_append_writes_its_threads_row_once(
    replicas: tuple[PostgresStore, ...], postgres_dsn: str, n: int
) -> None:
    """The triggers that make any change to a thread's messages write its row (schema
    version 14) find an append's row written by its own transaction: one version of the
    row per append (a batch's COPY comes after the row's update), as before them."""
    store = replicas[1]
    service = ContextService(store, ExtractiveSummarizer())
    service.create_agent(TENANT, AGENT, AgentSettings())
    service.append_messages(TENANT, AGENT, "", "t", [_said("first")])
    thread = ContextKey(TENANT, AGENT, "", "t")
    model = store.get_agent(TENANT, AGENT).model
    batch = prepare_batch([_said(f"m{i}") for i in range(n)], model, [()] * n)
    with psycopg.connect(postgres_dsn) as conn:
        store._append(conn, thread, batch, None)
        row = conn.execute(
            "SELECT n_tup_upd FROM pg_stat_xact_user_tables WHERE relname = 'threads'"
        ).fetchone()
        conn.commit()
    assert row == (1,)
    ref = store.context_ref(thread)
    assert ref is not None
    assert store.window_columns(ref, WindowSpec(0, 0)).num_rows == n + 1


def test_reads_sent_with_the_threads_read_are_taken_only_with_their_arguments(
    replicas: tuple[PostgresStore, ...], clock: ManualClock
) -> None:
    """A build sends its status block's read with the thread's read, and, after an
    append through its own replica, its window's bounds, with the arguments its
    replica's last build of the thread had (the agent's window from its cache of
    agents, the thread's clear and summary as last read): `plan_build_reads`. A change
    through another replica that makes any of those wrong (the agent's window, the
    thread's clear, its summary) costs a read made again, never an answer of the wrong
    arguments; a change they do not name (a status entry, another thread's activity,
    appends) is in what they read, from the build's own snapshot. Every build equals
    the build of a replica that remembers nothing."""
    a_store = replicas[0]
    a, b, plain, request = _services(replicas, older=80, other=3)

    def build() -> tuple[BuildResult, int]:
        got: list[BuildResult] = []
        trips = _round_trips(a_store, lambda: got.append(a.build_context(request)))
        expected = plain.build_context(request)
        assert got[0].context == expected.context
        assert got[0].stamps == expected.stamps
        return got[0], trips

    build()
    build()
    # Changes the sent reads' arguments do not name: read by them, in one round trip.
    changes: tuple[tuple[Callable[[], object], int], ...] = (
        (
            lambda: b.set_status(
                TENANT,
                AGENT,
                "",
                StatusEntry("deploy", StatusKind.PROCESS, "running", "v2", 0),
                None,
            ),
            0,
        ),
        (lambda: b.append_messages(TENANT, AGENT, "", "other", _turns("meanwhile", 2)), 0),
        # Another replica's append: the rows appended since, with the thread's read.
        (lambda: b.append_messages(TENANT, AGENT, "", "main", [_said("newer")]), 0),
        # This replica's: with the thread's read.
        (lambda: a.append_messages(TENANT, AGENT, "", "main", [_said("newest")]), 0),
    )
    for change, more in changes:
        clock.advance(SECOND)
        change()
        result, trips = build()
        assert trips == HOT_BUILD_ROUND_TRIPS + more
    assert [m.content for m in result.context.history[-2:]] == ["newer", "newest"]
    assert "deploy" in result.context.status
    # Changes that make a sent read's arguments wrong: the read is made again. The
    # agent's window narrowed: the older messages and the other thread leave it.
    clock.advance(2 * HOUR)
    b.append_messages(TENANT, AGENT, "", "main", _turns("recent", 30))
    wrong_guesses: tuple[Callable[[], object], ...] = (
        lambda: b.update_agent(
            TENANT, AGENT, AgentSettings(rolling_window_us=HOUR), ["rolling_window"]
        ),
        lambda: b.compact_context(
            TENANT, AGENT, "", "main", "", BuildOverrides(keep_recent_tokens=200)
        ),
        lambda: a.append_messages(TENANT, AGENT, "", "main", _turns("after summary", 3)),
        lambda: b.clear_context(TENANT, AGENT, "", "main"),
        lambda: a.append_messages(TENANT, AGENT, "", "main", _turns("after clear", 3)),
        # Appended here, then cleared elsewhere: the bounds sent ahead are of the
        # thread's clear as last read.
        lambda: (
            a.append_messages(TENANT, AGENT, "", "main", _turns("cleared", 3)),
            b.clear_context(TENANT, AGENT, "", "main"),
            a.append_messages(TENANT, AGENT, "", "main", _turns("after clear", 3)),
        ),
        # ... and compacted elsewhere: of its summary as last read.
        lambda: (
            a.append_messages(TENANT, AGENT, "", "main", _turns("more", 20)),
            b.compact_context(
                TENANT, AGENT, "", "main", "", BuildOverrides(keep_recent_tokens=200)
            ),
            a.append_messages(TENANT, AGENT, "", "main", _turns("after summary", 3)),
        ),
        # ... and its agent's window changed elsewhere.
        lambda: (
            a.append_messages(TENANT, AGENT, "", "main", _turns("wider", 3)),
            b.update_agent(
                TENANT, AGENT, AgentSettings(rolling_window_us=10 * HOUR), ["rolling_window"]
            ),
        ),
    )
    for wrong in wrong_guesses:
        build()  # the window of the state before the change, remembered
        clock.advance(SECOND)
        wrong()
        build()
    assert build()[0].context.history[-1].content.startswith("wider 2 ")


def test_only_appends_since_extend_the_window_kept(
    replicas: tuple[PostgresStore, ...], clock: ManualClock, postgres_dsn: str
) -> None:
    """A build after this replica's own append extends the window it keeps by the rows
    appended since (schema version 15: `appended_messages`) only when appends of plain
    messages are all that changed since that window was read; after any other change
    by another replica or in SQL, with or without appends around it, it reads the
    window afresh. Every build equals the build of a replica that remembers nothing."""
    a, b, plain, request = _services(replicas, older=60, other=5)
    turn = [0]

    def sql(statement: str, *params: object) -> int:
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            return conn.execute(statement, list(params)).rowcount

    def build() -> BuildResult:
        result = a.build_context(request)
        expected = plain.build_context(request)
        assert result.context == expected.context
        assert result.stamps == expected.stamps
        assert result.messages_loaded == expected.messages_loaded
        return result

    def then_own_append(change: Callable[[], object], extends: bool | None) -> BuildResult:
        """A window kept (built twice), the change, this replica's own append, a build
        (`extends`: whether it extends the window kept; None: either)."""
        build()
        build()
        clock.advance(SECOND)
        change()
        clock.advance(SECOND)
        turn[0] += 1
        a.append_messages(TENANT, AGENT, "", "main", [_said(f"own {turn[0]} " + "w " * 30)])
        before = a._builder.window_extensions
        result = build()
        if extends is not None:
            assert a._builder.window_extensions == before + int(extends)
        assert result.context.history[-1].content.startswith(f"own {turn[0]} ")
        return result

    def tool_turn() -> None:
        call = f'[{{"id": "c{turn[0]}", "name": "ls", "input": {{}}}}]'
        b.append_messages(
            TENANT,
            AGENT,
            "",
            "main",
            [
                NewMessage(role=Role.TOOL_USE, content="", tool_calls=call),
                NewMessage(role=Role.TOOL_RESULT, content="found", tool_call_id=f"c{turn[0]}"),
            ],
        )

    then_own_append(lambda: None, True)
    then_own_append(lambda: b.append_messages(TENANT, AGENT, "", "main", _turns("b", 3)), True)
    # A change the window does not read: the agent's prompt.
    then_own_append(
        lambda: b.update_agent(
            TENANT, AGENT, AgentSettings(system_prompt="be brief"), ["system_prompt"]
        ),
        True,
    )
    kept = build().context.history
    # An operator's UPDATE, alone and between appends of another replica.
    then_own_append(
        lambda: sql("UPDATE messages SET content = 'rewritten' WHERE id = %s", kept[-1].id), False
    )
    then_own_append(
        lambda: (
            b.append_messages(TENANT, AGENT, "", "main", _turns("b", 1)),
            sql("UPDATE messages SET metadata = 'x' WHERE id = %s", kept[-2].id),
            b.append_messages(TENANT, AGENT, "", "main", _turns("b", 1)),
        ),
        False,
    )
    # An UPDATE of no row changes nothing; one that rewrites a row as it was counts.
    then_own_append(lambda: sql("UPDATE messages SET tokenizer = tokenizer WHERE id = 0"), True)
    then_own_append(
        lambda: sql("UPDATE messages SET tokenizer = tokenizer WHERE id = %s", kept[0].id), False
    )
    then_own_append(lambda: sql("DELETE FROM messages WHERE id = %s", kept[-3].id), False)
    then_own_append(tool_turn, False)
    then_own_append(
        lambda: b.append_messages(
            TENANT,
            AGENT,
            "",
            "main",
            [NewMessage(role=Role.USER, content="old", source_time_us=clock.now_us() - HOUR)],
        ),
        False,
    )
    # (A thread with a source_time is read whole ever after: a new thread from here.)
    b.delete_agent(TENANT, AGENT)
    b.create_agent(TENANT, AGENT, AgentSettings(rolling_window_us=10 * HOUR))
    b.append_messages(TENANT, AGENT, "", "main", _turns("again", 60))
    then_own_append(lambda: None, True)
    then_own_append(
        lambda: b.compact_context(
            TENANT, AGENT, "", "main", "", BuildOverrides(keep_recent_tokens=200)
        ),
        False,
    )
    b.delete_agent(TENANT, AGENT)
    b.create_agent(TENANT, AGENT, AgentSettings(rolling_window_us=10 * HOUR))
    b.append_messages(TENANT, AGENT, "", "main", _turns("third", 60))
    then_own_append(lambda: None, True)
    # The window's start moved past its first message (settings, or the clock).
    then_own_append(
        lambda: b.update_agent(
            TENANT, AGENT, AgentSettings(rolling_window_us=SECOND), ["rolling_window"]
        ),
        False,
    )
    b.update_agent(TENANT, AGENT, AgentSettings(rolling_window_us=10 * HOUR), ["rolling_window"])
    b.append_messages(TENANT, AGENT, "", "main", _turns("fourth", 40))
    then_own_append(lambda: None, True)
    # Retention: a sweep's deletes, under a cap lifted again before the build.
    then_own_append(
        lambda: (
            b.update_agent(
                TENANT,
                AGENT,
                AgentSettings(retention=RetentionPolicy(max_messages=12, delete_overflow=True)),
                ["retention"],
            ),
            b.sweep_retention(),
            b.update_agent(TENANT, AGENT, AgentSettings(), ["retention"]),
        ),
        False,
    )
    b.append_messages(TENANT, AGENT, "", "main", _turns("fifth", 40))
    then_own_append(lambda: None, True)
    then_own_append(lambda: b.clear_context(TENANT, AGENT, "", "main"), False)
    b.append_messages(TENANT, AGENT, "", "main", _turns("sixth", 40))
    then_own_append(lambda: None, True)
    info = b.save_snapshot(TENANT, AGENT, "", "main", "cut")
    # A snapshot restored into its thread appends copies of its messages (plain ones).
    then_own_append(lambda: b.restore_snapshot(TENANT, AGENT, "", info.id, ""), None)
    then_own_append(lambda: None, True)
    then_own_append(lambda: sql("TRUNCATE messages"), False)


def test_schema_15_upgrades_a_version_14_database(postgres_dsn: str, clock: ManualClock) -> None:
    """A database at version 14 (its threads stored, no `rewrites`) is brought to 15 when
    a replica opens it: every thread's counter starts at 0, the triggers count an
    UPDATE, a DELETE and a raw INSERT from then on and not the service's appends, and
    builds extend their windows over it as over a database made at 15."""
    from contextd.adapters.postgres.schema import MIGRATIONS

    store = PostgresStore.open(postgres_dsn, clock=clock)
    service = ContextService(store, ExtractiveSummarizer())
    service.create_agent(TENANT, AGENT, AgentSettings())
    service.append_messages(TENANT, AGENT, "", "main", _turns("m", 40))
    store.close()
    version_14 = dict(MIGRATIONS)[14]
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:  # back to version 14
        conn.execute("ALTER TABLE threads DROP COLUMN rewrites")
        conn.execute("DROP TRIGGER messages_touch_threads_update ON messages")
        conn.execute(version_14[0].replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION"))
        conn.execute(next(s for s in version_14 if "messages_touch_threads_update" in s))
        conn.execute("DELETE FROM schema_migrations WHERE version >= 15")
    store = PostgresStore.open(postgres_dsn, clock=clock)
    try:
        service = ContextService(store, ExtractiveSummarizer())

        def rewrites() -> int:
            with psycopg.connect(postgres_dsn) as conn:
                row = conn.execute("SELECT rewrites FROM threads WHERE thread = 'main'").fetchone()
            assert row is not None
            return int(row[0])

        def sql(statement: str) -> None:
            with psycopg.connect(postgres_dsn, autocommit=True) as conn:
                conn.execute(statement)

        with psycopg.connect(postgres_dsn) as conn:
            row = conn.execute("SELECT max(version) FROM schema_migrations").fetchone()
        assert row == (MIGRATIONS[-1][0],)
        assert rewrites() == 0
        request = BuildRequest(
            TENANT, AGENT, "", "main", overrides=BuildOverrides(budget_tokens=600)
        )
        service.build_context(request)
        service.append_messages(TENANT, AGENT, "", "main", [_said("one")])
        service.append_messages(TENANT, AGENT, "", "main", _turns("two", 2))  # a batch
        assert rewrites() == 0
        before = service._builder.window_extensions
        assert service.build_context(request).context.history[-1].content.startswith("two 1 ")
        assert service._builder.window_extensions == before + 1
        sql("UPDATE messages SET metadata = 'x' WHERE content = 'one'")
        assert rewrites() == 1
        sql("DELETE FROM messages WHERE content = 'one'")
        assert rewrites() == 2
        sql(
            "INSERT INTO messages SELECT tenant, context_id, sequence + 1, "
            "nextval('message_ids'), role, 'raw', tool_calls, tool_call_id, external_id, "
            "metadata, token_estimate, create_time_us + 1, source_time_us, token_count, "
            "tokenizer, chars, group_id, tool_call_ids, is_summary, first_summarized_id, "
            "last_summarized_id, restored_from, group_start, NULL, NULL, NULL FROM messages "
            "WHERE sequence = (SELECT max(sequence) FROM messages)"
        )
        assert rewrites() == 3
    finally:
        store.close()
