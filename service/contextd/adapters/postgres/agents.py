"""Agents on PostgreSQL: create, read, update (etag checked under the row's lock), delete."""

from __future__ import annotations

from typing import Any

from contextd.adapters.postgres.base import Conn, PostgresBase, agent_missing, first
from contextd.adapters.rows import (
    AGENT_COLUMNS,
    agent_from_row,
    agent_row,
    docs_json,
    settings_json,
)
from contextd.domain.agents import check_etag, updated_json_settings
from contextd.domain.errors import AlreadyExists
from contextd.domain.idempotency import RequestRecord
from contextd.domain.model import Agent, AgentSettings

INSERT_AGENT = f"INSERT INTO agents ({AGENT_COLUMNS}) VALUES ({', '.join(['%s'] * 10)})"
# The version of an agent's row: the transaction that wrote it and where. Any change of
# the row (an update, a delete and create again) writes a new version with another.
AGENT_VERSION = "xmin::text || ':' || ctid::text"
# ... of the agent of thread row `t` (one index lookup, in a thread's own read).
AGENT_VERSION_OF_THREAD = (
    "SELECT a.xmin::text || ':' || a.ctid::text FROM agents a "
    "WHERE a.tenant = t.tenant AND a.name = t.agent"
)
# Agents this replica read, by (tenant, name): (row version, agent). At most this many.
AGENT_CACHE_SIZE = 4_096


def find_agent(conn: Conn, tenant: str, name: str, lock: str = "") -> Agent | None:
    """The agent's row; `lock` ("FOR KEY SHARE", "FOR UPDATE") locks it for the
    transaction: appends take KEY SHARE, so a delete (FOR UPDATE) waits for them."""
    row = first(
        conn,
        f"SELECT {AGENT_COLUMNS} FROM agents WHERE tenant = %s AND name = %s {lock}",
        [tenant, name],
    )
    return agent_from_row(row) if row else None


def require_agent(conn: Conn, tenant: str, name: str, lock: str = "") -> Agent:
    agent = find_agent(conn, tenant, name, lock)
    if agent is None:
        raise agent_missing(name)
    return agent


class AgentsMixin(PostgresBase):
    def create_agent(
        self, tenant: str, name: str, settings: AgentSettings, record: RequestRecord | None = None
    ) -> Agent:
        def create(conn: Conn) -> Agent:
            row = agent_row(tenant, name, settings, self.clock.tick())
            inserted = conn.execute(
                INSERT_AGENT + " ON CONFLICT (tenant, name) DO NOTHING RETURNING name", row
            ).fetchone()
            if inserted is None:
                raise AlreadyExists(f"agent {name!r} already exists", reason="AGENT_EXISTS")
            return require_agent(conn, tenant, name)

        return self._write(create, record)

    def get_agent(self, tenant: str, name: str) -> Agent:
        """The agent. Inside a snapshot in which `context_ref` read the version of this
        agent's row, from this replica's cache when it holds that very version (an
        agent's prompt and docs may be MiBs, and a build saves the round trip); the
        cache is only a shortcut, validated by the version the snapshot read."""
        cache = self._agent_cache
        seen = getattr(self._local, "agent_version", None)
        if seen is not None and seen[:2] == (tenant, name):
            cached = cache.get((tenant, name))
            if cached is not None and cached[0] == seen[2]:
                return cached[1]
        with self._reading() as conn:
            row = first(
                conn,
                f"SELECT {AGENT_COLUMNS}, {AGENT_VERSION} FROM agents "
                "WHERE tenant = %s AND name = %s",
                [tenant, name],
            )
        if row is None:
            raise agent_missing(name)
        agent = agent_from_row(row[:-1])
        if len(cache) >= AGENT_CACHE_SIZE:
            cache.clear()
        cache[(tenant, name)] = (str(row[-1]), agent)
        return agent

    def find_agent(self, tenant: str, name: str) -> Agent | None:
        with self._reading() as conn:
            return find_agent(conn, tenant, name)

    def update_agent(
        self,
        tenant: str,
        name: str,
        settings: AgentSettings,
        fields: frozenset[str],
        etag: str = "",
        record: RequestRecord | None = None,
    ) -> Agent:
        def update(conn: Conn) -> Agent:
            current = require_agent(conn, tenant, name, "FOR NO KEY UPDATE")
            check_etag(current, etag)
            assignments: list[str] = []
            params: list[Any] = []
            if "system_prompt" in fields:
                assignments.append("system_prompt = %s")
                params.append(settings.system_prompt)
            if "docs" in fields:
                assignments.append("docs_json = %s")
                params.append(docs_json(settings.docs))
            if "rolling_window" in fields:
                assignments.append("rolling_window_us = %s")
                params.append(settings.rolling_window_us)
            if "model" in fields:
                assignments.append("model = %s")
                params.append(settings.model)
            kept_as_json = updated_json_settings(current, settings, fields)
            if kept_as_json is not None:
                assignments.append("settings_json = %s")
                params.append(settings_json(kept_as_json))
            # Update times of one agent strictly increase (its etag depends on them),
            # whichever replica's clock stamps them.
            self.clock.advance_to(current.update_time_us)
            assignments.append("update_time_us = %s")
            params.append(self.clock.tick())
            conn.execute(
                f"UPDATE agents SET {', '.join(assignments)} WHERE tenant = %s AND name = %s",
                [*params, tenant, name],
            )
            return require_agent(conn, tenant, name)

        return self._write(update, record)

    def list_agents(self, tenant: str, after_name: str | None, limit: int) -> list[Agent]:
        with self._reading() as conn:
            rows = conn.execute(
                f"SELECT {AGENT_COLUMNS} FROM agents WHERE tenant = %s AND name > %s "
                "ORDER BY name LIMIT %s",
                [tenant, after_name or "", limit],
            ).fetchall()
        return [agent_from_row(r) for r in rows]

    def delete_agent(
        self, tenant: str, name: str, etag: str = "", record: RequestRecord | None = None
    ) -> int:
        """One transaction: the agent's row is locked FOR UPDATE first, which waits for
        appends in flight (they hold it FOR KEY SHARE) and makes later ones find no agent;
        then everything it holds goes. Final: nothing lands under it afterwards."""

        def delete(conn: Conn) -> int:
            check_etag(require_agent(conn, tenant, name, "FOR UPDATE"), etag)
            contexts = "SELECT context_id FROM threads WHERE tenant = %s AND agent = %s"
            row = first(
                conn,
                f"SELECT count(*) FROM messages WHERE tenant = %s AND context_id IN ({contexts})",
                [tenant, tenant, name],
            )
            for table in ("messages", "tool_calls"):
                conn.execute(
                    f"DELETE FROM {table} WHERE tenant = %s AND context_id IN ({contexts})",
                    [tenant, tenant, name],
                )
            for table in ("threads", "status_entries", "events", "snapshots"):
                conn.execute(
                    f"DELETE FROM {table} WHERE tenant = %s AND agent = %s", [tenant, name]
                )
            # Its tool outputs, in every scope, and their chunks.
            conn.execute(
                "DELETE FROM tool_output_chunks WHERE tenant = %s AND output_id IN "
                "(SELECT id FROM tool_outputs WHERE tenant = %s AND agent = %s)",
                [tenant, tenant, name],
            )
            conn.execute(
                "DELETE FROM tool_outputs WHERE tenant = %s AND agent = %s", [tenant, name]
            )
            conn.execute("DELETE FROM agents WHERE tenant = %s AND name = %s", [tenant, name])
            return int(row[0]) if row else 0

        return self._write(delete, record)
