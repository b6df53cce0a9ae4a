"""The search index's pending list, merged into the index off the append path.

The GIN index on messages (search.py) takes new rows into its pending list (`fastupdate`,
on by default): cheap at insert, scanned by every search until merged. PostgreSQL merges
it inside the insert that finds it past `gin_pending_list_limit` (4 MB by default): that
one append, whichever caller's it is, then waits for the merge of every row the others
added (measured: most 1,000-message appends ~0.3 s, one in a hundred 1.5-12 s, with four
callers). So appends of this store raise the limit for their own transactions
(PENDING_LIMIT, a backstop should the merging stop) and a thread of the store merges the
list (`gin_clean_pending_list`) after every CLEAN_EVERY_ROWS rows this replica appended:
the same work, in no caller's transaction. Searches still see every committed row at
once (a GIN scan reads the pending list too).

How often it merges is a trade between appends and searches. A merge rewrites the entry
of every word its rows hold (a word's posting list, decoded and re-encoded with the new
row ids, and written to the WAL whole): merged every 2,000 rows, that was about half of
the database's CPU of a batched append (measured: ~50 of ~90 ms per 1,000 messages, and
4.4 of 6.9 MB of WAL), as most words of a batch recur in the next one and each merge
rewrote their entries again. Merged every 10,000 rows, each such entry is rewritten a
fifth as often. A search meanwhile scans every row of the list (measured ~1.3 ms per
1,000 rows, so ~13 ms more than a merged index at most), and the planner counts the
list's pages against the index: with 18,000 rows waiting over 3,000 merged, it chose the
id range read newest first over the index (test_search's statistics_lag test; fine with
10,000 over 11,000, and with 20,000 over 21,000). The list is merged as well once this
replica's appends pause for IDLE_SECONDS, so that searches after a load, or between
bursts, find it merged.

Each replica runs its own; of two merges at once the second waits on the index's cleanup
lock and finds little left, or is skipped. A merge waits for that lock (or the index's)
only briefly (`_LOCK_WAIT`, below deadlock_timeout) and is otherwise skipped until the
next wake: autovacuum's VACUUM of messages holds the same lock while it cleans the
index, and when a backend still waits on a lock autovacuum holds at deadlock_timeout,
PostgreSQL cancels that autovacuum, its ANALYZE included. That left the planner's
statistics stale for minutes after bulk loads (3 of 5 loads of the search benchmark
logged "canceling autovacuum task ... while cleaning up index messages_search").

A database where the store's role may not merge the index (it needs ownership or
MAINTAIN) keeps PostgreSQL's own behaviour: the store logs it once and leaves the limit
alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import psycopg_pool

log = logging.getLogger(__name__)

# The limit (kB) of an append's own transaction while the merging thread runs: past it,
# the append merges the list itself, as PostgreSQL does by default past 4 MB.
PENDING_LIMIT_KB = 65_536
# Rows appended by this replica between two merges (about 8.5 MB of list for messages of
# ~55 distinct words; an eighth of PENDING_LIMIT_KB).
CLEAN_EVERY_ROWS = 10_000
# A pause of this replica's appends after which the rows appended since the last merge
# are merged, however few.
IDLE_SECONDS = 1.0

# How long a merge waits for a lock: half of deadlock_timeout (the server's setting, 1 s
# by default), so it gives up before PostgreSQL would cancel an autovacuum holding it.
_LOCK_WAIT = """
SELECT set_config('lock_timeout',
    greatest(1, (extract(epoch FROM current_setting('deadlock_timeout')::interval) * 500)::int)
    || 'ms', true)
"""

# Every GIN index on messages (whatever its name or expression), merged.
_CLEAN = """
SELECT coalesce(sum(gin_clean_pending_list(i.indexrelid)), 0)
FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_am am ON am.oid = c.relam
WHERE i.indrelid = 'messages'::regclass AND am.amname = 'gin'
"""


class PendingListMerger:
    """The thread that merges the pending list; `appended` after every committed append."""

    def __init__(
        self,
        pool: psycopg_pool.ConnectionPool[Any],
        every_rows: int = CLEAN_EVERY_ROWS,
        idle_seconds: float = IDLE_SECONDS,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = pool
        # Real time by default (not the store's clock): the pause is of this replica's
        # own appends, and the thread waits for it in real time.
        self._now = now
        self._every = every_rows
        self._idle = idle_seconds
        self._lock = threading.Lock()
        self._rows = 0
        self._full = False
        self._last_append = now()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.enabled = False

    def start(self) -> None:
        """Merge once now: the role may merge, or the store keeps PostgreSQL's default."""
        try:
            self.merge()
        except psycopg.errors.InsufficientPrivilege:
            log.warning(
                "this role may not merge the search index's pending list; appends keep "
                "PostgreSQL's own gin_pending_list_limit"
            )
            return
        self.enabled = True
        self._thread = threading.Thread(target=self._run, name="contextd-pending-list", daemon=True)
        self._thread.start()

    @property
    def limit_kb(self) -> int | None:
        """The gin_pending_list_limit of an append's transaction (None: leave it)."""
        return PENDING_LIMIT_KB if self.enabled else None

    def appended(self, rows: int) -> None:
        """Count committed rows; wake the thread every `every_rows` of them (and at the
        first rows after a merge, to watch for a pause)."""
        if not self.enabled:
            return
        with self._lock:
            first = not self._rows
            self._rows += rows
            self._last_append = self._now()
            if self._rows >= self._every:
                self._rows = 0
                self._full = True
            elif not first:
                return
        # The count's merge, or the first rows since a merge: the thread then waits for
        # a pause of `_idle` (it waited without a timeout while nothing was unmerged).
        self._wake.set()

    def _rows_to_merge(self) -> int | None:
        """What the thread merges on waking: None for nothing; 0 for the count's merge;
        else the rows appended since the last merge, when no append came for `_idle`
        (taken from the count)."""
        with self._lock:
            if self._full:
                self._full = False
                return 0
            if not self._rows or self._now() - self._last_append < self._idle:
                return None
            rows, self._rows = self._rows, 0
            return rows

    def merge(self) -> int | None:
        """Merge the pending list of every GIN index on messages now; pages merged, or
        None when a lock it needs stayed held past `_LOCK_WAIT` (by an autovacuum, say):
        skipped, the next wake merges."""
        try:
            with self._pool.connection() as conn, conn.transaction():
                conn.execute(_LOCK_WAIT)
                row = conn.execute(_CLEAN).fetchone()
        except psycopg.errors.LockNotAvailable:
            return None
        return int(row[0]) if row else 0

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def merge_due(self) -> bool:
        """Merge now if a merge is due (the count's, or a pause's); whether one was."""
        idle = self._rows_to_merge()
        if idle is None:
            return False
        if self.merge() is None and idle:
            # Skipped for a held lock: counted again, so the next pause retries.
            with self._lock:
                self._rows += idle
        return True

    def _run(self) -> None:
        while True:
            with self._lock:
                timeout = self._idle if self._rows else None
            self._wake.wait(timeout)
            self._wake.clear()
            if self._stopping:
                return
            try:
                self.merge_due()
            except (psycopg.Error, psycopg_pool.PoolTimeout) as exc:
                # The next wake tries again; meanwhile appends merge past the backstop.
                if self._stopping:
                    return
                log.warning(
                    "merging the search index's pending list failed",
                    extra={"error": type(exc).__name__, "detail": str(exc)[:300]},
                )
