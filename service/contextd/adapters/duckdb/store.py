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

import contextlib
import functools
import inspect
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from queue import Empty, SimpleQueue
from typing import Any, Concatenate, ParamSpec, TypeVar

import duckdb
import numpy as np
import pyarrow as pa

from contextd.adapters.duckdb.keys import load_or_create_key
from contextd.adapters.duckdb.thread_counters import (
    FLUSH_INTERVAL_S,
    IDLE_FLUSH_S,
    NO_SOURCE_TIME,
    PendingCounters,
)
from contextd.adapters.rows import (
    AGENT_COLUMNS,
    MESSAGE_COLUMNS,
    THREAD_COLUMNS,
    agent_from_row,
    agent_row,
    docs_json,
    message_from_row,
    settings_json,
    status_from_row,
    thread_from_row,
)
from contextd.domain.agents import check_etag, updated_options
from contextd.domain.clock import MonotonicClock
from contextd.domain.context import StatusEntry, StatusKind, ThreadActivity
from contextd.domain.errors import (
    AlreadyExists,
    ContextdError,
    InvalidArgument,
    NotFound,
    StoreBusy,
    StoreExhausted,
    StoreLocked,
    StoreUnavailable,
    Unavailable,
)
from contextd.domain.idempotency import (
    CLEANUP_BACKLOG_EVERY_US,
    CLEANUP_CHUNK,
    CLEANUP_EVERY_US,
    RETENTION_US,
    AlreadyDone,
    Remembered,
    RequestRecord,
    record_key,
    replay,
)
from contextd.domain.model import (
    Agent,
    AgentSettings,
    ContextKey,
    Event,
    MessageBatch,
    MessageReceipt,
    NewMessage,
    Role,
    StoredMessage,
    Thread,
)
from contextd.domain.validation import quote
from contextd.domain.window import MAX_SOURCE_LEAD_US, WindowSpec
from contextd.ports.store import ContextRef, ThreadFilter

log = logging.getLogger(__name__)

T = TypeVar("T")
P = ParamSpec("P")

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
                model VARCHAR NOT NULL DEFAULT '',
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
                create_time_us BIGINT NOT NULL,
                -- Tokens under the agent's model tokenizer at insert (`tokenizer` names it,
                -- margin included); equal to token_estimate when the agent has no model.
                token_count INTEGER NOT NULL,
                tokenizer VARCHAR NOT NULL,
                -- Length of content in Unicode scalar values, so trimming needs no content.
                chars INTEGER NOT NULL,
                -- The id of the tool_use message a tool_use or tool_result belongs to
                -- (its own id for the tool_use), -1 otherwise: trimming keeps groups whole.
                group_id BIGINT NOT NULL,
                -- For messages that call tools: their call ids, comma-separated.
                tool_call_ids VARCHAR NOT NULL
            )
            """,
            "CREATE INDEX messages_by_context ON messages (context_id)",
        ],
    ),
    (
        2,
        [
            # Compaction summaries are messages that stand for a range of their thread.
            "ALTER TABLE messages ADD COLUMN is_summary BOOLEAN DEFAULT false",
            "ALTER TABLE messages ADD COLUMN first_summarized_id BIGINT DEFAULT 0",
            "ALTER TABLE messages ADD COLUMN last_summarized_id BIGINT DEFAULT 0",
            """
            CREATE TABLE status_entries (
                tenant VARCHAR NOT NULL,
                agent VARCHAR NOT NULL,
                scope VARCHAR NOT NULL,
                key VARCHAR NOT NULL,
                kind UTINYINT NOT NULL,
                state VARCHAR NOT NULL,
                summary VARCHAR NOT NULL,
                update_time_us BIGINT NOT NULL,
                expire_time_us BIGINT,
                PRIMARY KEY (tenant, agent, scope, key)
            )
            """,
            """
            CREATE TABLE events (
                id BIGINT NOT NULL,
                tenant VARCHAR NOT NULL,
                agent VARCHAR NOT NULL,
                scope VARCHAR NOT NULL,
                thread VARCHAR NOT NULL,
                type VARCHAR NOT NULL,
                create_time_us BIGINT NOT NULL,
                data VARCHAR NOT NULL
            )
            """,
        ],
    ),
    (
        3,
        [
            # The newest compaction summary of each thread, so a build finds it by id
            # instead of scanning the thread's messages; 0 when it has none.
            "ALTER TABLE threads ADD COLUMN latest_summary_id BIGINT NOT NULL DEFAULT 0",
            """
            UPDATE threads SET latest_summary_id = s.id
            FROM (SELECT context_id, max(id) AS id FROM messages WHERE is_summary
                  GROUP BY context_id) s
            WHERE threads.context_id = s.context_id
            """,
            # Thread counters are written lazily (see thread_counters.py); this records
            # the last message id the threads table has counted.
            "CREATE TABLE store_state (key VARCHAR PRIMARY KEY, value BIGINT NOT NULL)",
            "INSERT INTO store_state SELECT 'thread_counters_through_id', coalesce(max(id), 0) "
            "FROM messages",
        ],
    ),
    (
        4,
        [
            # The client's own time of a message, apart from the server's commit time
            # (create_time_us); NULL when the client gave none.
            "ALTER TABLE messages ADD COLUMN source_time_us BIGINT",
            # Append order within a thread: 1, 2, 3, ... Existing messages are numbered in
            # the order they were read in before, (create time, id).
            "ALTER TABLE messages ADD COLUMN sequence BIGINT DEFAULT 0",
            """
            UPDATE messages SET sequence = s.sequence
            FROM (SELECT id, row_number() OVER (PARTITION BY context_id
                                                ORDER BY create_time_us, id) AS sequence
                  FROM messages) s
            WHERE messages.id = s.id
            """,
            # The thread's newest sequence and its oldest source time are thread counters
            # (see thread_counters.py): like message_count they include only the messages
            # up to thread_counters_through_id; opening the store counts the rest.
            "ALTER TABLE threads ADD COLUMN last_sequence BIGINT DEFAULT 0",
            "ALTER TABLE threads ADD COLUMN min_source_time_us BIGINT",
            """
            UPDATE threads SET last_sequence = s.n
            FROM (SELECT context_id, count(*) AS n FROM messages
                  WHERE id <= (SELECT value FROM store_state
                               WHERE key = 'thread_counters_through_id')
                  GROUP BY context_id) s
            WHERE threads.context_id = s.context_id
            """,
            # Every message id ever issued is at or below this mark, so ids are never
            # reused, also after their messages were deleted (see _reserve_ids).
            "INSERT INTO store_state SELECT 'message_id_high_water', coalesce(max(id), 0) "
            "FROM messages",
        ],
    ),
    (
        5,
        [
            # Two appends can never take the same number in a thread, whoever numbered
            # them. (Its own version: DuckDB cannot index a table in the transaction
            # that updated it.)
            "CREATE UNIQUE INDEX messages_by_sequence ON messages (context_id, sequence)",
        ],
    ),
    (
        6,
        [
            # Writes made with a request id: a retry finds its first response here. Rows
            # are written in the transaction of the write they record.
            """
            CREATE TABLE request_log (
                tenant VARCHAR NOT NULL,
                request_id VARCHAR NOT NULL,
                method VARCHAR NOT NULL,
                fingerprint VARCHAR NOT NULL,
                payload BLOB NOT NULL,
                create_time_us BIGINT NOT NULL,
                PRIMARY KEY (tenant, request_id)
            )
            """,
        ],
    ),
    (
        7,
        [
            # The request records again, keyed by one column (see idempotency.record_key):
            # DuckDB finds a row through an index only by a single-column key, so a lookup
            # by (tenant, request_id) scanned the whole table, on the writer, per write.
            """
            CREATE TABLE request_records (
                id_key VARCHAR NOT NULL PRIMARY KEY,
                tenant VARCHAR NOT NULL,
                request_id VARCHAR NOT NULL,
                method VARCHAR NOT NULL,
                fingerprint VARCHAR NOT NULL,
                payload BLOB NOT NULL,
                create_time_us BIGINT NOT NULL
            )
            """,
            "INSERT INTO request_records SELECT request_id || chr(9) || tenant, tenant, "
            "request_id, method, fingerprint, payload, create_time_us FROM request_log",
            "DROP TABLE request_log",
        ],
    ),
    (
        8,
        [
            # ListEvents reads the events of one scope of one agent: a one-column key of
            # them, since DuckDB uses an index only for a single-column predicate.
            "ALTER TABLE events ADD COLUMN scope_key VARCHAR",
            "UPDATE events SET scope_key = tenant || chr(9) || agent || chr(9) || scope",
            "CREATE INDEX events_by_scope ON events (scope_key)",
        ],
    ),
    (
        9,
        [
            # The contexts of deleted agents whose messages are still being removed, a
            # chunk at a time (see Store.delete_agent); a start resumes what a stop left.
            """
            CREATE TABLE deleted_contexts (
                context_id BIGINT NOT NULL PRIMARY KEY,
                tenant VARCHAR NOT NULL,
                agent VARCHAR NOT NULL,
                delete_time_us BIGINT NOT NULL
            )
            """,
        ],
    ),
]

# Message ids are reserved this many at a time: the high-water mark in store_state is
# written in the transaction of the append that passes it, about once per this many
# messages, instead of in every commit. A restart skips the unused rest of a block.
ID_BLOCK = 10_000

# Adds per-context counts (`{counts}`: a table or subquery of context_id, n, tokens,
# first_us, last_us) to the threads' counters: the flush of pending counts and the recount
# after a crash.
_ADD_TO_THREAD_COUNTERS = (
    "UPDATE threads SET message_count = threads.message_count + d.n, "
    "token_estimate = threads.token_estimate + d.tokens, "
    "create_time_us = least(threads.create_time_us, d.first_us), "
    "last_message_time_us = greatest(threads.last_message_time_us, d.last_us), "
    "last_sequence = threads.last_sequence + d.n, "
    "min_source_time_us = least(threads.min_source_time_us, "
    f"nullif(d.min_source_us, {NO_SOURCE_TIME})) "
    "FROM {counts} d WHERE threads.context_id = d.context_id"
)

# Threads with the counters the writer has not flushed yet (`contextd_pending`, an Arrow
# table in the reader's frame) added: what every read of thread counters selects from.
_LIVE_THREADS = f"""
    WITH live_threads AS (
        SELECT t.context_id, t.tenant, t.agent, t.scope, t.thread,
               least(t.create_time_us, coalesce(p.first_us, t.create_time_us))
                   AS create_time_us,
               greatest(t.last_message_time_us, coalesce(p.last_us, t.last_message_time_us))
                   AS last_message_time_us,
               t.message_count + coalesce(p.n, 0) AS message_count,
               t.token_estimate + coalesce(p.tokens, 0) AS token_estimate,
               t.last_clear_us,
               t.last_sequence + coalesce(p.n, 0) AS last_sequence,
               least(t.min_source_time_us, nullif(p.min_source_us, {NO_SOURCE_TIME}))
                   AS min_source_time_us
        FROM threads t LEFT JOIN contextd_pending p ON p.context_id = t.context_id
    )
