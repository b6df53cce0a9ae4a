"""Agents on DuckDB: create, read, update, and the two-step delete (mark, then purge in
chunks)."""

from __future__ import annotations

from typing import Any

import duckdb

from contextd.adapters.duckdb.base import (
    _INSERT_AGENT,
    NOTHING,
    DuckDBBase,
    Touches,
    _find_agent,
    _first,
    _require_agent,
    log,
)
from contextd.adapters.rows import (
    AGENT_COLUMNS,
    agent_from_row,
    agent_row,
    docs_json,
    settings_json,
)
from contextd.domain.agents import check_etag, updated_json_settings
from contextd.domain.errors import (
    AlreadyExists,
    ContextdError,
)
from contextd.domain.idempotency import (
    RequestRecord,
)
from contextd.domain.model import (
    Agent,
    AgentSettings,
)


class AgentsMixin(DuckDBBase):
    def create_agent(
        self,
        tenant: str,
        name: str,
        settings: AgentSettings,
        record: RequestRecord | None = None,
    ) -> Agent:
        def create(cur: duckdb.DuckDBPyConnection) -> Agent:
            exists = _first(
                cur.execute("SELECT 1 FROM agents WHERE tenant = ? AND name = ?", [tenant, name])
            )
            if exists:
                raise AlreadyExists(f"agent {name!r} already exists", reason="AGENT_EXISTS")
            now_us = self.clock.tick()
            cur.execute(_INSERT_AGENT, agent_row(tenant, name, settings, now_us))
            return _require_agent(cur, tenant, name)

        return self._write(create, record, Touches(agent_settings=((tenant, name),)))

    def get_agent(self, tenant: str, name: str) -> Agent:
        return _require_agent(self._cursor(), tenant, name)

    def find_agent(self, tenant: str, name: str) -> Agent | None:
        return _find_agent(self._cursor(), tenant, name)

    def update_agent(
        self,
        tenant: str,
        name: str,
        settings: AgentSettings,
        fields: frozenset[str],
        etag: str = "",
        record: RequestRecord | None = None,
    ) -> Agent:
        """Update the named fields ("build_options.<option>" names one build option) in
        one transaction; with `etag`, only if it is still the agent's current etag."""

        def update(cur: duckdb.DuckDBPyConnection) -> Agent:
            current = _require_agent(cur, tenant, name)
            check_etag(current, etag)
            assignments: list[str] = []
            params: list[Any] = []
            if "system_prompt" in fields:
                assignments.append("system_prompt = ?")
                params.append(settings.system_prompt)
            if "docs" in fields:
                assignments.append("docs_json = ?")
                params.append(docs_json(settings.docs))
            if "rolling_window" in fields:
                assignments.append("rolling_window_us = ?")
                params.append(settings.rolling_window_us)
            if "model" in fields:
                assignments.append("model = ?")
                params.append(settings.model)
            kept_as_json = updated_json_settings(current, settings, fields)
            if kept_as_json is not None:
                assignments.append("settings_json = ?")
                params.append(settings_json(kept_as_json))
            assignments.append("update_time_us = ?")
            params.append(self.clock.tick())
            cur.execute(
                f"UPDATE agents SET {', '.join(assignments)} WHERE tenant = ? AND name = ?",
                [*params, tenant, name],
            )
            return _require_agent(cur, tenant, name)

        return self._write(update, record, Touches(agent_settings=((tenant, name),)))

    def list_agents(self, tenant: str, after_name: str | None, limit: int) -> list[Agent]:
        rows = (
            self._cursor()
            .execute(
                f"SELECT {AGENT_COLUMNS} FROM agents WHERE tenant = ? AND name > ? "
                "ORDER BY name LIMIT ?",
                [tenant, after_name or "", limit],
            )
            .fetchall()
        )
        return [agent_from_row(r) for r in rows]

    def delete_agent(
        self, tenant: str, name: str, etag: str = "", record: RequestRecord | None = None
    ) -> int:
        """Delete the agent and everything it holds; return how many messages it had.

        In two steps, so that a large agent does not hold up every other tenant's writes
        (removing 235,000 messages in one transaction blocked all appends for ~350 ms): one
        short transaction deletes the agent, its threads, status entries, events, snapshots
        and tool outputs (their files once it commits), and records its context ids in
        `deleted_contexts`. From that commit on the agent is gone: its messages are
        reachable only through those threads, and a new agent of the same name gets new
        context ids (ids are never reused while any message still carries them). Then the
        messages are removed a chunk at a time, each chunk its own writer job queued behind
        whatever arrived meanwhile. The call returns when they are all gone, or when the
        server begins to stop; what a stop or a crash leaves is removed at the next start.
        """

        documents: list[str] = []  # the agent's snapshot documents, removed after the commit
        outputs: list[str] = []  # its tool output files, removed after the commit

        def mark(cur: duckdb.DuckDBPyConnection) -> tuple[int, list[int]]:
            check_etag(_require_agent(cur, tenant, name), etag)
            # Through the agent's context ids: messages are indexed by context_id only,
            # which keeps appends cheap; deletes are rare.
            where = "tenant = ? AND agent = ?"
            contexts = [
                int(r[0])
                for r in cur.execute(
                    f"SELECT context_id FROM threads WHERE {where}", [tenant, name]
                ).fetchall()
            ]
            row = _first(
                cur.execute(
                    f"SELECT count(*) FROM messages WHERE context_id IN "
                    f"(SELECT context_id FROM threads WHERE {where})",
                    [tenant, name],
                )
            )
            cur.execute(
                f"INSERT INTO deleted_contexts SELECT context_id, tenant, agent, ? FROM threads "
                f"WHERE {where}",
                [self.clock.tick(), tenant, name],
            )
            cur.execute(f"DELETE FROM threads WHERE {where}", [tenant, name])
            cur.execute(f"DELETE FROM status_entries WHERE {where}", [tenant, name])
            # Event ids are numbered on from max(id) at start: keep the newest issued one,
            # or a restart would issue the ids of the events deleted here again.
            cur.execute(
                "INSERT OR REPLACE INTO store_state VALUES ('event_id_high_water', ?)",
                [self._next_event_id - 1],
            )
            cur.execute(f"DELETE FROM events WHERE {where}", [tenant, name])
            cur.execute("DELETE FROM agents WHERE tenant = ? AND name = ?", [tenant, name])
            documents[:] = self._drop_agent_snapshots(cur, tenant, name)
            outputs[:] = self._drop_agent_tool_outputs(cur, tenant, name)
            # In the same writer job: the next append must not reuse the deleted ids.
            self._forget_contexts(tenant, name)
            return (int(row[0]) if row else 0), contexts

        # A retry is answered with the count alone, as the first call was.
        marked = record.with_encoder(lambda r: record.encode(r[0])) if record else None
        count, contexts = self._write(mark, marked, Touches(agents=((tenant, name),)))
        self._remove_documents(documents)
        self._remove_tool_output_files(outputs)
        if contexts:
            try:
                self._purge(contexts)
            except (ContextdError, duckdb.Error) as exc:
                # The deletion itself committed: the call succeeds. The rest is removed at
                # the next start.
                if isinstance(exc, duckdb.Error):
                    self._failed(exc)
                log.warning(
                    "removing a deleted agent's messages stopped; the next start resumes it",
                    extra={"error": type(exc).__name__, "detail": str(exc)[:300]},
                )
        return count

    def _purge(self, contexts: list[int]) -> None:
        """Remove the messages of deleted contexts, `delete_chunk_rows` at a time in id
        order, then their `deleted_contexts` rows; stops early (leaving the rest for the
        next start) once `stop_background_work` is called. Nothing adds messages to these
        contexts any more, so walking up the ids visits each message once."""
        after = 0
        while not self._stop_purging.is_set():

            def chunk(cur: duckdb.DuckDBPyConnection, after: int = after) -> int | None:
                ids = "context_id IN (SELECT unnest(?::BIGINT[]))"
                row = _first(
                    cur.execute(
                        f"SELECT max(id) FROM (SELECT id FROM messages WHERE id > ? AND {ids} "
                        "ORDER BY id LIMIT ?)",
                        [after, contexts, self._delete_chunk_rows],
                    )
                )
                last = row[0] if row else None
                if last is None:
                    cur.execute(f"DELETE FROM deleted_contexts WHERE {ids}", [contexts])
                    return None
                # The id range lets DuckDB skip every row group outside it.
                cur.execute(
                    f"DELETE FROM messages WHERE id > ? AND id <= ? AND {ids}",
                    [after, last, contexts],
                )
                return int(last)

            # Deleted contexts: no key reaches them any more, nothing cached changes.
            last = self._write(chunk, touches=NOTHING)
            if last is None:
                return
            after = last

    def _resume_purge(self, contexts: list[int]) -> None:
        """Finish removals a stop or crash interrupted (runs on its own thread at start)."""
        try:
            self._purge(contexts)
        except (ContextdError, duckdb.Error) as exc:
            if isinstance(exc, duckdb.Error):
                self._failed(exc)
            log.warning(
                "removing deleted agents' messages stopped; the next start resumes it",
                extra={"error": type(exc).__name__, "detail": str(exc)[:300]},
            )
        else:
            if not self._stop_purging.is_set():
                log.info("removed the rest of deleted agents' messages")

    def _forget_contexts(self, tenant: str, agent: str) -> None:
        """Drop cached context ids of a deleted agent (runs on the writer thread)."""
        for key in [k for k in self._context_ids if k.tenant == tenant and k.agent == agent]:
            self._last_sequence.pop(self._context_ids.pop(key), None)
        self._known_agents.discard((tenant, agent))
