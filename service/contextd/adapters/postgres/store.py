"""The PostgreSQL store: every aggregate's mixin over one connection pool.

Open with `PostgresStore.open(dsn)`: it migrates (safely while other replicas start too),
starts the clock above every time already stored, and serves. A replica keeps no state
that another could contradict; closing it loses nothing.
"""

from __future__ import annotations

import logging
import secrets
import threading
import weakref
from collections.abc import Callable

import psycopg
import psycopg_pool

from contextd.adapters.postgres.access import AccessMixin
from contextd.adapters.postgres.agents import AgentsMixin
from contextd.adapters.postgres.base import Conn, _remembered, failures_translated, first
from contextd.adapters.postgres.build_reads import BuildReadsMixin
from contextd.adapters.postgres.message_cache import MessageCache
from contextd.adapters.postgres.messages import MessagesMixin
from contextd.adapters.postgres.pending_list import PendingListMerger
from contextd.adapters.postgres.retention import RetentionMixin
from contextd.adapters.postgres.schema import migrate
from contextd.adapters.postgres.search import SearchMixin
from contextd.adapters.postgres.search_vector import matches_database
from contextd.adapters.postgres.snapshots import SnapshotsMixin
from contextd.adapters.postgres.status import StatusMixin
from contextd.adapters.postgres.threads import ThreadsMixin
from contextd.adapters.postgres.tool_outputs import ToolOutputsMixin
from contextd.adapters.postgres.usage import UsageMixin
from contextd.adapters.postgres.window_pages import WindowPagesMixin
from contextd.domain.clock import MonotonicClock
from contextd.domain.errors import StoreUnavailable
from contextd.domain.idempotency import (
    CLEANUP_BACKLOG_EVERY_US,
    CLEANUP_CHUNK,
    CLEANUP_EVERY_US,
    RETENTION_US,
    Remembered,
)

log = logging.getLogger(__name__)


