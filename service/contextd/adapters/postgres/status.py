"""Status entries and events on PostgreSQL."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from contextd.adapters.postgres.agents import require_agent
from contextd.adapters.postgres.base import Conn, PostgresBase, StatusArgs, first, thread_gone
from contextd.adapters.postgres.threads import activity_query
from contextd.adapters.rows import status_from_row, status_kind_code
from contextd.domain.context import StatusEntry, ThreadActivity
from contextd.domain.errors import NotFound
from contextd.domain.idempotency import RequestRecord
from contextd.domain.model import ContextKey, Event
from contextd.domain.validation import quote
from contextd.domain.window import WindowSpec
from contextd.ports.store import ThreadFilter

_LIST_STATUS = (
    "SELECT key, kind, state, summary, update_time_us, expire_time_us "
    "FROM status_entries WHERE tenant = %(tenant)s AND agent = %(agent)s "
    "AND scope = %(scope)s AND key > %(after)s AND (%(live_at)s::bigint IS NULL "
    "OR expire_time_us IS NULL OR expire_time_us > %(live_at)s) ORDER BY key LIMIT %(limit)s"
)


def status_query(args: StatusArgs) -> tuple[str, dict[str, Any]]:
    """`status_and_activity`'s statement and its parameters."""
    activity, params = activity_query(
        args.tenant, args.agent, args.scope, args.window, args.threads
    )
    params |= {"after": "", "live_at": args.live_at_us, "entries": args.entries}
    sql = (
        "SELECT * FROM (SELECT 0, row_number() OVER (ORDER BY key), key, kind, state, "
        "summary, update_time_us, expire_time_us FROM ("
        + _LIST_STATUS.replace("%(limit)s", "%(entries)s")
        + ") s) s UNION ALL SELECT * FROM (SELECT 1, row_number() OVER "
        "(ORDER BY a.last_message_time_us DESC, a.thread), a.thread, NULL::smallint, "
        "NULL, NULL, a.last_message_time_us, a.count FROM ("
        + activity
        + ") a(thread, last_message_time_us, count)) a ORDER BY 1, 2"
    )
    return sql, params


