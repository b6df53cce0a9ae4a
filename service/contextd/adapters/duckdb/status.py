"""Status entries and events on DuckDB."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import duckdb

from contextd.adapters.duckdb.base import (
    NOTHING,
    DuckDBBase,
    Touches,
    _context_row,
    _first,
    _require_agent,
    _scope_key,
)
from contextd.adapters.rows import (
    status_from_row,
)
from contextd.domain.context import StatusEntry, StatusKind
from contextd.domain.errors import (
    NotFound,
)
from contextd.domain.idempotency import (
    RequestRecord,
)
from contextd.domain.model import (
    ContextKey,
    Event,
)
from contextd.domain.validation import quote
from contextd.ports.store import ThreadFilter


class StatusMixin(DuckDBBase):
    def set_status(
        self,
        tenant: str,
        agent: str,
        scope: str,
        entry: StatusEntry,
        record: RequestRecord | None = None,
    ) -> StatusEntry:
        def upsert(cur: duckdb.DuckDBPyConnection) -> StatusEntry:
            _require_agent(cur, tenant, agent)
            now_us = self.clock.tick()
            cur.execute(
                "INSERT OR REPLACE INTO status_entries VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    tenant,
                    agent,
                    scope,
                    entry.key,
                    1 if entry.kind == StatusKind.THREAD else 2,
                    entry.state,
                    entry.summary,
                    now_us,
                    entry.expire_time_us,
                ],
            )
            return replace(entry, update_time_us=now_us)

        return self._write(upsert, record, Touches(status=((tenant, agent, scope),)))

    def list_status(
        self,
        tenant: str,
        agent: str,
        scope: str,
        after_key: str | None,
        limit: int,
        live_at_us: int | None,
    ) -> list[StatusEntry]:
        """Entries by key; only those live at `live_at_us` unless it is None."""
        rows = (
            self._cursor()
            .execute(
                "SELECT key, kind, state, summary, update_time_us, expire_time_us "
                "FROM status_entries WHERE tenant = ? AND agent = ? AND scope = ? AND key > ? "
                "AND (? IS NULL OR expire_time_us IS NULL OR expire_time_us > ?) "
                "ORDER BY key LIMIT ?",
                [tenant, agent, scope, after_key or "", live_at_us, live_at_us, limit],
            )
            .fetchall()
        )
        return [status_from_row(r) for r in rows]

    def clear_status(
        self,
        tenant: str,
        agent: str,
        scope: str,
        key: str | None,
        record: RequestRecord | None = None,
    ) -> int:
        def clear(cur: duckdb.DuckDBPyConnection) -> int:
            _require_agent(cur, tenant, agent)
            where = "tenant = ? AND agent = ? AND scope = ?"
            params: list[Any] = [tenant, agent, scope]
            if key is not None:
                where += " AND key = ?"
                params.append(key)
            row = _first(cur.execute(f"SELECT count(*) FROM status_entries WHERE {where}", params))
            count = int(row[0]) if row else 0
            if key is not None and count == 0:
                raise NotFound(
                    f"agent {agent!r} has no status entry {quote(key)} in scope {scope!r}",
                    reason="STATUS_NOT_FOUND",
                )
            cur.execute(f"DELETE FROM status_entries WHERE {where}", params)
            return count

        return self._write(clear, record, Touches(status=((tenant, agent, scope),)))

    def record_event(self, key: ContextKey, event_type: str, data: dict[str, Any]) -> Event:
        def insert(cur: duckdb.DuckDBPyConnection) -> Event:
            if _context_row(cur, key) is None:
                raise NotFound(
                    f"thread {key.thread!r} of agent {key.agent!r} no longer exists",
                    reason="THREAD_NOT_FOUND",
                )
            event_id = self._next_event_id
            now_us = self.clock.tick()
            text = json.dumps(data, separators=(",", ":"))
            cur.execute(
                "INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    event_id,
                    key.tenant,
                    key.agent,
                    key.scope,
                    key.thread,
                    event_type,
                    now_us,
                    text,
                    _scope_key(key.tenant, key.agent, key.scope),
                ],
            )
            self._next_event_id += 1
            return Event(event_id, event_type, key.agent, key.scope, key.thread, now_us, text)

        return self._write(insert, touches=NOTHING)  # events are not cached

    def list_events(
        self,
        where: ThreadFilter,
        event_type: str,
        start_us: int | None,
        end_us: int | None,
        after_id: int,
        limit: int,
    ) -> list[Event]:
        """Events of one scope (and, when `where.thread` is set, one thread), by id."""
        rows = (
            self._cursor()
            .execute(
                "SELECT id, type, agent, scope, thread, create_time_us, data FROM events "
                "WHERE scope_key = ? AND tenant = ? AND agent = ? AND scope = ? "
                "AND (? IS NULL OR thread = ?) "
                "AND (? = '' OR type = ?) "
                "AND (? IS NULL OR create_time_us >= ?) AND (? IS NULL OR create_time_us < ?) "
                "AND id > ? ORDER BY id LIMIT ?",
                [
                    _scope_key(where.tenant, where.agent, where.scope),
                    where.tenant,
                    where.agent,
                    where.scope,
                    where.thread,
                    where.thread,
                    event_type,
                    event_type,
                    start_us,
                    start_us,
                    end_us,
                    end_us,
                    after_id,
                    limit,
                ],
            )
            .fetchall()
        )
        return [Event(*r) for r in rows]
