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
  (see `HotCache.loaded`): it is installed only if no commit began or ended meanwhile.
- reads under `snapshot()` see one committed point: the first cached read of a snapshot
  fixes the cache generation `g0`; an entry is served only if it was last changed at or
  before `g0`. A read that must go to SQL opens the snapshot's DuckDB transaction and
  checks that no commit happened since `g0`; if one did after cached reads were served,
  the read raises `SnapshotMoved` and the caller runs its block again (then all in SQL).
- memory is bounded: entries are kept in one LRU by (estimated) bytes; the limit is the
  server's `--hot-cache-bytes` (0 turns the cache off).

The window is applied to the cached columns exactly as `base.window_predicate` applies it
in SQL (see `window_index`).
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import duckdb
import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from contextd.adapters.duckdb.agents import AgentsMixin
from contextd.adapters.duckdb.base import Touches, _find_agent, _first, log
from contextd.adapters.duckdb.journal import Columns
from contextd.adapters.duckdb.messages import MessagesMixin
from contextd.adapters.duckdb.status import StatusMixin
from contextd.adapters.rows import MESSAGE_COLUMNS, message_from_row, status_from_row
from contextd.domain.context import StatusEntry, ThreadActivity, derived
from contextd.domain.errors import NotFound
from contextd.domain.model import Agent, ContextKey, Role, StoredMessage
from contextd.domain.window import MAX_SOURCE_LEAD_US, WindowSpec
from contextd.ports.store import ContextRef, SnapshotMoved

# An append's rows as the writer hands them over: an Arrow batch, or (a small journaled
# group) its columns as Python lists.
Rows: TypeAlias = pa.Table | Columns

# The default bound of the cache's memory (the server's --hot-cache-bytes).
DEFAULT_HOT_CACHE_BYTES = 256 << 20
# The newest messages of a thread whose content is kept, at most this many characters
# (content, tool calls and metadata) and this many messages: a build with a budget of
# 100k tokens reads about 1.2 MB of it; a larger one reads the rest by SQL.
RECENT_CHARS = 1 << 20
RECENT_MESSAGES = 4_096
# A scope with more status entries or threads than this is not cached (read by SQL).
MAX_SCOPE_ROWS = 1_000
# Scopes whose threads are kept in recency order (`HotCache.by_recency`), at most.
MAX_RECENCY_ORDERS = 256
# Bytes counted per cached message beyond its strings: the object (21 slots, about 200
# bytes in CPython 3.11) and up to seven integers of 32 bytes (a summary's id pair is
# counted with the entry's summary rows), and per small entry.
_MESSAGE_OVERHEAD = 424
# Bytes counted per cached message for what builds derive from it and keep on it
# (`contextd.domain.context.derived`, made when the message is taken in): its history
# item (120), stamp (56) and their pair (56); then, at its first build, its cost memo
# (64), the item counted at that cost (120) with its own memo (64) and the cost (32).
_DERIVED_BYTES = 512
_ENTRY_OVERHEAD = 512
# Bytes per row of the cached columns (8 int64 columns and a uint8 role).
_ROW_BYTES = 8 * 8 + 1


def _ckey(key: ContextKey) -> tuple[str, ...]:
    """The cache key of a thread's entry."""
    return ("c", key.tenant, key.agent, key.scope, key.thread)


