"""PostgreSQL: what only its append path does.

- Appends leave the search index's pending list to the store's merging thread
  (adapters/postgres/pending_list.py): no append merges it, whatever its size up to the
  backstop, and the thread merges it after every CLEAN_EVERY_ROWS appended rows.
- Searches see rows still in the pending list.
- A one-message append is BEGIN, two statements and COMMIT (messages.py `_BEGIN_APPEND`
  and the write after it), request id or not; the look-up of a request id before a
  write is one statement in autocommit.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import pq

from contextd.adapters.postgres.store import PostgresStore
from contextd.app.build.summarizer import ExtractiveSummarizer
from contextd.app.service import ContextService
from contextd.domain.batches import prepare_batch
from contextd.domain.idempotency import AlreadyDone, RequestRecord
from contextd.domain.model import ContextKey, MessageBatch, MessageRange, NewMessage, Role

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
    store._pending._every = 10**9  # the thread never wakes in this test
    service = ContextService(store, ExtractiveSummarizer())
    for k in range(8):
        service.append_messages(TENANT, "a", "", "t", _batch(k * 1_000, 1_000), create_agent=True)
    # Past PostgreSQL's default limit, and no append merged it.
    pending = _pending_pages(postgres_dsn)
    assert pending > DEFAULT_LIMIT_PAGES
    # Searches see rows still in the list (a GIN scan reads it too).
    found = service.search_messages(TENANT, "a", "", "t", MessageRange.ALL, "w427000x", 5)
    assert [h.message.sequence for h in found.hits] == [7_001]
    assert store._pending.merge() >= pending
    assert _pending_pages(postgres_dsn) == 0
    found = service.search_messages(TENANT, "a", "", "t", MessageRange.ALL, "w427000x", 5)
    assert [h.message.sequence for h in found.hits] == [7_001]


def test_the_merger_merges_after_every_rows(store: PostgresStore, postgres_dsn: str) -> None:
    store._pending._every = 1_500
    service = ContextService(store, ExtractiveSummarizer())
    service.append_messages(TENANT, "a", "", "t", _batch(0, 1_000), create_agent=True)
    assert _pending_pages(postgres_dsn) > 0  # 1,000 rows: not yet
    service.append_messages(TENANT, "a", "", "t", _batch(1_000, 1_000), create_agent=True)
    deadline = time.monotonic() + 60
    while _pending_pages(postgres_dsn) and time.monotonic() < deadline:
        time.sleep(0.05)  # the store's own thread, not a clock: it runs in real time
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


def test_one_message_append_is_two_statements(postgres_dsn: str, tmp_path: Path) -> None:
    """Read from libpq's trace of the store's one connection. A one-message append is
    BEGIN, two statements and COMMIT, request id or not; the look-up of a request id
    before a write is one statement in autocommit. Before, an append to an existing
    thread was six (BEGIN, the agent's lock, the thread's lock, the row, the counters,
    COMMIT), eight with a request id, and the look-up three (BEGIN, the read, COMMIT)."""
    store = PostgresStore.open(postgres_dsn, pool_size=1)
    try:
        service = ContextService(store, ExtractiveSummarizer())
        service.append_messages(TENANT, "a", "", "t", _batch(0, 1), create_agent=True)
        trace = tmp_path / "trace"
        record = RequestRecord(TENANT, "r-1", "contextd.v1.AppendMessagesRequest", "f", _encode)
        with trace.open("w") as out:
            with store._pool.connection() as conn:
                conn.pgconn.trace(out.fileno())
                conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
            try:
                key = ContextKey(TENANT, "a", "", "t")
                store.append(key, _prepared(), None)
                assert store.remembered(TENANT, record.request_id) is None
                receipts = store.append(key, _prepared(), None, record)
            finally:
                with store._pool.connection() as conn:
                    conn.pgconn.untrace()
        # Lines are "F|B <tab> length <tab> message ..." (F: sent by the client).
        trips = _round_trips([line.split("\t") for line in trace.read_text().splitlines()])
        kinds = [trip[-1] for trip in trips]
        # Each append: BEGIN, the locks and ids (with the record), the writes, COMMIT;
        # between them the look-up: one extended statement, no BEGIN or COMMIT.
        append = ["Query", "Sync", "Sync", "Query"]
        assert kinds == [*append, "Sync", *append], trips
        # The record was written with the row: the same request replays it.
        again = store.append(key, _prepared(), None, record)
    except AlreadyDone as done:
        assert receipts is not None
        assert done.payload == record.encode(receipts)
        assert store.remembered(TENANT, record.request_id) is not None
        # The connection came back from the look-ups usable for writes.
        store.append(key, _prepared(), None)
        thread = store.get_thread(key)
        assert thread is not None and thread.message_count == 4
    else:
        raise AssertionError(f"not replayed: {again}")
    finally:
        store.close()


def _prepared() -> MessageBatch:
    return prepare_batch(_batch(5, 1), "", [()])


def _encode(receipts: Any) -> bytes:
    return repr([(r.id, r.sequence) for r in receipts]).encode()
