"""What a hot build costs the PostgreSQL store, counted on the wire, and the replica's
cache of loaded messages, which never answers with a row the build's snapshot does not
hold.

Round trips are counted by libpq itself: the pool's one connection traces the protocol
messages it sends and receives (`PGconn.trace`), and a round trip is a run of messages
the client sends followed by one the server sends (a build's snapshot is in pipeline
mode: its statements end with a Flush, not each with a Sync).

PostgreSQL only: the embedded engine reads in process.
"""

from __future__ import annotations

import functools
import itertools
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import pq

from contextd.adapters.postgres.store import PostgresStore
from contextd.app.build.build_types import BuildRequest
from contextd.app.build.summarizer import ExtractiveSummarizer
from contextd.app.service import ContextService
from contextd.domain.clock import ManualClock
from contextd.domain.model import AgentSettings, BuildOverrides, ContextKey, NewMessage, Role
from contextd.domain.window import WindowSpec

TENANT, AGENT = "default", "a1"
# A hot build (the replica keeps a window of the thread): the thread (with its summary
# and agent's version), and with it the status block and the rows appended since the
# window the replica saw (by any replica), sent with the arguments the replica's last
# build of the thread had (`plan_build_reads`), as one statement, then Sync: its
# snapshot is that statement's, ended with it (`_end_snapshot_early`), with no BEGIN
# and no COMMIT (`_read_in_one`).
HOT_BUILD_ROUND_TRIPS = 1
HOT_BUILD_STATEMENTS = 1
# A build that reads its window's bounds afresh (more rows appended here than extend a
# window): the thread, the status block, the bounds and the newest page; COMMIT.
BOUNDS_BUILD_ROUND_TRIPS = 2


@pytest.fixture
def store(postgres_dsn: str) -> Iterator[PostgresStore]:
    store = PostgresStore.open(postgres_dsn, clock=ManualClock(1_700_000_000_000_000), pool_size=1)
    yield store
    store.close()


@pytest.fixture
def service(store: PostgresStore) -> ContextService:
    service = ContextService(store, ExtractiveSummarizer())
    service.create_agent(TENANT, AGENT, AgentSettings())
    return service


def _turns(prefix: str, n: int) -> list[NewMessage]:
    return [
        NewMessage(role=(Role.USER, Role.ASSISTANT)[i % 2], content=f"{prefix} {i} " + "w " * 40)
        for i in range(n)
    ]


def _round_trips(
    store: PostgresStore,
    call: object,
    statements: list[str] | None = None,
    kinds: list[str] | None = None,
) -> int:
    """Round trips the pool's one connection makes while `call()` runs (and the text of
    each statement it parses, into `statements`; the type of each message it sends,
    such as Execute and Sync, into `kinds`)."""
    assert callable(call)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace"
        with path.open("wb") as out:
            with store._pool.connection() as conn:
                conn.pgconn.trace(out.fileno())
                conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
            try:
                call()
            finally:
                with store._pool.connection() as conn:
                    conn.pgconn.untrace()
        sent = [line.split("\t") for line in path.read_text(errors="replace").splitlines()]
    sides = [f[0] for f in sent if len(f) > 2 and f[0] in ("F", "B")]
    if statements is not None:
        statements += ["\t".join(f) for f in sent if f[0] == "F" and {"Parse", "Query"} & set(f)]
    if kinds is not None:
        kinds += [f[2] for f in sent if len(f) > 2 and f[0] == "F"]
    return sum(1 for a, b in itertools.pairwise(sides) if (a, b) == ("F", "B"))


def _build_into(service: ContextService, request: BuildRequest, into: list[Any]) -> None:
    into.append(service.build_context(request))


