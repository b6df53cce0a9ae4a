"""The hot cache: what a build reads of a thread, kept in memory by the process that writes it.

Why: a warm BuildContext on DuckDB spent most of its time in about eight statements (the
agent, the thread's ref, its summary, its window's columns, its recent content, the scope's
status entries and thread activity), each costing DuckDB's per-statement overhead (0.7 to
3.7 ms) whatever the size of the answer. DuckDB allows one writing process and every write
of this store goes through its one writer thread (writer.py), so this process sees every
change and can keep a copy of those reads exactly coherent:

- after each commit, and before any caller of that commit is answered, the writer applies
  the commit's *effects*: committed appends extend the cached columns of their thread
  (NumPy arrays with amortized growth, no Python object per message) and its recent
  content; every other write job names what it touches (`Touches`) and that is dropped.
  A job that names nothing drops everything (the safe default).
- a cold entry is loaded by SQL, once, in a transaction whose state is the cache's own
  (see `HotCache.install`): it is installed only if no commit began or ended meanwhile.
- reads under `snapshot()` see one committed point: the first cached read of a snapshot
  fixes the cache generation `g0`; an entry is served only if it was last changed at or
  before `g0`. A read that must go to SQL opens the snapshot's DuckDB transaction and
  checks that no commit happened since `g0`; if one did after cached reads were served,
  the read raises `SnapshotMoved` and the caller runs its block again (then all in SQL).
- memory is bounded: entries are kept in one LRU by (estimated) bytes; the limit is the
  server's `--hot-cache-bytes` (0 turns the cache off).

The window is applied to the cached columns exactly as `base.window_predicate` applies it
in SQL (see `hot_entries.window_index`).

This module is the cache and its commit protocol (`HotCache`) with the conversion of an
append's batch into its columns; what it holds is hot_entries.py, the scope's thread
activity made from its rows hot_activity.py, and the store's reads that fill and serve it
(`HotMixin`, `snapshot()`) hot_reads.py.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from contextd.adapters.duckdb.base import Touches, log
from contextd.adapters.duckdb.hot_activity import ActivityKept
from contextd.adapters.duckdb.hot_entries import (
    CACHED_COLUMNS,
    MAX_SCOPE_ROWS,
    RECENT_CHARS,
    RECENT_MESSAGES,
    CachedThread,
    Rows,
    ScopeThread,
    SmallEntry,
    SnapshotView,
    message_bytes,
    message_chars,
    messages_of,
    thread_entry_key,
)
from contextd.adapters.duckdb.journal import Columns
from contextd.domain.model import ContextKey


def _grow(array: npt.NDArray[Any], n: int, extra: int) -> npt.NDArray[Any]:
    """`array` with room for `extra` more rows after its first `n` (amortized growth by
    half: a long thread's columns do not double past the cache's bound on one append).
    A reader holding the old array keeps a valid view of its first `n` rows."""
    if n + extra <= len(array):
        return array
    grown = np.empty(max(len(array) + len(array) // 2, n + extra, 16), dtype=array.dtype)
    grown[:n] = array[:n]
    return grown


class HotCache:
    """The entries, their LRU by bytes, and the commit protocol with the writer."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.lock = threading.Lock()
        self.gen = 0  # completed commits
        self.committing = 0  # commits begun and not yet applied
        self.entries: OrderedDict[tuple[Any, ...], CachedThread | SmallEntry] = OrderedDict()
        self.by_context_id: dict[int, ContextKey] = {}
        self.bytes = 0
        self.evictions = 0
        # Per scope: its thread rows (the entry's value, replaced on every change: kept
        # to be compared by identity), the clear marker applied, and the rows newest
        # first (`by_recency`): a build of a scope with many threads sorts them once.
        self.by_recency: dict[
            tuple[Any, ...], tuple[dict[str, ScopeThread], int, list[ScopeThread]]
        ] = {}
        # Per scope: the last `thread_activity` answered from the thread rows alone (no
        # thread to count from its messages), with what it is a function of
        # (`ActivityKept`): an agent's builds between two commits to its threads read
        # the same list (making it was a tenth of a build of an agent with 100 threads).
        # Kept from the second answer over the same rows on (the first keeps the rows
        # alone): a thread appended to before every build changes them every time.
        self.activity: dict[tuple[Any, ...], ActivityKept | dict[str, ScopeThread]] = {}

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    # ----------------------------------------------------------------- writer side

    def begin_commit(self) -> None:
        if self.enabled:
            with self.lock:
                self.committing += 1

    def end_commit(
        self,
        touches: Touches | None,
        appended: tuple[Rows, Iterable[int]] | None = None,
    ) -> None:
        """Apply one commit's effects (after its COMMIT, before its callers are answered):
        `touches` (None: everything) and the rows of committed appends with the context
        ids whose clear marker the append moved (a thread found expired)."""
        if not self.enabled:
            return
        with self.lock:
            self.gen += 1
            self.committing -= 1
            try:
                self._apply(touches, appended)
            except Exception:  # a bug here must not leave a stale entry: drop all
                log.exception("the hot cache failed to follow a commit; it starts empty")
                self._clear()

    def _apply(self, touches: Touches | None, appended: tuple[Rows, Iterable[int]] | None) -> None:
        if touches is None:
            self._clear()
            return
        for tenant, name in touches.agent_settings:
            self._drop(("a", tenant, name))
        for tenant, name in touches.agents:
            self._drop_where(lambda k, t=tenant, a=name: k[1] == t and k[2] == a)
        for tenant, name, scope in touches.scopes:
            self._drop_where(
                lambda k, t=tenant, a=name, s=scope: k[1:4] == (t, a, s) and k[0] != "s"
            )
        for tenant, name, scope in touches.status:
            self._drop(("s", tenant, name, scope))
        for key in touches.contexts:
            self._drop(thread_entry_key(key))
            self._drop(("t", key.tenant, key.agent, key.scope))
        if appended is not None:
            self._appended(*appended)

    def _appended(self, batch: Rows, expired: Iterable[int]) -> None:
        """Follow committed appends: each thread's cached entries take its rows.

        Most appends touch threads with nothing cached (a fleet of writers that nobody
        reads at the moment): those cost a few dict lookups, and the batch's NumPy
        columns are built only when some entry takes rows. This runs on the writer
        with the GIL held, before its callers are answered, so every microsecond here
        is one that the handler threads wait for."""
        # Threads the append found expired had their clear marker moved: their entries
        # (and their scope's thread rows) are dropped below, whichever are cached.
        moved = set(expired)
        if isinstance(batch, dict):
            if not batch["id"]:
                return
            tenants, agents, scopes, threads = (
                batch["tenant"],
                batch["agent"],
                batch["scope"],
                batch["thread"],
            )

            def key_of(row: int) -> ContextKey:
                return ContextKey(tenants[row], agents[row], scopes[row], threads[row])

            per_context: dict[int, list[int]] = {}
            for row, context_id in enumerate(batch["context_id"]):
                rows_of = per_context.get(context_id)
                if rows_of is None:
                    per_context[context_id] = [row]
                else:
                    rows_of.append(row)
            groups: Iterable[tuple[int, Sequence[int] | npt.NDArray[np.intp]]] = per_context.items()
        else:
            if batch.num_rows == 0:
                return
            context_ids = batch.column("context_id").to_numpy()

            def key_of(row: int) -> ContextKey:
                col = batch.column
                return ContextKey(
                    col("tenant")[row].as_py(),
                    col("agent")[row].as_py(),
                    col("scope")[row].as_py(),
                    col("thread")[row].as_py(),
                )

            order = np.argsort(context_ids, kind="stable")
            sorted_ids = context_ids[order]
            starts = np.flatnonzero(np.concatenate(([True], sorted_ids[1:] != sorted_ids[:-1])))
            bounds = [*starts.tolist(), len(sorted_ids)]
            groups = (
                (int(sorted_ids[a]), np.sort(order[a:b])) for a, b in itertools.pairwise(bounds)
            )
        arrays: dict[str, npt.NDArray[Any]] | None = None

        def arrays_of() -> dict[str, npt.NDArray[Any]]:
            nonlocal arrays
            if arrays is None:
                arrays = _batch_arrays(batch)
            return arrays

        entries = self.entries
        for context_id, rows in groups:
            key = key_of(int(rows[0]))
            if context_id in moved:
                self._drop(thread_entry_key(key))
                self._drop(("t", key.tenant, key.agent, key.scope))
                continue
            agent = entries.get(("a", key.tenant, key.agent))
            if isinstance(agent, SmallEntry) and agent.value is None:
                self._drop(("a", key.tenant, key.agent))  # an append created the agent
            scope = entries.get(("t", key.tenant, key.agent, key.scope))
            entry = entries.get(thread_entry_key(key))
            if entry is None and scope is None:
                continue  # nothing cached of this thread: no arrays needed
            indices = np.asarray(rows, dtype=np.intp)
            if scope is not None:
                self._count_in_scope(key, context_id, arrays_of(), indices)
            if entry is None:
                continue
            if isinstance(entry, SmallEntry):  # cached as absent: it exists now
                self._drop(thread_entry_key(key))
                continue
            if entry.context_id != context_id:
                self._drop(thread_entry_key(key))
                continue
            self._extend(entry, arrays_of(), batch, indices)
        self._evict()

    def _count_in_scope(
        self,
        key: ContextKey,
        context_id: int,
        arrays: dict[str, npt.NDArray[Any]],
        rows: npt.NDArray[np.intp],
    ) -> None:
        """Add an append's rows to its scope's cached thread rows (the live counters
        thread_activity reads), copy-on-write: a reader may hold the old mapping."""
        entry = self.entries.get(("t", key.tenant, key.agent, key.scope))
        if entry is None or not isinstance(entry, SmallEntry):
            return
        threads: dict[str, ScopeThread] = entry.value
        first_us = int(arrays["create"][rows].min())
        last_us = int(arrays["create"][rows].max())
        given = arrays["has_source"][rows]
        min_source = int(arrays["own"][rows][given].min()) if given.any() else None
        old = threads.get(key.thread)
        if old is None:
            if len(threads) >= MAX_SCOPE_ROWS:
                self._drop(("t", key.tenant, key.agent, key.scope))
                return
            new = ScopeThread(
                key.thread, context_id, last_us, len(rows), first_us, min_source, None
            )
        else:
            sources = [s for s in (old.min_source_time_us, min_source) if s is not None]
            new = ScopeThread(
                key.thread,
                old.context_id,
                max(old.last_message_time_us, last_us),
                old.message_count + len(rows),
                min(old.create_time_us, first_us),
                min(sources) if sources else None,
                old.last_clear_us,
            )
        entry.value = {**threads, key.thread: new}
        entry.changed = self.gen

    def _extend(
        self,
        entry: CachedThread,
        arrays: dict[str, npt.NDArray[Any]],
        batch: Rows,
        rows: npt.NDArray[np.intp],
    ) -> None:
        before = entry.size()
        entry.current = None  # whatever changes below, the next read makes a new view
        summary = arrays["is_summary"][rows]
        sequences = arrays["sequence"][rows]
        if entry.newest_sequence is not None and int(sequences.min()) <= entry.newest_sequence:
            return  # already loaded with these rows (a load raced this commit): kept as is
        entry.newest_sequence = int(sequences.max())
        creates = arrays["create"][rows]
        newest = int(creates.max())
        entry.newest_create = (
            newest if entry.newest_create is None else max(entry.newest_create, newest)
        )
        if summary.any():
            entry.ancestors = {}  # not only rows: the thread's summary changed
            srows = rows[summary]
            entry.summary_rows += tuple(
                (int(arrays["create"][r]), int(arrays["own"][r]), int(arrays["gs"][r]))
                for r in srows
            )
            last = messages_of(batch, srows[-1:])[0]
            entry.latest_summary = last
            entry.latest_summary_id = last.id
        plain = rows[~summary]
        k = len(plain)
        if k:
            n = entry.n
            for name, _dtype in CACHED_COLUMNS:
                grown = _grow(entry.cols[name], n, k)
                grown[n : n + k] = arrays[name][plain]
                entry.cols[name] = grown
            entry.n = n + k
            entry.has_source = entry.has_source or bool(arrays["has_source"][plain].any())
            newest_rows = plain[-RECENT_MESSAGES:]
            chars = arrays["all_chars"][newest_rows]
            within = np.cumsum(chars[::-1]) <= RECENT_CHARS
            keep = int(within.sum()) if len(within) else 0
            added = messages_of(batch, newest_rows[len(newest_rows) - keep :]) if keep else []
            added_bytes = sum(message_bytes(m) for m in added)
            if keep < k:  # the older part of the batch does not fit: recent starts anew
                entry.recent, entry.recent_chars = added, int(chars[len(chars) - keep :].sum())
                entry.recent_bytes = added_bytes
                entry.recent_from = entry.n - keep
            else:
                recent = entry.recent + added
                total = entry.recent_chars + int(chars.sum())
                nbytes = entry.recent_bytes + added_bytes
                drop = 0
                while len(recent) - drop > RECENT_MESSAGES or (
                    total > RECENT_CHARS and drop < len(recent)
                ):
                    total -= message_chars(recent[drop])
                    nbytes -= message_bytes(recent[drop])
                    drop += 1
                entry.recent = recent[drop:]
                entry.recent_chars = total
                entry.recent_bytes = nbytes
                entry.recent_from += drop
        entry.changed = self.gen
        self.bytes += entry.size() - before
        self.entries.move_to_end(thread_entry_key(entry.key))

    # ----------------------------------------------------------------- entries

    def _clear(self) -> None:
        self.entries.clear()
        self.by_context_id.clear()
        self.bytes = 0

    def _drop(self, key: tuple[Any, ...]) -> None:
        entry = self.entries.pop(key, None)
        if entry is None:
            return
        self.bytes -= entry.size()
        if isinstance(entry, CachedThread):
            self.by_context_id.pop(entry.context_id, None)

    def _drop_where(self, test: Any) -> None:
        for key in [k for k in self.entries if test(k)]:
            self._drop(key)

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self.entries:
            key = next(iter(self.entries))
            self._drop(key)
            self.evictions += 1

    def install(self, key: tuple[Any, ...], entry: CachedThread | SmallEntry, at_gen: int) -> None:
        """Install what a load read at generation `at_gen`, unless a commit began or
        ended since (then the read may be of another state: the next read loads again)."""
        with self.lock:
            if self.gen != at_gen or self.committing:
                return
            self._drop(key)
            entry.changed = at_gen
            size = entry.size()
            if size > self.max_bytes:
                return
            self.entries[key] = entry
            self.bytes += size
            if isinstance(entry, CachedThread):
                self.by_context_id[entry.context_id] = entry.key
            self._evict()

    def lookup(
        self, key: tuple[Any, ...], view: SnapshotView | None
    ) -> CachedThread | SmallEntry | None:
        """The entry for `key` if it may be served: outside a snapshot when present; in
        one, when it is unchanged since the snapshot's generation (fixed by its first
        cached read). Called under `lock`."""
        entry = self.entries.get(key)
        if view is not None:
            if view.sql_only:
                return None
            if view.g0 is None:
                if view.began or self.committing:
                    return None  # SQL was read first, or a commit is under way: SQL
                view.g0 = self.gen
            if entry is None or entry.changed > view.g0:
                return None
            view.served = True
        if entry is not None:
            self.entries.move_to_end(key)
        return entry