"""

# How many tool-call ids the writer remembers to tie results to their tool_use without a
# query; older ones are looked up in the table.
_REMEMBERED_CALLS = 100_000

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
        ("token_count", pa.int32()),
        ("tokenizer", pa.string()),
        ("chars", pa.int32()),
        ("group_id", pa.int64()),
        ("tool_call_ids", pa.string()),
        ("is_summary", pa.bool_()),
        ("first_summarized_id", pa.int64()),
        ("last_summarized_id", pa.int64()),
        ("source_time_us", pa.int64()),
        ("sequence", pa.int64()),
    ]
)
_ARROW_COLUMNS = ", ".join(_ARROW_SCHEMA.names)


def _in_sequence_order(table: pa.Table) -> pa.Table:
    """The rows of one thread sorted by sequence, without sorting when they already are
    (rows come back in insertion order, which is sequence order unless DuckDB reorders)."""
    if table.num_rows < 2:
        return table
    sequences = table.column("sequence").to_numpy()
    if bool(np.all(np.diff(sequences) > 0)):
        return table
    return table.take(pa.array(np.argsort(sequences, kind="stable"))).combine_chunks()


def window_predicate(
    window: WindowSpec, m: str = "m", t: str | None = "t"
) -> tuple[str, list[int]]:
    """The SQL of "message `m` is in the window" and its parameters: the one definition
    of the window (see window.py) that every read of a window uses.

    With a threads alias `t`, each thread's own clear marker applies where it is later
    than the window's; without one, `window` must already hold the thread's marker.
    """
    clear = f"greatest(?, coalesce({t}.last_clear_us, ?))" if t else "?"
    params = [window.clear_after_us] * (2 if t else 1)
    sql = f"({m}.create_time_us > {clear} AND coalesce({m}.source_time_us, {m}.create_time_us) > ?)"
    return sql, [*params, window.age_after_us]


_INSERT_AGENT = f"INSERT INTO agents ({AGENT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"


def _remembered(cur: duckdb.DuckDBPyConnection, tenant: str, request_id: str) -> Remembered | None:
    key = record_key(tenant, request_id)
    return _remembered_keys(cur, [key]).get(key)


def _remembered_keys(cur: duckdb.DuckDBPyConnection, keys: Sequence[str]) -> dict[str, Remembered]:
    """The records of these keys (see idempotency.record_key), in one query per few
    hundred: the writer checks a whole group of appends at once."""
    found: dict[str, Remembered] = {}
    for start in range(0, len(keys), 500):
        chunk = list(dict.fromkeys(keys[start : start + 500]))
        rows = cur.execute(
            "SELECT id_key, method, fingerprint, payload FROM request_records "
            f"WHERE id_key IN ({', '.join('?' * len(chunk))})",
            chunk,
        ).fetchall()
        for key, method, fingerprint, payload in rows:
            found[key] = Remembered(method, fingerprint, bytes(payload))
    return found


_INSERT_REQUESTS = (
    "INSERT INTO request_records (id_key, tenant, request_id, method, fingerprint, payload, "
    "create_time_us) SELECT id_key, tenant, request_id, method, fingerprint, payload, "
    "create_time_us FROM contextd_requests"
)


def _request_rows(requests: list[tuple[RequestRecord, bytes]], now_us: int) -> pa.Table:
    return pa.table(
        {
            "id_key": [r.key for r, _ in requests],
            "tenant": [r.tenant for r, _ in requests],
            "request_id": [r.request_id for r, _ in requests],
            "method": [r.method for r, _ in requests],
            "fingerprint": [r.fingerprint for r, _ in requests],
            "payload": pa.array([p for _, p in requests], pa.binary()),
            "create_time_us": [now_us] * len(requests),
        }
    )


def _save_records(
    cur: duckdb.DuckDBPyConnection, requests: list[tuple[RequestRecord, bytes]], now_us: int
) -> None:
    contextd_requests = _request_rows(requests, now_us)  # noqa: F841 - scanned below
    cur.execute(_INSERT_REQUESTS)


def _scope_key(tenant: str, agent: str, scope: str) -> str:
    """One column naming (tenant, agent, scope): names never hold a tab."""
    return f"{tenant}\t{agent}\t{scope}"


@dataclass(slots=True)
class _AppendJob:
    key: ContextKey
    batch: MessageBatch
    # The settings to create a missing agent with; None: a missing agent is NOT_FOUND.
    default_settings: AgentSettings | None
    future: Future[list[MessageReceipt]]
    record: RequestRecord | None = None


@dataclass(slots=True)
class _CallJob:
    fn: Callable[[duckdb.DuckDBPyConnection], Any]
    future: Future[Any]


_STOP = object()

# How long a caller is told to wait before retrying after a store failure that may pass
# (an I/O error, the writer busy); running out of memory is given a little longer.
RETRY_AFTER_S = 1.0
RETRY_AFTER_OOM_S = 2.0


def store_error(exc: duckdb.Error) -> ContextdError | None:
    """The domain error a DuckDB failure stands for, or None for one that is a bug.

    Messages name the kind of failure, never DuckDB's text (it holds server paths); the
    store logs that. DuckDB reports a write that fails when its commit is written as a
    TransactionException "Failed to commit: <the I/O error>", not as an IOException, and
    it rolls the transaction back. After a fatal or internal error DuckDB refuses every
    further statement until the database is reopened: only a restart helps, so that one
    has no retry delay (the server turns NOT_SERVING instead).
    """
    text = str(exc)
    if isinstance(exc, duckdb.FatalException | duckdb.InternalException):
        return StoreUnavailable(
            "the store failed and must be reopened; the server reports NOT_SERVING until "
            "it is restarted"
        )
    commit_failed = isinstance(exc, duckdb.TransactionException) and "Failed to commit" in text
    if isinstance(exc, duckdb.OutOfMemoryException) or (commit_failed and "Out of Memory" in text):
        return StoreExhausted(
            "the store ran out of memory for this call (its memory limit); retry later",
            retry_after_s=RETRY_AFTER_OOM_S,
        )
    if commit_failed:
        return StoreUnavailable(
            "the store could not write this change to disk (I/O error); nothing of it was "
            "saved; retry later",
            retry_after_s=RETRY_AFTER_S,
        )
    if isinstance(exc, duckdb.IOException):
        return StoreUnavailable(
            "the store could not read or write its files (I/O error); retry later",
            retry_after_s=RETRY_AFTER_S,
        )
    if isinstance(exc, duckdb.ConnectionException):  # the store was closed under the call
        return Unavailable(
            "the server is shutting down", reason="SHUTTING_DOWN", retry_after_s=RETRY_AFTER_S
        )
    return None


def _translating(method: Callable[Concatenate[Store, P], T]) -> Callable[Concatenate[Store, P], T]:
    @functools.wraps(method)
    def call(self: Store, /, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return method(self, *args, **kwargs)
        except duckdb.Error as exc:
            error = self._failed(exc)
            if error is None:
                raise
            raise error from exc

    return call


def _failures_translated(cls: type[T]) -> type[T]:
    """Wrap every public method of the store so that a DuckDB failure (disk, memory, a
    fatal error) reaches callers as the domain error it stands for (`store_error`), on
    reads and writes alike, and so that a method added later is covered too. DuckDB errors
    that are not failures of the store (a bug in our SQL) pass through unchanged."""
    for name, member in list(vars(cls).items()):
        if not name.startswith("_") and inspect.isfunction(member):
            setattr(cls, name, _translating(member))
    return cls


@_failures_translated
class Store:
    """The DuckDB store. Open with `Store.open(path)`; close with `close()`.

    Failure modes: every call that waits for the writer waits at most `write_timeout_s`
    (then StoreBusy); DuckDB failures become domain errors (`store_error`); `watch` tells
    the server when the store cannot serve (a fatal error, or the writer stuck on one job
    longer than the write timeout) and when it can again.
    """

    def __init__(
        self,
        con: duckdb.DuckDBPyConnection,
        max_group_rows: int,
        clock: MonotonicClock | None = None,
        *,
        write_timeout_s: float = 30.0,
        delete_chunk_rows: int = 5_000,
    ) -> None:
        self._con = con
        self._data_dir = Path(".")
        self._max_group_rows = max_group_rows
        self._write_timeout_s = write_timeout_s
        self._delete_chunk_rows = delete_chunk_rows
        # Health: a fatal DuckDB error (sticky) or a wedged writer makes the store unable
        # to serve; listeners hear every change, in order (they are called under the lock).
        self._health_lock = threading.Lock()
        self._listeners: list[Callable[[bool], None]] = []
        self._fatal: str | None = None
        self._wedged = False
        # When the writer began what it is doing now (monotonic), None while it waits.
        self._busy_since: float | None = None
        self._stop_purging = threading.Event()
        self._purger: threading.Thread | None = None
        self._flush_failed = False
        self._local = threading.local()
        self._cursors: list[duckdb.DuckDBPyConnection] = []
        self._cursors_lock = threading.Lock()
        self._migrate()
        self._recount_threads()
        self._pending = PendingCounters()
        # The server's one clock (see clock.py): the service and the builder read it too.
        self.clock = clock or MonotonicClock()
        self.clock.advance_to(self._newest_time_us())
        self._next_message_id, self._next_context_id = self._next_ids()
        self._id_high_water = self._next_message_id - 1
        # The last sequence of each thread the writer has numbered (context id -> it):
        # read from the thread's row (plus its pending count) on first use.
        self._last_sequence: dict[int, int] = {}
        row = _first(self._con.execute("SELECT coalesce(max(id), 0) FROM events"))
        self._next_event_id = int(row[0]) + 1
        self._next_request_cleanup_us = 0  # the writer removes old request records then
        self._context_ids: dict[ContextKey, int] = {}
        self._calls: OrderedDict[tuple[int, str], int] = OrderedDict()
        self._known_agents: set[tuple[str, str]] = set()
        self._queue: SimpleQueue[Any] = SimpleQueue()
        self._held: Any = None  # a job taken from the queue for the next group
        self._submit_lock = threading.Lock()
        self._closed = False
        leftover = [
            int(r[0])
            for r in self._con.execute(
                "SELECT context_id FROM deleted_contexts ORDER BY context_id"
            ).fetchall()
        ]
        self._writer = threading.Thread(
            target=self._write_loop, name="contextd-writer", daemon=True
        )
        self._writer.start()
        if leftover:
            # A stop (or a crash) came while deleted agents' messages were being removed:
            # they have been invisible since the deletion committed; remove the rest now.
            log.info(
                "resuming the removal of deleted agents' messages",
                extra={"contexts": len(leftover)},
            )
            self._purger = threading.Thread(
                target=self._resume_purge, args=(leftover,), name="contextd-purge", daemon=True
            )
            self._purger.start()

    # ----------------------------------------------------------------- life cycle

    @classmethod
    def open(
        cls,
        path: Path,
        *,
        max_group_rows: int = 50_000,
        clock: MonotonicClock | None = None,
        write_timeout_s: float = 30.0,
        memory_limit: str = "",
        delete_chunk_rows: int = 5_000,
    ) -> Store:
        """Open (creating if needed) the DuckDB file and migrate it to the current schema.

        Raises StoreLocked when another process holds the file, so the caller can say so
        in one line instead of a stack trace. `memory_limit` ("" for DuckDB's default) is
        DuckDB's; a call that needs more memory is answered StoreExhausted.
        """
        path.parent.mkdir(parents=True, exist_ok=True)
        config: dict[str, str | bool | int | float | list[str]] = {}
        if memory_limit:
            config["memory_limit"] = memory_limit
        try:
            con = duckdb.connect(str(path), config=config)
        except duckdb.IOException as exc:
            text = str(exc)
            if "lock" in text.lower():
                raise StoreLocked(
                    f"the database file {path} is in use by another process "
                    f"(one contextd server per file; set CONTEXTD_DATA_DIR to run another): "
                    f"{text.splitlines()[0]}"
                ) from exc
            raise
        store = cls(
            con,
            max_group_rows,
            clock,
            write_timeout_s=write_timeout_s,
            delete_chunk_rows=delete_chunk_rows,
        )
        store._data_dir = path.parent
        return store

    def page_token_key(self) -> bytes:
        """The key that signs page tokens: a file beside the database, so tokens outlive
        a restart (created on first use)."""
        return load_or_create_key(self._data_dir)

    def stop_background_work(self) -> None:
        """Stop removing deleted agents' messages after the chunk in progress: a shutdown
        must not wait for a long removal (DeleteAgent calls in flight then return at once;
        what is left is invisible and is removed at the next start)."""
        self._stop_purging.set()

    def close(self) -> None:
        """Stop the writer after the queued writes, checkpoint and close the file.

        Bounded like every wait on the writer: if it is stuck in a job for longer than the
        write timeout, the file is left as it is (closing DuckDB under a running statement
        could crash the process); every acknowledged write is in the WAL, which the next
        start replays.
        """
        self.stop_background_work()
        with self._submit_lock:  # no write can be queued behind the stop marker
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        self._writer.join(self._write_timeout_s)
        if self._writer.is_alive():
            log.error(
                "the store's writer did not stop within the write timeout; leaving the "
                "database without a checkpoint (the next start replays its WAL)"
            )
            return
        if self._purger is not None:
            self._purger.join(self._write_timeout_s)
        if self._fatal is None:
            try:
                self._con.execute("CHECKPOINT")
            except duckdb.Error:
                log.exception("checkpoint at close failed; the WAL will be replayed at next start")
        with self._cursors_lock:
            for cur in self._cursors:
                cur.close()
            self._cursors.clear()
        self._con.close()

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
                con.execute("INSERT INTO schema_migrations VALUES (?, epoch_us(now()))", [version])
                con.execute("COMMIT")
            except Exception:
                con.execute("ROLLBACK")
                raise
            log.info("migrated schema", extra={"schema_version": version})

    def schema_version(self) -> int:
        row = _first(self._cursor().execute("SELECT max(version) FROM schema_migrations"))
        return int(row[0]) if row and row[0] is not None else 0

    def _newest_time_us(self) -> int:
        """The newest time the server ever stamped: the clock starts above it."""
        row = _first(
            self._con.execute(
                "SELECT greatest("
                "  (SELECT coalesce(max(create_time_us), 0) FROM messages),"
                "  (SELECT coalesce(max(last_clear_us), 0) FROM agents),"
                "  (SELECT coalesce(max(update_time_us), 0) FROM agents),"
                "  (SELECT coalesce(max(last_clear_us), 0) FROM threads),"
                "  (SELECT coalesce(max(update_time_us), 0) FROM status_entries),"
                "  (SELECT coalesce(max(create_time_us), 0) FROM events))"
            )
        )
        return int(row[0]) if row else 0

    def _next_ids(self) -> tuple[int, int]:
        """The next message id (above every id ever issued: the high-water mark survives
        the deletion of the messages that held them) and the next context id (context ids
        of deleted agents count too: their messages may still be there)."""
        row = _first(
            self._con.execute(
                "SELECT greatest((SELECT coalesce(max(id), 0) FROM messages),"
                "  (SELECT value FROM store_state WHERE key = 'message_id_high_water')),"
                " greatest((SELECT coalesce(max(context_id), 0) FROM threads),"
                "  (SELECT coalesce(max(context_id), 0) FROM deleted_contexts))"
            )
        )
        assert row is not None
        return int(row[0]) + 1, int(row[1]) + 1

    def _cursor(self, live: bool = False) -> duckdb.DuckDBPyConnection:
        """This thread's own DuckDB cursor, for reads: inside `snapshot`, the one in its
        transaction. `live` gives a second cursor that never is (thread counters are
        read live, see `_thread_rows`)."""
        name = "live_cursor" if live else "cursor"
        cur: duckdb.DuckDBPyConnection | None = getattr(self._local, name, None)
        if cur is None:
            if self._closed:
                raise Unavailable(
                    "the server is shutting down",
                    reason="SHUTTING_DOWN",
                    retry_after_s=RETRY_AFTER_S,
                )
            cur = self._con.cursor()
            setattr(self._local, name, cur)
            with self._cursors_lock:
                self._cursors.append(cur)
        return cur

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[None]:
        """Reads of this thread inside the block see one consistent state of the store
        (one DuckDB transaction on its cursor): a build never mixes a summary committed
        after its window was read with that window. Nested blocks join the outer one."""
        if getattr(self._local, "in_snapshot", False):
            yield
            return
        cur = self._cursor()
        cur.execute("BEGIN TRANSACTION")
        self._local.in_snapshot = True
        try:
            yield
        except BaseException:
            with contextlib.suppress(duckdb.Error):
                cur.execute("ROLLBACK")
            raise
        else:
            cur.execute("COMMIT")
        finally:
            self._local.in_snapshot = False

    # ----------------------------------------------------------------- health

    def watch(self, listener: Callable[[bool], None]) -> None:
        """Call `listener(serving)` whenever the store turns unable to serve (a fatal
        DuckDB error, for good; the writer stuck on one job for longer than the write
        timeout) or able again (the stuck writer finished its job). Listeners are called
        in order, under a lock: they must be quick and must not call the store."""
        with self._health_lock:
            self._listeners.append(listener)
            if not self._serving():
                listener(False)

    def serving(self) -> bool:
        """Whether the store can serve: no fatal error and no writer stuck on a job."""
        with self._health_lock:
            return self._serving()

    def _serving(self) -> bool:
        return self._fatal is None and not self._wedged

    def _update_health(self, *, wedged: bool | None = None, fatal: str | None = None) -> None:
        """Record a change (the caller holds `_health_lock`); tell listeners if serving
        changed."""
        before = self._serving()
        if wedged is not None:
            self._wedged = wedged
        if fatal is not None and self._fatal is None:
            self._fatal = fatal
        after = self._serving()
        if after != before:
            for listener in self._listeners:
                listener(after)

    def _failed(self, exc: duckdb.Error) -> ContextdError | None:
        """The domain error for a DuckDB failure (None: not a store failure, a bug); logs
        it with DuckDB's own text, and a fatal one makes the store stop serving."""
        error = store_error(exc)
        if error is None or isinstance(exc, duckdb.ConnectionException):
            return error
        detail = {"error": type(exc).__name__, "detail": str(exc)[:1000]}
        if isinstance(exc, duckdb.FatalException | duckdb.InternalException):
            with self._health_lock:
                if self._fatal is None:
                    log.error(
                        "the store failed fatally; every call is answered UNAVAILABLE until "
                        "the server is restarted",
                        extra=detail,
                    )
                self._update_health(fatal=detail["detail"])
        else:
            log.error("store failure", extra=detail)
        return error

    def _writer_waiting(self) -> None:
        """The writer finished what it was doing: a stuck writer, if one was reported,
        is taking work again."""
        with self._health_lock:
            self._busy_since = None
            if self._wedged:
                log.warning("the store's writer is taking calls again")
                self._update_health(wedged=False)

    def _wait_timed_out(self, submitted: float) -> None:
        """A caller waited the whole write timeout. If the writer has been on the same
        job since before the call was queued, it is stuck, not merely busy: report it."""
        with self._health_lock:
            since = self._busy_since
            if since is not None and since <= submitted and not self._wedged:
                log.error(
                    "the store's writer has been on one job for longer than the write "
                    "timeout; calls that wait for it are answered STORE_BUSY",
                    extra={"write_timeout_s": self._write_timeout_s},
                )
                self._update_health(wedged=True)

    # ----------------------------------------------------------------- the writer

    def _submit(self, job: _AppendJob | _CallJob) -> Any:
        """Queue `job` for the writer and wait for its result, at most the write timeout.

        A caller must never hang on a stuck writer. When the wait times out, a job the
        writer has not taken yet is withdrawn (it is never written); one it has taken may
        still commit after its caller was answered STORE_BUSY. That is acceptable only
        because client-chosen request ids make the retry safe: an append retried with its
        request id after its first attempt committed is not written twice.
        """
        with self._submit_lock:
            if self._closed:
                raise Unavailable(
                    "the server is shutting down",
                    reason="SHUTTING_DOWN",
                    retry_after_s=RETRY_AFTER_S,
                )
            submitted = time.monotonic()
            self._queue.put(job)
        try:
            return job.future.result(timeout=self._write_timeout_s)
        except TimeoutError:
            if job.future.done():
                raise  # the job's own error, not the wait's
        withdrawn = job.future.cancel()
        if not withdrawn and job.future.done():
            return job.future.result()  # it finished as the wait ended
        self._wait_timed_out(submitted)
        timeout = f"{self._write_timeout_s:g}"
        if withdrawn:
            raise StoreBusy(
                f"the store did not take this write within {timeout}s; it was not written; "
                "retry later",
                retry_after_s=RETRY_AFTER_S,
            )
        raise StoreBusy(
            f"the store did not finish this write within {timeout}s; it may still be "
            "written: retry with the same request id",
            retry_after_s=RETRY_AFTER_S,
        )

    def _write(
        self, fn: Callable[[duckdb.DuckDBPyConnection], T], record: RequestRecord | None = None
    ) -> T:
        """Run `fn` in its own transaction on the writer thread and return its result.

        With a record, the transaction first looks the request id up (AlreadyDone with
        the first payload, or REQUEST_ID_REUSED) and, after `fn`, records its result.
        """
        if record is None:
            result: T = self._submit(_CallJob(fn=fn, future=Future()))
            return result

        def recorded(cur: duckdb.DuckDBPyConnection) -> T:
            found = _remembered(cur, record.tenant, record.request_id)
            if found is not None:
                raise AlreadyDone(replay(record, found))
            value = fn(cur)
            _save_records(cur, [(record, record.encode(value))], self.clock.tick())
            return value

        recorded_result: T = self._submit(_CallJob(fn=recorded, future=Future()))
        return recorded_result

    def remembered(self, tenant: str, request_id: str) -> Remembered | None:
        """The recorded request of this id, if any (a read: the fast path of retries)."""
        return _remembered(self._cursor(), tenant, request_id)

    def _forget_old_requests(self, writer: duckdb.DuckDBPyConnection) -> None:
        """Remove request records past their retention, at most CLEANUP_CHUNK per pass
        (a few milliseconds), once a minute by the store's clock; a pass that found a
        full chunk brings the next one to a second later, so a backlog drains without
        any pass holding the writer for long."""
        now = self.clock.now_us()
        if now < self._next_request_cleanup_us:
            return
        self._next_request_cleanup_us = now + CLEANUP_EVERY_US
        try:
            row = _first(
                writer.execute(
                    "DELETE FROM request_records WHERE rowid IN (SELECT rowid FROM "
                    "request_records WHERE create_time_us < ? LIMIT ?)",
                    [now - RETENTION_US, CLEANUP_CHUNK],
                )
            )
        except duckdb.Error:
            self._rollback(writer)
            log.exception("removing old request records failed; the next pass retries")
            return
        if row and int(row[0]) >= CLEANUP_CHUNK:
            self._next_request_cleanup_us = now + CLEANUP_BACKLOG_EVERY_US

    def _write_loop(self) -> None:
        writer = self._con.cursor()
        try:
            while True:
                job, self._held = self._held, None
                if job is None:
                    try:
                        # With counters pending, wait only so long for work: a writer that
                        # stays idle that long writes them while no caller is waiting.
                        # After a failed flush (a full disk, say) retry less eagerly.
                        wait = FLUSH_INTERVAL_S if self._flush_failed else IDLE_FLUSH_S
                        flush = len(self._pending) and self._fatal is None
                        job = self._queue.get(timeout=wait if flush else None)
                    except Empty:
                        self._busy_since = time.monotonic()
                        self._flush_counters(writer)
                        self._forget_old_requests(writer)
                        self._writer_waiting()
                        continue
                self._busy_since = time.monotonic()
                if job is _STOP:
                    self._flush_counters(writer)
                    return
                # Before the group, so a write answered after the clock passed a due
                # pass was preceded by it (also on a writer that is never idle).
                self._forget_old_requests(writer)
                appends: list[_AppendJob] = []
                calls: list[_CallJob] = []
                stop = self._gather(job, appends, calls)
                try:
                    if appends:
                        self._commit_appends(writer, appends)
                    for call in calls:
                        self._run_call(writer, call)
                except BaseException as exc:
                    # The writer must outlive any failure, or every later caller would
                    # wait forever: fail what is unanswered and go on.
                    log.exception("writer failed a group; its unanswered calls get the error")
                    futures: list[Future[Any]] = [j.future for j in appends]
                    futures += [c.future for c in calls]
                    for future in futures:
                        if not future.done():
                            future.set_exception(exc)
                    self._rollback(writer)
                if stop:
                    self._flush_counters(writer)
                    return
                if self._pending.flush_due():
                    self._flush_counters(writer)
                self._writer_waiting()
        finally:
            writer.close()

    def _flush_counters(self, writer: duckdb.DuckDBPyConnection) -> None:
        """Write the pending thread counters and the id they count through, in one
        transaction; on failure they stay pending and the next flush retries."""
        if self._fatal is not None:
            return  # DuckDB refuses every statement now; the next start recounts
        through_id = self._next_message_id - 1  # every id below it is committed
        try:
            with self._pending.flushing() as contextd_flush:  # noqa: F841 - scanned by the script
                writer.execute(
                    "BEGIN TRANSACTION;\n"
                    + _ADD_TO_THREAD_COUNTERS.format(counts="contextd_flush")
                    + f";\nUPDATE store_state SET value = {int(through_id)} "
                    "WHERE key = 'thread_counters_through_id';\n"
                    "COMMIT"
                )
            self._flush_failed = False
        except Exception as exc:  # the writer must survive: every later write depends on it
            self._rollback(writer)
            self._flush_failed = True
            if isinstance(exc, duckdb.Error) and self._failed(exc) is not None:
                # Logged (and, if fatal, reported to the server) by _failed.
                log.warning("writing thread counters failed; they stay pending")
            else:
                log.exception("writing thread counters failed; they stay pending")

    def _recount_threads(self) -> None:
        """Add the messages after the counted id to their threads' counters: the counts
        that were pending when the process last stopped without flushing them."""
        uncounted = """(
            SELECT context_id, count(*) AS n, sum(token_estimate) AS tokens,
                   min(create_time_us) AS first_us, max(create_time_us) AS last_us,
                   min(source_time_us) AS min_source_us
            FROM messages
            WHERE id > (SELECT value FROM store_state WHERE key = 'thread_counters_through_id')
            GROUP BY context_id)"""
        self._con.execute(
            "BEGIN TRANSACTION;\n"
            + _ADD_TO_THREAD_COUNTERS.format(counts=uncounted)
            + ";\nUPDATE store_state SET value = (SELECT coalesce(max(id), 0) FROM messages) "
            "WHERE key = 'thread_counters_through_id';\n"
            "COMMIT"
        )

    def _gather(self, first: Any, appends: list[_AppendJob], calls: list[_CallJob]) -> bool:
        """Take `first` and whatever of the same kind is queued right behind it, up to the
        group limit: a run of appends (committed together) or a run of calls.

        A job of the other kind ends the group and is held for the next one, so writes
        commit in the order they arrived: an append queued after a DeleteAgent must not be
        committed before the delete (it would be acknowledged, then deleted).
        """
        rows = 0
        job = first
        while True:
            if job is _STOP:
                return True  # finish this group, then stop
            # A job whose caller gave up waiting (and withdrew it) is dropped unwritten.
            if isinstance(job, _AppendJob) and not calls:
                if job.future.set_running_or_notify_cancel():
                    appends.append(job)
                    rows += len(job.batch)
            elif isinstance(job, _CallJob) and not appends:
                if job.future.set_running_or_notify_cancel():
                    calls.append(job)
            else:
                self._held = job
                return False
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
        with contextlib.suppress(duckdb.Error):  # no transaction was open
            writer.execute("ROLLBACK")

    def _without_replays(
        self, writer: duckdb.DuckDBPyConnection, jobs: list[_AppendJob]
    ) -> tuple[list[_AppendJob], list[tuple[_AppendJob, _AppendJob]]]:
        """The jobs to write: those whose request id was recorded before are answered
        here (their first payload, or REQUEST_ID_REUSED); a job repeating the id of an
        earlier job of this group waits for that one (returned as (job, first) pairs)."""
        recorded = [j for j in jobs if j.record is not None]
        if not recorded:
            return jobs, []
        keep: list[_AppendJob] = []
        repeats: list[tuple[_AppendJob, _AppendJob]] = []
        first_of: dict[str, _AppendJob] = {}
        stored = _remembered_keys(writer, [j.record.key for j in recorded if j.record])
        for job in jobs:
            record = job.record
            if record is None:
                keep.append(job)
                continue
            id_key = record.key
            if id_key in first_of:
                repeats.append((job, first_of[id_key]))
                continue
            found = stored.get(id_key)
            if found is None:
                first_of[id_key] = job
                keep.append(job)
                continue
            try:
                job.future.set_exception(AlreadyDone(replay(record, found)))
            except InvalidArgument as exc:
                job.future.set_exception(exc)
        return keep, repeats

    def _answer_repeats(self, repeats: list[tuple[_AppendJob, _AppendJob]]) -> None:
        for job, first in repeats:
            assert job.record is not None and first.record is not None
            exc = first.future.exception()
            if exc is not None:
                job.future.set_exception(exc)
                continue
            remembered = Remembered(
                first.record.method,
                first.record.fingerprint,
                first.record.encode(first.future.result()),
            )
            try:
                job.future.set_exception(AlreadyDone(replay(job.record, remembered)))
            except InvalidArgument as error:
                job.future.set_exception(error)

    def _commit_appends(self, writer: duckdb.DuckDBPyConnection, jobs: list[_AppendJob]) -> None:
        """Commit a group of appends in one transaction; isolate a failing job on error."""
        jobs, repeats = self._without_replays(writer, jobs)
        try:
            if jobs:
                self._commit_new_appends(writer, jobs)
        finally:
            self._answer_repeats(repeats)

    def _commit_new_appends(
        self, writer: duckdb.DuckDBPyConnection, jobs: list[_AppendJob]
    ) -> None:
        # New context ids enter the cache only after their commit, so it needs no restore.
        saved = (self._next_message_id, self._next_context_id)
        try:
            receipts, counted = self._insert_appends(writer, jobs)  # commits
        except BaseException as exc:
            self._rollback(writer)
            self._next_message_id, self._next_context_id = saved
            self._calls.clear()  # may name ids of the rolled-back rows; the table still knows
            self._known_agents.clear()  # may name agents whose insert was rolled back
            self._last_sequence.clear()  # re-read from the rows, whoever numbered them
            if len(jobs) == 1:
                jobs[0].future.set_exception(exc)
                return
            log.warning("group commit failed; retrying its %d calls one by one", len(jobs))
            for job in jobs:
                self._commit_new_appends(writer, [job])
            return
        for context_id, (n, tokens, first_us, last_us, min_source_us) in counted.items():
            self._pending.add(context_id, n, tokens, first_us, last_us, min_source_us)
        for job, job_receipts in zip(jobs, receipts, strict=True):
            job.future.set_result(job_receipts)

    def _context_id(self, writer: duckdb.DuckDBPyConnection, key: ContextKey) -> int | None:
        cached = self._context_ids.get(key)
        if cached is not None:
            return cached
        row = _context_row(writer, key)
        if row is None:
            return None
        self._context_ids[key] = int(row[0])
        return int(row[0])

    def _sequence_of(self, writer: duckdb.DuckDBPyConnection, context_id: int) -> int:
        """The last sequence of a stored thread: its row's, plus the messages not yet
        counted there (see thread_counters.py), cached while the writer numbers it."""
        cached = self._last_sequence.get(context_id)
        if cached is not None:
            return cached
        row = _first(
            writer.execute("SELECT last_sequence FROM threads WHERE context_id = ?", [context_id])
        )
        return (int(row[0]) if row else 0) + self._pending.count_of(context_id)

    def _insert_appends(
        self, writer: duckdb.DuckDBPyConnection, jobs: list[_AppendJob]
    ) -> tuple[list[list[MessageReceipt]], dict[int, list[int]]]:
        """Insert and commit the group; return its receipts and, per context id, the
        counts it adds to its thread ([messages, tokens, first time, last time, oldest
        source time]), which the caller leaves pending (see thread_counters.py).

        Each call gets one commit time from the server's clock (client times never move
        it) and its thread's next sequence numbers. Sequences are numbered here from the
        thread's row, and the unique index on (context_id, sequence) checks them in the
        transaction: a number taken by any other writer fails the commit instead of
        being stored twice. (Numbering in SQL with an UPDATE of the thread's row would
        check the same but costs about 2 ms a commit, as much as the insert itself.)
        """
        columns: dict[str, list[Any]] = {name: [] for name in _ARROW_SCHEMA.names}
        all_receipts: list[list[MessageReceipt]] = []
        # per context: [count, tokens, first commit, last commit, oldest source time]
        thread_deltas: dict[ContextKey, list[int]] = {}
        numbered: dict[int, int] = {}  # context id -> its last sequence in this group
        new_contexts: dict[ContextKey, int] = {}
        agents_seen: dict[tuple[str, str], AgentSettings | None] = {}
        summaries: dict[int, int] = {}  # context id -> id of its newest stored summary

        for job in jobs:
            agent_key = (job.key.tenant, job.key.agent)
            if agents_seen.get(agent_key) is None:
                agents_seen[agent_key] = job.default_settings
        # Ticked before any message time: an auto-created agent's clear marker (its create
        # time) must precede the messages that created it, or they would start outside.
        now_us = self.clock.tick()
        in_transaction = False  # opened early only when an agent must be created
        for (tenant, name), settings in agents_seen.items():
            # Known agents skip the lookup: a statement costs more than a commit's rows.
            if (tenant, name) in self._known_agents:
                continue
            exists = _first(
                writer.execute("SELECT 1 FROM agents WHERE tenant = ? AND name = ?", [tenant, name])
            )
            if not exists:
                if settings is None:
                    # Raised before anything is written; the group is then retried call by
                    # call, so only the calls for this agent fail.
                    raise NotFound(f"agent {name!r} does not exist", reason="AGENT_NOT_FOUND")
                if not in_transaction:
                    writer.execute("BEGIN TRANSACTION")
                    in_transaction = True
                writer.execute(_INSERT_AGENT, agent_row(tenant, name, settings, now_us))
            self._known_agents.add((tenant, name))

        for job in jobs:
            key = job.key
            context_id = new_contexts.get(key) or self._context_id(writer, key)
            if context_id is None:
                if job.batch.summarized_ids is not None:
                    # A summary stands for messages of an existing thread; if the thread
                    # is gone (its agent deleted meanwhile) the summary has nothing to
                    # stand for and must not bring the context back.
                    raise NotFound(
                        f"thread {key.thread!r} of agent {key.agent!r} no longer exists",
                        reason="THREAD_NOT_FOUND",
                    )
                context_id = self._next_context_id
                self._next_context_id += 1
                new_contexts[key] = context_id
            commit_time = self.clock.tick()
            batch = job.batch
            messages = batch.messages
            n = len(messages)
            first_id = self._next_message_id
            self._next_message_id += n
            ids = range(first_id, first_id + n)
            last = numbered.get(context_id)
            if last is None:
                last = 0 if key in new_contexts else self._sequence_of(writer, context_id)
            sequences = range(last + 1, last + 1 + n)
            numbered[context_id] = last + n
            sources = [m.source_time_us for m in messages]
            columns["id"].extend(ids)
            columns["context_id"].extend([context_id] * n)
            columns["tenant"].extend([key.tenant] * n)
            columns["agent"].extend([key.agent] * n)
            columns["scope"].extend([key.scope] * n)
            columns["thread"].extend([key.thread] * n)
            columns["role"].extend([int(m.role) for m in messages])
            columns["content"].extend([m.content for m in messages])
            columns["tool_calls"].extend([m.tool_calls for m in messages])
            columns["tool_call_id"].extend([m.tool_call_id for m in messages])
            columns["external_id"].extend([m.external_id for m in messages])
            columns["metadata"].extend([m.metadata for m in messages])
            columns["token_estimate"].extend(batch.token_estimates)
            columns["create_time_us"].extend([commit_time] * n)
            columns["source_time_us"].extend(sources)
            columns["sequence"].extend(sequences)
            columns["token_count"].extend(batch.token_counts)
            columns["tokenizer"].extend([batch.tokenizer] * n)
            columns["chars"].extend(batch.chars)
            columns["group_id"].extend(
                [
                    self._group_of(writer, context_id, i, m, calls)
                    for i, m, calls in zip(ids, messages, batch.tool_call_ids, strict=True)
                ]
            )
            columns["tool_call_ids"].extend([",".join(c) for c in batch.tool_call_ids])
            summary = batch.summarized_ids
            if summary is not None:
                summaries[context_id] = ids[-1]
            columns["is_summary"].extend([summary is not None] * n)
            columns["first_summarized_id"].extend([summary[0] if summary else 0] * n)
            columns["last_summarized_id"].extend([summary[1] if summary else 0] * n)
            all_receipts.append(
                [
                    MessageReceipt(i, commit_time, e, c, q)
                    for i, e, c, q in zip(
                        ids, batch.token_estimates, batch.token_counts, sequences, strict=True
                    )
                ]
            )
            delta = thread_deltas.setdefault(key, [0, 0, commit_time, 0, NO_SOURCE_TIME])
            delta[0] += n
            delta[1] += sum(batch.token_estimates)
            delta[3] = commit_time
            given = [t for t in sources if t is not None]
            if given:
                delta[4] = min(delta[4], *given)

        # The whole group is written by one client call: a script of BEGIN, the inserts
        # (and a summary pointer's update), and COMMIT. Every call into DuckDB gives up
        # the GIL and must win it back, and with dozens of handler threads waiting that
        # costs more than the statements themselves, so a group makes one call. The
        # scripts read their rows from the Arrow tables below through DuckDB's replacement
        # scans (the names of this frame's local variables); they carry no parameters.
        contextd_batch = pa.table(columns, schema=_ARROW_SCHEMA)  # noqa: F841 - scanned by the script
        script = [] if in_transaction else ["BEGIN TRANSACTION"]
        script.append(
            f"INSERT INTO messages ({_ARROW_COLUMNS}) SELECT {_ARROW_COLUMNS} FROM contextd_batch"
        )
        high_water = self._id_high_water
        if self._next_message_id - 1 > high_water:
            # Reserve the next block of ids in this transaction: no id this group commits
            # is ever above the stored mark, so none is issued again after a restart.
            high_water = self._next_message_id - 1 + ID_BLOCK
            script.append(
                f"UPDATE store_state SET value = {int(high_water)} "
                "WHERE key = 'message_id_high_water'"
            )
        counted = {
            new_contexts.get(key) or self._context_ids[key]: delta
            for key, delta in thread_deltas.items()
        }
        if new_contexts:
            # New threads start with zero counters: like every other append, theirs are
            # added by the next counter flush (or by the recount after a crash), so no
            # message is ever counted twice.
            contextd_new_threads = pa.table(  # noqa: F841 - scanned by the script
                {
                    "context_id": list(new_contexts.values()),
                    "first_us": [thread_deltas[k][2] for k in new_contexts],
                    "last_us": [thread_deltas[k][3] for k in new_contexts],
                }
            )
            script.append(
                "INSERT INTO threads (context_id, tenant, agent, scope, thread, create_time_us, "
                "last_message_time_us, message_count, token_estimate) "
                "SELECT d.context_id, b.tenant, b.agent, b.scope, b.thread, d.first_us, "
                "d.last_us, 0, 0 FROM contextd_new_threads d JOIN (SELECT DISTINCT "
                "context_id, tenant, agent, scope, thread FROM contextd_batch) b "
                "ON b.context_id = d.context_id"
            )
        if summaries:
            contextd_summaries = pa.table(  # noqa: F841 - scanned by the script
                {"context_id": list(summaries), "summary_id": list(summaries.values())}
            )
            script.append(
                "UPDATE threads SET latest_summary_id = d.summary_id FROM contextd_summaries d "
                "WHERE threads.context_id = d.context_id"
            )
        requests = [
            (job.record, job.record.encode(receipts))
            for job, receipts in zip(jobs, all_receipts, strict=True)
            if job.record is not None
        ]
        if requests:
            contextd_requests = _request_rows(requests, now_us)  # noqa: F841 - scanned
            script.append(_INSERT_REQUESTS)
        script.append("COMMIT")
        writer.execute(";\n".join(script))
        self._context_ids.update(new_contexts)
        self._last_sequence.update(numbered)
        self._id_high_water = high_water
        return all_receipts, counted

    def _group_of(
        self,
        writer: duckdb.DuckDBPyConnection,
        context_id: int,
        message_id: int,
        message: NewMessage,
        call_ids: tuple[str, ...],
    ) -> int:
        """The tool group of a message: the id of the tool_use it belongs to, or -1.

        Computed once at insert so that trimming reads integers, never JSON.
        """
        if call_ids:
            for call_id in call_ids:
                self._calls[(context_id, call_id)] = message_id
                self._calls.move_to_end((context_id, call_id))
            while len(self._calls) > _REMEMBERED_CALLS:
                self._calls.popitem(last=False)
            return message_id
        if message.role != Role.TOOL_RESULT or not message.tool_call_id:
            return -1
        known = self._calls.get((context_id, message.tool_call_id))
        if known is not None:
            return known
        row = _first(
            writer.execute(
                "SELECT id FROM messages WHERE context_id = ? AND tool_call_ids <> '' "
                "AND list_contains(string_split(tool_call_ids, ','), ?) "
                "ORDER BY sequence DESC LIMIT 1",
                [context_id, message.tool_call_id],
            )
        )
        return int(row[0]) if row else -1

    # ----------------------------------------------------------------- agents

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

        return self._write(create, record)

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
            options = updated_options(current.build_options, settings.build_options, fields)
            if options is not None:
                assignments.append("settings_json = ?")
                params.append(settings_json(replace(settings, build_options=options)))
            assignments.append("update_time_us = ?")
            params.append(self.clock.tick())
            cur.execute(
                f"UPDATE agents SET {', '.join(assignments)} WHERE tenant = ? AND name = ?",
                [*params, tenant, name],
            )
            return _require_agent(cur, tenant, name)

        return self._write(update, record)

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
        (removing 235,000 messages in one transaction blocked all appends for ~350 ms):
        one short transaction deletes the agent, its threads, status entries and events,
        and records its context ids in `deleted_contexts`. From that commit on the agent
        is gone: its messages are reachable only through those threads, and a new agent
        of the same name gets new context ids (ids are never reused while any message
        still carries them). Then the messages are removed a chunk at a time, each chunk
        its own writer job queued behind whatever arrived meanwhile. The call returns when
        they are all gone, or when the server begins to stop; what a stop or a crash
        leaves is removed at the next start.
        """

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
            cur.execute(f"DELETE FROM events WHERE {where}", [tenant, name])
            cur.execute("DELETE FROM agents WHERE tenant = ? AND name = ?", [tenant, name])
            # In the same writer job: the next append must not reuse the deleted ids.
            self._forget_contexts(tenant, name)
            return (int(row[0]) if row else 0), contexts

        # A retry is answered with the count alone, as the first call was.
        marked = record.with_encoder(lambda r: record.encode(r[0])) if record else None
        count, contexts = self._write(mark, marked)
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

            last = self._write(chunk)
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

    # ----------------------------------------------------------------- messages

    def append(
        self,
        key: ContextKey,
        batch: MessageBatch,
        default_settings: AgentSettings | None,
        record: RequestRecord | None = None,
    ) -> list[MessageReceipt]:
        """Append durably; a missing agent is created with `default_settings`, or is
        NOT_FOUND when they are None. With a record, a repeated request id raises
        AlreadyDone with the first append's payload and writes nothing."""
        receipts: list[MessageReceipt] = self._submit(
            _AppendJob(
                key=key,
                batch=batch,
                default_settings=default_settings,
                future=Future(),
                record=record,
            )
        )
        return receipts

    def list_messages(
        self,
        where: ThreadFilter,
        window: WindowSpec | None,
        after: tuple[int, int] | None,
        limit: int,
    ) -> list[StoredMessage]:
        """Messages of one thread in sequence order, or of every thread of the agent in
        the scope by (create_time, id); strictly after the position `after`, which is a
        (sequence, id) for one thread and a (create_time, id) for all.

        With a window, only its messages; each thread's own clear marker applies to it.
        """
        params: list[Any] = [where.tenant, where.agent, where.scope]
        thread_clause = ""
        if where.thread is not None:
            thread_clause = "AND t.thread = ?"
            params.append(where.thread)
        window_clause = ""
        if window is not None:
            predicate, window_params = window_predicate(window)
            window_clause = f"AND {predicate}"
            params += window_params
        if where.thread is not None:
            after_clause = "AND m.sequence > ?"
            params.append(after[0] if after is not None else 0)
            order = "m.sequence"
        else:
            after_time, after_id = after if after is not None else (-(2**63), -(2**63))
            after_clause = "AND (m.create_time_us > ? OR (m.create_time_us = ? AND m.id > ?))"
            params += [after_time, after_time, after_id]
            order = "m.create_time_us, m.id"
        params.append(limit)
        sql = f"""
            SELECT {", ".join("m." + c.strip() for c in MESSAGE_COLUMNS.split(","))}
            FROM threads t JOIN messages m ON m.context_id = t.context_id
            WHERE t.tenant = ? AND t.agent = ? AND t.scope = ? {thread_clause}
              {window_clause} {after_clause}
            ORDER BY {order}
            LIMIT ?
        """
        rows = self._cursor().execute(sql, params).fetchall()
        return [message_from_row(r) for r in rows]

    def context_ref(self, key: ContextKey) -> ContextRef | None:
        """What a build needs to know of a thread before reading it, in one lookup; None
        when the thread has no messages yet."""
        row = _first(
            self._cursor().execute(
                "SELECT context_id, last_clear_us, latest_summary_id FROM threads "
                "WHERE tenant = ? AND agent = ? AND scope = ? AND thread = ?",
                [key.tenant, key.agent, key.scope, key.thread],
            )
        )
        return ContextRef(int(row[0]), row[1], int(row[2])) if row else None

    def window_columns(self, context: ContextRef, window: WindowSpec) -> pa.Table:
        """The window of one thread as columns, without content: the first read of a build.

        Columns: id (int64), role (uint8), token_count (uint64), chars (uint64), group_id
        (int64), sequence (int64), in sequence order, in one chunk each (ready for
        zero-copy NumPy views). Stored summaries are left out (see `latest_summary`). A
        build trims on these and then loads content only for the newest messages it can
        keep (`window_messages_from`), so its cost follows the budget, not the window.
        `window` is the thread's (its own clear marker included).
        """
        predicate, params = window_predicate(window, "m", None)
        # No ORDER BY: rows come back in insertion order, which is sequence order;
        # `_in_sequence_order` checks and sorts only if not, which saves the sort of a
        # long window on every build.
        table: pa.Table = (
            self._cursor()
            .sql(
                "SELECT id, role, token_count::UBIGINT AS token_count, "
                "chars::UBIGINT AS chars, group_id, sequence FROM messages m "
                f"WHERE context_id = ? AND {predicate} AND NOT is_summary",
                params=[context.context_id, *params],
            )
            .to_arrow_table()
            .combine_chunks()
        )
        return _in_sequence_order(table)

    def window_messages_from(
        self,
        context: ContextRef,
        window: WindowSpec,
        from_sequence: int,
        id_range: tuple[int, int],
    ) -> list[StoredMessage]:
        """The window's messages from `from_sequence` on, in sequence order, without
        stored summaries: the newest suffix a build keeps, read as one range.

        `id_range` (smallest and largest id of that suffix, from `window_columns`) adds
        nothing to the result; it lets DuckDB skip every row group outside it by its
        min/max statistics (ids grow with insertion), so the read costs the suffix, not
        the thread. It also leaves out messages appended since the columns were read,
        so a build loads exactly what it planned.
        """
        predicate, params = window_predicate(window, "m", None)
        rows = (
            self._cursor()
            .execute(
                f"SELECT {MESSAGE_COLUMNS} FROM messages m "
                "WHERE id BETWEEN ? AND ? AND context_id = ? "
                f"AND {predicate} AND NOT is_summary AND sequence >= ? "
                "ORDER BY sequence",
                [id_range[0], id_range[1], context.context_id, *params, from_sequence],
            )
            .fetchall()
        )
        return [message_from_row(r) for r in rows]

    def latest_summary(self, context: ContextRef) -> StoredMessage | None:
        """The newest stored summary of a thread, whatever the window."""
        if not context.latest_summary_id:
            return None
        row = _first(
            self._cursor().execute(
                f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE id = ? AND context_id = ?",
                [context.latest_summary_id, context.context_id],
            )
        )
        return message_from_row(row) if row else None

    def messages_by_ids(self, key: ContextKey, ids: Sequence[int]) -> list[StoredMessage]:
        """Whole messages of one context by id, ordered by (create_time, id). Ids are
        matched within the full context key only: an id of another thread, scope, agent
        or tenant is never returned, whoever asks."""
        if not ids:
            return []
        rows = (
            self._cursor()
            .execute(
                f"SELECT {MESSAGE_COLUMNS} FROM messages "
                "WHERE context_id = (SELECT context_id FROM threads WHERE tenant = ? "
                "AND agent = ? AND scope = ? AND thread = ?) "
                "AND id IN (SELECT unnest(?::BIGINT[])) "
                "ORDER BY create_time_us, id",
                [key.tenant, key.agent, key.scope, key.thread, list(ids)],
            )
            .fetchall()
        )
        return [message_from_row(r) for r in rows]

    def thread_activity(
        self, tenant: str, agent: str, scope: str, window: WindowSpec, limit: int
    ) -> list[ThreadActivity]:
        """The agent's threads with messages in their windows (`window` is the agent's;
        each thread's own clear marker applies too), most recently active first, with
        how many messages each has in its window.

        A thread whose first message was committed after its clear marker and whose
        oldest message time (source or commit) is inside the age limit has all its
        messages in its window, so its count comes from its metadata; only the others
        are counted from the messages, with the window's own predicate.
        """
        cur = self._cursor()
        clear = "greatest(?, coalesce(last_clear_us, ?))"
        # A message's own time is at most MAX_SOURCE_LEAD_US after its commit, so a thread
        # whose newest commit is that much older than the age limit has nothing inside.
        oldest_commit = window.age_after_us - MAX_SOURCE_LEAD_US
        rows = self._thread_rows(
            "SELECT thread, last_message_time_us, message_count, context_id, last_clear_us, "
            f"create_time_us > {clear} "
            "AND least(create_time_us, coalesce(min_source_time_us, create_time_us)) > ? "
            "AS whole FROM live_threads "
            "WHERE tenant = ? AND agent = ? AND scope = ? "
            f"AND last_message_time_us > {clear} AND last_message_time_us > ? "
            "ORDER BY last_message_time_us DESC, thread LIMIT ?",
            [
                window.clear_after_us,
                window.clear_after_us,
                window.age_after_us,
                tenant,
                agent,
                scope,
                window.clear_after_us,
                window.clear_after_us,
                oldest_commit,
                limit,
            ],
        )
        # The others are counted all in one statement: one branch per thread, each an
        # equality on context_id (which the index serves), instead of a query per thread.
        partial = [(r[3], window.with_thread_clear(r[4])) for r in rows if not r[5]]
        counted: dict[int, int] = {}
        if partial:
            predicate, _ = window_predicate(window, "m", None)
            branch = f"SELECT ?, count(*) FROM messages m WHERE context_id = ? AND {predicate}"
            params: list[Any] = []
            for context_id, own in partial:
                params += [context_id, context_id, *window_predicate(own, "m", None)[1]]
            counted = dict(
                cur.execute(" UNION ALL ".join([branch] * len(partial)), params).fetchall()
            )
        activity = [
            ThreadActivity(thread, last_us, int(counted.get(context_id, count)))
            for thread, last_us, count, context_id, _clear, _whole in rows
        ]
        return [a for a in activity if a.window_message_count > 0]

    # ----------------------------------------------------------------- status entries

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

        return self._write(clear, record)

    # ----------------------------------------------------------------- events

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

    # ----------------------------------------------------------------- clears

    def clear_agent(self, tenant: str, agent: str, record: RequestRecord | None = None) -> int:
        def clear(cur: duckdb.DuckDBPyConnection) -> int:
            _require_agent(cur, tenant, agent)
            now_us = self.clock.tick()
            cur.execute(
                "UPDATE agents SET last_clear_us = ? WHERE tenant = ? AND name = ?",
                [now_us, tenant, agent],
            )
            return now_us

        return self._write(clear, record)

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

        return self._write(clear, record)

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

        return self._write(clear, record)

    # ----------------------------------------------------------------- threads and stats

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


def _context_row(cur: duckdb.DuckDBPyConnection, key: ContextKey) -> Any:
    """The row (context_id,) of a context, or None when the thread has no messages yet."""
    return _first(
        cur.execute(
            "SELECT context_id FROM threads WHERE tenant = ? AND agent = ? AND scope = ? "
            "AND thread = ?",
            [key.tenant, key.agent, key.scope, key.thread],
        )
    )


def _first(result: duckdb.DuckDBPyConnection) -> Any:
    """The first row, reading the result to its end.

    DuckDB keeps a partly read result open on its connection and refuses other work on it
    until the result is finished, so never fetchone().
    """
    rows = result.fetchall()
    return rows[0] if rows else None


def _find_agent(cur: duckdb.DuckDBPyConnection, tenant: str, name: str) -> Agent | None:
    row = _first(
        cur.execute(
            f"SELECT {AGENT_COLUMNS} FROM agents WHERE tenant = ? AND name = ?", [tenant, name]
        )
    )
    return agent_from_row(row) if row else None


def _require_agent(cur: duckdb.DuckDBPyConnection, tenant: str, name: str) -> Agent:
    agent = _find_agent(cur, tenant, name)
    if agent is None:
        raise NotFound(f"agent {name!r} does not exist", reason="AGENT_NOT_FOUND")
    return agent