@pytest.mark.parametrize("batches", [[300], [20] * 4], ids=["one-batch", "several-batches"])
def test_a_build_after_more_appended_rows_than_extend_a_window_reads_its_bounds_at_once(
    store: PostgresStore, service: ContextService, batches: list[int]
) -> None:
    """More plain rows appended here since the last build than an extension reads
    (APPENDED_ROWS, 64), in one call or several: the next build sends the window's
    bounds with the thread's read, not the appended rows' read (which could not extend
    the window, and would leave the bounds a round trip of their own)."""
    service.append_messages(TENANT, AGENT, "", "main", _turns("first", 100))
    request = BuildRequest(TENANT, AGENT, "", "main", overrides=BuildOverrides(budget_tokens=2_000))
    for _ in range(2):
        service.build_context(request)
    for at, size in enumerate(batches):
        service.append_messages(TENANT, AGENT, "", "main", _turns(f"more{at}", size))
    after: list[Any] = []
    extended = service._builder.window_extensions
    trips = _round_trips(store, functools.partial(_build_into, service, request, after))
    assert after[0].context.history[-1].content.startswith(f"more{len(batches) - 1} ")
    assert service._builder.window_extensions == extended
    assert trips == BOUNDS_BUILD_ROUND_TRIPS


@pytest.mark.parametrize("interleaved", [False, True], ids=["alone", "interleaved"])
def test_a_hot_build_makes_one_round_trip(
    store: PostgresStore, service: ContextService, postgres_dsn: str, interleaved: bool
) -> None:
    """Whether the thread was written alone or in turns with others (its ids then jump:
    the ids it leaves out come from the replica's run of them, with their ordinals),
    a hot build makes the same one round trip, of one statement, and it does not grow
    with the thread; the build right after an append too, and it equals a fresh
    replica's (three before `plan_build_reads`; interleaved,
    three before a build extended its window by the appended rows; two before its
    snapshot ended with the reads sent ahead)."""
    for step in range(6):
        service.append_messages(TENANT, AGENT, "", "main", _turns(f"main{step}", 100))
        if interleaved:
            for other in range(3):
                service.append_messages(TENANT, AGENT, "", f"o{other}", _turns("other", 7))
    request = BuildRequest(TENANT, AGENT, "", "main", overrides=BuildOverrides(budget_tokens=2_000))
    for _ in range(2):
        first = service.build_context(request)
    assert first.context.stats.dropped_ids  # a window longer than the budget
    kinds: list[str] = []
    assert _round_trips(store, lambda: service.build_context(request), kinds=kinds) == (
        HOT_BUILD_ROUND_TRIPS
    )
    assert (kinds.count("Execute"), kinds.count("Sync")) == (HOT_BUILD_STATEMENTS, 1)
    service.append_messages(TENANT, AGENT, "", "main", _turns("later", 300))
    service.build_context(request)
    assert _round_trips(store, lambda: service.build_context(request)) == HOT_BUILD_ROUND_TRIPS
    for step in range(3):
        service.append_messages(TENANT, AGENT, "", "main", _turns(f"after{step}", 1))
        after: list[Any] = []
        extended = service._builder.window_extensions
        kinds = []
        trips = _round_trips(
            store, functools.partial(_build_into, service, request, after), kinds=kinds
        )
        assert after[0].context.history[-1].content.startswith(f"after{step} 0 ")
        # The window kept is extended by the appended row, read with the thread's: no
        # bounds, and (interleaved) no ids left out read past the replica's run of them.
        assert service._builder.window_extensions == extended + 1
        assert trips == HOT_BUILD_ROUND_TRIPS
        assert kinds.count("Execute") == HOT_BUILD_STATEMENTS
        # As a replica that never built before builds it (in a snapshot of reads that
        # each take a round trip): the one statement read the same state.
        fresh = PostgresStore.open(postgres_dsn, clock=store.clock, pool_size=1)
        try:
            expected = ContextService(fresh, ExtractiveSummarizer()).build_context(request)
        finally:
            fresh.close()
        assert after[0].context == expected.context
        assert after[0].stamps == expected.stamps


# PostgreSQL's plan cache plans a prepared statement's first five runs for their values
# (custom plans), then keeps its generic plan when that is not estimated dearer.
CUSTOM_PLANS = 5


