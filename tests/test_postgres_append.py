"""PostgreSQL: what only its append path does.

- Appends leave the search index's pending list to the store's merging thread
  (adapters/postgres/pending_list.py): no append merges it, whatever its size up to the
  backstop, and the thread merges it after every CLEAN_EVERY_ROWS appended rows, and
  the rows appended since its last merge once appends pause for IDLE_SECONDS.
- A merge gives up on a lock held past half of deadlock_timeout (an autovacuum's) and
  is skipped, rather than have PostgreSQL cancel that autovacuum.
- Searches see rows still in the pending list.
- A one-message append to an existing thread is one statement in autocommit (messages.py
  `_ONE_STATEMENT_APPEND`), request id or not, and a retry of it is answered by that
  statement with the first receipts; the look-up of a request id before a write is one
  statement in autocommit, and an AppendMessages call with a request id makes none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest
from psycopg import pq

from conftest import USER, Client, connect
from contextd.adapters.postgres.messages import _text_array
from contextd.adapters.postgres.pending_list import IDLE_SECONDS
from contextd.adapters.postgres.store import PostgresStore
from contextd.api.server import RunningServer, create_server
from contextd.app.build.summarizer import ExtractiveSummarizer
from contextd.app.service import ContextService
from contextd.config import Settings
from contextd.domain.batches import prepare_batch
from contextd.domain.clock import ManualClock, wall_clock_us
from contextd.domain.errors import StaleModel
from contextd.domain.idempotency import AlreadyDone, RequestRecord
from contextd.domain.model import (
    AgentSettings,
    ContextKey,
    MessageBatch,
    MessageRange,
    NewMessage,
    Role,
)
from contextd.domain.retention import RetentionPolicy
from contextd.v1 import context_service_pb2 as pb
from waiting import wait_until

TENANT = "default"
# PostgreSQL's default gin_pending_list_limit (4 MB) in 8 kB pages: past it, an insert
# that is not raised merges the list itself.
DEFAULT_LIMIT_PAGES = 4 * 1024 // 8


def _pending_pages(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")
        row = conn.execute("SELECT pending_pages FROM pgstatginindex('messages_search')").fetchone()
    assert row is not None
    return int(row[0])


def _batch(start: int, n: int) -> list[NewMessage]:
    """Messages of 60 distinct words each, so the pending list grows fast."""
    return [
        NewMessage(
            role=Role.USER,
            content=" ".join(f"w{(start + i) * 61 + j}x" for j in range(60)),
        )
        for i in range(n)
    ]


@pytest.fixture
def store(postgres_dsn: str) -> Iterator[PostgresStore]:
    opened = PostgresStore.open(postgres_dsn)
    try:
        yield opened
    finally:
        opened.close()


def test_appends_leave_the_pending_list_to_the_merger(
    store: PostgresStore, postgres_dsn: str
) -> None:
    assert store._pending.enabled  # the test role owns the index: it may merge it
    store._pending._every = 10**9  # the thread never merges in this test
    store._pending._idle = 10**6
    service = ContextService(store, ExtractiveSummarizer())
    for k in range(8):
        service.append_messages(TENANT, "a", "", "t", _batch(k * 1_000, 1_000), create_agent=True)
    # Past PostgreSQL's default limit, and no append merged it.
    pending = _pending_pages(postgres_dsn)
    assert pending > DEFAULT_LIMIT_PAGES
    # Searches see rows still in the list (a GIN scan reads it too).
    found = service.search_messages(TENANT, "a", "", "t", MessageRange.ALL, "w427000x", 5)
    assert [h.message.sequence for h in found.hits] == [7_001]
    merged = store._pending.merge()
    assert merged is not None and merged >= pending
    assert _pending_pages(postgres_dsn) == 0
    found = service.search_messages(TENANT, "a", "", "t", MessageRange.ALL, "w427000x", 5)
    assert [h.message.sequence for h in found.hits] == [7_001]


def test_the_merger_merges_after_every_rows(store: PostgresStore, postgres_dsn: str) -> None:
    store._pending._every = 1_500
    store._pending._idle = 10**6  # no pause merges in this test
    service = ContextService(store, ExtractiveSummarizer())
    service.append_messages(TENANT, "a", "", "t", _batch(0, 1_000), create_agent=True)
    assert _pending_pages(postgres_dsn) > 0  # 1,000 rows: not yet
    service.append_messages(TENANT, "a", "", "t", _batch(1_000, 1_000), create_agent=True)
    # The store's own thread, not a clock: it runs in real time.
    wait_until(lambda: _pending_pages(postgres_dsn) == 0, "the merger empties the pending list")


def test_the_merger_merges_what_is_left_once_appends_pause(
    store: PostgresStore, postgres_dsn: str
) -> None:
    """Rows short of the count are merged once this replica's appends pause for
    IDLE_SECONDS, so the searches after a load do not scan them in the list; appends
    after that merge are watched again. The merger's own step (`merge_due`), on a clock
    the test moves (its thread stopped)."""
    merger = store._pending
    merger.stop()
    now = [1_000.0]
    merger._now = lambda: now[0]
    merger._every = 10**9  # the count never merges in this test
    service = ContextService(store, ExtractiveSummarizer())
    for k in range(2):
        service.append_messages(TENANT, "a", "", "t", _batch(k * 1_000, 1_000), create_agent=True)
        now[0] += IDLE_SECONDS / 2
        assert not merger.merge_due()  # appends have not paused long enough
        assert _pending_pages(postgres_dsn) > 0
        now[0] += IDLE_SECONDS / 2
        assert merger.merge_due()
        assert _pending_pages(postgres_dsn) == 0
        assert not merger.merge_due()  # nothing left until the next append
    found = service.search_messages(TENANT, "a", "", "t", MessageRange.ALL, "w61000x", 5)
    assert [h.message.sequence for h in found.hits] == [1_001]


def test_the_merger_skips_a_merge_rather_than_wait_for_a_held_lock(
    store: PostgresStore, postgres_dsn: str
) -> None:
    """An autovacuum cleaning the index holds the lock a merge needs, and PostgreSQL
    cancels an autovacuum (its ANALYZE too) that a backend waits on past
    deadlock_timeout: the merge gives up first and is skipped, never waits."""
    store._pending._every = 10**9  # the thread never merges in this test
    store._pending._idle = 10**6
    service = ContextService(store, ExtractiveSummarizer())
    service.append_messages(TENANT, "a", "", "t", _batch(0, 1_000), create_agent=True)
    pending = _pending_pages(postgres_dsn)
    assert pending > 0
    with psycopg.connect(postgres_dsn) as holder:
        # Should the merge wait after all, the holder ends within a minute and the merge
        # then merges: the assertion below fails instead of hanging.
        holder.execute("SET idle_in_transaction_session_timeout = '60s'")
        holder.execute("DROP INDEX messages_search")  # its lock, held until the rollback
        assert store._pending.merge() is None
        holder.rollback()
    assert _pending_pages(postgres_dsn) == pending  # skipped: nothing merged
    merged = store._pending.merge()
    assert merged is not None and merged >= pending
    assert _pending_pages(postgres_dsn) == 0


def _round_trips(fields: list[list[str]]) -> list[list[str]]:
    """The client's messages (libpq trace lines split at tabs) grouped by round trip: a
    group ends where the client waits for the server, at a simple Query, a Sync, or a
    Flush that asks for the results sent so far (psycopg's Flush right after a Sync asks
    for nothing more)."""
    groups: list[list[str]] = [[]]
    previous = ""
    for f in fields:
        if len(f) < 3 or f[0] != "F":
            continue
        kind = f[2]
        if kind == "Flush" and previous == "Sync":
            continue
        groups[-1].append(kind if kind != "Parse" else f"Parse {f[3].split()[1]}")
        if kind in ("Query", "Sync", "Flush"):
            groups.append([])
        previous = kind
    return [g for g in groups if g]


@contextlib.contextmanager
def _traced(store: PostgresStore, path: Path) -> Iterator[list[list[str]]]:
    """The round trips (`_round_trips`) of the pool's one connection while the block
    runs, in the list yielded (filled when the block ends), read from libpq's trace."""
    trips: list[list[str]] = []
    with path.open("w") as out:
        with store._pool.connection() as conn:
            conn.pgconn.trace(out.fileno())
            conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            yield trips
        finally:
            with store._pool.connection() as conn:
                conn.pgconn.untrace()
    # Lines are "F|B <tab> length <tab> message ..." (F: sent by the client).
    trips += _round_trips([line.split("\t") for line in path.read_text().splitlines()])