# Arrow batches of at most this many rows are converted through Python lists: a few Arrow
# compute calls cost more than that (a single-message append spent 0.26 ms here). Small
# journaled groups come as Python lists already (journal.py).
_SMALL_BATCH = 16


def _list_arrays(d: Columns) -> dict[str, npt.NDArray[Any]]:
    """`_batch_arrays` of a batch as Python lists (the writer's columns, or a small Arrow
    batch's): the same arrays."""
    create = d["create_time_us"]
    sequence = d["sequence"]
    source = d["source_time_us"]
    starts = d["group_start"]
    long = d["content_long"]
    i64 = np.int64
    return {
        "id": np.array(d["id"], dtype=i64),
        "role": np.array(d["role"], dtype=np.uint8),
        "token_count": np.array(d["token_count"], dtype=np.uint64),
        "chars": np.array(d["chars"], dtype=np.uint64),
        "group_id": np.array(d["group_id"], dtype=i64),
        "sequence": np.array(sequence, dtype=i64),
        "create": np.array(create, dtype=i64),
        "own": np.array(
            [c if s is None else s for s, c in zip(source, create, strict=True)], dtype=i64
        ),
        "gs": np.array(
            [q if g is None else g for g, q in zip(starts, sequence, strict=True)], dtype=i64
        ),
        "has_source": np.array([s is not None for s in source], dtype=bool),
        "is_summary": np.array(d["is_summary"], dtype=bool),
        "all_chars": np.array(
            [
                len(a) + (0 if b is None else len(b)) + len(t) + len(m)
                for a, b, t, m in zip(
                    d["content_short"], long, d["tool_calls"], d["metadata"], strict=True
                )
            ],
            dtype=i64,
        ),
    }


