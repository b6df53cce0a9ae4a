"""What the DuckDB store's modules share: constants, row helpers, the writer's jobs, the
translation of DuckDB failures, and `DuckDBBase`, the state every mixin works on."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from queue import SimpleQueue
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import duckdb
import numpy as np
import pyarrow as pa

from contextd.adapters.duckdb.reply import Reply
from contextd.adapters.duckdb.request_filter import RequestFilter
from contextd.adapters.duckdb.thread_counters import (
    NO_SOURCE_TIME,
    PendingCounters,
)
from contextd.adapters.rows import (
    AGENT_COLUMNS,
    agent_from_row,
)
from contextd.domain.clock import MonotonicClock
from contextd.domain.errors import (
    ContextdError,
    NotFound,
    StoreExhausted,
    StoreUnavailable,
    Unavailable,
)
from contextd.domain.idempotency import (
    Remembered,
    RequestRecord,
    record_key,
)
from contextd.domain.model import (
    Agent,
    AgentSettings,
    ContextKey,
    MessageBatch,
    MessageReceipt,
)
from contextd.domain.window import WindowSpec

if TYPE_CHECKING:
    from contextd.adapters.duckdb.hot import HotCache
    from contextd.adapters.duckdb.journal import GroupWrite, JournalFile

log = logging.getLogger("contextd.adapters.duckdb.store")

T = TypeVar("T")
P = ParamSpec("P")

# Message ids are reserved this many at a time: the high-water mark in store_state is
# written in the transaction of the append that passes it, about once per this many
# messages, instead of in every commit. A restart skips the unused rest of a block.
ID_BLOCK = 10_000

# Adds per-context counts (`{counts}`: a table or subquery of context_id, n, tokens,
# first_us, last_us, min_source_us, bytes) to the threads' counters: the flush of pending
# counts and the recount after a crash.
_ADD_TO_THREAD_COUNTERS = (
    "UPDATE threads SET message_count = threads.message_count + d.n, "
    "token_estimate = threads.token_estimate + d.tokens, "
    "create_time_us = least(threads.create_time_us, d.first_us), "
    "last_message_time_us = greatest(threads.last_message_time_us, d.last_us), "
    "last_sequence = threads.last_sequence + d.n, "
    "min_source_time_us = least(threads.min_source_time_us, "
    f"nullif(d.min_source_us, {NO_SOURCE_TIME})), "
    "stored_bytes = threads.stored_bytes + d.bytes "
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
                   AS min_source_time_us,
               t.stored_bytes + coalesce(p.bytes, 0) AS stored_bytes,
               t.outputs_expired_through_us
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
        # `content` is virtual: coalesce(content_long, content_short) (schema version 22).
        ("content_short", pa.string()),
        ("content_long", pa.string()),
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
        ("restored_from", pa.string()),
        ("group_start", pa.int64()),
    ]
)
# The names once: `Schema.names` builds a new list of new strings on every read, and a
# group of appends starts from one empty list per column.
_ARROW_NAMES = tuple(_ARROW_SCHEMA.names)
_ARROW_COLUMNS = ", ".join(_ARROW_NAMES)


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
    window: WindowSpec, m: str = "m", t: str | None = "t", context_id: int | None = None
) -> tuple[str, list[int]]:
    """The SQL of "message `m` is in the window" and its parameters: the one definition
    of the window (see window.py) that every read of a window uses.

    With a threads alias `t`, each thread's own clear marker applies where it is later
    than the window's; without one, `window` must already hold the thread's marker.
    Retention bounds compare with the thread's newest message, read from the messages
    (the threads row's counters are written lazily): by `context_id` when the read is of
    one known thread (an index lookup), else per row's thread.
    """
    clear = f"greatest(?, coalesce({t}.last_clear_us, ?))" if t else "?"
    params = [window.clear_after_us] * (2 if t else 1)
    sql = f"{m}.create_time_us > {clear} AND coalesce({m}.source_time_us, {m}.create_time_us) > ?"
    params.append(window.age_after_us)
    if window.retains:
        of_thread = f"{m}.context_id" if context_id is None else str(int(context_id))
        newest = "(SELECT max(x.{}) FROM messages x WHERE x.context_id = " + of_thread + ")"
        if window.expire_after_us is not None:
            sql += f" AND {newest.format('create_time_us')} > ?"
            params.append(window.expire_after_us)
        if window.max_messages:
            sql += f" AND coalesce({m}.group_start, {m}.sequence) > {newest.format('sequence')} - ?"
            params.append(window.max_messages)
    return f"({sql})", params


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
    future: Reply[list[MessageReceipt]]
    record: RequestRecord | None = None
    # More threads' batches committed in this job's transaction, after its own (a
    # restore into several threads); the receipts of every part come back in order.
    more: tuple[tuple[ContextKey, MessageBatch], ...] = ()

    def parts(self) -> tuple[tuple[ContextKey, MessageBatch], ...]:
        return ((self.key, self.batch), *self.more)

    @property
    def rows(self) -> int:
        if not self.more:  # asked per job on the writer's hot path
            return len(self.batch.messages)
        return sum(len(batch) for _, batch in self.parts())


@dataclass(frozen=True, slots=True)
class Touches:
    """What a write job changes of what the hot cache (hot.py) holds, beyond appends,
    which the writer applies from their rows. Each name drops the entries it covers."""

    # (tenant, agent): the agent's settings entry only.
    agent_settings: tuple[tuple[str, str], ...] = ()
    # (tenant, agent): everything of the agent (its settings, threads, scopes, status).
    agents: tuple[tuple[str, str], ...] = ()
    # (tenant, agent, scope): every thread of the scope and its activity.
    scopes: tuple[tuple[str, str, str], ...] = ()
    # (tenant, agent, scope): the scope's status entries.
    status: tuple[tuple[str, str, str], ...] = ()
    # One thread (and its scope's activity).
    contexts: tuple[ContextKey, ...] = ()


NOTHING = Touches()
EVERYTHING: Touches | None = None


@dataclass(slots=True)
class _CallJob:
    fn: Callable[[duckdb.DuckDBPyConnection], Any]
    future: Reply[Any]
    # What the job changes of the hot cache (hot.py); None: anything (all is dropped).
    touches: Touches | None = None


@dataclass(slots=True)
class _ApplyJob:
    """A read's barrier: the writer applies the append journal, then answers (journal.py)."""

    future: Reply[None]


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


def _translating(
    method: Callable[Concatenate[Any, P], T],
) -> Callable[Concatenate[Any, P], T]:
    @functools.wraps(method)
    def call(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> T:
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
    that are not failures of the store (a bug in our SQL) pass through unchanged.

    The methods of every mixin the store is made of are wrapped (each once, the nearest
    definition in the MRO)."""
    wrapped: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("contextd.adapters.duckdb"):
            continue
        for name, member in list(vars(klass).items()):
            public = not name.startswith("_") and inspect.isfunction(member)
            if public and name not in wrapped:
                wrapped.add(name)
                setattr(cls, name, _translating(getattr(cls, name)))
    return cls


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


class DuckDBBase:
    """The state of one open store, shared by its mixins (set in `Store.__init__`), and
    the methods one mixin calls on another."""

    clock: MonotonicClock
    _con: duckdb.DuckDBPyConnection
    _data_dir: Path
    _max_group_rows: int
    _write_timeout_s: float
    _delete_chunk_rows: int
    _health_lock: threading.Lock
    _listeners: list[Callable[[bool], None]]
    _fatal: str | None
    _wedged: bool
    _busy_since: float | None
    _stop_purging: threading.Event
    _purger: threading.Thread | None
    _flush_failed: bool
    _wal_path: Path | None
    _last_group_at: float
    _next_checkpoint_at: float
    _local: threading.local
    _cursors: list[duckdb.DuckDBPyConnection]
    _cursors_lock: threading.Lock
    _pending: PendingCounters
    _next_message_id: int
    _next_context_id: int
    _id_high_water: int
    _last_sequence: dict[int, int]
    _next_event_id: int
    _next_request_cleanup_us: int
    _context_ids: dict[ContextKey, int]
    # (context id, call id) -> (id, sequence) of the tool_use that declared the call
    _calls: OrderedDict[tuple[int, str], tuple[int, int]]
    _known_agents: set[tuple[str, str]]
    _queue: SimpleQueue[Any]
    _held: Any
    _submit_lock: threading.Lock
    _closed: bool
    _writer: threading.Thread
    # The append journal (journal.py): None on a store without one. Groups journaled
    # (acknowledged) and applied to the tables, by number; what is journaled and not yet
    # applied, and its request records (answered to retries from memory).
    _journal: JournalFile | None
    _journal_group: int
    _journal_applied: int
    _journal_pending: list[GroupWrite]
    _journal_rows: int
    _journal_requests: dict[str, Remembered]
    # The request keys that may be recorded (request_filter.py): the writer adds, any
    # thread reads; rebuilt by the writer (not before `_request_filter_retry_at` after a
    # failed rebuild).
    _requests: RequestFilter
    _request_filter_retry_at: float
    _journal_idle_s: float
    _journal_retry_at: float  # monotonic: no apply of the writer's own before it
    _writer_ident: int | None

    def _cursor(self, live: bool = False) -> duckdb.DuckDBPyConnection:
        """This thread's own DuckDB cursor, for reads: inside `snapshot`, the one in its
        transaction. `live` gives a second cursor that never is (thread counters are
        read live, see `_thread_rows`).

        The read barrier: a read that may begin a transaction first has the writer apply
        every journaled append (acknowledged ones are in the journal, not yet in the
        tables), so every read by SQL sees every append acknowledged before it began.
        """
        if (
            self._journal_group > self._journal_applied
            and threading.get_ident() != self._writer_ident
            and not self._in_read_transaction()
        ):
            self._submit(_ApplyJob(future=Reply()))
        return self._thread_cursor("live_cursor" if live else "cursor")

    def _thread_cursor(self, name: str) -> duckdb.DuckDBPyConnection:
        """This thread's cursor of that name, without the read barrier."""
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

    def _in_read_transaction(self) -> bool:
        """Whether this thread's cursor is inside a snapshot's open transaction (then its
        state is fixed: the barrier ran when it began, and must not fail its COMMIT)."""
        if getattr(self._local, "in_snapshot", False):
            return True
        view = getattr(self._local, "hot_view", None)  # hot_reads.py's snapshot
        return bool(view is not None and view.began)

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

    _hot: HotCache
    _hot_appended: tuple[pa.Table | dict[str, list[Any]], tuple[int, ...]] | None

    if TYPE_CHECKING:  # defined by the mixins, called across them

        def _submit(self, job: _AppendJob | _CallJob | _ApplyJob) -> Any: ...

        def _write(
            self,
            fn: Callable[[duckdb.DuckDBPyConnection], T],
            record: RequestRecord | None = None,
            touches: Touches | None = None,
        ) -> T: ...

        def _failed(self, exc: duckdb.Error) -> ContextdError | None: ...

        def _flush_counters(self, writer: duckdb.DuckDBPyConnection) -> None: ...

        def _sequence_of(self, writer: duckdb.DuckDBPyConnection, context_id: int) -> int: ...

        def _thread_rows(self, sql: str, params: list[Any]) -> list[Any]: ...

        def _drop_agent_snapshots(
            self, cur: duckdb.DuckDBPyConnection, tenant: str, agent: str
        ) -> list[str]: ...

        def _remove_documents(self, paths: Sequence[str]) -> None: ...

        def _drop_agent_tool_outputs(
            self, cur: duckdb.DuckDBPyConnection, tenant: str, agent: str
        ) -> list[str]: ...

        def _remove_tool_output_files(self, paths: Sequence[str]) -> None: ...

        def _insert_appends(
            self, writer: duckdb.DuckDBPyConnection, jobs: list[_AppendJob], journal: bool = False
        ) -> tuple[list[list[MessageReceipt]], dict[int, list[int]]]: ...

        def _apply_group(
            self,
            writer: duckdb.DuckDBPyConnection,
            group: GroupWrite,
            in_transaction: bool = False,
            applied_group: int | None = None,
        ) -> None: ...

        def _apply_journal(self, writer: duckdb.DuckDBPyConnection) -> None: ...

        def _note_requests(self, keys: Iterable[str]) -> None: ...

        def _journal_append(self, group: GroupWrite) -> None: ...
