"""Threads on PostgreSQL: their rows (counters kept current by every append), activity,
counts and clears.

A clear marker must fall after every message already committed to what it clears, even
when this replica's clock is behind the one that stamped them: each clear locks the rows
it moves and stamps a time above their newest message.
"""

from __future__ import annotations

from typing import Any

from contextd.adapters.postgres.agents import require_agent
from contextd.adapters.postgres.base import Conn, PostgresBase, first
from contextd.adapters.postgres.message_sql import window_predicate
from contextd.adapters.rows import THREAD_COLUMNS, thread_from_row
from contextd.domain.context import ThreadActivity
from contextd.domain.errors import NotFound
from contextd.domain.idempotency import RequestRecord
from contextd.domain.model import ContextKey, Thread
from contextd.domain.window import MAX_SOURCE_LEAD_US, WindowSpec
from contextd.ports.store import ThreadFilter


def activity_query(
    tenant: str, agent: str, scope: str, window: WindowSpec, limit: int
) -> tuple[str, dict[str, Any]]:
    """`thread_activity`'s statement (thread, newest message time, messages in the
    window; most recently active first) and its named parameters."""
    clear = "greatest(%(clear)s::bigint, coalesce(t.last_clear_us, %(clear)s::bigint))"
    sql = f"""
        SELECT t.thread, t.last_message_time_us,
          CASE WHEN NOT %(retains)s AND t.create_time_us > {clear}
                AND least(t.create_time_us, coalesce(t.min_source_time_us, t.create_time_us))
                    > %(age)s
            THEN t.message_count
            ELSE (SELECT count(*) FROM messages m
                  WHERE m.tenant = t.tenant AND m.context_id = t.context_id
                    AND m.create_time_us > {clear}
                    AND coalesce(m.source_time_us, m.create_time_us) > %(age)s
                    AND (%(expire)s::bigint IS NULL
                         OR t.last_message_time_us > %(expire)s::bigint)
                    AND (%(cap)s::bigint = 0
                         OR coalesce(m.group_start, m.sequence)
                            > t.last_sequence - %(cap)s::bigint))
          END
        FROM threads t
        WHERE t.tenant = %(tenant)s AND t.agent = %(agent)s AND t.scope = %(scope)s
          AND t.last_message_time_us > {clear} AND t.last_message_time_us > %(oldest)s
        ORDER BY t.last_message_time_us DESC, t.thread
        LIMIT %(limit)s
    """
    params: dict[str, Any] = {
        "clear": window.clear_after_us,
        "age": window.age_after_us,
        "tenant": tenant,
        "agent": agent,
        "scope": scope,
        # A message's own time is at most MAX_SOURCE_LEAD_US after its commit.
        "oldest": window.age_after_us - MAX_SOURCE_LEAD_US,
        "limit": limit,
        # Retention (see window_predicate): no thread counts from its row then.
        "retains": window.retains,
        "expire": window.expire_after_us,
        "cap": window.max_messages,
    }
    return sql, params


