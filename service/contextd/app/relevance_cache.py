"""Relevance over many stored outputs: one BM25 index per (tenant, agent, scope), kept
across calls and checked against the store on every call.

Rebuilding a BM25 index over a scope's outputs on every selection costs time in
proportion to the scope (seconds at 100,000 outputs); here an index is built once and
then kept current. Every selection first reads the scope's fingerprint from the store
(count, sum of create times and sum of the engine's hashes of its ids: one small
aggregate; on PostgreSQL an index-only range), which every put and delete changes,
whichever server made it, even a delete and a put of the same microsecond on two
replicas:

- equal to the index's own: the index is current, and is searched as is;
- else the outputs stored after the newest one indexed are read and added, when with
  them the index's fingerprint equals the store's (only puts happened, in order);
- else (a delete, a sweep, a put that committed out of order) the index is rebuilt.

An index's fingerprint is computed from the rows it indexed, never taken on trust, so an
index is never used for a state of the store it does not hold; on PostgreSQL every
replica keeps its own indexes and they agree, since each checks itself against the
database on every call. A scope with more than MAX_INDEXED_OUTPUTS outputs is not
cached (selections rank its newest MAX_RELEVANCE_CANDIDATES, as without a cache), and
the indexes of all scopes hold at most MAX_CACHED_OUTPUTS outputs together (the least
recently used scopes are dropped first).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

from contextd import core
from contextd.domain.tool_outputs import ToolOutputFilter
from contextd.ports.tool_outputs import IndexedOutput, ToolOutputStore

MAX_INDEXED_OUTPUTS = 200_000
MAX_CACHED_OUTPUTS = 400_000
_PAGE = 5_000


@dataclass(slots=True)
class _ScopeIndex:
    """A scope's outputs as indexed: doc number i is the i-th output added."""

    index: core.Bm25Index = field(default_factory=core.Bm25Index)
    ids: list[str] = field(default_factory=list)
    tags: list[tuple[str, str | None, str | None, str]] = field(default_factory=list)
    count: int = 0
    time_sum: int = 0
    id_sum: int = 0
    last: tuple[int, str] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, rows: list[IndexedOutput]) -> None:
        first = len(self.ids)
        self.index.add(list(range(first, first + len(rows))), [r[6] for r in rows])
        for r in rows:
            self.ids.append(r[0])
            self.tags.append((r[2], r[3], r[4], r[5]))
            self.count += 1
            self.time_sum += r[1]
            self.id_sum += r[7]
        if rows:
            self.last = (rows[-1][1], rows[-1][0])


class RelevanceIndexes:
    """The cached indexes of one store (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._scopes: OrderedDict[tuple[str, str, str], _ScopeIndex] = OrderedDict()

    def search(
        self, store: ToolOutputStore, where: ToolOutputFilter, query: str, k: int
    ) -> tuple[list[tuple[str, float]], int] | None:
        """The ids of the best k outputs of the filter that match `query` at all,
        highest score first, with their scores, and how many outputs were ranked; None
        when the scope is too large to cache."""
        key = (where.tenant, where.agent, where.scope)
        with self._lock:
            entry = self._scopes.get(key)
            if entry is None:
                entry = self._scopes[key] = _ScopeIndex()
            self._scopes.move_to_end(key)
        with entry.lock:
            stored = store.tool_output_fingerprint(*key)
            count = stored[0]
            if count > MAX_INDEXED_OUTPUTS:
                with self._lock:
                    self._scopes.pop(key, None)
                return None
            if (entry.count, entry.time_sum, entry.id_sum) != stored:
                newer = self._read(store, key, entry.last)
                grown = (
                    entry.count + len(newer),
                    entry.time_sum + sum(r[1] for r in newer),
                    entry.id_sum + sum(r[7] for r in newer),
                )
                if grown == stored:
                    entry.add(newer)
                else:
                    rebuilt = _ScopeIndex(lock=entry.lock)
                    rebuilt.add(self._read(store, key, None))
                    entry = rebuilt
                    with self._lock:
                        self._scopes[key] = entry
                self._evict(key)
            return _matches(entry, where, query, k), entry.count

    def _read(
        self, store: ToolOutputStore, key: tuple[str, str, str], after: tuple[int, str] | None
    ) -> list[IndexedOutput]:
        rows: list[IndexedOutput] = []
        while True:
            page = store.tool_output_docs(*key, after, _PAGE)
            rows += page
            if len(page) < _PAGE or len(rows) > MAX_INDEXED_OUTPUTS:
                return rows
            after = (page[-1][1], page[-1][0])

    def _evict(self, keep: tuple[str, str, str]) -> None:
        with self._lock:
            total = sum(e.count for e in self._scopes.values())
            for key in list(self._scopes):
                if total <= MAX_CACHED_OUTPUTS:
                    return
                if key != keep:
                    total -= self._scopes.pop(key).count


def _matches(
    entry: _ScopeIndex, where: ToolOutputFilter, query: str, k: int
) -> list[tuple[str, float]]:
    narrowed = any(
        v is not None for v in (where.thread, where.task_id, where.query_id, where.tool_name)
    )
    docs, scores = entry.index.search(query, len(entry.ids) if narrowed else k)
    found: list[tuple[str, float]] = []
    for doc, score in zip(docs, scores, strict=True):
        if score <= 0:
            break
        thread, task_id, query_id, tool_name = entry.tags[doc]
        if (
            (where.thread is not None and thread != where.thread)
            or (where.task_id is not None and task_id != where.task_id)
            or (where.query_id is not None and query_id != where.query_id)
            or (where.tool_name is not None and tool_name != where.tool_name)
        ):
            continue
        found.append((entry.ids[doc], float(score)))
        if len(found) == k:
            break
    return found


_BY_STORE: weakref.WeakKeyDictionary[ToolOutputStore, RelevanceIndexes] = (
    weakref.WeakKeyDictionary()
)
_BY_STORE_LOCK = threading.Lock()


def indexes_of(store: ToolOutputStore) -> RelevanceIndexes:
    """The cached indexes of this store (one set per store object)."""
    with _BY_STORE_LOCK:
        found = _BY_STORE.get(store)
        if found is None:
            found = _BY_STORE[store] = RelevanceIndexes()
        return found