def test_one_message_append_is_one_statement(postgres_dsn: str, tmp_path: Path) -> None:
    """Read from libpq's trace of the store's one connection. A one-message append to an
    existing thread is one statement in autocommit, request id or not, and so is its
    retry; the look-up of a request id before a write is one statement too. Before, an
    append was BEGIN, two statements and COMMIT (six round trips before that, eight with
    a request id)."""
    store = PostgresStore.open(postgres_dsn, pool_size=1)
    try:
        service = ContextService(store, ExtractiveSummarizer())
        service.append_messages(TENANT, "a", "", "t", _batch(0, 1), create_agent=True)
        trace = tmp_path / "trace"
        record = RequestRecord(TENANT, "r-1", "contextd.v1.AppendMessagesRequest", "f", _encode)
        key = ContextKey(TENANT, "a", "", "t")
        with _traced(store, trace) as trips:
            store.append(key, _prepared(), None)
            assert store.remembered(TENANT, record.request_id) is None
            receipts = store.append(key, _prepared(), None, record)
            with pytest.raises(AlreadyDone) as done:
                store.append(key, _prepared(), None, record)
        # The append, the look-up, the append with its record, the retry: one extended
        # statement each, no BEGIN or COMMIT.
        assert [trip[-1] for trip in trips] == ["Sync"] * 4, trips
        # The retry was answered by the statement: the first receipts, by the retry's
        # own encoder, and nothing written.
        assert done.value.payload == record.encode(receipts)
        assert [r.sequence for r in receipts] == [3]
        found = store.remembered(TENANT, record.request_id)
        assert found is not None and found.fingerprint == record.fingerprint
        assert found.result == receipts
        # The connection came back from the autocommit statements usable for writes.
        store.append(key, _prepared(), None)
        thread = store.get_thread(key)
        assert thread is not None and thread.message_count == 4
    finally:
        store.close()