def test_a_hot_builds_statement_keeps_its_generic_plan(
    store: PostgresStore, service: ContextService, postgres_dsn: str
) -> None:
    """The hot build's one statement (`_read_in_one`) is planned for its values only in
    its first runs on a connection: after that every run, alone, after an append (the
    appended rows' join) or between builds of other threads, of agents with other
    windows, takes the generic plan, on a database with statistics (where, with its
    values in sight, the planner estimated the custom plans cheaper and planned every
    build afresh, about 2 ms each), and it is one prepared statement, whatever the
    values' sizes or NULLs."""
    service.create_agent(TENANT, "a2", AgentSettings(rolling_window_us=3_600_000_000))
    for step in range(4):
        for agent in (AGENT, "a2"):
            service.append_messages(TENANT, agent, "", "main", _turns(f"main{step}", 2_500))
        for other in range(3):
            service.append_messages(TENANT, AGENT, "", f"o{other}", _turns("other", 5))
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute("ANALYZE")
    requests = [
        BuildRequest(TENANT, agent, "", thread, overrides=BuildOverrides(budget_tokens=2_000))
        for agent, thread in [(AGENT, "main"), ("a2", "main"), (AGENT, "o0"), (AGENT, "o1")]
    ]
    builds = 0
    for step in range(12):
        if step % 3 == 2:
            service.append_messages(TENANT, AGENT, "", "main", _turns(f"after{step}", 1))
        for request in requests:
            for _ in range(2):
                kinds: list[str] = []
                _round_trips(store, functools.partial(service.build_context, request), kinds=kinds)
                builds += kinds.count("Execute") == HOT_BUILD_STATEMENTS == kinds.count("Sync")
    assert builds > 60  # most builds were hot: one statement alone
    with store._pool.connection() as conn:
        plans = conn.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
            "WHERE statement LIKE 'SELECT q.*, NULL, %'"
        ).fetchall()
    assert len(plans) == 1  # one statement, prepared once
    generic, custom = plans[0]
    assert custom == CUSTOM_PLANS
    assert generic + custom >= builds


def test_cached_messages_are_used_only_at_the_version_the_snapshot_reads(
    store: PostgresStore, service: ContextService, postgres_dsn: str
) -> None:
    """The second read of the same messages answers with the objects the first made
    (nothing decoded again); a row rewritten since (by anyone: another replica, an
    operator) comes back as stored now, and a deleted one not at all."""
    service.append_messages(TENANT, AGENT, "", "t", _turns("m", 12))
    thread = ContextKey(TENANT, AGENT, "", "t")
    ref = store.context_ref(thread)
    assert ref is not None
    everything = WindowSpec(0, 0)

    def read() -> list[str]:
        return [m.content for m in store.window_messages_from(ref, everything, 1, (1, 2**62))]

    first = store.window_messages_from(ref, everything, 1, (1, 2**62))
    again = store.window_messages_from(ref, everything, 1, (1, 2**62))
    assert len(first) == 12 and all(a is b for a, b in zip(first, again, strict=True))
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute("UPDATE messages SET content = 'rewritten' WHERE id = %s", [first[5].id])
        conn.execute("DELETE FROM messages WHERE id = %s", [first[7].id])
    now = store.window_messages_from(ref, everything, 1, (1, 2**62))
    assert [m.id for m in now] == [m.id for i, m in enumerate(first) if i != 7]
    assert now[5].content == "rewritten" and now[5] is not first[5]
    assert all(a is b for a, b in zip(now[:5], first[:5], strict=True))
    assert read()[5] == "rewritten"
    # Only what the range asks: a narrower id range answers from the same objects.
    part = store.window_messages_from(ref, everything, 1, (first[2].id, first[4].id))
    assert [m.id for m in part] == [m.id for m in first[2:5]]
    assert all(a is b for a, b in zip(part, first[2:5], strict=True))