def _grow(array: npt.NDArray[Any], n: int, extra: int) -> npt.NDArray[Any]:
    """`array` with room for `extra` more rows after its first `n` (amortized growth by
    half: a long thread's columns do not double past the cache's bound on one append).
    A reader holding the old array keeps a valid view of its first `n` rows."""
    if n + extra <= len(array):
        return array
    grown = np.empty(max(len(array) + len(array) // 2, n + extra, 16), dtype=array.dtype)
    grown[:n] = array[:n]
    return grown


_COLUMNS = (
    ("id", np.int64),
    ("role", np.uint8),
    ("token_count", np.uint64),
    ("chars", np.uint64),
    ("group_id", np.int64),
    ("sequence", np.int64),
    ("create", np.int64),
    ("own", np.int64),  # coalesce(source_time_us, create_time_us)
    ("gs", np.int64),  # coalesce(group_start, sequence)
)


@dataclass(slots=True)
class ContextView:
    """One thread as of one committed point: what the cached reads of a build use."""

    key: ContextKey
    context_id: int
    last_clear_us: int | None
    latest_summary_id: int
    latest_summary: StoredMessage | None
    cols: dict[str, npt.NDArray[Any]]  # the thread's non-summary messages, by sequence
    has_source: bool
    newest_sequence: int | None  # over every message, summaries included
    newest_create: int | None
    summary_rows: tuple[tuple[int, int, int], ...]  # (create, own, gs) of stored summaries
    recent: list[StoredMessage]  # the newest non-summary messages, by sequence
    recent_from: int  # the column index of recent[0]
    # The window tables served from this view, by (start, stop) of a contiguous window:
    # every build of a hot thread asks for the same one until the next append, and making
    # an Arrow table of six columns (zero-copy, but not free) was a tenth of a warm build.
    # Immutable, and the view's columns never change, so readers share them.
    tables: dict[tuple[int, int], pa.Table] = field(default_factory=dict)
    # This view's number, never given to another (`_VIEW_SERIALS`): a view is one state of
    # its thread and never changes, so equal serials mean equal reads of the thread
    # (`build_token` carries it: a builder's window memo outlives other threads' commits).
    serial: int = 0
    # Earlier views of this thread that this one differs from by appends of non-summary
    # messages alone, by serial: how many rows each had (its columns are this view's
    # first rows). Any other change drops the cached thread, so a reloaded thread's
    # views have none (`appended_window` extends a remembered window only from these).
    ancestors: dict[int, int] = field(default_factory=dict)

    # The windows' positions (`window_index`) asked of this view, the contiguous ones:
    # a build after an append asks for them twice (its token, then its columns).
    indexes: dict[WindowSpec, slice] = field(default_factory=dict)

    def index(self, window: WindowSpec) -> slice | npt.NDArray[np.intp]:
        """`window_index(self, window)`, a contiguous one kept (a function of the view,
        which never changes, and the window)."""
        found = self.indexes.get(window)
        if found is not None:
            return found
        index = window_index(self, window)
        if isinstance(index, slice):
            if len(self.indexes) >= _VIEW_TABLES:
                self.indexes.clear()
            self.indexes[window] = index
        return index

    def window_table(self, index: slice | npt.NDArray[np.intp]) -> pa.Table:
        """`window_table` of this view, made once per contiguous window."""
        if not isinstance(index, slice):
            return window_table(self, index)
        key = (index.start or 0, len(self.cols["id"]) if index.stop is None else index.stop)
        table = self.tables.get(key)
        if table is None:
            if len(self.tables) >= _VIEW_TABLES:
                self.tables.clear()
            table = self.tables[key] = window_table(self, index)
        return table


# The numbers of views (`ContextView.serial`): one count for the process, so that no two
# views of any thread, before or after a drop and reload, share one.
_VIEW_SERIALS = itertools.count(1)

# Earlier views a view names as its ancestors (`ContextView.ancestors`): a builder
# remembers the window of the last build of a thread, made one or a few views ago.
_VIEW_ANCESTORS = 4

# Window tables kept per view (windows of one thread differ only by the agent's clear
# markers and ages, so one or two are in use).
_VIEW_TABLES = 4


@dataclass(slots=True)
class _Context:
    """A cached thread; mutated only by the writer (under the cache's lock), appends only
    past the rows a reader may hold."""

    key: ContextKey
    context_id: int
    last_clear_us: int | None
    latest_summary_id: int
    latest_summary: StoredMessage | None
    cols: dict[str, npt.NDArray[Any]]
    n: int
    has_source: bool
    newest_sequence: int | None
    newest_create: int | None
    summary_rows: tuple[tuple[int, int, int], ...]
    recent: list[StoredMessage]
    recent_from: int
    recent_chars: int
    recent_bytes: int  # what `recent` holds in memory (see `_message_bytes`)
    changed: int = 0
    # The view of the current state, made at the first read after a change (`_extend`
    # drops it): the reads of a build, and every build until the next append, share it.
    current: ContextView | None = None
    # The views made since the thread was loaded whose state this one extends by appends
    # of non-summary messages alone (serial: rows), the newest last; emptied when an
    # append stores a summary (the thread's summary changed, not only its rows).
    ancestors: dict[int, int] = field(default_factory=dict)

    def view(self) -> ContextView:
        if self.current is None:
            self.current = self._new_view()
        return self.current

    def _new_view(self) -> ContextView:
        view = self._make_view()
        if len(self.ancestors) >= _VIEW_ANCESTORS:
            del self.ancestors[next(iter(self.ancestors))]
        self.ancestors[view.serial] = self.n
        return view

    def _make_view(self) -> ContextView:
        return ContextView(
            self.key,
            self.context_id,
            self.last_clear_us,
            self.latest_summary_id,
            self.latest_summary,
            {name: a[: self.n] for name, a in self.cols.items()},
            self.has_source,
            self.newest_sequence,
            self.newest_create,
            self.summary_rows,
            self.recent,
            self.recent_from,
            serial=next(_VIEW_SERIALS),
            ancestors=dict(self.ancestors),
        )

    def size(self) -> int:
        capacity = len(self.cols["id"])  # every column has this many rows allocated
        summary = self.latest_summary
        return (
            _ENTRY_OVERHEAD
            + capacity * _ROW_BYTES
            + self.recent_bytes
            + (_message_bytes(summary) if summary is not None else 0)
            + 100 * len(self.summary_rows)
        )


@dataclass(slots=True)
class _Small:
    """A cached agent, status list, scope activity rows or absent thread."""

    value: Any
    nbytes: int
    changed: int = 0

    def size(self) -> int:
        return self.nbytes


@dataclass(frozen=True, slots=True)
class ScopeThread:
    """A thread of a scope as thread_activity reads it (live counters)."""

    thread: str
    context_id: int
    last_message_time_us: int
    message_count: int
    create_time_us: int
    min_source_time_us: int | None
    last_clear_us: int | None


@dataclass(slots=True)
class _View:
    """A snapshot's state (thread-local): the generation its cached reads are of."""

    g0: int | None = None
    sql_only: bool = False
    began: bool = False
    served: bool = False
    # The last `build_token` asked, by (context id, window), and its answer.
    token: (
        tuple[tuple[int, WindowSpec], tuple[int, tuple[int, int | None, int | None, int]]] | None
    ) = None


def window_index(v: ContextView, window: WindowSpec) -> slice | npt.NDArray[np.intp]:
    """The positions of `v`'s messages in `window`: `base.window_predicate` on the cached
    columns. Commit times never go back within a thread and sequences grow, so the clear
    marker, a window without client times and the cap's floor are binary searches; client
    times and tool groups are checked on the rest only."""
    cols = v.cols
    n = len(cols["id"])
    if window.retains:
        if v.newest_create is None or v.newest_sequence is None:
            return slice(0, 0)
        if window.expire_after_us is not None and not v.newest_create > window.expire_after_us:
            return slice(0, 0)
    create = cols["create"]
    # The arrays' own `searchsorted`: `np.searchsorted` dispatches through NumPy's
    # function protocol first, which cost a build after an append (a new view of the
    # thread, so a window searched anew) about 2 us a search, five times the search.
    # One search for both time bounds: past the later one is past both.
    # A message's own time is at most MAX_SOURCE_LEAD_US after its commit time.
    age = window.age_after_us - MAX_SOURCE_LEAD_US if v.has_source else window.age_after_us
    start = int(create.searchsorted(max(window.clear_after_us, age), side="right"))
    floor = 0
    if window.max_messages:
        assert v.newest_sequence is not None
        floor = v.newest_sequence - window.max_messages
        start = max(start, int(cols["sequence"].searchsorted(floor, side="right")))
    if start >= n:
        return slice(n, n)
    mask: npt.NDArray[np.bool_] | None = None
    if v.has_source:
        mask = cols["own"][start:] > window.age_after_us
    if window.max_messages:
        capped = cols["gs"][start:] > floor
        mask = capped if mask is None else mask & capped
    if mask is None or bool(mask.all()):
        return slice(start, n)
    return start + np.flatnonzero(mask)


def window_count(v: ContextView, window: WindowSpec) -> int:
    """How many messages of the thread, stored summaries included, are in `window`."""
    index = v.index(window)
    n = len(v.cols["id"])
    count = len(range(*index.indices(n))) if isinstance(index, slice) else len(index)
    for create, own, gs in v.summary_rows:
        if create <= window.clear_after_us or own <= window.age_after_us:
            continue
        if window.retains:
            assert v.newest_create is not None and v.newest_sequence is not None
            if window.expire_after_us is not None and not v.newest_create > window.expire_after_us:
                continue
            if window.max_messages and not gs > v.newest_sequence - window.max_messages:
                continue
        count += 1
    return count


# The columns of `ContextReader.window_columns`, in its order.
WINDOW_COLUMNS = ("id", "role", "token_count", "chars", "group_id", "sequence")


def window_table(v: ContextView, index: slice | npt.NDArray[np.intp]) -> pa.Table:
    """The window's columns as `ContextReader.window_columns` returns them."""
    cols = v.cols
    return pa.table({name: pa.array(cols[name][index]) for name in WINDOW_COLUMNS})


def _message_chars(m: StoredMessage) -> int:
    return len(m.content) + len(m.tool_calls) + len(m.metadata)


def _message_bytes(m: StoredMessage) -> int:
    """The memory one cached message holds, so the cache's bound is one of real bytes:
    each string as CPython stores it (an ASCII character takes one byte, others two or
    four: counting characters undercounted CJK and emoji text by up to 4x) and every
    message's own strings (names and the tokenizer are separate objects per message,
    as Arrow and DuckDB hand them over), plus the object and its integers, and what
    builds derive from it (`_DERIVED_BYTES`)."""
    return (
        _MESSAGE_OVERHEAD
        + _DERIVED_BYTES
        + sum(
            sys.getsizeof(text)
            for text in (
                m.content,
                m.tool_calls,
                m.metadata,
                m.tenant,
                m.agent,
                m.scope,
                m.thread,
                m.tool_call_id,
                m.external_id,
                m.tokenizer,
                m.restored_from,
            )
            if text  # "" is one shared object
        )
    )


def _messages_of(batch: Rows, rows: npt.NDArray[np.intp]) -> list[StoredMessage]:
    """StoredMessages of some rows of an append's Arrow batch or columns (the writer's),
    each with what a build derives from it (`derived`: made here, by the writer, once)."""
    if isinstance(batch, dict):
        picked = rows.tolist()
        part = {name: [values[i] for i in picked] for name, values in batch.items()}
    else:
        part = batch.take(pa.array(rows)).to_pydict()
    out: list[StoredMessage] = []
    for i in range(len(rows)):
        summary = bool(part["is_summary"][i])
        out.append(
            StoredMessage(
                id=part["id"][i],
                tenant=part["tenant"][i],
                agent=part["agent"][i],
                scope=part["scope"][i],
                thread=part["thread"][i],
                role=Role(part["role"][i]),
                # The writer's batch keeps content in two columns (schema version 22).
                content=part["content_long"][i] or part["content_short"][i],
                tool_calls=part["tool_calls"][i],
                tool_call_id=part["tool_call_id"][i],
                external_id=part["external_id"][i],
                metadata=part["metadata"][i],
                token_estimate=part["token_estimate"][i],
                create_time_us=part["create_time_us"][i],
                token_count=part["token_count"][i],
                group_id=part["group_id"][i],
                is_summary=summary,
                summarized_ids=(
                    (part["first_summarized_id"][i], part["last_summarized_id"][i])
                    if summary
                    else None
                ),
                tokenizer=part["tokenizer"][i],
                source_time_us=part["source_time_us"][i],
                sequence=part["sequence"][i],
                restored_from=part["restored_from"][i],
            )
        )
        derived(out[-1])
    return out


def new_context(
    key: ContextKey,
    context_id: int,
    last_clear_us: int | None,
    latest_summary_id: int,
    latest_summary: StoredMessage | None,
    columns: dict[str, npt.NDArray[Any]],
    newest: tuple[int | None, int | None],
    summary_rows: Sequence[tuple[int, int, int]],
    recent: list[StoredMessage],
    has_source: bool,
) -> _Context:
    """A cached thread from what a cold load read (see `HotMixin._load_context`)."""
    n = len(columns["id"])
    cols = {name: np.ascontiguousarray(columns[name], dtype=dtype) for name, dtype in _COLUMNS}
    return _Context(
        key,
        context_id,
        last_clear_us,
        latest_summary_id,
        latest_summary,
        cols,
        n,
        has_source,
        newest[0],
        newest[1],
        tuple(summary_rows),
        recent,
        n - len(recent),
        sum(_message_chars(m) for m in recent),
        sum(_message_bytes(m) for m in recent),
    )


class HotCache:
    """The entries, their LRU by bytes, and the commit protocol with the writer."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.lock = threading.Lock()
        self.gen = 0  # completed commits
        self.committing = 0  # commits begun and not yet applied
        self.entries: OrderedDict[tuple[Any, ...], _Context | _Small] = OrderedDict()
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
            self._drop(_ckey(key))
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
                self._drop(_ckey(key))
                self._drop(("t", key.tenant, key.agent, key.scope))
                continue
            agent = entries.get(("a", key.tenant, key.agent))
            if isinstance(agent, _Small) and agent.value is None:
                self._drop(("a", key.tenant, key.agent))  # an append created the agent
            scope = entries.get(("t", key.tenant, key.agent, key.scope))
            entry = entries.get(_ckey(key))
            if entry is None and scope is None:
                continue  # nothing cached of this thread: no arrays needed
            indices = np.asarray(rows, dtype=np.intp)
            if scope is not None:
                self._count_in_scope(key, context_id, arrays_of(), indices)
            if entry is None:
                continue
            if isinstance(entry, _Small):  # cached as absent: it exists now
                self._drop(_ckey(key))
                continue
            if entry.context_id != context_id:
                self._drop(_ckey(key))
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
        if entry is None or not isinstance(entry, _Small):
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
        entry: _Context,
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
            last = _messages_of(batch, srows[-1:])[0]
            entry.latest_summary = last
            entry.latest_summary_id = last.id
        plain = rows[~summary]
        k = len(plain)
        if k:
            n = entry.n
            for name, _dtype in _COLUMNS:
                grown = _grow(entry.cols[name], n, k)
                grown[n : n + k] = arrays[name][plain]
                entry.cols[name] = grown
            entry.n = n + k
            entry.has_source = entry.has_source or bool(arrays["has_source"][plain].any())
            newest_rows = plain[-RECENT_MESSAGES:]
            chars = arrays["all_chars"][newest_rows]
            within = np.cumsum(chars[::-1]) <= RECENT_CHARS
            keep = int(within.sum()) if len(within) else 0
            added = _messages_of(batch, newest_rows[len(newest_rows) - keep :]) if keep else []
            added_bytes = sum(_message_bytes(m) for m in added)
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
                    total -= _message_chars(recent[drop])
                    nbytes -= _message_bytes(recent[drop])
                    drop += 1
                entry.recent = recent[drop:]
                entry.recent_chars = total
                entry.recent_bytes = nbytes
                entry.recent_from += drop
        entry.changed = self.gen
        self.bytes += entry.size() - before
        self.entries.move_to_end(_ckey(entry.key))

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
        if isinstance(entry, _Context):
            self.by_context_id.pop(entry.context_id, None)

    def _drop_where(self, test: Any) -> None:
        for key in [k for k in self.entries if test(k)]:
            self._drop(key)

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self.entries:
            key = next(iter(self.entries))
            self._drop(key)
            self.evictions += 1

    def install(self, key: tuple[Any, ...], entry: _Context | _Small, at_gen: int) -> None:
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
            if isinstance(entry, _Context):
                self.by_context_id[entry.context_id] = entry.key
            self._evict()

    def lookup(self, key: tuple[Any, ...], view: _View | None) -> _Context | _Small | None:
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


def small(value: Any, nbytes: int = _ENTRY_OVERHEAD) -> _Small:
    return _Small(value, nbytes)


def agent_bytes(agent: Agent) -> int:
    return _ENTRY_OVERHEAD + len(agent.system_prompt) + sum(len(d.content) for d in agent.docs)


def status_bytes(entries: Sequence[StatusEntry]) -> int:
    return _ENTRY_OVERHEAD + sum(200 + len(e.state) + len(e.summary) for e in entries)


def by_recency(threads: Iterable[ScopeThread], window: WindowSpec) -> list[ScopeThread]:
    """The threads with messages after their clear markers, newest first: what does not
    depend on the window's ages (its clear marker aside), so it is kept per scope row
    set (`HotCache.by_recency`)."""
    rows = [t for t in threads if t.last_message_time_us > _clear(window, t)]
    rows.sort(key=lambda t: (-t.last_message_time_us, t.thread))
    return rows


def newest_of(ordered: Sequence[ScopeThread], window: WindowSpec, limit: int) -> list[ScopeThread]:
    """`ordered` (see `by_recency`) cut to the threads whose newest commit the window
    may hold: a prefix, as they are newest first."""
    oldest_commit = window.age_after_us - MAX_SOURCE_LEAD_US
    out: list[ScopeThread] = []
    for t in ordered:
        if len(out) >= limit or t.last_message_time_us <= oldest_commit:
            break
        out.append(t)
    return out


def activity_of(newest: Sequence[ScopeThread], counts: dict[int, int]) -> list[ThreadActivity]:
    """`thread_activity` over a scope's newest thread rows (`newest_of`), `counts`
    giving the window count of each thread that is not wholly in its window (see
    `partial_threads`)."""
    activity = [
        ThreadActivity(t.thread, t.last_message_time_us, counts.get(t.context_id, t.message_count))
        for t in newest
    ]
    return [a for a in activity if a.window_message_count > 0]


@dataclass(frozen=True, slots=True)
class ActivityKept:
    """A `thread_activity` answer made from a scope's thread rows alone, and the
    windows it answers: the same rows (compared by identity: they are replaced on every
    change), the same bounds but the age, and an age in ``[age_from, age_until)``.

    Within that range no row leaves the newest (`newest_of` cuts at the age less the
    source lead) and every row stays wholly in its window (`partial_threads`: its oldest
    time after the age), so the answer is the same list; a smaller age (a clock set
    back) may take in more rows and is not answered."""

    threads: dict[str, ScopeThread]
    clear_after_us: int
    max_messages: int
    expire_after_us: int | None
    limit: int
    age_from: int
    age_until: int
    activity: list[ThreadActivity]

    def answers(self, threads: dict[str, ScopeThread], window: WindowSpec, limit: int) -> bool:
        return (
            self.threads is threads
            and self.age_from <= window.age_after_us < self.age_until
            and self.clear_after_us == window.clear_after_us
            and self.limit == limit
            and self.max_messages == window.max_messages
            and self.expire_after_us == window.expire_after_us
        )


def activity_kept(
    threads: dict[str, ScopeThread],
    window: WindowSpec,
    limit: int,
    newest: Sequence[ScopeThread],
    activity: list[ThreadActivity],
) -> ActivityKept | None:
    """What `ActivityKept` keeps of an answer made with no partial thread (None: the
    answer read messages, or retention applies, and is not kept)."""
    if window.retains:
        return None
    until = 1 << 62
    for t in newest:
        source = t.create_time_us if t.min_source_time_us is None else t.min_source_time_us
        # Wholly in the window while the age is before the row's oldest time (see
        # `partial_threads`), and among the newest while before its commit plus the lead.
        until = min(
            until, min(t.create_time_us, source), t.last_message_time_us + MAX_SOURCE_LEAD_US
        )
    return ActivityKept(
        threads,
        window.clear_after_us,
        window.max_messages,
        window.expire_after_us,
        limit,
        window.age_after_us,
        until,
        activity,
    )


def partial_threads(newest: Sequence[ScopeThread], window: WindowSpec) -> list[ScopeThread]:
    """The threads of `newest` (`newest_of`) `activity_of` must count from their
    messages: under retention all of them, else those not wholly in their window (as
    `thread_activity` decides in SQL)."""
    out = []
    for t in newest:
        source = t.create_time_us if t.min_source_time_us is None else t.min_source_time_us
        own_oldest = min(t.create_time_us, source)
        whole = t.create_time_us > _clear(window, t) and own_oldest > window.age_after_us
        if window.retains or not whole:
            out.append(t)
    return out


def _clear(window: WindowSpec, t: ScopeThread) -> int:
    marker = window.clear_after_us if t.last_clear_us is None else t.last_clear_us
    return max(window.clear_after_us, marker)


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
        view = _View(sql_only=bool(self._local.__dict__.pop("hot_sql_next", False)))
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
            view: _View | None = getattr(self._local, "hot_view", None)
            if view is not None and not view.began:
                self._begin_view(cur, view)
        return cur

    def _begin_view(self, cur: duckdb.DuckDBPyConnection, view: _View) -> None:
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

    def _view(self) -> _View | None:
        view: _View | None = getattr(self._local, "hot_view", None)
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

    def _cached(self, key: tuple[Any, ...]) -> _Context | _Small | None:
        with self._hot.lock:
            entry = self._hot.lookup(key, self._view())
        if entry is not None:
            self.hot_stats.hits += 1
        return entry

    def _load(
        self, key: tuple[Any, ...], read: Callable[[duckdb.DuckDBPyConnection], _Context | _Small]
    ) -> _Context | _Small | None:
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

    def _context(self, key: ContextKey) -> _Context | bool | None:
        """The cached thread (None: it has no messages), or False: read by SQL."""
        entry = self._cached(_ckey(key))
        if entry is None:
            entry = self._load(_ckey(key), lambda cur: _read_context(cur, key))
            if entry is None:
                return False
        return entry if isinstance(entry, _Context) else None

    def _context_of(self, ref: ContextRef) -> ContextView | None:
        if not self._hot.enabled or ref.key is None:
            return None
        found = self._context(ref.key)
        if not isinstance(found, _Context) or found.context_id != ref.context_id:
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

            def read(cur: duckdb.DuckDBPyConnection) -> _Small:
                found = _find_agent(cur, tenant, name)
                return small(found, agent_bytes(found) if found else _ENTRY_OVERHEAD)

            entry = self._load(key, read)
            if entry is None:
                return super().find_agent(tenant, name)
        assert isinstance(entry, _Small)
        found: Agent | None = entry.value
        return found

    def context_ref(self, key: ContextKey) -> ContextRef | None:
        if not self._hot.enabled:
            return super().context_ref(key)
        found = self._context(key)
        if found is False:
            return super().context_ref(key)
        if not isinstance(found, _Context):
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
        if entry is None or not isinstance(entry, _Small) or entry.value is None:
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
        if entry is None or not isinstance(entry, _Small) or entry.value is None:
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
            if not isinstance(found, _Context) or found.context_id != t.context_id:
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
    ) -> _Small | None:
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
        entry = small(value, _ENTRY_OVERHEAD + 200 * len(rows))
        if same:
            self._hot.install(key, entry, at)
        return entry


def _read_status(cur: duckdb.DuckDBPyConnection, tenant: str, agent: str, scope: str) -> _Small:
    rows = cur.execute(
        "SELECT key, kind, state, summary, update_time_us, expire_time_us "
        "FROM status_entries WHERE tenant = ? AND agent = ? AND scope = ? ORDER BY key LIMIT ?",
        [tenant, agent, scope, MAX_SCOPE_ROWS + 1],
    ).fetchall()
    if len(rows) > MAX_SCOPE_ROWS:
        return small(None)
    entries = [status_from_row(r) for r in rows]
    return small(entries, status_bytes(entries))


def _read_context(cur: duckdb.DuckDBPyConnection, key: ContextKey) -> _Context | _Small:
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
                derived(m)  # what a build derives, made once (see `_messages_of`)
            while recent and sum(_message_chars(m) for m in recent) > 2 * RECENT_CHARS:
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
