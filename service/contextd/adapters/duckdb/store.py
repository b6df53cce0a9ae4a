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

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from queue import SimpleQueue
from typing import Any

import duckdb

from contextd.adapters.duckdb.access import AccessMixin
from contextd.adapters.duckdb.agents import AgentsMixin
from contextd.adapters.duckdb.base import (
    _STOP,
    _failures_translated,
    _first,
    log,
)
from contextd.adapters.duckdb.checkpoints import DEFAULT_CHECKPOINT_THRESHOLD, wal_path
from contextd.adapters.duckdb.hot import HotCache
from contextd.adapters.duckdb.hot_entries import DEFAULT_HOT_CACHE_BYTES
from contextd.adapters.duckdb.hot_reads import HotMixin, LoadStats
from contextd.adapters.duckdb.journal import APPLY_IDLE_S, GroupWrite, JournalFile, journal_path
from contextd.adapters.duckdb.messages import MessagesMixin
from contextd.adapters.duckdb.page_token_key import load_or_create_key
from contextd.adapters.duckdb.retention import RetentionMixin
from contextd.adapters.duckdb.schema import MIGRATION_STEPS, MIGRATIONS
from contextd.adapters.duckdb.search import SearchMixin
from contextd.adapters.duckdb.snapshots import SnapshotsMixin
from contextd.adapters.duckdb.status import StatusMixin
from contextd.adapters.duckdb.thread_counters import (
    PendingCounters,
)
from contextd.adapters.duckdb.threads import ThreadsMixin
from contextd.adapters.duckdb.tool_outputs import ToolOutputsMixin
from contextd.adapters.duckdb.usage import UsageMixin
from contextd.adapters.duckdb.writer import WriterMixin
from contextd.domain.clock import MonotonicClock
from contextd.domain.errors import (
    StoreLocked,
    StoreUnavailable,
)
from contextd.domain.model import (
    ContextKey,
)

# DuckDB's memory limit unless the server is told otherwise (--store-memory-limit). DuckDB's
# own default, 80% of the machine's memory, lets its buffer pool keep every block a long
# import writes: the server grew by about 1 GB importing 1,000,000 messages. With this
# limit the blocks it wrote are evicted (they are on disk; a read brings them back), and
# the resident set stays flat (docs/operations.md, Memory). It also bounds one
# transaction: an AppendMessages of more than about 100 MB then needs a larger limit.
DEFAULT_MEMORY_LIMIT = "128MB"


