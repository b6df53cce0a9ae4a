"""What the hot cache holds (see hot.py): its entries, their views, and their sizes.

A cached thread (`CachedThread`: its integer columns as NumPy arrays, its newest messages,
its ref and summary) and the one-committed-point view a build reads of it
(`ContextView`), the window applied to a view's columns exactly as SQL applies it
(`window_index`, `window_count`, `window_table`), the small entries (an agent, a scope's
status entries or thread rows), a snapshot's own state (`SnapshotView`), and the bytes
each entry is counted at against the cache's bound. Kept apart from the cache itself
(`HotCache`, which changes entries as commits land) and from the store's reads that fill
and serve them (hot_reads.py): these are the data, with no lock and no SQL.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from contextd.adapters.duckdb.journal import Columns
from contextd.domain.context import StatusEntry, derived
from contextd.domain.model import Agent, ContextKey, Role, StoredMessage
from contextd.domain.window import MAX_SOURCE_LEAD_US, WindowSpec

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
ENTRY_OVERHEAD = 512
# Bytes per row of the cached columns (8 int64 columns and a uint8 role).
_ROW_BYTES = 8 * 8 + 1


def thread_entry_key(key: ContextKey) -> tuple[str, ...]:
    """The cache key of a thread's entry."""
    return ("c", key.tenant, key.agent, key.scope, key.thread)


CACHED_COLUMNS = (
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
class CachedThread:
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
    recent_bytes: int  # what `recent` holds in memory (see `message_bytes`)
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
            ENTRY_OVERHEAD
            + capacity * _ROW_BYTES
            + self.recent_bytes
            + (message_bytes(summary) if summary is not None else 0)
            + 100 * len(self.summary_rows)
        )


@dataclass(slots=True)
class SmallEntry:
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
class SnapshotView:
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


def message_chars(m: StoredMessage) -> int:
    return len(m.content) + len(m.tool_calls) + len(m.metadata)


def message_bytes(m: StoredMessage) -> int:
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


def messages_of(batch: Rows, rows: npt.NDArray[np.intp]) -> list[StoredMessage]:
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
) -> CachedThread:
    """A cached thread from what a cold load read (see `HotMixin._load_context`)."""
    n = len(columns["id"])
    cols = {
        name: np.ascontiguousarray(columns[name], dtype=dtype) for name, dtype in CACHED_COLUMNS
    }
    return CachedThread(
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
        sum(message_chars(m) for m in recent),
        sum(message_bytes(m) for m in recent),
    )


def small(value: Any, nbytes: int = ENTRY_OVERHEAD) -> SmallEntry:
    return SmallEntry(value, nbytes)


def agent_bytes(agent: Agent) -> int:
    return ENTRY_OVERHEAD + len(agent.system_prompt) + sum(len(d.content) for d in agent.docs)


def status_bytes(entries: Sequence[StatusEntry]) -> int:
    return ENTRY_OVERHEAD + sum(200 + len(e.state) + len(e.summary) for e in entries)