class StatusMixin(PostgresBase):
    def set_status(
        self,
        tenant: str,
        agent: str,
        scope: str,
        entry: StatusEntry,
        record: RequestRecord | None = None,
    ) -> StatusEntry:
        def upsert(conn: Conn) -> StatusEntry:
            require_agent(conn, tenant, agent, "FOR KEY SHARE")
            now = self.clock.tick()
            conn.execute(
                "INSERT INTO status_entries VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) "
                "ON CONFLICT (tenant, agent, scope, key) DO UPDATE SET kind = excluded.kind, "
                "state = excluded.state, summary = excluded.summary, "
                "update_time_us = excluded.update_time_us, "
                "expire_time_us = excluded.expire_time_us",
                [
                    tenant,
                    agent,
                    scope,
                    entry.key,
                    status_kind_code(entry.kind),
                    entry.state,
                    entry.summary,
                    now,
                    entry.expire_time_us,
                ],
            )
            return replace(entry, update_time_us=now)

        return self._write(upsert, record)

    def list_status(
        self,
        tenant: str,
        agent: str,
        scope: str,
        after_key: str | None,
        limit: int,
        live_at_us: int | None,
    ) -> list[StatusEntry]:
        params = {
            "tenant": tenant,
            "agent": agent,
            "scope": scope,
            "after": after_key or "",
            "live_at": live_at_us,
            "limit": limit,
        }
        with self._reading() as conn:
            rows = conn.execute(_LIST_STATUS, params).fetchall()
        return [status_from_row(r) for r in rows]

    def _status_statement(self, args: StatusArgs) -> tuple[str, dict[str, Any]]:
        return status_query(args)

    def _send_status(self, conn: Conn, args: StatusArgs) -> None:
        """Queue `status_and_activity`'s statement with these arguments in this
        snapshot's pipeline; that call takes its result when made with the same ones."""
        self._local.status = (args, conn.execute(*status_query(args)))

    def status_and_activity(
        self,
        tenant: str,
        agent: str,
        scope: str,
        live_at_us: int,
        entries: int,
        window: WindowSpec,
        threads: int,
    ) -> tuple[list[StatusEntry], list[ThreadActivity]]:
        """`list_status` (from the first key) and `thread_activity` in one statement,
        one round trip: what a build's status block reads. Inside a snapshot, taken
        from the statement `plan_build_reads` had sent with the thread's read when it
        was sent with these very arguments."""
        args = StatusArgs(tenant, agent, scope, live_at_us, entries, window, threads)
        sent: tuple[StatusArgs, Any] | None = getattr(self._local, "status", None)
        self._local.status = None
        if sent is not None and sent[0] == args and getattr(self._local, "ended", False):
            # The snapshot ended with the reads sent ahead (`_end_snapshot_early`), this
            # one among them; no bounds can be queued after it.
            rows = sent[1].fetchall()
            return _status_and_activity(rows)
        with self._reading() as conn:
            in_snapshot = getattr(self._local, "conn", None) is conn
            if sent is not None and sent[0] == args and in_snapshot:
                cursor = sent[1]
            else:
                cursor = conn.execute(*status_query(args))
            if in_snapshot:
                # In a snapshot (pipeline mode): the bounds the build reads next travel
                # with this statement.
                self._queue_bounds(conn, tenant, agent, scope, window)
            rows = cursor.fetchall()
        return _status_and_activity(rows)

    def clear_status(
        self,
        tenant: str,
        agent: str,
        scope: str,
        key: str | None,
        record: RequestRecord | None = None,
    ) -> int:
        def clear(conn: Conn) -> int:
            require_agent(conn, tenant, agent, "FOR KEY SHARE")
            where = "tenant = %s AND agent = %s AND scope = %s"
            params: list[Any] = [tenant, agent, scope]
            if key is not None:
                where += " AND key = %s"
                params.append(key)
            deleted = conn.execute(f"DELETE FROM status_entries WHERE {where}", params).rowcount
            if key is not None and deleted == 0:
                raise NotFound(
                    f"agent {agent!r} has no status entry {quote(key)} in scope {scope!r}",
                    reason="STATUS_NOT_FOUND",
                )
            return deleted

        return self._write(clear, record)

    def record_event(self, key: ContextKey, event_type: str, data: dict[str, Any]) -> Event:
        def insert(conn: Conn) -> Event:
            # The thread's row is locked FOR KEY SHARE: a delete of its agent waits for
            # this event, or this event finds the thread gone.
            exists = first(
                conn,
                "SELECT 1 FROM threads WHERE tenant = %s AND agent = %s AND scope = %s "
                "AND thread = %s FOR KEY SHARE",
                [key.tenant, key.agent, key.scope, key.thread],
            )
            if exists is None:
                raise thread_gone(key.agent, key.thread)
            now = self.clock.tick()
            text = json.dumps(data, separators=(",", ":"))
            row = first(
                conn,
                "INSERT INTO events (tenant, id, agent, scope, thread, type, create_time_us, "
                "data) VALUES (%s, nextval('event_ids'), %s, %s, %s, %s, %s, %s) RETURNING id",
                [key.tenant, key.agent, key.scope, key.thread, event_type, now, text],
            )
            return Event(int(row[0]), event_type, key.agent, key.scope, key.thread, now, text)

        return self._write(insert)

    def list_events(
        self,
        where: ThreadFilter,
        event_type: str,
        start_us: int | None,
        end_us: int | None,
        after_id: int,
        limit: int,
    ) -> list[Event]:
        with self._reading() as conn:
            rows = conn.execute(
                "SELECT id, type, agent, scope, thread, create_time_us, data FROM events "
                "WHERE tenant = %(tenant)s AND agent = %(agent)s AND scope = %(scope)s "
                "AND (%(thread)s::text IS NULL OR thread = %(thread)s) "
                "AND (%(type)s = '' OR type = %(type)s) "
                "AND (%(start)s::bigint IS NULL OR create_time_us >= %(start)s) "
                "AND (%(end)s::bigint IS NULL OR create_time_us < %(end)s) "
                "AND id > %(after)s ORDER BY id LIMIT %(limit)s",
                {
                    "tenant": where.tenant,
                    "agent": where.agent,
                    "scope": where.scope,
                    "thread": where.thread,
                    "type": event_type,
                    "start": start_us,
                    "end": end_us,
                    "after": after_id,
                    "limit": limit,
                },
            ).fetchall()
        return [Event(*r) for r in rows]


def _status_and_activity(rows: list[Any]) -> tuple[list[StatusEntry], list[ThreadActivity]]:
    """The rows of `status_query`'s statement as `status_and_activity` answers them."""
    status = [status_from_row(r[2:]) for r in rows if r[0] == 0]
    found = [ThreadActivity(r[2], r[6], int(r[7])) for r in rows if r[0] == 1]
    return status, [a for a in found if a.window_message_count > 0]
