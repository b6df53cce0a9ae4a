"""Threads on DuckDB: clears, thread rows (with pending counters), activity, counts."""

from __future__ import annotations

from typing import Any

import duckdb

from contextd.adapters.duckdb.base import (
    _LIVE_THREADS,
    DuckDBBase,
    Touches,
    _context_row,
    _first,
    _require_agent,
    window_predicate,
)
from contextd.adapters.rows import (
    THREAD_COLUMNS,
    thread_from_row,
)
from contextd.domain.errors import (
    NotFound,
)
from contextd.domain.idempotency import (
    RequestRecord,
)
from contextd.domain.model import (
    ContextKey,
    Thread,
)
from contextd.domain.window import WindowSpec
from contextd.ports.store import ThreadFilter


class ThreadsMixin(DuckDBBase):
    def clear_agent(self, tenant: str, agent: str, record: RequestRecord | None = None) -> int:
        def clear(cur: duckdb.DuckDBPyConnection) -> int:
            _require_agent(cur, tenant, agent)
            now_us = self.clock.tick()
            cur.execute(
                "UPDATE agents SET last_clear_us = ? WHERE tenant = ? AND name = ?",
                [now_us, tenant, agent],
            )
            return now_us

        return self._write(clear, record, Touches(agent_settings=((tenant, agent),)))

    def clear_scope(
        self, tenant: str, agent: str, scope: str, record: RequestRecord | None = None
    ) -> int:
        """Move the clear marker of every thread of one scope to now.

        Threads of the scope that do not exist yet need no marker: every message they will
        ever hold commits after this call returns, so it belongs in their window anyway.
        """

        def clear(cur: duckdb.DuckDBPyConnection) -> int:
            _require_agent(cur, tenant, agent)
            now_us = self.clock.tick()
            cur.execute(
                "UPDATE threads SET last_clear_us = ? WHERE tenant = ? AND agent = ? AND scope = ?",
                [now_us, tenant, agent, scope],
            )
            return now_us

        return self._write(clear, record, Touches(scopes=((tenant, agent, scope),)))

    def clear_thread(self, key: ContextKey, record: RequestRecord | None = None) -> int:
        def clear(cur: duckdb.DuckDBPyConnection) -> int:
            _require_agent(cur, key.tenant, key.agent)
            row = _context_row(cur, key)
            if row is None:
                raise NotFound(
                    f"agent {key.agent!r} has no thread {key.thread!r} in scope {key.scope!r}",
                    reason="THREAD_NOT_FOUND",
                )
            now_us = self.clock.tick()
            cur.execute(
                "UPDATE threads SET last_clear_us = ? WHERE context_id = ?", [now_us, row[0]]
            )
            return now_us

        return self._write(clear, record, Touches(contexts=(key,)))

    def _thread_rows(self, sql: str, params: list[Any]) -> list[Any]:
        """The rows of `sql`, which selects from `live_threads`: the threads table with
        the counters the writer has not flushed yet added (see thread_counters.py).

        Read live, outside any snapshot: the pending counts are of now, so the table they
        are added to must be too (inside an older snapshot a flush would be missed)."""
        cur = self._cursor(live=True)
        while True:
            generation, pending = self._pending.snapshot()
            contextd_pending = pending  # noqa: F841 - scanned by the query below
            rows = cur.execute(_LIVE_THREADS + sql, params).fetchall()
            if self._pending.unchanged_since(generation):
                return rows

    def get_thread(self, key: ContextKey) -> Thread | None:
        rows = self._thread_rows(
            f"SELECT {THREAD_COLUMNS} FROM live_threads WHERE tenant = ? AND agent = ? "
            "AND scope = ? AND thread = ?",
            [key.tenant, key.agent, key.scope, key.thread],
        )
        return thread_from_row(rows[0]) if rows else None

    def list_threads(
        self, tenant: str, agent: str, scope: str, after_thread: str | None, limit: int
    ) -> list[Thread]:
        rows = self._thread_rows(
            f"SELECT {THREAD_COLUMNS} FROM live_threads WHERE tenant = ? AND agent = ? "
            "AND scope = ? AND thread > ? ORDER BY thread LIMIT ?",
            [tenant, agent, scope, after_thread or "", limit],
        )
        return [thread_from_row(r) for r in rows]

    def context_counts(self, where: ThreadFilter, window: WindowSpec) -> tuple[int, ...]:
        """(window count, window tokens, total count, total tokens, oldest, newest, threads).

        `window` is the agent's; thread clears apply per thread, as in list_messages.
        """
        in_window, window_params = window_predicate(window)
        params: list[Any] = window_params * 2
        params += [where.tenant, where.agent, where.scope]
        thread_clause = ""
        if where.thread is not None:
            thread_clause = "AND t.thread = ?"
            params.append(where.thread)
        row = _first(
            self._cursor().execute(
                f"""
            SELECT count(m.id) FILTER (WHERE {in_window}),
                   coalesce(sum(m.token_estimate) FILTER (WHERE {in_window}), 0),
                   count(m.id),
                   coalesce(sum(m.token_estimate), 0),
                   min(m.create_time_us),
                   max(m.create_time_us),
                   count(DISTINCT t.context_id)
            FROM threads t LEFT JOIN messages m ON m.context_id = t.context_id
            WHERE t.tenant = ? AND t.agent = ? AND t.scope = ? {thread_clause}
            """,
                params,
            )
        )
        assert row is not None
        return tuple(row)
