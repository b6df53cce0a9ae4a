"""Retention on DuckDB: what the sweep reads and deletes (see domain/retention.py).

Every delete is one small writer job (at most `limit` messages), so appends queued
meanwhile commit between two chunks instead of waiting for a whole sweep. Only messages
the thread counters have already counted (ids up to `thread_counters_through_id`) are
deleted, and the counters are lowered in the same transaction: a crash can then never
leave a counter that counts a deleted message, nor one that lost a deleted message
twice. A chunk first writes its thread's pending counters when it has any.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import duckdb

from contextd.adapters.duckdb.base import DuckDBBase, Touches, _first
from contextd.adapters.rows import AGENT_COLUMNS, agent_from_row
from contextd.domain.model import Agent, ContextKey
from contextd.domain.retention import KEEP_EVERYTHING
from contextd.ports.store import RetainedThread

# One sweeper per process (one process owns the file).
_SWEEPING = threading.Lock()


class RetentionMixin(DuckDBBase):
    @contextlib.contextmanager
    def sweep_lock(self) -> Iterator[bool]:
        """True while this caller is the only sweeper."""
        held = _SWEEPING.acquire(blocking=False)
        try:
            yield held
        finally:
            if held:
                _SWEEPING.release()

    def retention_agents(self, after: tuple[str, str] | None, limit: int) -> list[Agent]:
        rows = (
            self._cursor()
            .execute(
                f"SELECT {AGENT_COLUMNS} FROM agents WHERE (tenant, name) > (?, ?) "
                "AND (settings_json LIKE '%\"retention\"%' "
                "OR settings_json LIKE '%\"retention_overrides\"%') "
                "ORDER BY tenant, name LIMIT ?",
                [*(after or ("", "")), limit],
            )
            .fetchall()
        )
        return [
            a
            for a in map(agent_from_row, rows)
            if a.retention_overrides or a.retention != KEEP_EVERYTHING
        ]

    def retention_threads(
        self, tenant: str, agent: str, after_context_id: int, limit: int
    ) -> list[RetainedThread]:
        rows = self._thread_rows(
            "SELECT l.tenant, l.agent, l.scope, l.thread, l.context_id, l.last_sequence, "
            "l.last_message_time_us, t.expired_through, "
            "(SELECT min(sequence) FROM messages m WHERE m.context_id = l.context_id), "
            "(SELECT min(coalesce(group_start, sequence)) FROM messages m "
            " WHERE m.context_id = l.context_id), t.outputs_expired_through_us "
            "FROM live_threads l JOIN threads t ON t.context_id = l.context_id "
            "WHERE l.tenant = ? AND l.agent = ? AND l.context_id > ? "
            "ORDER BY l.context_id LIMIT ?",
            [tenant, agent, after_context_id, limit],
        )
        return [RetainedThread(ContextKey(r[0], r[1], r[2], r[3]), *r[4:11]) for r in rows]

    def mark_expired(self, thread: RetainedThread, cutoff_us: int) -> int:
        def mark(cur: duckdb.DuckDBPyConnection) -> int:
            row = _first(
                cur.execute(
                    "SELECT expired_through, last_message_time_us FROM threads "
                    "WHERE context_id = ?",
                    [thread.context_id],
                )
            )
            if row is None:
                return 0
            last_us = max(int(row[1]), self._pending.last_of(thread.context_id))
            if last_us > cutoff_us:  # appended to since it was read: alive again
                return int(row[0])
            last_sequence = self._sequence_of(cur, thread.context_id)
            cur.execute(
                "UPDATE threads SET expired_through = greatest(expired_through, ?) "
                "WHERE context_id = ?",
                [last_sequence, thread.context_id],
            )
            return max(int(row[0]), last_sequence)

        return int(self._write(mark, touches=Touches(contexts=(thread.key,))))

    def delete_retained(
        self, thread: RetainedThread, through: int, by_group: bool, limit: int
    ) -> int:
        """Delete at most `limit` messages of the thread at or before `through`: by
        sequence (`by_group` False: an expired past, bounded by the stored
        expired_through) or by the start of their tool group (an overflow of the cap)."""
        position = "coalesce(group_start, sequence)" if by_group else "sequence"

        def chunk(cur: duckdb.DuckDBPyConnection) -> int:
            if self._pending.count_of(thread.context_id):
                # Counters of this thread are pending: write them first (their own
                # transaction, between the one the writer opened for this job and the
                # one this job's delete runs in), so every message can be deleted now.
                cur.execute("COMMIT")
                self._flush_counters(cur)
                cur.execute("BEGIN TRANSACTION")
            bound: Any = through
            if not by_group:
                row = _first(
                    cur.execute(
                        "SELECT expired_through FROM threads WHERE context_id = ?",
                        [thread.context_id],
                    )
                )
                bound = min(through, int(row[0])) if row else 0
            counted = _first(
                cur.execute(
                    "SELECT value FROM store_state WHERE key = 'thread_counters_through_id'"
                )
            )
            gone = cur.execute(
                "DELETE FROM messages WHERE rowid IN (SELECT rowid FROM messages "
                f"WHERE context_id = ? AND {position} <= ? AND id <= ? LIMIT ?) "
                "RETURNING token_estimate",
                [thread.context_id, bound, int(counted[0]), limit],
            ).fetchall()
            if gone:
                cur.execute(
                    "UPDATE threads SET message_count = message_count - ?, "
                    "token_estimate = token_estimate - ? WHERE context_id = ?",
                    [len(gone), sum(int(g[0]) for g in gone), thread.context_id],
                )
            return len(gone)

        return int(self._write(chunk, touches=Touches(contexts=(thread.key,))))