def test_the_one_statement_is_sent_the_models_of_its_label_as_an_array_literal(
    postgres_dsn: str, tmp_path: Path
) -> None:
    """The one statement is sent the models seen under the batch's label as the text of
    an array literal (`_text_array`, not psycopg's list dumper): it reads back as the
    same list whatever the names hold (quotes, backslashes, commas, braces), every
    model seen under a label matches its agents (one statement each), and a batch
    counted under another label does not (StaleModel, from the transaction)."""
    odd = ['we"ird', "back\\slash", "a,b", "{x}", "", "plain"]
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT %s::text::text[]", [_text_array(odd)]).fetchone()
    assert row is not None and row[0] == odd
    store = PostgresStore.open(postgres_dsn, pool_size=1)
    try:
        service = ContextService(store, ExtractiveSummarizer())
        models = ["gpt-4o", "gpt-4o-mini", "o3"]  # one label, o200k_base
        for k, model in enumerate(models):
            service.create_agent(TENANT, f"agent-{k}", AgentSettings(model=model))
            # The first append creates the thread (the transaction, which notes the model)
            service.append_messages(TENANT, f"agent-{k}", "", "t", _batch(k, 1))
        for k, model in enumerate(models):
            key = ContextKey(TENANT, f"agent-{k}", "", "t")
            with _traced(store, tmp_path / f"trace-{k}") as trips:
                store.append(key, prepare_batch(_batch(k, 1), model, [()]), None)
            assert [trip[-1] for trip in trips] == ["Sync"], (model, trips)
            thread = store.get_thread(key)
            assert thread is not None and thread.message_count == 2
        other = ContextKey(TENANT, "agent-0", "", "t")
        with pytest.raises(StaleModel):
            store.append(other, prepare_batch(_batch(9, 1), "claude-sonnet-4", [()]), None)
    finally:
        store.close()


def test_appends_it_does_not_cover_take_the_transaction(postgres_dsn: str) -> None:
    """The one statement leaves what it does not cover to the transaction, which answers
    as before: a new thread, a batch counted under another model's label (StaleModel), a tool
    call and its result (found by the call's id). (Agents with retention: tests/contract.)"""
    store = PostgresStore.open(postgres_dsn)
    try:
        service = ContextService(store, ExtractiveSummarizer())
        key = ContextKey(TENANT, "a", "", "t")
        service.append_messages(TENANT, "a", "", "t", _batch(0, 1), create_agent=True)
        stale = prepare_batch(_batch(1, 1), "claude-sonnet-4", [()])
        with pytest.raises(StaleModel):
            store.append(key, stale, None)
        call = NewMessage(role=Role.ASSISTANT, content="x", tool_calls='[{"id": "c1"}]')
        store.append(key, prepare_batch([call], "", [("c1",)]), None)
        result = NewMessage(role=Role.TOOL_RESULT, content="y", tool_call_id="c1")
        [receipt] = store.append(key, prepare_batch([result], "", [()]), None)
        [row] = store.messages_by_ids(key, [receipt.id])
        assert row.group_id >= 0  # found its call, as the transaction does
        thread = store.get_thread(key)
        assert thread is not None and thread.message_count == 3
    finally:
        store.close()


