"""The DuckDB store on its own: versioned migrations, group-committed appends, thread
counters and the writer. What every engine must do is in tests/contract/."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import duckdb
import pytest

from contextd.adapters.duckdb import schema as duckdb_schema
from contextd.adapters.duckdb.store import Store
from contextd.domain.batches import prepare_batch
from contextd.domain.model import AgentSettings, ContextKey, MessageBatch, NewMessage, Role
from contextd.domain.window import WindowSpec
from contextd.ports.store import ThreadFilter


def _batch(*texts: str) -> MessageBatch:
    return prepare_batch(
        [NewMessage(role=Role.USER, content=t) for t in texts], "", [()] * len(texts)
    )


def test_migrates_an_older_schema_in_place(tmp_path: Path) -> None:
    """A file written at schema v1 (made here with v1's own statements) opens at the
    current version with its rows intact and the new columns at their defaults."""
    path = tmp_path / "db.duckdb"
    con = duckdb.connect(str(path))
    con.execute(
        "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, "
        "applied_time_us BIGINT NOT NULL)"
    )
    for statement in duckdb_schema.MIGRATIONS[0][1]:
        con.execute(statement)
    con.execute("INSERT INTO schema_migrations VALUES (1, 0)")
    con.execute(
        "INSERT INTO agents VALUES ('default', 'a1', '', '[]', 86400000000, 1, 1, 1, '', '{}')"
    )
    con.execute("INSERT INTO threads VALUES (1, 'default', 'a1', '', 't1', 5, 5, 1, 2, NULL)")
    con.execute(
        "INSERT INTO messages VALUES (1, 1, 'default', 'a1', '', 't1', 1, 'from v1', "
        "'', '', '', '', 2, 5, 2, 'estimate', 7, -1, '')"
    )
    con.close()
    store = Store.open(path)
    try:
        assert store.schema_version() == duckdb_schema.MIGRATIONS[-1][0]
        [message] = store.list_messages(ThreadFilter("default", "a1", "", "t1"), None, None, 10)
        assert (message.content, message.is_summary) == ("from v1", False)
        assert store.list_status("default", "a1", "", None, 10, None) == []
        receipt = store.append(ContextKey("default", "a1", "", "t1"), _batch("v2"), AgentSettings())
        assert receipt[0].id == 2 and receipt[0].create_time_us > 5
    finally:
        store.close()


def test_v3_points_each_thread_at_its_newest_summary(tmp_path: Path) -> None:
    """A file written at schema v2 with stored summaries: migrating to v3 fills each
    thread's latest_summary_id from its messages, so builds find the same summary."""
    path = tmp_path / "db.duckdb"
    con = duckdb.connect(str(path))
    con.execute(
        "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, "
        "applied_time_us BIGINT NOT NULL)"
    )
    for version, statements in duckdb_schema.MIGRATIONS[:2]:
        for statement in statements:
            con.execute(statement)
        con.execute("INSERT INTO schema_migrations VALUES (?, 0)", [version])
    con.execute(
        "INSERT INTO agents VALUES ('default', 'a1', '', '[]', 86400000000, 1, 1, 1, '', '{}')"
    )
    for context_id, thread in ((1, "t1"), (2, "t2")):
        con.execute(
            "INSERT INTO threads VALUES (?, 'default', 'a1', '', ?, 5, 9, 3, 6, NULL)",
            [context_id, thread],
        )
    rows = [  # (id, context, is_summary): t1 has two summaries, t2 none
        (1, 1, False),
        (2, 1, True),
        (3, 1, True),
        (4, 1, False),
        (5, 2, False),
    ]
    for message_id, context_id, is_summary in rows:
        con.execute(
            "INSERT INTO messages VALUES (?, ?, 'default', 'a1', '', ?, 1, ?, '', '', '', '', "
            "1, ?, 1, 'estimate', 1, -1, '', ?, 0, 0)",
            [message_id, context_id, f"t{context_id}", f"m{message_id}", message_id, is_summary],
        )
    con.close()
    store = Store.open(path)
    try:
        refs = [store.context_ref(ContextKey("default", "a1", "", t)) for t in ("t1", "t2")]
        assert [r.latest_summary_id if r else None for r in refs] == [3, 0]
        assert refs[0] is not None and refs[1] is not None
        summary = store.latest_summary(refs[0])
        assert summary is not None and summary.content == "m3"
        assert store.latest_summary(refs[1]) is None
    finally:
        store.close()


def test_v4_numbers_existing_messages_in_their_old_order(tmp_path: Path) -> None:
    """A file written at schema v3, one thread holding imported (out of time order)
    messages and messages the thread counters had not counted yet: migrating numbers each
    thread 1..n in the order it was read in before, (create time, id); the counters and
    the next append continue from there, and the id high-water mark starts at max(id)."""
    path = tmp_path / "db.duckdb"
    con = duckdb.connect(str(path))
    con.execute(
        "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, "
        "applied_time_us BIGINT NOT NULL)"
    )
    for version, statements in duckdb_schema.MIGRATIONS[:3]:
        for statement in statements:
            con.execute(statement)
        con.execute("INSERT INTO schema_migrations VALUES (?, 0)", [version])
    con.execute(
        "INSERT INTO agents VALUES ('default', 'a1', '', '[]', 86400000000, 1, 1, 1, '', '{}')"
    )
    # t1 counted through id 3 (its counters hold 2 messages); id 5 is not counted yet.
    con.execute("INSERT INTO threads VALUES (1, 'default', 'a1', '', 't1', 10, 30, 2, 2, NULL, 0)")
    con.execute("INSERT INTO threads VALUES (2, 'default', 'a1', '', 't2', 20, 20, 1, 1, NULL, 0)")
    con.execute("UPDATE store_state SET value = 3 WHERE key = 'thread_counters_through_id'")
    for message_id, context_id, time_us in [(1, 1, 30), (2, 2, 20), (3, 1, 10), (5, 1, 30)]:
        con.execute(
            "INSERT INTO messages VALUES (?, ?, 'default', 'a1', '', ?, 1, ?, '', '', '', '', "
            "1, ?, 1, 'estimate', 1, -1, '', false, 0, 0)",
            [message_id, context_id, f"t{context_id}", f"m{message_id}", time_us],
        )
    con.close()
    store = Store.open(path)
    try:
        t1 = ThreadFilter("default", "a1", "", "t1")
        rows = store.list_messages(t1, None, None, 10)
        assert [(r.content, r.sequence) for r in rows] == [("m3", 1), ("m1", 2), ("m5", 3)]
        assert all(r.source_time_us is None for r in rows)
        threads = store.list_threads("default", "a1", "", None, 10)
        assert [(t.thread, t.message_count, t.last_sequence) for t in threads] == [
            ("t1", 3, 3),
            ("t2", 1, 1),
        ]
        [receipt] = store.append(
            ContextKey("default", "a1", "", "t1"), _batch("m6"), AgentSettings()
        )
        assert (receipt.id, receipt.sequence) == (6, 4)
    finally:
        store.close()


def test_a_sequence_taken_by_another_writer_fails_the_append(tmp_path: Path) -> None:
    """The unique (thread, sequence) index checks the writer's numbers in the transaction:
    a number already taken (here written behind the writer's back, as a second writer
    would) fails the append instead of being stored twice; reopened, the store numbers
    on from the stored rows. (Without the append journal: a journaled append meets the
    index when the journal is applied, see test_journal.py.)"""
    path = tmp_path / "db.duckdb"
    store = Store.open(path, journal=False)
    key = ContextKey("default", "a1", "", "t1")
    try:
        store.append(key, _batch("one"), AgentSettings())
        store._con.cursor().execute(
            "INSERT INTO messages BY NAME "  # `content` is virtual (schema version 22)
            "SELECT * EXCLUDE (content) REPLACE (id + 1000 AS id, 2 AS sequence) FROM messages"
        )
        with pytest.raises(duckdb.ConstraintException):
            store.append(key, _batch("two"), AgentSettings())
    finally:
        store.close()
    store = Store.open(path)
    try:
        [receipt] = store.append(key, _batch("three"), AgentSettings())
        assert receipt.sequence == 3 and receipt.id > 1001
        rows = store.list_messages(ThreadFilter("default", "a1", "", "t1"), None, None, 10)
        assert [(r.content, r.sequence) for r in rows] == [("one", 1), ("one", 2), ("three", 3)]
    finally:
        store.close()


def test_thread_counters_are_exact_while_appends_race_reads(tmp_path: Path) -> None:
    """Readers add the writer's pending counters to the table's; under concurrent appends
    (the writer flushes while busy) a read never counts a message twice or misses one
    that was acknowledged before it began, and the counts survive a reopen."""
    path = tmp_path / "db.duckdb"
    store = Store.open(path)
    acked = [0] * 4
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        key = ContextKey("default", "a1", "", f"t{n}")
        try:
            while not stop.is_set():
                store.append(key, _batch(f"{n}-{acked[n]}"), AgentSettings())
                acked[n] += 1
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    writers = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in writers:
        t.start()
    reads = 0
    deadline = time.monotonic() + 2.5  # longer than the flush interval: flushes happen
    try:
        while time.monotonic() < deadline:
            floor = list(acked)
            counts = {
                t.thread: t.message_count for t in store.list_threads("default", "a1", "", None, 10)
            }
            for n in range(4):
                # Never below what was acknowledged before the read, never above what
                # was started (at most one call in flight per writer).
                assert floor[n] <= counts.get(f"t{n}", 0) <= acked[n] + 1
            reads += 1
    finally:
        stop.set()
        for t in writers:
            t.join()
    assert not errors and reads > 10
    final = {t.thread: t.message_count for t in store.list_threads("default", "a1", "", None, 10)}
    assert final == {f"t{n}": acked[n] for n in range(4)}
    store.close()
    store = Store.open(path)
    try:
        reopened = store.list_threads("default", "a1", "", None, 10)
        assert {t.thread: t.message_count for t in reopened} == final
    finally:
        store.close()


def test_reopening_does_not_migrate_again(tmp_path: Path) -> None:
    path = tmp_path / "db.duckdb"
    Store.open(path).close()
    store = Store.open(path)
    try:
        rows = store._cursor().execute("SELECT count(*) FROM schema_migrations").fetchall()
        assert rows == [(len(duckdb_schema.MIGRATIONS),)]
    finally:
        store.close()


def test_concurrent_appends_are_all_committed_in_order(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "db.duckdb")
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        key = ContextKey("default", "a1", "", f"t{n % 4}")
        try:
            for i in range(50):
                store.append(key, _batch(f"{n}-{i}-a", f"{n}-{i}-b"), AgentSettings())
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == []
        total = 0
        for thread_no in range(4):
            where = ThreadFilter("default", "a1", "", f"t{thread_no}")
            rows = store.list_messages(where, None, None, 10_000)
            total += len(rows)
            # Each call's two messages are adjacent and in order, per writer.
            for n in range(thread_no, 16, 4):
                mine = [r.content for r in rows if r.content.startswith(f"{n}-")]
                assert mine == [f"{n}-{i}-{s}" for i in range(50) for s in "ab"]
            counts = store.context_counts(where, WindowSpec(0, 0))
            assert counts[2] == len(rows)  # thread metadata agrees with the rows
            # Numbered 1, 2, 3, ... in append order, with no gap or repeat.
            assert [r.sequence for r in rows] == list(range(1, len(rows) + 1))
            assert [r.id for r in rows] == sorted(r.id for r in rows)
        assert total == 16 * 50 * 2
        ids = store._cursor().execute("SELECT count(DISTINCT id) FROM messages").fetchall()
        assert ids == [(total,)]
    finally:
        store.close()
