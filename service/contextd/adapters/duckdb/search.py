"""Search over message history on DuckDB: one BM25 index (the Rust core's) per scope.

Why this shape:
- One `Bm25Index` per (tenant, agent, agent's create time, scope), over the content and
  tool_calls text of every message of the scope (stored summaries left out), CJK runs as
  bigrams. The agent's create time is part of the key: an agent deleted and made again
  under the same name gets a new, empty index, so a deleted agent's messages never come
  back (its old index is dropped when the new one is made, or ages out of the cache).
- Built lazily, on the scope's first search, and kept current by catching up before
  every search: the messages with ids above the last one indexed. The one writer commits
  groups in id order, so "ids above the last one read" is exactly "committed since", and
  an append acknowledged before a search is always found by it. Nothing in the write
  path knows about search.
- Window and thread searches rank within the ids of that window or thread (read as one
  integer column), with the statistics of the whole scope, so a message's score does not
  depend on what else is in the window.
- Bounded memory: indexes live in an LRU cache whose estimated size (the Rust core's
  `memory_bytes`) stays under `search_max_bytes`, least recently searched evicted first;
  a scope with more than `search_max_messages` messages is refused
  (SEARCH_INDEX_TOO_LARGE) instead of indexed. An evicted index is rebuilt on its next
  search.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from contextd.adapters.duckdb.base import DuckDBBase, _first, window_predicate
from contextd.adapters.rows import MESSAGE_COLUMNS, message_from_row
from contextd.core import Bm25Index
from contextd.domain.model import StoredMessage
from contextd.domain.search import SearchQuery, index_too_large

# Rows read per step while building or catching up an index: a few MB of text at a time.
BUILD_CHUNK_ROWS = 50_000

# The text of a message as the index sees it: content, then its tool calls' JSON.
_TEXT = "m.content || CASE WHEN m.tool_calls = '' THEN '' ELSE chr(10) || m.tool_calls END"

_SCOPE = (
    "FROM threads t JOIN messages m ON m.context_id = t.context_id "
    "WHERE t.tenant = ? AND t.agent = ? AND t.scope = ? AND NOT m.is_summary"
)

IndexKey = tuple[str, str, int, str]  # tenant, agent, agent's create time, scope


@dataclass
class _Entry:
    index: Bm25Index
    through_id: int = 0  # every message of the scope with an id up to this is indexed
    lock: threading.Lock = field(default_factory=threading.Lock)
    bytes: int = 0


class SearchMixin(DuckDBBase):
    # Bounds of the index cache (see the module docstring); a store may change them.
    search_max_bytes: int = 1 << 30
    search_max_messages: int = 4_000_000
    # Made on the first search (see `_search_cache`): the lock and the LRU of indexes.
    _search_indexes: tuple[threading.Lock, OrderedDict[IndexKey, _Entry]]

    def search_messages(self, query: SearchQuery) -> list[tuple[StoredMessage, float]]:
        key: IndexKey = (query.tenant, query.agent, query.agent_created_us, query.scope)
        entry = self._search_entry(key)
        with entry.lock:
            self._catch_up(entry, key)
            through = entry.through_id
        self._account(key, entry)
        within = self._allowed_ids(query, through) if query.thread or query.window else None
        ids, scores = entry.index.search(" ".join(query.terms), query.k, within)
        if not ids:
            return []
        found = self._search_rows(query, ids)
        gone = [i for i in ids if i not in found]
        if gone:  # removed since they were indexed (never expected: agents go whole)
            entry.index.remove(gone)
        return [(found[i], s) for i, s in zip(ids, scores, strict=True) if i in found]

    # ----------------------------------------------------------------- the cache

    def _search_cache(self) -> tuple[threading.Lock, OrderedDict[IndexKey, _Entry]]:
        cache: tuple[threading.Lock, OrderedDict[IndexKey, _Entry]] | None = getattr(
            self, "_search_indexes", None
        )
        if cache is None:
            with self._cursors_lock:  # made once, on the first search
                cache = getattr(self, "_search_indexes", None)
                if cache is None:
                    cache = (threading.Lock(), OrderedDict())
                    self._search_indexes = cache
        return cache

    def _search_entry(self, key: IndexKey) -> _Entry:
        lock, entries = self._search_cache()
        with lock:
            entry = entries.get(key)
            if entry is None:
                tenant, agent, created, _ = key
                # An earlier agent of the same name is gone for good: drop its indexes.
                for old in [k for k in entries if k[:2] == (tenant, agent) and k[2] != created]:
                    del entries[old]
                entry = _Entry(Bm25Index(cjk_bigrams=True))
                entries[key] = entry
            entries.move_to_end(key)
            return entry

    def _account(self, key: IndexKey, entry: _Entry) -> None:
        """Record the entry's new size, then evict the least recently searched indexes
        until the cache fits (never the one just searched)."""
        lock, entries = self._search_cache()
        entry.bytes = entry.index.memory_bytes
        with lock:
            total = sum(e.bytes for e in entries.values())
            for old in list(entries):
                if total <= self.search_max_bytes:
                    break
                if old != key:
                    total -= entries.pop(old).bytes

    def search_index_bytes(self) -> int:
        """The estimated memory of every cached search index (for tests and metrics)."""
        lock, entries = self._search_cache()
        with lock:
            return sum(e.bytes for e in entries.values())

    # ----------------------------------------------------------------- reads

    def _catch_up(self, entry: _Entry, key: IndexKey) -> None:
        """Index the scope's messages committed since the entry was last brought up to
        date, a chunk at a time (the caller holds the entry's lock)."""
        if self._next_message_id - 1 <= entry.through_id:
            # No id above the last one indexed was even issued (ids are issued before
            # their commit): nothing to read.
            return
        tenant, agent, _, scope = key
        cur = self._cursor()
        pending = _first(
            cur.execute(
                f"SELECT count(*), max(m.id) {_SCOPE} AND m.id > ?",
                [tenant, agent, scope, entry.through_id],
            )
        )
        count, newest = (int(pending[0]), pending[1]) if pending else (0, None)
        if not count or newest is None:
            return
        if len(entry.index) + count > self.search_max_messages:
            raise index_too_large(len(entry.index) + count, self.search_max_messages)
        newest = int(newest)
        # One query, streamed in record batches (no ORDER BY: a top-N per chunk would
        # read the rest of the table again for every chunk); the index takes ids as given.
        reader: pa.RecordBatchReader = cur.sql(
            f"SELECT m.id, {_TEXT} AS text {_SCOPE} AND m.id > ? AND m.id <= ?",
            params=[tenant, agent, scope, entry.through_id, newest],
        ).to_arrow_reader(BUILD_CHUNK_ROWS)
        for batch in reader:
            entry.index.add(batch.column(0).to_pylist(), batch.column(1).to_pylist())
        entry.through_id = newest

    def _allowed_ids(self, query: SearchQuery, through: int) -> np.ndarray[Any, Any]:
        """The ids a window or thread search may return, as an int64 array."""
        params: list[Any] = [query.tenant, query.agent, query.scope, through]
        sql = f"SELECT m.id {_SCOPE} AND m.id <= ?"
        if query.thread is not None:
            sql += " AND t.thread = ?"
            params.append(query.thread)
        if query.window is not None:
            predicate, window_params = window_predicate(query.window)
            sql += f" AND {predicate}"
            params += window_params
        column = self._cursor().execute(sql, params).fetchnumpy()["id"]
        return np.ascontiguousarray(column, dtype=np.int64)

    def _search_rows(self, query: SearchQuery, ids: list[int]) -> dict[int, StoredMessage]:
        """The whole messages of these ids, of the query's scope only."""
        # One point lookup per id, joined by UNION ALL: DuckDB prunes each `id = ?` to
        # the one row group (and vector) whose min/max statistics hold it, since ids grow
        # with insertion. An IN list is pruned by the list's min and max instead, which
        # for hits spread over a long history reads nearly every row group: about 100 ms
        # for 10 hits over 1,000,000 messages under a 128 MB buffer pool, against 6 ms.
        # The scope is checked on the rows' own tenant, agent and scope, here: a join
        # with `threads` in every branch (a semi-join DuckDB plans as a hash join over
        # the scope's threads) cost about as much again as the lookups themselves.
        branch = f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE id = ?"
        rows = self._cursor().execute(" UNION ALL ".join([branch] * len(ids)), ids).fetchall()
        scope = (query.tenant, query.agent, query.scope)
        messages = [message_from_row(r) for r in rows]
        return {m.id: m for m in messages if (m.tenant, m.agent, m.scope) == scope}