@failures_translated
class PostgresStore(
    AccessMixin,
    AgentsMixin,
    MessagesMixin,
    BuildReadsMixin,
    WindowPagesMixin,
    ThreadsMixin,
    StatusMixin,
    SnapshotsMixin,
    RetentionMixin,
    ToolOutputsMixin,
    UsageMixin,
    SearchMixin,
):
    """contextd's store on PostgreSQL (see the package docstring for what it guarantees)."""

    def __init__(self, pool: psycopg_pool.ConnectionPool[Conn], clock: MonotonicClock) -> None:
        self._pool = pool
        self._local = threading.local()
        self._agent_cache = {}
        self._id_runs = {}
        self._windows_seen = {}
        self._bounds_guess = {}
        self._one_prepared = weakref.WeakSet()
        self._moved_here = {}
        self._label_models = {}
        self._retention_agents = set()
        self._messages = MessageCache()
        self._closed = False
        self.clock = clock
        self._listeners: list[Callable[[bool], None]] = []
        self._cleanup_lock = threading.Lock()
        self._next_request_cleanup_us = 0
        with pool.connection() as conn:
            self._schema_version = migrate(conn)
            # Appends make the search vectors they can make exactly (search_vector.py)
            # only when this database's own expression agrees with them.
            self._search_vectors = matches_database(conn)
            self.clock.advance_to(_newest_time_us(conn))
        self._pending = PendingListMerger(pool)
        self._pending.start()

    @classmethod
    def open(
        cls,
        dsn: str,
        *,
        clock: MonotonicClock | None = None,
        pool_size: int = 16,
        connect_timeout_s: float = 30.0,
    ) -> PostgresStore:
        """Connect (waiting at most `connect_timeout_s` for the database) and migrate.
        Raises StoreUnavailable, naming the database without its password, when it cannot
        be reached."""
        try:  # one plain connection first: a wrong address or password fails at once
            psycopg.connect(dsn, connect_timeout=max(1, int(connect_timeout_s))).close()
        except psycopg.Error as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise StoreUnavailable(
                f"cannot connect to the PostgreSQL database {_safe(dsn)}: {reason[:300]}"
            ) from exc
        pool: psycopg_pool.ConnectionPool[Conn] = psycopg_pool.ConnectionPool(
            dsn,
            min_size=1,
            max_size=pool_size,
            timeout=connect_timeout_s,
            open=False,
            name="contextd",
        )
        try:
            pool.open(wait=True, timeout=connect_timeout_s)
        except psycopg_pool.PoolTimeout as exc:
            pool.close()
            raise StoreUnavailable(
                f"cannot reach the PostgreSQL database {_safe(dsn)} within {connect_timeout_s:g}s"
            ) from exc
        try:
            return cls(pool, clock or MonotonicClock())
        except BaseException:
            pool.close()
            raise

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pending.stop()
        self._pool.close()

    def stop_background_work(self) -> None:
        """Stop merging the search index's pending list (pending_list.py); deletes are
        one transaction each."""
        self._pending.stop()

    def schema_version(self) -> int:
        return self._schema_version

    def watch(self, listener: Callable[[bool], None]) -> None:
        """Connection failures are reported per call (UNAVAILABLE with a retry delay):
        PostgreSQL recovers without a restart of contextd, so the health stays SERVING."""
        self._listeners.append(listener)

    def serving(self) -> bool:
        return not self._closed

    def page_token_key(self) -> bytes:
        """The key that signs page tokens, shared by every replica: a token one replica
        gave out is honoured by all. Made once, by whichever replica asks first."""
        with self._pool.connection() as conn:
            conn.execute(
                "INSERT INTO service_keys VALUES ('', 'page_token', %s) "
                "ON CONFLICT (tenant, name) DO NOTHING",
                [secrets.token_bytes(32)],
            )
            row = first(
                conn, "SELECT value FROM service_keys WHERE tenant = '' AND name = 'page_token'", []
            )
        return bytes(row[0])

    def remembered(self, tenant: str, request_id: str) -> Remembered | None:
        """The record of a request id, read by one statement in autocommit (one round
        trip, see `_reading_once`), on every write that carries a request id but the
        append (whose statement reads it). Writes look the id up again in their own
        transaction (`PostgresBase._write`), so this read is only the fast path of
        retries."""
        self._forget_old_requests()
        with self._reading_once() as conn:
            return _remembered(conn, tenant, request_id)

    def _forget_old_requests(self) -> None:
        """Remove request records past their retention, at most CLEANUP_CHUNK per pass,
        once a minute by this replica's clock (a second later while a backlog drains).
        Every replica may run a pass; two passes at once delete different rows (SKIP
        LOCKED), so none waits for another."""
        now = self.clock.now_us()
        with self._cleanup_lock:
            if now < self._next_request_cleanup_us:
                return
            self._next_request_cleanup_us = now + CLEANUP_EVERY_US
        try:
            with self._pool.connection() as conn:
                deleted = conn.execute(
                    "DELETE FROM request_records WHERE ctid IN (SELECT ctid FROM "
                    "request_records WHERE create_time_us < %s LIMIT %s FOR UPDATE SKIP LOCKED)",
                    [now - RETENTION_US, CLEANUP_CHUNK],
                ).rowcount
        except psycopg.Error:
            log.exception("removing old request records failed; the next pass retries")
            return
        if deleted >= CLEANUP_CHUNK:
            with self._cleanup_lock:
                self._next_request_cleanup_us = now + CLEANUP_BACKLOG_EVERY_US


def _newest_time_us(conn: Conn) -> int:
    """The newest time stored: this replica's clock starts above it."""
    row = first(
        conn,
        "SELECT greatest("
        " (SELECT coalesce(max(last_message_time_us), 0) FROM threads),"
        " (SELECT coalesce(max(last_clear_us), 0) FROM threads),"
        " (SELECT coalesce(max(last_clear_us), 0) FROM agents),"
        " (SELECT coalesce(max(update_time_us), 0) FROM agents),"
        " (SELECT coalesce(max(update_time_us), 0) FROM status_entries),"
        " (SELECT coalesce(max(create_time_us), 0) FROM events),"
        " (SELECT coalesce(max(create_time_us), 0) FROM snapshots))",
        [],
    )
    return int(row[0]) if row else 0


def _safe(dsn: str) -> str:
    """The DSN without its password, for messages and logs."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "(unparsable connection string)"
    return f"{info.get('host', 'localhost')}:{info.get('port', 5432)}/{info.get('dbname', '')}"