_SMALL_COLUMNS = [
    "id",
    "role",
    "token_count",
    "chars",
    "group_id",
    "sequence",
    "create_time_us",
    "source_time_us",
    "group_start",
    "is_summary",
    "content_short",
    "content_long",
    "tool_calls",
    "metadata",
]


def _batch_arrays(batch: Rows) -> dict[str, npt.NDArray[Any]]:
    """NumPy columns of an append's batch, in the cache's layout."""
    if isinstance(batch, dict):
        return _list_arrays(batch)
    if batch.num_rows <= _SMALL_BATCH:
        return _list_arrays(batch.select(_SMALL_COLUMNS).to_pydict())
    return _arrow_batch_arrays(batch)


def _arrow_batch_arrays(batch: pa.Table) -> dict[str, npt.NDArray[Any]]:
    col = batch.column
    create = col("create_time_us").to_numpy()
    source = col("source_time_us")
    has_source = ~np.asarray(source.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    own = np.where(has_source, source.fill_null(0).to_numpy(), create)
    sequence = col("sequence").to_numpy()
    group_start = col("group_start")
    gs = np.where(
        np.asarray(group_start.is_null().to_numpy(zero_copy_only=False), dtype=bool),
        sequence,
        group_start.fill_null(0).to_numpy(),
    )

    def lengths(name: str) -> npt.NDArray[np.int64]:
        return np.asarray(pc.utf8_length(col(name)).to_numpy(), dtype=np.int64)

    return {
        "id": col("id").to_numpy(),
        "role": col("role").to_numpy(),
        "token_count": col("token_count").to_numpy().astype(np.uint64),
        "chars": col("chars").to_numpy().astype(np.uint64),
        "group_id": col("group_id").to_numpy(),
        "sequence": sequence,
        "create": create,
        "own": own.astype(np.int64),
        "gs": gs.astype(np.int64),
        "has_source": has_source,
        "is_summary": np.asarray(col("is_summary").to_numpy(zero_copy_only=False), dtype=bool),
        "all_chars": lengths("content_short")
        + np.asarray(pc.utf8_length(col("content_long")).fill_null(0).to_numpy(), dtype=np.int64)
        + lengths("tool_calls")
        + lengths("metadata"),
    }