def test_a_build_uses_a_kept_message_as_stored_now(
    store: PostgresStore, service: ContextService, postgres_dsn: str
) -> None:
    """A hot build takes the messages of its newest page from the replica's cache; one
    rewritten in the database since (by anyone) is built as it is stored now, one deleted
    is gone, and another replica's appends are read whole."""
    service.append_messages(TENANT, AGENT, "", "main", _turns("m", 300))
    request = BuildRequest(TENANT, AGENT, "", "main", overrides=BuildOverrides(budget_tokens=2_000))
    before = service.build_context(request)
    kept = [item.id for item in before.context.history]
    assert len(kept) > 3
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute("UPDATE messages SET content = 'rewritten' WHERE id = %s", [kept[-2]])
    after = service.build_context(request)
    assert [item.id for item in after.context.history][-3:] == kept[-3:]
    assert after.context.history[-2].content == "rewritten"
    assert after.context.history[-1].content == before.context.history[-1].content
    other = PostgresStore.open(postgres_dsn, clock=store.clock)
    try:
        ContextService(other, ExtractiveSummarizer()).append_messages(
            TENANT, AGENT, "", "main", [NewMessage(role=Role.USER, content="from the other")]
        )
    finally:
        other.close()
    assert service.build_context(request).context.history[-1].content == "from the other"


