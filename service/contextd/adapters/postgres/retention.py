"""Retention on PostgreSQL: what the sweep reads and deletes (see domain/retention.py).

One sweeper at a time across every replica: `sweep_lock` takes a session advisory lock
with pg_try_advisory_lock on a connection held for the pass (a replica that dies while
holding it releases it with its connection). Each delete is its own short transaction
that first locks the thread's row, as an append does, so a chunk and an append to the
same thread take turns and the counters stay exact.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from contextd.adapters.postgres.base import Conn, PostgresBase, first
from contextd.adapters.rows import AGENT_COLUMNS, agent_from_row
from contextd.domain.model import Agent, ContextKey
from contextd.domain.retention import KEEP_EVERYTHING
from contextd.ports.store import RetainedThread

# The advisory lock key of the sweep ("contextd retention sweep").
SWEEP_LOCK = 0x636F6E7478_7377


class RetentionMixin(PostgresBase):
    @contextlib.contextmanager
    def sweep_lock(self) -> Iterator[bool]:
        with self._pool.connection() as conn:
            conn.commit()  # no transaction left open on the held connection
            conn.autocommit = True
            try:
                row = conn.execute("SELECT pg_try_advisory_lock(%s)", [SWEEP_LOCK]).fetchone()
                held = bool(row and row[0])
                try:
                    yield held
                finally:
                    if held:
                        conn.execute("SELECT pg_advisory_unlock(%s)", [SWEEP_LOCK])
            finally:
                conn.autocommit = False

    def retention_agents(self, after: tuple[str, str] | None, limit: int) -> list[Agent]:
        with self._reading() as conn:
            rows = conn.execute(
                f"SELECT {AGENT_COLUMNS} FROM agents WHERE (tenant, name) > (%s, %s) "
                "AND (settings_json LIKE '%%\"retention\"%%' "
                "OR settings_json LIKE '%%\"retention_overrides\"%%') "
                "ORDER BY tenant, name LIMIT %s",
                [*(after or ("", "")), limit],
            ).fetchall()
        agents = [agent_from_row(r) for r in rows]
        return [a for a in agents if a.retention_overrides or a.retention != KEEP_EVERYTHING]

    def retention_threads(
        self, tenant: str, agent: str, after_context_id: int, limit: int
    ) -> list[RetainedThread]:
        with self._reading() as conn:
            rows = conn.execute(
                "SELECT scope, thread, context_id, last_sequence, last_message_time_us, "
                "expired_through, "
                "(SELECT min(sequence) FROM messages m WHERE m.tenant = t.tenant "
                " AND m.context_id = t.context_id), "
                "(SELECT min(coalesce(group_start, sequence)) FROM messages m "
                " WHERE m.tenant = t.tenant AND m.context_id = t.context_id), "
                "outputs_expired_through_us "
                "FROM threads t WHERE tenant = %s AND agent = %s "
                "AND context_id > %s ORDER BY context_id LIMIT %s",
                [tenant, agent, after_context_id, limit],
            ).fetchall()
        return [RetainedThread(ContextKey(tenant, agent, r[0], r[1]), *r[2:9]) for r in rows]

    def _lock_thread(self, conn: Conn, thread: RetainedThread) -> tuple[int, int, int] | None:
        row = first(
            conn,
            "SELECT expired_through, last_message_time_us, last_sequence FROM threads "
            "WHERE tenant = %s AND context_id = %s FOR UPDATE",
            [thread.key.tenant, thread.context_id],
        )
        return (int(row[0]), int(row[1]), int(row[2])) if row else None

    def mark_expired(self, thread: RetainedThread, cutoff_us: int) -> int:
        def mark(conn: Conn) -> int:
            row = self._lock_thread(conn, thread)
            if row is None:
                return 0
            expired_through, last_us, last_sequence = row
            if last_us > cutoff_us:  # appended to since it was read: alive again
                return expired_through
            conn.execute(
                "UPDATE threads SET expired_through = %s WHERE tenant = %s AND context_id = %s",
                [max(expired_through, last_sequence), thread.key.tenant, thread.context_id],
            )
            return max(expired_through, last_sequence)

        return self._write(mark)

    def delete_retained(
        self, thread: RetainedThread, through: int, by_group: bool, limit: int
    ) -> int:
        position = "coalesce(group_start, sequence)" if by_group else "sequence"
        tenant = thread.key.tenant

        def chunk(conn: Conn) -> int:
            row = self._lock_thread(conn, thread)
            if row is None:
                return 0
            bound = through if by_group else min(through, row[0])
            gone = first(
                conn,
                "WITH gone AS (DELETE FROM messages WHERE tenant = %s AND context_id = %s "
                "AND sequence IN (SELECT sequence FROM messages WHERE tenant = %s "
                f"AND context_id = %s AND {position} <= %s ORDER BY sequence LIMIT %s) "
                "RETURNING token_estimate) "
                "SELECT count(*), coalesce(sum(token_estimate), 0) FROM gone",
                [tenant, thread.context_id, tenant, thread.context_id, bound, limit],
            )
            count, tokens = (int(gone[0]), int(gone[1])) if gone else (0, 0)
            if count:
                conn.execute(
                    "UPDATE threads SET message_count = message_count - %s, "
                    "token_estimate = token_estimate - %s WHERE tenant = %s AND context_id = %s",
                    [count, tokens, tenant, thread.context_id],
                )
            return count

        return self._write(chunk)
