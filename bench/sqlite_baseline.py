"""The reference design's store, for comparison: SQLite from Python, in process.

WAL journal with ``synchronous=FULL`` so that every commit is durable, like contextd's
acknowledged appends. Two variants, both with a single caller: one INSERT and one commit
per message (what one durable single-message append costs on this disk), and
``executemany`` of a whole batch in one commit. It runs in the benchmark process with no
network and no serialisation, and its rows have fewer columns than contextd's (no token
count, chars, group or context id), which flatters it: it is the ceiling of that design,
not what a server built on it would reach, and not the same load as contextd's 32
concurrent callers.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

from bench import corpus

SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    agent TEXT NOT NULL, scope TEXT NOT NULL, thread TEXT NOT NULL,
    role INTEGER NOT NULL, content TEXT NOT NULL, tool_calls TEXT NOT NULL,
    tool_call_id TEXT NOT NULL, external_id TEXT NOT NULL, metadata TEXT NOT NULL,
    token_estimate INTEGER NOT NULL, create_time_us INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_thread
    ON messages (agent, scope, thread, create_time_us);
"""
INSERT = (
    "INSERT INTO messages (agent, scope, thread, role, content, tool_calls, tool_call_id, "
    "external_id, metadata, token_estimate, create_time_us) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
SELECT_WINDOW = (
    "SELECT id, agent, scope, thread, role, content, tool_calls, tool_call_id, external_id, "
    "metadata, token_estimate, create_time_us FROM messages "
    "WHERE agent = ? AND scope = ? AND thread = ? AND create_time_us > ? "
    "ORDER BY create_time_us, id LIMIT ?"
)


def connect(path: Path) -> sqlite3.Connection:
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA synchronous=FULL")
    con.executescript(SCHEMA)
    return con


def _row(thread: str, message: corpus.Message) -> tuple[Any, ...]:
    content = message.content
    return (
        "bench",
        "",
        thread,
        message.role,
        content,
        "",
        "",
        "",
        "",
        (len(content) + 3) // 4,
        time.time_ns() // 1_000,
    )


def insert_one_by_one(con: sqlite3.Connection, thread: str, messages: list[corpus.Message]) -> None:
    for message in messages:
        con.execute("BEGIN")
        con.execute(INSERT, _row(thread, message))
        con.execute("COMMIT")


def insert_batch(con: sqlite3.Connection, thread: str, messages: list[corpus.Message]) -> None:
    con.execute("BEGIN")
    con.executemany(INSERT, [_row(thread, m) for m in messages])
    con.execute("COMMIT")


def append_rates(
    directory: Path, single: int, batches: tuple[int, ...], batched_messages: int
) -> dict[str, float]:
    """Messages/s of the one-by-one variant and of ``executemany`` per batch size."""
    history = corpus.conversation(max(single, batched_messages), tools=False)
    out: dict[str, float] = {}
    con = connect(directory / "seed.sqlite")
    try:
        start = time.perf_counter()
        insert_one_by_one(con, "single", history[:single])
        out["single"] = single / (time.perf_counter() - start)
        for size in batches:
            start = time.perf_counter()
            done = 0
            while done < batched_messages:
                insert_batch(con, f"batch-{size}", history[done : done + size])
                done += size
            out[f"batch{size}"] = done / (time.perf_counter() - start)
    finally:
        con.close()
    return out
