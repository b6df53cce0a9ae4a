"""What a hot build costs the PostgreSQL store, counted on the wire, and the replica's
cache of loaded messages, which never answers with a row the build's snapshot does not
hold.

Round trips are counted by libpq itself: the pool's one connection traces the protocol
messages it sends (`PGconn.trace`), and every round trip ends with a Sync (a statement)
or is a Query (BEGIN, COMMIT).

PostgreSQL only: the embedded engine reads in process.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import pq

from contextd.adapters.postgres.store import PostgresStore
from contextd.app.build.builder import BuildRequest
from contextd.app.build.summarizer import ExtractiveSummarizer
from contextd.app.service import ContextService
from contextd.domain.clock import ManualClock
from contextd.domain.model import AgentSettings, BuildOverrides, ContextKey, NewMessage, Role
from contextd.domain.window import WindowSpec

TENANT, AGENT = "default", "a1"
# A hot build: BEGIN, the thread (with its summary and agent's version), the window's
# bounds with its newest page (and the kept messages among them), the status block, COMMIT.
HOT_BUILD_ROUND_TRIPS = 5


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


def _round_trips(store: PostgresStore, call: object) -> int:
    """Round trips the pool's one connection makes while `call()` runs."""
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
    return sum(1 for f in sent if len(f) > 2 and f[0] == "F" and f[2] in ("Sync", "Query"))


@pytest.mark.parametrize("interleaved", [False, True], ids=["alone", "interleaved"])
def test_a_hot_build_makes_five_round_trips(
    store: PostgresStore, service: ContextService, interleaved: bool
) -> None:
    """Whether the thread was written alone or in turns with others (its ids then jump:
    the ids it leaves out come from the replica's run of them, with their ordinals),
    a hot build makes the same five round trips, and they do not grow with the thread."""
    for step in range(6):
        service.append_messages(TENANT, AGENT, "", "main", _turns(f"main{step}", 100))
        if interleaved:
            for other in range(3):
                service.append_messages(TENANT, AGENT, "", f"o{other}", _turns("other", 7))
    request = BuildRequest(TENANT, AGENT, "", "main", overrides=BuildOverrides(budget_tokens=2_000))
    for _ in range(2):
        first = service.build_context(request)
    assert first.context.stats.dropped_ids  # a window longer than the budget
    assert _round_trips(store, lambda: service.build_context(request)) == HOT_BUILD_ROUND_TRIPS
    service.append_messages(TENANT, AGENT, "", "main", _turns("later", 300))
    service.build_context(request)
    assert _round_trips(store, lambda: service.build_context(request)) == HOT_BUILD_ROUND_TRIPS


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
