"""The reference design's read path, for comparison: SQLite (WAL) from Python, in process.

The table and its index are the reference design's (``bench.sqlite_baseline.SCHEMA``: one
``messages`` table, an index on (agent, scope, thread, time)); ``token_estimate`` holds
the exact per-message count contextd stored for the same message, and the time column a
strictly increasing value per insert, so it orders a thread like contextd's sequence.
Two ways to fill an 8,000-token budget with a thread's newest messages:

- newest-first (the peer's fastest path): walk the index backwards from the newest
  message, reading role, content and count row by row, and stop at the first message
  that does not fit (OpenAI's chat framing per message, as contextd's builds count);
- load-then-trim: read the whole thread oldest first, then trim in Python.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path

from bench.sqlite_baseline import INSERT, SCHEMA
from bench.trim import OPENAI_PER_MESSAGE, OPENAI_PER_REQUEST, newest_first, openai_framed

NEWEST_FIRST = (
    "SELECT id, content, token_estimate FROM messages "
    "WHERE agent = ? AND scope = '' AND thread = ? ORDER BY create_time_us DESC"
)
OLDEST_FIRST = (
    "SELECT id, role, content, token_estimate FROM messages "
    "WHERE agent = ? AND scope = '' AND thread = ? ORDER BY create_time_us"
)


class SqlitePeer:
    """One SQLite file holding the same threads as the contextd stores under test."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.con = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.con.execute("PRAGMA journal_mode=WAL")
        self.con.execute("PRAGMA synchronous=FULL")
        self.con.executescript(SCHEMA)
        self._clock = 0

    def insert(self, agent: str, thread: str, rows: Iterable[tuple[int, str, int]]) -> None:
        """Append ``(role, content, token_count)`` rows to a thread in one transaction."""
        batch = []
        for role, content, tokens in rows:
            self._clock += 1
            batch.append((agent, "", thread, role, content, "", "", "", "", tokens, self._clock))
        self.con.execute("BEGIN")
        self.con.executemany(INSERT, batch)
        self.con.execute("COMMIT")

    @contextlib.contextmanager
    def unsynced(self) -> Iterator[None]:
        """``synchronous=OFF`` within the block (a fill whose durability is not measured)."""
        self.con.execute("PRAGMA synchronous=OFF")
        try:
            yield
        finally:
            self.con.execute("PRAGMA synchronous=FULL")

    def plan(self) -> str:
        """SQLite's plan of the newest-first read (must walk the index, not sort)."""
        rows = self.con.execute("EXPLAIN QUERY PLAN " + NEWEST_FIRST, ("a", "t")).fetchall()
        return "; ".join(str(r[-1]) for r in rows)

    def newest_first(self, agent: str, thread: str, budget: int) -> list[tuple[int, str]]:
        """The newest messages that fit ``budget``, oldest first, reading no further back
        than the first one that does not fit."""
        room = budget - OPENAI_PER_REQUEST
        total = 0
        kept: list[tuple[int, str]] = []
        for message_id, content, tokens in self.con.execute(NEWEST_FIRST, (agent, thread)):
            total += tokens + OPENAI_PER_MESSAGE
            if total > room:
                break
            kept.append((message_id, content))
        kept.reverse()
        return kept

    def load_then_trim(self, agent: str, thread: str, budget: int) -> list[tuple[int, str]]:
        """The whole thread read oldest first, then the newest suffix that fits."""
        rows = self.con.execute(OLDEST_FIRST, (agent, thread)).fetchall()
        costs, room = openai_framed([r[3] for r in rows], budget)
        return [(r[0], r[2]) for r in rows[newest_first(costs, room) :]]

    def disk_bytes(self) -> int:
        """The file's size once the WAL is checkpointed into it (table and index)."""
        self.con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        wal = self.path.with_name(self.path.name + "-wal")
        return self.path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)

    def close(self) -> None:
        self.con.close()
