"""The store's build reads served from the hot cache: `HotMixin` and its DuckDB loaders.

`HotMixin` answers the reads of a build (`ContextReader`, the agent, status entries and
thread activity) from the hot cache when it is on, and loads a cold entry by SQL once
(`_read_context`, `_read_status`), installing it only if no commit came meanwhile; its
`snapshot()` fixes the cache generation a snapshot's reads are of. Kept apart from the
cache (hot.py) and its entries (hot_entries.py): this is the only part that runs SQL.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import duckdb
import numpy as np
import numpy.typing as npt
import pyarrow as pa

from contextd.adapters.duckdb.agents import AgentsMixin
from contextd.adapters.duckdb.base import _find_agent, _first
from contextd.adapters.duckdb.hot import HotCache
from contextd.adapters.duckdb.hot_activity import (
    ActivityKept,
    activity_kept,
    activity_of,
    by_recency,
    newest_of,
    partial_threads,
)
from contextd.adapters.duckdb.hot_entries import (
    ENTRY_OVERHEAD,
    MAX_RECENCY_ORDERS,
    MAX_SCOPE_ROWS,
    RECENT_CHARS,
    RECENT_MESSAGES,
    WINDOW_COLUMNS,
    CachedThread,
    ContextView,
    ScopeThread,
    SmallEntry,
    SnapshotView,
    agent_bytes,
    message_chars,
    new_context,
    small,
    status_bytes,
    thread_entry_key,
    window_count,
)
from contextd.adapters.duckdb.messages import MessagesMixin
from contextd.adapters.duckdb.status import StatusMixin
from contextd.adapters.rows import MESSAGE_COLUMNS, message_from_row, status_from_row
from contextd.domain.context import StatusEntry, ThreadActivity, derived
from contextd.domain.errors import NotFound
from contextd.domain.model import Agent, ContextKey, StoredMessage
from contextd.domain.window import WindowSpec
from contextd.ports.store import ContextRef, SnapshotMoved


@dataclass(slots=True)
class LoadStats:
    """Counts for tests and operators: loads, hits, and snapshots run again."""

    hits: int = 0
    loads: int = 0
    moved: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class HotMixin(AgentsMixin, MessagesMixin, StatusMixin):
    """The build's reads of `ContextReader` (and the agent, status and activity reads of
    its preamble) served from the hot cache when it is on; SQL (the next mixins) when off.

    Every cold entry is loaded once by SQL (`_load`) and served from then on; a read that
    cannot be served from memory (a build reaching older than the cached recent content,
    a scope with too many threads to count) goes to SQL in the snapshot's transaction.
    """

    _hot: HotCache
    hot_stats: LoadStats

    # ----------------------------------------------------------------- snapshots

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[None]:
        """As `DuckDBBase.snapshot`, but the DuckDB transaction begins only when a read
        needs SQL: a warm build reads nothing but memory (see the module docstring)."""
        if not self._hot.enabled:
            with super().snapshot():
                yield
            return
        if getattr(self._local, "hot_view", None) is not None:
            yield  # nested: joins the outer block
            return
        view = SnapshotView(sql_only=bool(self._local.__dict__.pop("hot_sql_next", False)))
        self._local.hot_view = view
        try:
            yield
        except BaseException:
            if view.began:
                with contextlib.suppress(duckdb.Error):
                    super()._cursor().execute("ROLLBACK")
            raise
        else:
            if view.began:
                super()._cursor().execute("COMMIT")
        finally:
            self._local.hot_view = None

    def _cursor(self, live: bool = False) -> duckdb.DuckDBPyConnection:
        cur = super()._cursor(live)
        if not live:
            view: SnapshotView | None = getattr(self._local, "hot_view", None)
            if view is not None and not view.began:
                self._begin_view(cur, view)
        return cur

    def _begin_view(self, cur: duckdb.DuckDBPyConnection, view: SnapshotView) -> None:
        """Open the snapshot's DuckDB transaction. If cached reads fixed its generation,
        the transaction must see that same state: pinned, then checked against commits."""
        cur.execute("BEGIN TRANSACTION")
        view.began = True
        if view.g0 is None:
            view.sql_only = True
            return
        _first(cur.execute("SELECT 1 FROM store_state LIMIT 1"))  # pins its snapshot
        with self._hot.lock:
            same = self._hot.gen == view.g0 and not self._hot.committing
        if same:
            return
        if view.served:
            self.hot_stats.moved += 1
            self._local.hot_sql_next = True
            raise SnapshotMoved("a commit happened during this snapshot's cached reads")
        view.sql_only = True

    def _view(self) -> SnapshotView | None:
        view: SnapshotView | None = getattr(self._local, "hot_view", None)
        return view

    def build_token(
        self, context: ContextRef, window: WindowSpec
    ) -> tuple[int, tuple[int, int | None, int | None, int]] | None:
        """What every read of this snapshot so far saw, for a build of `context` over
        `window`: equal tokens mean equal reads (a builder memoizes a build's result by
        it, see `ContextBuilder.build`); None when that cannot be told (a read went to
        SQL, the cache is off, or the window is not a run of the thread's messages).

        Every read of the snapshot was served from entries unchanged since its generation
        `g0`, and each commit moves the generation: so the reads were of the committed
        state `g0`. A window names its messages by its bounds in microseconds, which move
        with the clock; the run of positions they select only moves when a message enters
        or leaves it, so the token carries the run, not the bounds. Call it inside the
        snapshot, after the reads it stands for. The first item is the generation:
        a token of an older one is never made again by a new snapshot. The second names
        the thread's reads alone: (context id, the window's run, the view's serial), equal
        only for the same state of the thread, whatever other threads committed since."""
        view = self._view()
        if view is None or view.sql_only or view.began or view.g0 is None:
            return None
        if view.token is not None and view.token[0] == (context.context_id, window):
            return view.token[1]  # asked again after the window's reads, all cached
        v = self._context_of(context)
        if v is None or view.began:
            return None
        index = v.index(window)
        if not isinstance(index, slice):
            return None
        token = (view.g0, (context.context_id, index.start, index.stop, v.serial))
        view.token = ((context.context_id, window), token)
        return token

    # ----------------------------------------------------------------- loading

    def _cached(self, key: tuple[Any, ...]) -> CachedThread | SmallEntry | None:
        with self._hot.lock:
            entry = self._hot.lookup(key, self._view())
        if entry is not None:
            self.hot_stats.hits += 1
        return entry

    def _load(
        self,
        key: tuple[Any, ...],
        read: Callable[[duckdb.DuckDBPyConnection], CachedThread | SmallEntry],
    ) -> CachedThread | SmallEntry | None:
        """Read a cold entry by SQL and install it if it is of the cache's state; None when
        this snapshot must read by SQL instead (it began in SQL)."""
        view = self._view()
        self.hot_stats.loads += 1
        if view is not None:
            if view.sql_only:
                return None
            at = view.g0
            entry = read(self._cursor())  # in the snapshot's transaction (pinned at g0)
            if view.sql_only or at is None:
                return entry  # the transaction is of a later state: serve, keep nothing
            self._hot.install(key, entry, at)
            view.served = True
            return entry
        with self._hot.lock:
            at = self._hot.gen
            busy = self._hot.committing
        cur = super()._cursor()
        cur.execute("BEGIN TRANSACTION")
        try:
            entry = read(cur)
        except BaseException:
            with contextlib.suppress(duckdb.Error):
                cur.execute("ROLLBACK")
            raise
        cur.execute("COMMIT")
        if not busy:
            self._hot.install(key, entry, at)
        return entry

    def _context(self, key: ContextKey) -> CachedThread | bool | None:
        """The cached thread (None: it has no messages), or False: read by SQL."""
        entry = self._cached(thread_entry_key(key))
        if entry is None:
            entry = self._load(thread_entry_key(key), lambda cur: _read_context(cur, key))
            if entry is None:
                return False
        return entry if isinstance(entry, CachedThread) else None

    def _context_of(self, ref: ContextRef) -> ContextView | None:
        if not self._hot.enabled or ref.key is None:
            return None
        found = self._context(ref.key)
        if not isinstance(found, CachedThread) or found.context_id != ref.context_id:
            return None
        with self._hot.lock:
            view = self._view()
            if view is not None and view.g0 is not None and found.changed > view.g0:
                # Changed since the snapshot's first cached read (after its lookup): the
                # view is of a later state; SQL tells whether the snapshot moved.
                return None
            return found.view()

    # ----------------------------------------------------------------- the reads

    def get_agent(self, tenant: str, name: str) -> Agent:
        agent = self.find_agent(tenant, name)
        if agent is None:
            raise NotFound(f"agent {name!r} does not exist", reason="AGENT_NOT_FOUND")
        return agent

    def find_agent(self, tenant: str, name: str) -> Agent | None:
        if not self._hot.enabled:
            return super().find_agent(tenant, name)
        key = ("a", tenant, name)
        entry = self._cached(key)
        if entry is None:

            def read(cur: duckdb.DuckDBPyConnection) -> SmallEntry:
                found = _find_agent(cur, tenant, name)
                return small(found, agent_bytes(found) if found else ENTRY_OVERHEAD)

            entry = self._load(key, read)
            if entry is None:
                return super().find_agent(tenant, name)
        assert isinstance(entry, SmallEntry)
        found: Agent | None = entry.value
        return found

    def context_ref(self, key: ContextKey) -> ContextRef | None:
        if not self._hot.enabled:
            return super().context_ref(key)
        found = self._context(key)
        if found is False:
            return super().context_ref(key)
        if not isinstance(found, CachedThread):
            return None
        return ContextRef(found.context_id, found.last_clear_us, found.latest_summary_id, key)

    def latest_summary(self, context: ContextRef) -> StoredMessage | None:
        v = self._context_of(context)
        if v is None:
            return super().latest_summary(context)
        return v.latest_summary

    def window_columns(self, context: ContextRef, window: WindowSpec) -> pa.Table:
        v = self._context_of(context)
        if v is None:
            return super().window_columns(context, window)
        return v.window_table(v.index(window))

    def window_arrays(
        self, context: ContextRef, window: WindowSpec
    ) -> dict[str, npt.NDArray[Any]] | None:
        """`window_columns` as NumPy views of the cached columns, no Arrow table made
        (a build converts each column back to NumPy: after an append, making the new
        view's table cost a 10,000-message build about 0.1 ms); None when the thread is
        not served from the cache (read `window_columns`). Read-only by contract."""
        if not self._hot.enabled:
            return None
        v = self._context_of(context)
        if v is None:
            return None
        index = v.index(window)
        cols = v.cols
        return {name: cols[name][index] for name in WINDOW_COLUMNS}

    def appended_window(
        self, context: ContextRef, window: WindowSpec, since: Hashable
    ) -> tuple[dict[str, npt.NDArray[Any]], int, list[StoredMessage]] | None:
        """`window_arrays` of this snapshot's state of the thread, how many of its first
        rows are the whole window `since` named (the second item of an earlier
        `build_token`), and the messages after those (what `window_messages_from` reads
        of them: the cached objects, which the writer derived when it took them in),
        when that window ran to the thread's newest message, this one starts at the
        same message and differs from it by appended non-summary messages alone, and
        those are among the cached content; None otherwise (the caller reads the window
        afresh).

        Only appends change a cached thread in place (`HotCache._extend`); every other
        change (a clear, a delete, an update, a retention pass, a stored summary, agent
        settings) drops it, and a reloaded thread's views name no ancestors. So a view
        that names `since`'s view as its ancestor holds that view's rows as its first
        rows, unchanged, and the same summary and clear marker."""
        if not self._hot.enabled or not isinstance(since, tuple) or len(since) != 4:
            return None
        context_id, start, stop, serial = since
        if context_id != context.context_id or start is None or stop is None:
            return None
        v = self._context_of(context)
        if v is None or v.context_id != context_id:
            return None
        rows = v.ancestors.get(serial)
        if rows is None or rows != stop:
            return None  # not an ancestor, or its window ended before its newest row
        index = v.index(window)
        n = len(v.cols["id"])
        if not isinstance(index, slice) or (index.start or 0) != start:
            return None  # the window's start moved (its clock, its settings)
        if (n if index.stop is None else index.stop) != n or stop < v.recent_from:
            return None  # not a suffix of the thread, or older than the cached content
        cols = v.cols
        return (
            {name: cols[name][index] for name in WINDOW_COLUMNS},
            stop - start,
            v.recent[stop - v.recent_from :],
        )

    def window_messages_from(
        self,
        context: ContextRef,
        window: WindowSpec,
        from_sequence: int,
        id_range: tuple[int, int],
    ) -> list[StoredMessage]:
        v = self._context_of(context)
        if v is None:
            return super().window_messages_from(context, window, from_sequence, id_range)
        at = int(v.cols["sequence"].searchsorted(from_sequence, side="left"))
        if at < v.recent_from:  # older than the cached content: read by SQL
            return super().window_messages_from(context, window, from_sequence, id_range)
        index = v.index(window)
        n = len(v.cols["id"])
        if isinstance(index, slice):
            positions = np.arange(max(at, index.start or 0), n)
        else:
            positions = index[index >= at]
        ids = v.cols["id"][positions]
        positions = positions[(ids >= id_range[0]) & (ids <= id_range[1])]
        if len(positions) and int(positions[-1]) - int(positions[0]) + 1 == len(positions):
            # Consecutive (the usual window suffix): one slice of the kept objects.
            first = int(positions[0]) - v.recent_from
            return v.recent[first : first + len(positions)]
        return [v.recent[p - v.recent_from] for p in positions.tolist()]

    def list_status(
        self,
        tenant: str,
        agent: str,
        scope: str,
        after_key: str | None,
        limit: int,
        live_at_us: int | None,
    ) -> list[StatusEntry]:
        if not self._hot.enabled:
            return super().list_status(tenant, agent, scope, after_key, limit, live_at_us)
        key = ("s", tenant, agent, scope)
        entry = self._cached(key)
        if entry is None:
            entry = self._load(key, lambda cur: _read_status(cur, tenant, agent, scope))
        if entry is None or not isinstance(entry, SmallEntry) or entry.value is None:
            return super().list_status(tenant, agent, scope, after_key, limit, live_at_us)
        entries: list[StatusEntry] = entry.value
        after = after_key or ""
        chosen = [
            e
            for e in entries
            if e.key > after
            and (live_at_us is None or e.expire_time_us is None or e.expire_time_us > live_at_us)
        ]
        return chosen[:limit]

    def thread_activity(
        self, tenant: str, agent: str, scope: str, window: WindowSpec, limit: int
    ) -> list[ThreadActivity]:
        if not self._hot.enabled:
            return super().thread_activity(tenant, agent, scope, window, limit)
        key = ("t", tenant, agent, scope)
        entry = self._cached(key)
        if entry is None:
            entry = self._load_scope(key, tenant, agent, scope)
        if entry is None or not isinstance(entry, SmallEntry) or entry.value is None:
            return super().thread_activity(tenant, agent, scope, window, limit)
        threads: dict[str, ScopeThread] = entry.value
        before = self._hot.activity.get(key)
        if isinstance(before, ActivityKept) and before.answers(threads, window, limit):
            return before.activity
        kept = self._hot.by_recency.get(key)
        if kept is not None and kept[0] is threads and kept[1] == window.clear_after_us:
            ordered = kept[2]
        else:
            ordered = by_recency(threads.values(), window)
            if len(self._hot.by_recency) >= MAX_RECENCY_ORDERS:
                self._hot.by_recency.clear()
            self._hot.by_recency[key] = (threads, window.clear_after_us, ordered)
        newest = newest_of(ordered, window, limit)
        partial = partial_threads(newest, window)
        if len(partial) > 8:
            return super().thread_activity(tenant, agent, scope, window, limit)
        counts: dict[int, int] = {}
        for t in partial:
            found = self._context(ContextKey(tenant, agent, scope, t.thread))
            if not isinstance(found, CachedThread) or found.context_id != t.context_id:
                return super().thread_activity(tenant, agent, scope, window, limit)
            with self._hot.lock:
                v = found.view()
            counts[t.context_id] = window_count(v, window.with_thread_clear(t.last_clear_us))
        activity = activity_of(newest, counts)
        again = before is threads or (
            isinstance(before, ActivityKept) and before.threads is threads
        )
        remembered = (
            activity_kept(threads, window, limit, newest, activity)
            if again and not partial
            else None
        )
        if len(self._hot.activity) >= MAX_RECENCY_ORDERS:
            self._hot.activity.clear()
        self._hot.activity[key] = threads if remembered is None else remembered
        return activity

    def _load_scope(
        self, key: tuple[Any, ...], tenant: str, agent: str, scope: str
    ) -> SmallEntry | None:
        """A scope's live thread rows (read outside any transaction, as every read of
        thread counters is), installed only if no commit began or ended meanwhile."""
        view = self._view()
        if view is not None and (view.sql_only or (view.began and view.g0 is None)):
            return None
        with self._hot.lock:
            at = self._hot.gen
            busy = self._hot.committing
        self.hot_stats.loads += 1
        rows = self._thread_rows(
            "SELECT thread, context_id, last_message_time_us, message_count, create_time_us, "
            "min_source_time_us, last_clear_us FROM live_threads "
            "WHERE tenant = ? AND agent = ? AND scope = ? LIMIT ?",
            [tenant, agent, scope, MAX_SCOPE_ROWS + 1],
        )
        with self._hot.lock:
            same = not busy and self._hot.gen == at and not self._hot.committing
        if view is not None and (not same or view.g0 != at):
            return None  # of another state than the snapshot's: read by SQL
        value = None
        if len(rows) <= MAX_SCOPE_ROWS:
            value = {r[0]: ScopeThread(*r) for r in rows}
        entry = small(value, ENTRY_OVERHEAD + 200 * len(rows))
        if same:
            self._hot.install(key, entry, at)
        return entry


def _read_status(cur: duckdb.DuckDBPyConnection, tenant: str, agent: str, scope: str) -> SmallEntry:
    rows = cur.execute(
        "SELECT key, kind, state, summary, update_time_us, expire_time_us "
        "FROM status_entries WHERE tenant = ? AND agent = ? AND scope = ? ORDER BY key LIMIT ?",
        [tenant, agent, scope, MAX_SCOPE_ROWS + 1],
    ).fetchall()
    if len(rows) > MAX_SCOPE_ROWS:
        return small(None)
    entries = [status_from_row(r) for r in rows]
    return small(entries, status_bytes(entries))


def _read_context(cur: duckdb.DuckDBPyConnection, key: ContextKey) -> CachedThread | SmallEntry:
    """A thread's columns, summary and recent content, read by SQL in `cur`'s transaction."""
    row = _first(
        cur.execute(
            "SELECT context_id, last_clear_us, latest_summary_id FROM threads "
            "WHERE tenant = ? AND agent = ? AND scope = ? AND thread = ?",
            [key.tenant, key.agent, key.scope, key.thread],
        )
    )
    if row is None:
        return small(None)
    context_id, last_clear, summary_id = int(row[0]), row[1], int(row[2])
    table = (
        cur.sql(
            "SELECT id, role, token_count::UBIGINT AS token_count, chars::UBIGINT AS chars, "
            'group_id, sequence, create_time_us AS "create", '
            "coalesce(source_time_us, create_time_us) AS own, "
            "coalesce(group_start, sequence) AS gs, source_time_us IS NOT NULL AS given, "
            "is_summary FROM messages WHERE context_id = ? ORDER BY sequence",
            params=[context_id],
        )
        .to_arrow_table()
        .combine_chunks()
    )
    arrays = {
        name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names
    }
    summary = np.asarray(arrays["is_summary"], dtype=bool)
    newest = (
        (int(arrays["sequence"].max()), int(arrays["create"].max()))
        if table.num_rows
        else (None, None)
    )
    summary_rows = [
        (int(arrays["create"][i]), int(arrays["own"][i]), int(arrays["gs"][i]))
        for i in np.flatnonzero(summary).tolist()
    ]
    plain = {name: a[~summary] for name, a in arrays.items()}
    latest = None
    if summary_id:
        found = _first(
            cur.execute(
                f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE id = ? AND context_id = ?",
                [summary_id, context_id],
            )
        )
        latest = message_from_row(found) if found else None
    n = len(plain["id"])
    recent: list[StoredMessage] = []
    if n:
        chars = np.asarray(plain["chars"][-RECENT_MESSAGES:], dtype=np.int64)
        keep = int((np.cumsum(chars[::-1]) <= RECENT_CHARS).sum())
        if keep:
            start = n - keep
            rows = cur.execute(
                f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE id BETWEEN ? AND ? "
                "AND context_id = ? AND NOT is_summary AND sequence >= ? ORDER BY sequence",
                [
                    int(plain["id"][start:].min()),
                    int(plain["id"][start:].max()),
                    context_id,
                    int(plain["sequence"][start]),
                ],
            ).fetchall()
            recent = [message_from_row(r) for r in rows]
            for m in recent:
                derived(m)  # what a build derives, made once (see `messages_of`)
            while recent and sum(message_chars(m) for m in recent) > 2 * RECENT_CHARS:
                recent = recent[len(recent) // 2 :]
    return new_context(
        key,
        context_id,
        last_clear,
        summary_id,
        latest,
        plain,
        newest,
        summary_rows,
        recent,
        bool(np.asarray(plain["given"], dtype=bool).any()),
    )