def test_appends_of_an_agent_with_retention_take_the_transaction_at_once(
    postgres_dsn: str, tmp_path: Path
) -> None:
    """The one statement leaves agents with retention to the transaction (it does not
    read their ttl); once an append has read such an agent's settings, the next goes to
    the transaction without trying the statement first: BEGIN, two statements, COMMIT,
    not one round trip more."""
    store = PostgresStore.open(postgres_dsn, pool_size=1)
    try:
        settings = AgentSettings(retention=RetentionPolicy(ttl_us=3_600 * 10**6))
        key = ContextKey(TENANT, "r", "", "t")
        store.append(key, _prepared(), settings)
        store.append(key, _prepared(), None)  # the transaction reads the retention
        trace = tmp_path / "trace"
        with _traced(store, trace) as trips:
            [receipt] = store.append(key, _prepared(), None)
        assert [trip[-1] for trip in trips] == ["Query", "Sync", "Sync", "Query"], trips
        assert receipt.sequence == 3
    finally:
        store.close()


def _prepared() -> MessageBatch:
    return prepare_batch(_batch(5, 1), "", [()])


def _encode(receipts: Any) -> bytes:
    return repr([(r.id, r.sequence) for r in receipts]).encode()


def _serve(postgres_dsn: str, data_dir: Path, **settings: Any) -> tuple[RunningServer, Client]:
    running = create_server(
        Settings(
            addr="127.0.0.1:0",
            data_dir=data_dir,
            store=postgres_dsn,
            sweep_interval_seconds=0,
            **settings,
        ),
        clock=ManualClock(wall_clock_us()),
    )
    return running, connect(f"127.0.0.1:{running.port}")


def _request(request_id: str, *texts: str) -> pb.AppendMessagesRequest:
    return pb.AppendMessagesRequest(
        agent="a",
        thread="t",
        request_id=request_id,
        create_agent_if_missing=True,
        messages=[pb.Message(role=USER, content=t) for t in texts],
    )


def test_an_append_call_with_a_request_id_is_one_round_trip(
    postgres_dsn: str, tmp_path: Path
) -> None:
    """Over gRPC, an AppendMessages with a request id makes one round trip to
    PostgreSQL, and so does its retry: the append's statement, which also checks that
    the server still has no API key (the call came without one). The servicer does not
    look the id up first (that statement reads it). Before, a call made eight: the check
    of keys (BEGIN, the read, COMMIT), the look-up and the append (four); then two."""
    running, client = _serve(postgres_dsn, tmp_path / "data", store_pool_size=1)
    store = running.store
    assert isinstance(store, PostgresStore)
    try:
        client.stub.AppendMessages(_request("", "first"))
        client.stub.AppendMessages(_request("", "second"))  # the agent is cached now
        trace = tmp_path / "trace"
        with _traced(store, trace) as trips:
            first_response = client.stub.AppendMessages(_request("r-1", "hello"))
            again = client.stub.AppendMessages(_request("r-1", "hello"))
        # Each call: the append's statement alone.
        assert [trip[-1] for trip in trips] == ["Sync"] * 2, trips
        assert all(trip[0] == 'Parse "WITH' for trip in trips), trips
        assert again == first_response
        assert [r.sequence for r in first_response.receipts] == [3]
        assert [m.content for m in client.history("a", thread="t")] == ["first", "second", "hello"]
    finally:
        client.channel.close()
        running.stop(grace=1)


def test_a_retry_the_servicer_refuses_before_the_store_replays_the_first(
    postgres_dsn: str, tmp_path: Path
) -> None:
    """A retry that fails before the store is reached (here another replica's limits
    refuse the batch) is looked up then: the first response, not the error."""
    first_replica, first_client = _serve(postgres_dsn, tmp_path / "one")
    second_replica, second_client = _serve(postgres_dsn, tmp_path / "two", max_batch_messages=1)
    try:
        first_client.stub.AppendMessages(_request("", "first"))
        response = first_client.stub.AppendMessages(_request("r-1", "a", "b"))
        assert second_client.stub.AppendMessages(_request("r-1", "a", "b")) == response
        with pytest.raises(grpc.RpcError) as info:
            second_client.stub.AppendMessages(_request("r-2", "a", "b"))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert [m.content for m in first_client.history("a", thread="t")] == ["first", "a", "b"]
    finally:
        for replica, client in ((first_replica, first_client), (second_replica, second_client)):
            client.channel.close()
            replica.stop(grace=1)