def test_a_read_of_ids_further_back_than_the_run_reads_only_what_it_lacks(
    store: PostgresStore, service: ContextService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ids a build lists of what it leaves out come from the replica's run of them;
    a later build that needs older ones too (a smaller budget) reads only those, and the
    run grows down to hold them."""
    service.append_messages(TENANT, AGENT, "", "t", _turns("m", 100))
    ref = store.context_ref(ContextKey(TENANT, AGENT, "", "t"))
    assert ref is not None
    every = [m.id for m in store.window_messages_from(ref, WindowSpec(0, 0), 1, (1, 2**62))]
    read: list[int] = []
    read_page_ids = store._read_page_ids

    def reading(*args: Any) -> Any:
        sequences, ids, ordinals = read_page_ids(*args)
        read.append(len(ids))
        return sequences, ids, ordinals

    monkeypatch.setattr(store, "_read_page_ids", reading)

    def ids(limit: int) -> list[int]:
        page = store.window_page(ref, 1, 101, limit, ids_only=True)
        return [int(i) for i in page.column("id").to_numpy()]

    assert ids(10) == every[-10:] and read == [10]
    assert ids(30) == every[-30:] and read == [10, 20]  # the 20 below the run, only
    assert ids(25) == every[-25:] and read == [10, 20]  # held
    assert ids(200) == every and read == [10, 20, 70]  # all there is
    assert ids(100) == every and read == [10, 20, 70]
    assert ids(5) == every[-5:] and read == [10, 20, 70]
    # A range that ends below a thread's run is read as it is.
    service.append_messages(TENANT, AGENT, "", "u", _turns("u", 100))
    other = store.context_ref(ContextKey(TENANT, AGENT, "", "u"))
    assert other is not None
    every = [m.id for m in store.window_messages_from(other, WindowSpec(0, 0), 1, (1, 2**62))]
    newest = store.window_page(other, 1, 101, 10, ids_only=True).column("id").to_numpy()
    assert [int(i) for i in newest] == every[-10:]
    older = store.window_page(other, 1, 50, 10, ids_only=True).column("id").to_numpy()
    assert [int(i) for i in older] == every[39:49]


def test_the_bounds_queued_with_the_status_block_are_never_stale(
    store: PostgresStore, service: ContextService, postgres_dsn: str
) -> None:
    """A hot build's window bounds travel with its status block's statement, read for
    the thread and window its snapshot's own reads name: after another replica appends,
    clears the thread, clears the agent, stores a summary, or a row is rewritten or
    deleted between two builds, the build is the one a replica that never built before
    makes, in the same three round trips (but where a deleted row leaves a hole: the
    window is then read whole)."""
    clock = store.clock
    assert isinstance(clock, ManualClock)
    other = PostgresStore.open(postgres_dsn, clock=clock, pool_size=1)
    try:
        elsewhere = ContextService(other, ExtractiveSummarizer())
        service.append_messages(TENANT, AGENT, "", "main", _turns("m", 300))
        service.append_messages(TENANT, AGENT, "", "side", _turns("s", 5))
        request = BuildRequest(
            TENANT, AGENT, "", "main", overrides=BuildOverrides(budget_tokens=2_000)
        )

        def fresh() -> list[tuple[int, str]]:
            cold = PostgresStore.open(postgres_dsn, clock=clock, pool_size=1)
            try:
                built = ContextService(cold, ExtractiveSummarizer()).build_context(request)
            finally:
                cold.close()
            return [(m.id, m.content) for m in built.context.history]

        def check(trips_as_hot: bool = True) -> list[tuple[int, str]]:
            service.build_context(request)  # the first build after a change may read more
            got: list[Any] = []
            trips = _round_trips(store, lambda: got.append(service.build_context(request)))
            built = [(m.id, m.content) for m in got[0].context.history]
            assert built == fresh()
            assert trips == HOT_BUILD_ROUND_TRIPS or not trips_as_hot
            return built

        for _ in range(2):
            service.build_context(request)
        first = check()
        elsewhere.append_messages(TENANT, AGENT, "", "main", _turns("other", 3))
        after_append = service.build_context(request)
        assert after_append.context.history[-1].content.startswith("other 2")
        assert check()[-1][1].startswith("other 2")
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute("UPDATE messages SET content = 'rewritten' WHERE id = %s", [first[-4][0]])
            conn.execute("DELETE FROM messages WHERE id = %s", [first[-6][0]])
        rewritten = service.build_context(request)
        contents = {m.id: m.content for m in rewritten.context.history}
        assert contents[first[-4][0]] == "rewritten" and first[-6][0] not in contents
        assert check(trips_as_hot=False)  # a hole in the thread: its window is read whole
        clock.advance(1_000)
        elsewhere.clear_context(TENANT, AGENT, "", "main")
        clock.advance(1_000)
        assert not service.build_context(request).context.history
        elsewhere.append_messages(TENANT, AGENT, "", "main", _turns("after", 4))
        assert [c for _, c in check()] == [m.content for m in _turns("after", 4)]
        clock.advance(1_000)
        elsewhere.clear_context(TENANT, AGENT, "", "", all_scopes=True)
        clock.advance(1_000)
        elsewhere.append_messages(TENANT, AGENT, "", "main", _turns("later", 2))
        assert [c for _, c in check()] == [m.content for m in _turns("later", 2)]
    finally:
        other.close()


def test_queued_bounds_answer_only_the_call_they_were_read_for(
    store: PostgresStore, service: ContextService
) -> None:
    """The bounds `status_and_activity` queues in a snapshot answer `window_bounds` only
    when it is called with the arguments they were read with: another window of the
    same thread is read on its own."""
    service.append_messages(TENANT, AGENT, "", "main", _turns("m", 40))
    service.append_messages(TENANT, AGENT, "", "main", _turns("n", 10))  # committed later
    key = ContextKey(TENANT, AGENT, "", "main")
    ref = store.context_ref(key)
    assert ref is not None
    stored = store.window_messages_from(ref, WindowSpec(0, 0), 1, (1, 2**62))
    everything = store.window_bounds(ref, WindowSpec(0, 0), 0, 16, 100)
    assert everything is not None and everything.count == 50
    later = WindowSpec(stored[39].create_time_us, 0)
    with store.snapshot():
        ref = store.context_ref(key)
        assert ref is not None
        store.status_and_activity(TENANT, AGENT, "", 0, 10, WindowSpec(0, 0), 10)
        assert store._local.bounds is not None  # read for WindowSpec(0, 0)
        inside = store.window_bounds(ref, later, 0, 16, 100)
    assert inside is not None and inside.count == 10 and inside.first_id == stored[40].id
    with store.snapshot():
        ref = store.context_ref(key)
        assert ref is not None
        store.status_and_activity(TENANT, AGENT, "", 0, 10, WindowSpec(0, 0), 10)
        again = store.window_bounds(ref, WindowSpec(0, 0), 0, 16, 100)
    assert again is not None and again.count == 50 and again.first_id == stored[0].id


def _other_appended(other: ContextService, conn: psycopg.Connection[Any], ids: list[int]) -> None:
    other.append_messages(TENANT, AGENT, "", "main", _turns("other", 3))


def _other_cleared(other: ContextService, conn: psycopg.Connection[Any], ids: list[int]) -> None:
    clock = other._store.clock
    assert isinstance(clock, ManualClock)
    clock.advance(1_000)
    other.clear_context(TENANT, AGENT, "", "main")
    clock.advance(1_000)
    other.append_messages(TENANT, AGENT, "", "main", _turns("after", 4))


def _deleted(other: ContextService, conn: psycopg.Connection[Any], ids: list[int]) -> None:
    conn.execute("DELETE FROM messages WHERE id = %s", [ids[-2]])


def _rewritten(other: ContextService, conn: psycopg.Connection[Any], ids: list[int]) -> None:
    conn.execute("UPDATE messages SET content = 'rewritten' WHERE id = %s", [ids[-3]])


def _agent_changed(other: ContextService, conn: psycopg.Connection[Any], ids: list[int]) -> None:
    other.update_agent(TENANT, AGENT, AgentSettings(system_prompt="changed"), ["system_prompt"])


# Changes between two builds of a replica that keeps the thread's window, and whether its
# next build still takes everything from the reads it sent ahead (one snapshot, one round
# trip) or needs another read, and runs again in a snapshot that ends last.
CHANGES = {
    "appended elsewhere": (_other_appended, True),
    "cleared elsewhere": (_other_cleared, False),
    "a message deleted": (_deleted, False),
    "a message rewritten": (_rewritten, False),
    "agent changed elsewhere": (_agent_changed, False),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_hot_build_that_needs_another_read_runs_again_in_a_snapshot_that_ends_last(
    store: PostgresStore, service: ContextService, postgres_dsn: str, change: str
) -> None:
    """A hot build's snapshot ends with the reads sent ahead (`_end_snapshot_early`):
    when the thread changed in a way they cannot answer (another replica cleared it, a
    message was deleted or rewritten, the agent's settings changed), its next read
    raises SnapshotMoved, and the build runs again in a snapshot that ends after its
    reads; another replica's plain append is among the reads sent ahead. Either way
    the build equals the one a replica that never built before makes, and the build
    after it is hot again."""
    make, hot = CHANGES[change]
    clock = store.clock
    other = PostgresStore.open(postgres_dsn, clock=clock, pool_size=1)
    try:
        elsewhere = ContextService(other, ExtractiveSummarizer())
        service.append_messages(TENANT, AGENT, "", "main", _turns("m", 300))
        request = BuildRequest(
            TENANT, AGENT, "", "main", overrides=BuildOverrides(budget_tokens=2_000)
        )
        for _ in range(2):
            before = service.build_context(request)
        ids = [m.id for m in before.context.history]
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            make(elsewhere, conn, ids)
        got: list[Any] = []
        kinds: list[str] = []
        extended = service._builder.window_extensions
        trips = _round_trips(
            store, functools.partial(_build_into, service, request, got), kinds=kinds
        )
        # Each snapshot ends with a Sync: the hot one-statement read's, or a BEGIN's.
        snapshots = kinds.count("Sync")
        fresh = PostgresStore.open(postgres_dsn, clock=clock, pool_size=1)
        try:
            expected = ContextService(fresh, ExtractiveSummarizer()).build_context(request)
        finally:
            fresh.close()
        assert got[0].context == expected.context
        assert got[0].stamps == expected.stamps
        if hot:
            assert (trips, snapshots) == (HOT_BUILD_ROUND_TRIPS, 1)
            assert service._builder.window_extensions == extended + 1
        else:
            assert snapshots == 2 and trips > HOT_BUILD_ROUND_TRIPS
        again = _round_trips(store, functools.partial(_build_into, service, request, got))
        assert got[1].context == got[0].context and again == HOT_BUILD_ROUND_TRIPS
    finally:
        other.close()
