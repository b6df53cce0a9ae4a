"""The embedded engine keeps long content apart (schema version 22, docs/operations.md).

Content of at most 4,096 bytes (UTF-8) is stored in `content_short` (compressed by
DuckDB), longer content in `content_long`, and every read sees one `content` column. These
inspect the DuckDB file itself, so they are `duckdb_only`.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from contextd.adapters.duckdb import schema as duckdb_schema
from contextd.adapters.duckdb.store import Store
from contextd.domain.batches import prepare_batch
from contextd.domain.model import AgentSettings, ContextKey, NewMessage, Role
from contextd.ports.store import ThreadFilter

pytestmark = pytest.mark.duckdb_only

KEY = ContextKey("acme", "a1", "", "t1")
WHERE = ThreadFilter("acme", "a1", "", "t1")

# At the edge in bytes, not characters: "é" is 2 bytes and "→" 3 in UTF-8.
TEXTS = [
    "short",
    "é" * 2048,  # 4,096 bytes: short
    "é" * 2049,  # 4,098 bytes: long
    "x" * 4096,  # short
    "x" * 4097,  # long
    "→" * 1400,  # 1,400 characters, 4,200 bytes: long
    "→" * 1024,  # 3,072 bytes: short
]
LONG = [False, False, True, False, True, True, False]


def _append(store: Store, texts: list[str]) -> None:
    store.append(
        KEY,
        prepare_batch(
            [NewMessage(role=Role.USER, content=t) for t in texts], "", [()] * len(texts)
        ),
        AgentSettings(),
    )


def _stored(path: Path) -> list[tuple[str, str, str | None]]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        rows = con.execute(
            "SELECT content, content_short, content_long FROM messages ORDER BY id"
        ).fetchall()
    finally:
        con.close()
    return [(str(a), str(b), None if c is None else str(c)) for a, b, c in rows]


def test_long_content_is_stored_apart_and_read_back_whole(tmp_path: Path) -> None:
    path = tmp_path / "db.duckdb"
    store = Store.open(path)
    try:
        _append(store, TEXTS)
        listed = store.list_messages(WHERE, None, None, 100)
        assert [m.content for m in listed] == TEXTS
        got = store.messages_by_ids(KEY, [m.id for m in listed])
        assert [m.content for m in got] == TEXTS
    finally:
        store.close()
    stored = _stored(path)
    assert [c for c, _, _ in stored] == TEXTS
    assert [long is not None for _, _, long in stored] == LONG
    assert all(
        (short == "") == is_long for (_, short, _), is_long in zip(stored, LONG, strict=True)
    )
    # A store opened again (no hot cache) reads the same.
    store = Store.open(path)
    try:
        assert [m.content for m in store.list_messages(WHERE, None, None, 100)] == TEXTS
    finally:
        store.close()


def test_a_file_from_before_the_split_is_migrated_with_its_indexes(tmp_path: Path) -> None:
    """A file at version 20 (content in one column) migrates: the same rows and content,
    long content moved, the indexes made again; opening it again changes nothing."""
    path = tmp_path / "db.duckdb"
    store = Store.open(path)
    try:
        _append(store, TEXTS)
    finally:
        store.close()
    con = duckdb.connect(str(path))
    indexes = con.execute(
        "SELECT index_name FROM duckdb_indexes() WHERE table_name = 'messages' ORDER BY 1"
    ).fetchall()
    # Back to version 20's table (one stored content column), made from today's
    # definition, rows in order, and its indexes made again.
    ddl = con.execute("SELECT sql FROM duckdb_tables() WHERE table_name = 'messages'").fetchone()
    split = (
        "content_short VARCHAR NOT NULL, content_long VARCHAR, "
        '"content" VARCHAR GENERATED ALWAYS AS(COALESCE(content_long, content_short))'
    )
    assert ddl is not None and split in str(ddl[0])
    con.execute(
        str(ddl[0])
        .replace("CREATE TABLE messages(", "CREATE TABLE old_messages(")
        .replace(split, '"content" VARCHAR NOT NULL')
    )
    columns = [
        str(r[0])
        for r in con.execute(
            "SELECT column_name FROM duckdb_columns() WHERE table_name = 'old_messages' "
            "ORDER BY column_index"
        ).fetchall()
    ]
    quoted = ", ".join(f'"{c}"' for c in columns)
    con.execute(f"INSERT INTO old_messages ({quoted}) SELECT {quoted} FROM messages")
    index_sql = [
        str(r[0])
        for r in con.execute(
            "SELECT sql FROM duckdb_indexes() WHERE table_name = 'messages' ORDER BY index_name"
        ).fetchall()
    ]
    con.execute("DROP TABLE messages")
    con.execute("ALTER TABLE old_messages RENAME TO messages")
    for sql in index_sql:
        con.execute(sql)
    con.execute("DELETE FROM schema_migrations WHERE version >= 21")
    ddl = con.execute("SELECT sql FROM duckdb_tables() WHERE table_name = 'messages'").fetchone()
    assert ddl is not None and "content_short" not in str(ddl[0])
    con.close()
    for opened in range(2):
        store = Store.open(path)
        try:
            assert store.schema_version() >= 22
            listed = [m.content for m in store.list_messages(WHERE, None, None, 100)]
            assert listed == [*TEXTS, *["after"] * opened]
            _append(store, ["after"])
        finally:
            store.close()
    stored = _stored(path)
    assert [c for c, _, _ in stored] == [*TEXTS, "after", "after"]
    assert [long is not None for _, _, long in stored] == [*LONG, False, False]
    con = duckdb.connect(str(path), read_only=True)
    try:
        after = con.execute(
            "SELECT index_name FROM duckdb_indexes() WHERE table_name = 'messages' ORDER BY 1"
        ).fetchall()
    finally:
        con.close()
    assert after == indexes


def test_the_edge_is_in_bytes() -> None:
    assert [duckdb_schema.is_long_content(t) for t in TEXTS] == LONG