@_failures_translated
class Store(
    HotMixin,
    AccessMixin,
    AgentsMixin,
    MessagesMixin,
    StatusMixin,
    ThreadsMixin,
    SnapshotsMixin,
    RetentionMixin,
    ToolOutputsMixin,
    UsageMixin,
    SearchMixin,
    WriterMixin,
):
    """The DuckDB store. Open with `Store.open(path)`; close with `close()`.

    Failure modes: every call that waits for the writer waits at most `write_timeout_s`
    (then StoreBusy); DuckDB failures become domain errors (`store_error`); `watch` tells
    the server when the store cannot serve (a fatal error, or the writer stuck on one job
    longer than the write timeout) and when it can again.
    """

    # The writer thread looks request ids up in its journal after the caller's look-up.
    append_reads_record = False
    # Keys are read in process (no round trip to save): every call's key is looked up.
    confirms_owed_keys = False

    def __init__(
        self,
        con: duckdb.DuckDBPyConnection,
        max_group_rows: int,
        clock: MonotonicClock | None = None,
        *,
        write_timeout_s: float = 30.0,
        delete_chunk_rows: int = 5_000,
        hot_cache_bytes: int = DEFAULT_HOT_CACHE_BYTES,
        journal: Path | None = None,
        journal_idle_s: float = APPLY_IDLE_S,
    ) -> None:
        self._con = con
        # What builds read, kept coherent by the writer (hot.py); 0 bytes: off.
        self._hot = HotCache(hot_cache_bytes)
        self.hot_stats = LoadStats()
        self._hot_appended = None
        self._data_dir = Path(".")
        self._max_group_rows = max_group_rows
        self._write_timeout_s = write_timeout_s
        self._delete_chunk_rows = delete_chunk_rows
        # Health: a fatal DuckDB error (sticky) or a wedged writer makes the store unable
        # to serve; listeners hear every change, in order (they are called under the lock).
        self._health_lock = threading.Lock()
        self._keys_lock = threading.Lock()  # the keys kept in memory (access.py)
        self._listeners: list[Callable[[bool], None]] = []
        self._fatal: str | None = None
        self._wedged = False
        # When the writer began what it is doing now (monotonic), None while it waits.
        self._busy_since: float | None = None
        self._stop_purging = threading.Event()
        self._purger: threading.Thread | None = None
        self._flush_failed = False
        # The WAL the writer checkpoints when idle (None: never; checkpoints.py), and the
        # monotonic times of the writer's last group and of its next allowed attempt.
        self._wal_path: Path | None = None
        self._last_group_at = time.monotonic()
        self._next_checkpoint_at = 0.0
        self._local = threading.local()
        self._cursors: list[duckdb.DuckDBPyConnection] = []
        self._cursors_lock = threading.Lock()
        # The append journal (journal.py): applied here, before anything reads the tables.
        self._journal = None
        self._journal_group = self._journal_applied = 0
        self._journal_pending = []
        self._journal_rows = 0
        self._journal_requests = {}
        self._journal_idle_s = journal_idle_s
        self._journal_retry_at = 0.0
        self._writer_ident = None
        self._migrate()
        if journal is not None:
            self._open_journal(journal)
        # After the journal's replay, which put its records in the table.
        self._requests = self._load_request_filter(self._con)
        self._request_filter_retry_at = 0.0
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
        # Above every event id ever issued, also those of deleted agents' events.
        row = _first(
            self._con.execute(
                "SELECT greatest((SELECT coalesce(max(id), 0) FROM events), (SELECT "
                "coalesce(max(value), 0) FROM store_state WHERE key = 'event_id_high_water'))"
            )
        )
        self._next_event_id = int(row[0]) + 1
        self._next_request_cleanup_us = 0  # the writer removes old request records then
        self._context_ids: dict[ContextKey, int] = {}
        self._calls: OrderedDict[tuple[int, str], tuple[int, int]] = OrderedDict()
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
        self._writer_ident = self._writer.ident
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

    @classmethod
    def open(
        cls,
        path: Path,
        *,
        max_group_rows: int = 50_000,
        clock: MonotonicClock | None = None,
        write_timeout_s: float = 30.0,
        memory_limit: str = DEFAULT_MEMORY_LIMIT,
        checkpoint_threshold: str = DEFAULT_CHECKPOINT_THRESHOLD,
        delete_chunk_rows: int = 5_000,
        hot_cache_bytes: int = DEFAULT_HOT_CACHE_BYTES,
        journal: bool = True,
        journal_idle_s: float = APPLY_IDLE_S,
    ) -> Store:
        """Open (creating if needed) the DuckDB file and migrate it to the current schema.

        Raises StoreLocked when another process holds the file, so the caller can say so
        in one line instead of a stack trace. `memory_limit` is DuckDB's (DEFAULT_MEMORY_LIMIT
        unless given; "" for DuckDB's own default); a call that needs more memory is
        answered StoreExhausted. `checkpoint_threshold` is the WAL size at which a commit
        checkpoints ("" for DuckDB's own); the writer checkpoints sooner when idle
        (checkpoints.py). `journal` False commits every append group to DuckDB directly
        (no append journal, journal.py); `journal_idle_s` is how long the writer stays
        idle before it applies the journal on its own (tests make it long, so that only
        their reads and writes apply it).
        """
        path.parent.mkdir(parents=True, exist_ok=True)
        config: dict[str, str | bool | int | float | list[str]] = {}
        if memory_limit:
            config["memory_limit"] = memory_limit
        if checkpoint_threshold:
            config["checkpoint_threshold"] = checkpoint_threshold
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
        try:
            store = cls(
                con,
                max_group_rows,
                clock,
                write_timeout_s=write_timeout_s,
                delete_chunk_rows=delete_chunk_rows,
                hot_cache_bytes=hot_cache_bytes,
                journal=journal_path(path) if journal else None,
                journal_idle_s=journal_idle_s,
            )
        except BaseException:
            con.close()  # e.g. a journal that cannot be applied: free the file's lock
            raise
        store._data_dir = path.parent
        store._wal_path = wal_path(path)
        try:
            store._reconcile_snapshot_files()
            store._reconcile_tool_output_files()
        except BaseException:
            store.close()
            raise
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
        if self._journal is not None:
            self._journal.close()  # what it still holds (an apply failed) is applied at start
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
                step = MIGRATION_STEPS.get(version)
                if step is not None:
                    step(con)
                con.execute("INSERT INTO schema_migrations VALUES (?, epoch_us(now()))", [version])
                con.execute("COMMIT")
            except Exception:
                con.execute("ROLLBACK")
                raise
            log.info("migrated schema", extra={"schema_version": version})

    def _open_journal(self, path: Path) -> None:
        """Apply the journal's records after the applied mark in one transaction, then
        empty it (journal.py). A failure stops the open and leaves the file as it is."""
        journal = JournalFile(path)
        try:
            row = _first(
                self._con.execute(
                    "SELECT value FROM store_state WHERE key = 'journal_applied_group'"
                )
            )
            applied = int(row[0])
            todo = [(n, payload) for n, payload in journal.records() if n > applied]
            if todo:
                groups = [GroupWrite.decode(payload) for _, payload in todo]
                merged = GroupWrite.merged(groups)
                self._apply_group(self._con, merged, applied_group=todo[-1][0])
                applied = todo[-1][0]
                log.info(
                    "applied the append journal's acknowledged appends",
                    extra={"groups": len(todo), "rows": merged.rows},
                )
            if journal.size:
                journal.empty()
        except BaseException as exc:
            journal.close()
            if isinstance(exc, Exception):
                raise StoreUnavailable(
                    f"the append journal {path} could not be applied ({type(exc).__name__}: "
                    f"{str(exc)[:300]}); it holds acknowledged appends and was left as it is"
                ) from exc
            raise
        self._journal = journal
        self._journal_group = self._journal_applied = applied

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
                "  (SELECT coalesce(max(create_time_us), 0) FROM events),"
                "  (SELECT coalesce(max(create_time_us), 0) FROM snapshots))"
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
