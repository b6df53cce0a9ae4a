"""All of contextd's SQL, over one embedded DuckDB file.

Why this shape:
- Every write goes through one writer thread. DuckDB allows one writing process and
  serialises conflicting transactions anyway; a single writer lets appends that arrive
  together be *group-committed*: one transaction, one columnar (Arrow) insert, one WAL
  sync for many calls. Each caller is answered only after its transaction commits, so an
  acknowledged message survives kill -9 (DuckDB syncs its WAL on commit).
- Reads use a DuckDB cursor per calling thread (a DuckDB connection is not thread-safe)
  and see committed data only.
- Every table carries the tenant, so isolation by tenant never has to be retrofitted.
- Messages carry a `context_id`, a small integer per (tenant, agent, scope, thread), so
  that the window query is an index lookup on one integer plus a time range.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from queue import Empty, SimpleQueue
from typing import Any, TypeVar

import duckdb
import pyarrow as pa

from contextd.clock import MonotonicClock
from contextd.domain import (
    Agent,
    AgentDoc,
    AgentSettings,
    ContextKey,
    MessageReceipt,
    NewMessage,
    Role,
    StoredMessage,
    Thread,
)
from contextd.errors import AlreadyExists, NotFound, StoreLocked, Unavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

# Each migration moves the schema from version N-1 to N and runs in one transaction.
# Never edit a released migration; append a new one.
MIGRATIONS: list[tuple[int, list[str]]] = [
    (
        1,
        [
            """
            CREATE TABLE agents (
                tenant VARCHAR NOT NULL,
                name VARCHAR NOT NULL,
                system_prompt VARCHAR NOT NULL,
                docs_json VARCHAR NOT NULL,
                rolling_window_us BIGINT NOT NULL,
                create_time_us BIGINT NOT NULL,
                update_time_us BIGINT NOT NULL,
                last_clear_us BIGINT NOT NULL,
                settings_json VARCHAR NOT NULL DEFAULT '{}',
                PRIMARY KEY (tenant, name)
            )
            """,
            """
            CREATE TABLE threads (
                context_id BIGINT NOT NULL PRIMARY KEY,
                tenant VARCHAR NOT NULL,
                agent VARCHAR NOT NULL,
                scope VARCHAR NOT NULL,
                thread VARCHAR NOT NULL,
                create_time_us BIGINT NOT NULL,
                last_message_time_us BIGINT NOT NULL,
                message_count BIGINT NOT NULL,
                token_estimate BIGINT NOT NULL,
                last_clear_us BIGINT,
                UNIQUE (tenant, agent, scope, thread)
            )
            """,
            """
            CREATE TABLE messages (
                id BIGINT NOT NULL,
                context_id BIGINT NOT NULL,
                tenant VARCHAR NOT NULL,
                agent VARCHAR NOT NULL,
                scope VARCHAR NOT NULL,
                thread VARCHAR NOT NULL,
                role UTINYINT NOT NULL,
                content VARCHAR NOT NULL,
                tool_calls VARCHAR NOT NULL,
                tool_call_id VARCHAR NOT NULL,
                external_id VARCHAR NOT NULL,
                metadata VARCHAR NOT NULL,
                token_estimate INTEGER NOT NULL,
                create_time_us BIGINT NOT NULL
            )
            """,
            "CREATE INDEX messages_by_context ON messages (context_id)",
            "CREATE INDEX messages_by_agent ON messages (tenant, agent)",
        ],
    ),
]

MESSAGE_COLUMNS = (
    "id, tenant, agent, scope, thread, role, content, tool_calls, tool_call_id, "
    "external_id, metadata, token_estimate, create_time_us"
)

_ARROW_SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("context_id", pa.int64()),
        ("tenant", pa.string()),
        ("agent", pa.string()),
        ("scope", pa.string()),
        ("thread", pa.string()),
        ("role", pa.uint8()),
        ("content", pa.string()),
        ("tool_calls", pa.string()),
        ("tool_call_id", pa.string()),
        ("external_id", pa.string()),
        ("metadata", pa.string()),
        ("token_estimate", pa.int32()),
        ("create_time_us", pa.int64()),
    ]
)


@dataclass(frozen=True, slots=True)
class ThreadFilter:
    """Which messages of an agent in a scope a read covers."""

    tenant: str
    agent: str
    scope: str
    thread: str | None  # None: every thread of the agent in the scope


def _agent_from_row(row: Sequence[Any]) -> Agent:
    docs = tuple(AgentDoc(name=d["name"], content=d["content"]) for d in json.loads(row[3]))
    return Agent(
        tenant=row[0],
        name=row[1],
        system_prompt=row[2],
        docs=docs,
        rolling_window_us=row[4],
        create_time_us=row[5],
        update_time_us=row[6],
        last_clear_time_us=row[7],
    )


_AGENT_COLUMNS = (
    "tenant, name, system_prompt, docs_json, rolling_window_us, create_time_us, "
    "update_time_us, last_clear_us"
)
_THREAD_COLUMNS = (
    "tenant, agent, scope, thread, create_time_us, last_message_time_us, message_count, "
    "token_estimate, last_clear_us"
)


def _thread_from_row(row: Sequence[Any]) -> Thread:
    return Thread(*row)


def _message_from_row(row: Sequence[Any]) -> StoredMessage:
    return StoredMessage(
        id=row[0],
        tenant=row[1],
        agent=row[2],
        scope=row[3],
        thread=row[4],
        role=Role(row[5]),
        content=row[6],
        tool_calls=row[7],
        tool_call_id=row[8],
        external_id=row[9],
        metadata=row[10],
        token_estimate=row[11],
        create_time_us=row[12],
    )


def _docs_json(docs: Sequence[AgentDoc]) -> str:
    return json.dumps([{"name": d.name, "content": d.content} for d in docs])


@dataclass(slots=True)
class _AppendJob:
    key: ContextKey
    messages: Sequence[NewMessage]
    default_settings: AgentSettings
    future: Future[list[MessageReceipt]]


@dataclass(slots=True)
class _CallJob:
    fn: Callable[[duckdb.DuckDBPyConnection], Any]
    future: Future[Any]


_STOP = object()


class Store:
    """The DuckDB store. Open with `Store.open(path)`; close with `close()`."""

    def __init__(self, con: duckdb.DuckDBPyConnection, path: Path, max_group_rows: int) -> None:
        self._con = con
        self._path = path
        self._max_group_rows = max_group_rows
        self._local = threading.local()
        self._cursors: list[duckdb.DuckDBPyConnection] = []
        self._cursors_lock = threading.Lock()
        self._migrate()
        self.clock = MonotonicClock()
        self.clock.advance_to(self._newest_time_us())
        self._next_message_id, self._next_context_id = self._next_ids()
        self._context_ids: dict[ContextKey, int] = {}
        self._queue: SimpleQueue[Any] = SimpleQueue()
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="contextd-writer", daemon=True)
        self._writer.start()

    # ----------------------------------------------------------------- life cycle

    @classmethod
    def open(cls, path: Path, *, max_group_rows: int = 50_000) -> Store:
        """Open (creating if needed) the DuckDB file and migrate it to the current schema.

        Raises StoreLocked when another process holds the file, so the caller can say so
        in one line instead of a stack trace.
        """
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            con = duckdb.connect(str(path))
        except duckdb.IOException as exc:
            text = str(exc)
            if "lock" in text.lower():
                raise StoreLocked(
                    f"the database file {path} is in use by another process "
                    f"(one contextd server per file; set CONTEXTD_DATA_DIR to run another): "
                    f"{text.splitlines()[0]}"
                ) from exc
            raise
        return cls(con, path, max_group_rows)

    def close(self) -> None:
        """Stop the writer after the queued writes, checkpoint and close the file."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._writer.join()
        try:
            self._con.execute("CHECKPOINT")
        except duckdb.Error:
            log.exception("checkpoint at close failed; the WAL will be replayed at next start")
        with self._cursors_lock:
            for cur in self._cursors:
                cur.close()
            self._cursors.clear()
        self._con.close()

    @property
    def path(self) -> Path:
        return self._path

    def _migrate(self) -> None:
        con = self._con
        con.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations "
            "(version INTEGER PRIMARY KEY, applied_time_us BIGINT NOT NULL)"
        )
        row = _first(con.execute("SELECT coalesce(max(version), 0) FROM schema_migrations"))
        current = int(row[0]) if row else 0
        for version, statements in MIGRATIONS:
            if version <= current:
                continue
            con.execute("BEGIN TRANSACTION")
            try:
                for statement in statements:
                    con.execute(statement)
                con.execute(
                    "INSERT INTO schema_migrations VALUES (?, epoch_us(now()))", [version]
                )
                con.execute("COMMIT")
            except Exception:
                con.execute("ROLLBACK")
                raise
            log.info("migrated schema", extra={"schema_version": version})

    def schema_version(self) -> int:
        row = _first(self._cursor().execute("SELECT max(version) FROM schema_migrations"))
        return int(row[0]) if row and row[0] is not None else 0

    def _newest_time_us(self) -> int:
        row = _first(self._con.execute(
            "SELECT greatest("
            "  (SELECT coalesce(max(create_time_us), 0) FROM messages),"
            "  (SELECT coalesce(max(last_clear_us), 0) FROM agents),"
            "  (SELECT coalesce(max(update_time_us), 0) FROM agents),"
            "  (SELECT coalesce(max(last_clear_us), 0) FROM threads))"
        ))
        return int(row[0]) if row else 0

    def _next_ids(self) -> tuple[int, int]:
        row = _first(self._con.execute(
            "SELECT (SELECT coalesce(max(id), 0) FROM messages),"
            " (SELECT coalesce(max(context_id), 0) FROM threads)"
        ))
        assert row is not None
        return int(row[0]) + 1, int(row[1]) + 1

    def _cursor(self) -> duckdb.DuckDBPyConnection:
        """This thread's own DuckDB cursor, for reads."""
        cur: duckdb.DuckDBPyConnection | None = getattr(self._local, "cursor", None)
        if cur is None:
            if self._closed:
                raise Unavailable("the server is shutting down")
            cur = self._con.cursor()
            self._local.cursor = cur
            with self._cursors_lock:
                self._cursors.append(cur)
        return cur

    # ----------------------------------------------------------------- the writer

    def _submit(self, job: _AppendJob | _CallJob) -> Any:
        if self._closed:
            raise Unavailable("the server is shutting down")
        self._queue.put(job)
        return job.future.result()

    def _write(self, fn: Callable[[duckdb.DuckDBPyConnection], T]) -> T:
        """Run `fn` in its own transaction on the writer thread and return its result."""
        result: T = self._submit(_CallJob(fn=fn, future=Future()))
        return result

    def _write_loop(self) -> None:
        writer = self._con.cursor()
        try:
            while True:
                job = self._queue.get()
                if job is _STOP:
                    return
                appends: list[_AppendJob] = []
                calls: list[_CallJob] = []
                stop = self._gather(job, appends, calls)
                if appends:
                    self._commit_appends(writer, appends)
                for call in calls:
                    self._run_call(writer, call)
                if stop:
                    return
        finally:
            writer.close()

    def _gather(self, first: Any, appends: list[_AppendJob], calls: list[_CallJob]) -> bool:
        """Take `first` and whatever else is already queued, up to the group limit."""
        rows = 0
        job = first
        while True:
            if isinstance(job, _AppendJob):
                appends.append(job)
                rows += len(job.messages)
            elif isinstance(job, _CallJob):
                calls.append(job)
            else:
                return True  # _STOP: finish this group, then stop
            if rows >= self._max_group_rows:
                return False
            try:
                job = self._queue.get_nowait()
            except Empty:
                return False

    def _run_call(self, writer: duckdb.DuckDBPyConnection, call: _CallJob) -> None:
        try:
            writer.execute("BEGIN TRANSACTION")
            result = call.fn(writer)
            writer.execute("COMMIT")
        except BaseException as exc:
            self._rollback(writer)
            call.future.set_exception(exc)
        else:
            call.future.set_result(result)

    @staticmethod
    def _rollback(writer: duckdb.DuckDBPyConnection) -> None:
        try:
            writer.execute("ROLLBACK")
        except duckdb.Error:
            pass  # no transaction was open

    def _commit_appends(self, writer: duckdb.DuckDBPyConnection, jobs: list[_AppendJob]) -> None:
        """Commit a group of appends in one transaction; isolate a failing job on error."""
        saved = (self._next_message_id, self._next_context_id, dict(self._context_ids))
        try:
            writer.execute("BEGIN TRANSACTION")
            receipts = self._insert_appends(writer, jobs)
            writer.execute("COMMIT")
        except BaseException as exc:
            self._rollback(writer)
            self._next_message_id, self._next_context_id, self._context_ids = saved
            if len(jobs) == 1:
                jobs[0].future.set_exception(exc)
                return
            log.warning("group commit failed; retrying its %d calls one by one", len(jobs))
            for job in jobs:
                self._commit_appends(writer, [job])
            return
        for job, job_receipts in zip(jobs, receipts, strict=True):
            job.future.set_result(job_receipts)

    def _context_id(self, writer: duckdb.DuckDBPyConnection, key: ContextKey) -> int | None:
        cached = self._context_ids.get(key)
        if cached is not None:
            return cached
        row = _first(writer.execute(
            "SELECT context_id FROM threads WHERE tenant = ? AND agent = ? AND scope = ? "
            "AND thread = ?",
            [key.tenant, key.agent, key.scope, key.thread],
        ))
        if row is None:
            return None
        self._context_ids[key] = int(row[0])
        return int(row[0])

    def _insert_appends(
        self, writer: duckdb.DuckDBPyConnection, jobs: list[_AppendJob]
    ) -> list[list[MessageReceipt]]:
        columns: dict[str, list[Any]] = {name: [] for name in _ARROW_SCHEMA.names}
        all_receipts: list[list[MessageReceipt]] = []
        # per context: [count, tokens, min time, max time]
        thread_deltas: dict[ContextKey, list[int]] = {}
        new_contexts: dict[ContextKey, int] = {}
        agents_seen: dict[tuple[str, str], AgentSettings] = {}

        for job in jobs:
            agents_seen.setdefault((job.key.tenant, job.key.agent), job.default_settings)
        # Ticked before any message time: an auto-created agent's clear marker (its create
        # time) must precede the messages that created it, or they would start outside.
        now_us = self.clock.tick()
        for (tenant, name), settings in agents_seen.items():
            writer.execute(
                f"INSERT INTO agents ({_AGENT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT DO NOTHING",
                [
                    tenant,
                    name,
                    settings.system_prompt,
                    _docs_json(settings.docs),
                    settings.rolling_window_us,
                    now_us,
                    now_us,
                    now_us,
                ],
            )

        for job in jobs:
            key = job.key
            context_id = new_contexts.get(key) or self._context_id(writer, key)
            if context_id is None:
                context_id = self._next_context_id
                self._next_context_id += 1
                new_contexts[key] = context_id
            commit_time = self.clock.tick()
            receipts: list[MessageReceipt] = []
            delta = thread_deltas.setdefault(key, [0, 0, 2**63 - 1, 0])
            for message in job.messages:
                message_id = self._next_message_id
                self._next_message_id += 1
                created = message.create_time_us if message.create_time_us is not None else commit_time
                columns["id"].append(message_id)
                columns["context_id"].append(context_id)
                columns["tenant"].append(key.tenant)
                columns["agent"].append(key.agent)
                columns["scope"].append(key.scope)
                columns["thread"].append(key.thread)
                columns["role"].append(int(message.role))
                columns["content"].append(message.content)
                columns["tool_calls"].append(message.tool_calls)
                columns["tool_call_id"].append(message.tool_call_id)
                columns["external_id"].append(message.external_id)
                columns["metadata"].append(message.metadata)
                columns["token_estimate"].append(message.token_estimate)
                columns["create_time_us"].append(created)
                receipts.append(MessageReceipt(message_id, created, message.token_estimate))
                delta[0] += 1
                delta[1] += message.token_estimate
                delta[2] = min(delta[2], created)
                delta[3] = max(delta[3], created)
            all_receipts.append(receipts)

        batch = pa.table(columns, schema=_ARROW_SCHEMA)
        writer.register("contextd_append_batch", batch)
        try:
            writer.execute("INSERT INTO messages SELECT * FROM contextd_append_batch")
        finally:
            writer.unregister("contextd_append_batch")

        for key, (count, tokens, first, last) in thread_deltas.items():
            context_id = new_contexts.get(key)
            if context_id is not None:
                writer.execute(
                    "INSERT INTO threads VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, NULL)",
                    [context_id, key.tenant, key.agent, key.scope, key.thread,
                     first, last, count, tokens],
                )
            else:
                writer.execute(
                    "UPDATE threads SET message_count = message_count + ?, "
                    "token_estimate = token_estimate + ?, "
                    "create_time_us = least(create_time_us, ?), "
                    "last_message_time_us = greatest(last_message_time_us, ?) "
                    "WHERE context_id = ?",
                    [count, tokens, first, last, self._context_ids[key]],
                )
        self._context_ids.update(new_contexts)
        return all_receipts

    # ----------------------------------------------------------------- agents

    def create_agent(self, tenant: str, name: str, settings: AgentSettings) -> Agent:
        def create(cur: duckdb.DuckDBPyConnection) -> Agent:
            exists = _first(cur.execute(
                "SELECT 1 FROM agents WHERE tenant = ? AND name = ?", [tenant, name]
            ))
            if exists:
                raise AlreadyExists(f"agent {name!r} already exists", reason="AGENT_EXISTS")
            now_us = self.clock.tick()
            cur.execute(
                f"INSERT INTO agents ({_AGENT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [tenant, name, settings.system_prompt, _docs_json(settings.docs),
                 settings.rolling_window_us, now_us, now_us, now_us],
            )
            return _require_agent(cur, tenant, name)

        return self._write(create)

    def get_agent(self, tenant: str, name: str) -> Agent:
        return _require_agent(self._cursor(), tenant, name)

    def find_agent(self, tenant: str, name: str) -> Agent | None:
        return _find_agent(self._cursor(), tenant, name)

    def update_agent(
        self, tenant: str, name: str, settings: AgentSettings, fields: frozenset[str]
    ) -> Agent:
        def update(cur: duckdb.DuckDBPyConnection) -> Agent:
            _require_agent(cur, tenant, name)
            assignments: list[str] = []
            params: list[Any] = []
            if "system_prompt" in fields:
                assignments.append("system_prompt = ?")
                params.append(settings.system_prompt)
            if "docs" in fields:
                assignments.append("docs_json = ?")
                params.append(_docs_json(settings.docs))
            if "rolling_window" in fields:
                assignments.append("rolling_window_us = ?")
                params.append(settings.rolling_window_us)
            assignments.append("update_time_us = ?")
            params.append(self.clock.tick())
            cur.execute(
                f"UPDATE agents SET {', '.join(assignments)} WHERE tenant = ? AND name = ?",
                [*params, tenant, name],
            )
            return _require_agent(cur, tenant, name)

        return self._write(update)

    def list_agents(self, tenant: str, after_name: str | None, limit: int) -> list[Agent]:
        rows = self._cursor().execute(
            f"SELECT {_AGENT_COLUMNS} FROM agents WHERE tenant = ? AND name > ? "
            "ORDER BY name LIMIT ?",
            [tenant, after_name or "", limit],
        ).fetchall()
        return [_agent_from_row(r) for r in rows]

    def delete_agent(self, tenant: str, name: str) -> int:
        def delete(cur: duckdb.DuckDBPyConnection) -> int:
            _require_agent(cur, tenant, name)
            row = _first(cur.execute(
                "SELECT count(*) FROM messages WHERE tenant = ? AND agent = ?", [tenant, name]
            ))
            cur.execute("DELETE FROM messages WHERE tenant = ? AND agent = ?", [tenant, name])
            cur.execute("DELETE FROM threads WHERE tenant = ? AND agent = ?", [tenant, name])
            cur.execute("DELETE FROM agents WHERE tenant = ? AND name = ?", [tenant, name])
            return int(row[0]) if row else 0

        deleted = self._write(delete)
        self._write(lambda _cur: self._forget_contexts(tenant, name))
        return deleted

    def _forget_contexts(self, tenant: str, agent: str) -> None:
        """Drop cached context ids of a deleted agent (runs on the writer thread)."""
        for key in [k for k in self._context_ids if k.tenant == tenant and k.agent == agent]:
            del self._context_ids[key]

    # ----------------------------------------------------------------- messages

    def append(
        self, key: ContextKey, messages: Sequence[NewMessage], default_settings: AgentSettings
    ) -> list[MessageReceipt]:
        """Append durably; creates the agent with `default_settings` if it is missing."""
        receipts: list[MessageReceipt] = self._submit(
            _AppendJob(key=key, messages=messages, default_settings=default_settings,
                       future=Future())
        )
        return receipts

    def list_messages(
        self,
        where: ThreadFilter,
        window_start_us: int | None,
        after: tuple[int, int] | None,
        limit: int,
    ) -> list[StoredMessage]:
        """Messages oldest first by (create_time, id), strictly after `after`.

        With a window start, each thread is further limited by its own clear marker.
        """
        after_time, after_id = after if after is not None else (-(2**63), -(2**63))
        params: list[Any] = [where.tenant, where.agent, where.scope]
        thread_clause = ""
        if where.thread is not None:
            thread_clause = "AND t.thread = ?"
            params.append(where.thread)
        window_clause = ""
        if window_start_us is not None:
            window_clause = "AND m.create_time_us > greatest(?, coalesce(t.last_clear_us, ?))"
            params += [window_start_us, window_start_us]
        params += [after_time, after_time, after_id, limit]
        sql = f"""
            SELECT {", ".join("m." + c.strip() for c in MESSAGE_COLUMNS.split(","))}
            FROM threads t JOIN messages m ON m.context_id = t.context_id
            WHERE t.tenant = ? AND t.agent = ? AND t.scope = ? {thread_clause}
              {window_clause}
              AND (m.create_time_us > ? OR (m.create_time_us = ? AND m.id > ?))
            ORDER BY m.create_time_us, m.id
            LIMIT ?
        """
        rows = self._cursor().execute(sql, params).fetchall()
        return [_message_from_row(r) for r in rows]

    # ----------------------------------------------------------------- clears

    def clear_agent(self, tenant: str, agent: str) -> int:
        def clear(cur: duckdb.DuckDBPyConnection) -> int:
            _require_agent(cur, tenant, agent)
            now_us = self.clock.tick()
            cur.execute(
                "UPDATE agents SET last_clear_us = ? WHERE tenant = ? AND name = ?",
                [now_us, tenant, agent],
            )
            return now_us

        return self._write(clear)

    def clear_thread(self, key: ContextKey) -> int:
        def clear(cur: duckdb.DuckDBPyConnection) -> int:
            _require_agent(cur, key.tenant, key.agent)
            row = _first(cur.execute(
                "SELECT context_id FROM threads WHERE tenant = ? AND agent = ? AND scope = ? "
                "AND thread = ?",
                [key.tenant, key.agent, key.scope, key.thread],
            ))
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

        return self._write(clear)

    # ----------------------------------------------------------------- threads and stats

    def get_thread(self, key: ContextKey) -> Thread | None:
        row = _first(self._cursor().execute(
            f"SELECT {_THREAD_COLUMNS} FROM threads WHERE tenant = ? AND agent = ? "
            "AND scope = ? AND thread = ?",
            [key.tenant, key.agent, key.scope, key.thread],
        ))
        return _thread_from_row(row) if row else None

    def list_threads(
        self, tenant: str, agent: str, scope: str, after_thread: str | None, limit: int
    ) -> list[Thread]:
        rows = self._cursor().execute(
            f"SELECT {_THREAD_COLUMNS} FROM threads WHERE tenant = ? AND agent = ? "
            "AND scope = ? AND thread > ? ORDER BY thread LIMIT ?",
            [tenant, agent, scope, after_thread or "", limit],
        ).fetchall()
        return [_thread_from_row(r) for r in rows]

    def context_counts(self, where: ThreadFilter, window_start_us: int) -> tuple[int, ...]:
        """(window count, window tokens, total count, total tokens, oldest, newest, threads).

        Thread clears apply per thread, as in list_messages.
        """
        params: list[Any] = [window_start_us, window_start_us] * 2
        params += [where.tenant, where.agent, where.scope]
        thread_clause = ""
        if where.thread is not None:
            thread_clause = "AND t.thread = ?"
            params.append(where.thread)
        in_window = "m.create_time_us > greatest(?, coalesce(t.last_clear_us, ?))"
        row = _first(self._cursor().execute(
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
        ))
        assert row is not None
        return tuple(row)


def _first(result: duckdb.DuckDBPyConnection) -> Any:
    """The first row, reading the result to its end.

    DuckDB keeps a partly read result open on its connection and refuses other work on it
    (e.g. registering an Arrow batch) until the result is finished, so never fetchone().
    """
    rows = result.fetchall()
    return rows[0] if rows else None


def _find_agent(cur: duckdb.DuckDBPyConnection, tenant: str, name: str) -> Agent | None:
    row = _first(cur.execute(
        f"SELECT {_AGENT_COLUMNS} FROM agents WHERE tenant = ? AND name = ?", [tenant, name]
    ))
    return _agent_from_row(row) if row else None


def _require_agent(cur: duckdb.DuckDBPyConnection, tenant: str, name: str) -> Agent:
    agent = _find_agent(cur, tenant, name)
    if agent is None:
        raise NotFound(f"agent {name!r} does not exist", reason="AGENT_NOT_FOUND")
    return agent