class ThreadsMixin(PostgresBase):
    def get_thread(self, key: ContextKey) -> Thread | None:
        with self._reading() as conn:
            row = first(
                conn,
                f"SELECT {THREAD_COLUMNS} FROM threads WHERE tenant = %s AND agent = %s "
                "AND scope = %s AND thread = %s",
                [key.tenant, key.agent, key.scope, key.thread],
            )
        return thread_from_row(row) if row else None

    def list_threads(
        self, tenant: str, agent: str, scope: str, after_thread: str | None, limit: int
    ) -> list[Thread]:
        with self._reading() as conn:
            rows = conn.execute(
                f"SELECT {THREAD_COLUMNS} FROM threads WHERE tenant = %s AND agent = %s "
                "AND scope = %s AND thread > %s ORDER BY thread LIMIT %s",
                [tenant, agent, scope, after_thread or "", limit],
            ).fetchall()
        return [thread_from_row(r) for r in rows]

    def thread_activity(
        self, tenant: str, agent: str, scope: str, window: WindowSpec, limit: int
    ) -> list[ThreadActivity]:
        """As the embedded engine: a thread wholly inside its window counts from its row;
        the others count their messages with the window's own predicate."""
        sql, params = activity_query(tenant, agent, scope, window, limit)
        with self._reading() as conn:
            rows = conn.execute(sql, params).fetchall()
        return [ThreadActivity(r[0], r[1], int(r[2])) for r in rows if int(r[2]) > 0]

    def context_counts(self, where: ThreadFilter, window: WindowSpec) -> tuple[int, ...]:
        in_window, window_params = window_predicate(window)
        params: list[Any] = window_params * 2
        params += [where.tenant, where.agent, where.scope]
        thread_clause = ""
        if where.thread is not None:
            thread_clause = "AND t.thread = %s"
            params.append(where.thread)
        with self._reading() as conn:
            row = first(
                conn,
                f"""
                SELECT count(m.id) FILTER (WHERE {in_window}),
                       coalesce(sum(m.token_estimate) FILTER (WHERE {in_window}), 0),
                       count(m.id),
                       coalesce(sum(m.token_estimate), 0),
                       min(m.create_time_us),
                       max(m.create_time_us),
                       count(DISTINCT t.context_id)
                FROM threads t LEFT JOIN messages m
                  ON m.tenant = t.tenant AND m.context_id = t.context_id
                WHERE t.tenant = %s AND t.agent = %s AND t.scope = %s {thread_clause}
                """,
                params,
            )
        assert row is not None
        return tuple(int(v) if v is not None else None for v in row)  # type: ignore[misc]

    def _clear_time(self, conn: Conn, where: str, params: list[Any]) -> int:
        """Lock the threads `where` selects and return a time after their newest message
        and their own clear markers (and after every time this replica issued): with
        another replica's clock ahead, a marker must still never go back."""
        row = first(
            conn,
            "SELECT coalesce(max(greatest(last_message_time_us, last_clear_us)), 0) FROM "
            f"(SELECT last_message_time_us, last_clear_us FROM threads WHERE {where} "
            "FOR UPDATE) t",
            params,
        )
        self.clock.advance_to(int(row[0]) if row else 0)
        return self.clock.tick()

    def clear_agent(self, tenant: str, agent: str, record: RequestRecord | None = None) -> int:
        def clear(conn: Conn) -> int:
            current = require_agent(conn, tenant, agent, "FOR NO KEY UPDATE")
            self.clock.advance_to(current.last_clear_time_us)
            now = self._clear_time(conn, "tenant = %s AND agent = %s", [tenant, agent])
            conn.execute(
                "UPDATE agents SET last_clear_us = %s WHERE tenant = %s AND name = %s",
                [now, tenant, agent],
            )
            return now

        return self._write(clear, record)

    def clear_scope(
        self, tenant: str, agent: str, scope: str, record: RequestRecord | None = None
    ) -> int:
        def clear(conn: Conn) -> int:
            self.clock.advance_to(require_agent(conn, tenant, agent).last_clear_time_us)
            where = "tenant = %s AND agent = %s AND scope = %s"
            now = self._clear_time(conn, where, [tenant, agent, scope])
            conn.execute(
                f"UPDATE threads SET last_clear_us = %s WHERE {where}", [now, tenant, agent, scope]
            )
            return now

        return self._write(clear, record)

    def clear_thread(self, key: ContextKey, record: RequestRecord | None = None) -> int:
        def clear(conn: Conn) -> int:
            self.clock.advance_to(require_agent(conn, key.tenant, key.agent).last_clear_time_us)
            where = "tenant = %s AND agent = %s AND scope = %s AND thread = %s"
            params = [key.tenant, key.agent, key.scope, key.thread]
            exists = first(conn, f"SELECT 1 FROM threads WHERE {where}", params)
            if exists is None:
                raise NotFound(
                    f"agent {key.agent!r} has no thread {key.thread!r} in scope {key.scope!r}",
                    reason="THREAD_NOT_FOUND",
                )
            now = self._clear_time(conn, where, params)
            conn.execute(f"UPDATE threads SET last_clear_us = %s WHERE {where}", [now, *params])
            return now

        return self._write(clear, record)
