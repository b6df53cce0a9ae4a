"""Thread counters the writer has not yet written to the threads table.

Every thread row carries counters (messages, estimated tokens, first and last commit
time, the last sequence number, the oldest client source_time) that ListThreads,
GetContextStats (for its thread's clear marker), the status preamble and the writer's
numbering read. Updating that row in every group commit was the largest single cost of
an append: an UPDATE costs DuckDB about 1.5 ms whatever it touches, more than inserting
the messages. So the writer adds each commit's counts here instead, and writes them to
the table in one transaction when it has nothing else to do (no call for IDLE_FLUSH_S)
or once they have waited FLUSH_INTERVAL_S.

Readers add what is pending to what they read, so an acknowledged append is always
counted. A reader snapshots the pending counts with a generation number, runs its query,
and retries if a flush completed in between (it might have read the table with those
counts already in it). Only the writer thread adds and flushes.

After a crash the pending counts are gone, but not lost: the table records the last
message id its counters include, and opening the store recounts the messages after it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pyarrow as pa

# How long the writer lets counters wait while appends keep it busy.
FLUSH_INTERVAL_S = 1.0
# How long the writer waits for work before it calls itself idle and flushes: long enough
# that the next call of a steady stream of appends is not made to wait behind a flush.
IDLE_FLUSH_S = 0.05

PENDING_SCHEMA = pa.schema(
    [
        ("context_id", pa.int64()),
        ("n", pa.int64()),
        ("tokens", pa.int64()),
        ("first_us", pa.int64()),
        ("last_us", pa.int64()),
        # The oldest source_time among the messages; NO_SOURCE_TIME when none has one.
        ("min_source_us", pa.int64()),
        # Bytes of content, tool_calls and metadata (UTF-8): the tenant's stored bytes.
        ("bytes", pa.int64()),
    ]
)
# "No message has a source_time" in the min_source_us column (SQL reads it as NULL).
NO_SOURCE_TIME = 2**63 - 1


class PendingCounters:
    """Per context id: [messages, tokens, first time, last time, oldest source time,
    bytes] not yet in the table."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deltas: dict[int, list[int]] = {}
        self._generation = 0
        self._waiting_since = time.monotonic()

    def __len__(self) -> int:
        return len(self._deltas)

    def add(
        self,
        context_id: int,
        n: int,
        tokens: int,
        first_us: int,
        last_us: int,
        min_source_us: int = NO_SOURCE_TIME,
        nbytes: int = 0,
    ) -> None:
        with self._lock:
            if not self._deltas:
                # Counters wait from their first pending count, not from the last flush:
                # the first group after a quiet spell does not flush at once.
                self._waiting_since = time.monotonic()
            delta = self._deltas.get(context_id)
            if delta is None:
                self._deltas[context_id] = [n, tokens, first_us, last_us, min_source_us, nbytes]
            else:
                delta[0] += n
                delta[1] += tokens
                delta[2] = min(delta[2], first_us)
                delta[3] = max(delta[3], last_us)
                delta[4] = min(delta[4], min_source_us)
                delta[5] += nbytes

    def count_of(self, context_id: int) -> int:
        """Messages of a context not yet counted in the table (the writer adds them to the
        table's last_sequence to number the next message)."""
        with self._lock:
            delta = self._deltas.get(context_id)
            return delta[0] if delta is not None else 0

    def last_of(self, context_id: int) -> int:
        """The newest pending commit time of a context (0: none pending)."""
        with self._lock:
            delta = self._deltas.get(context_id)
            return delta[3] if delta is not None else 0

    def flush_due(self) -> bool:
        """Whether a busy writer should flush now: counters have waited FLUSH_INTERVAL_S."""
        return bool(self._deltas) and time.monotonic() - self._waiting_since >= FLUSH_INTERVAL_S

    def snapshot(self) -> tuple[int, pa.Table]:
        """The generation and the pending counters, for a reader to add to the table's."""
        with self._lock:
            return self._generation, self._table()

    def unchanged_since(self, generation: int) -> bool:
        """False when a flush completed after `snapshot` returned `generation`."""
        with self._lock:
            return self._generation == generation

    @contextmanager
    def flushing(self) -> Iterator[pa.Table]:
        """The pending counters to write; when the block succeeds (its transaction is
        committed), they are cleared. Readers wait on the lock meanwhile, so none sees
        the table with the counters and the counters still pending."""
        with self._lock:
            yield self._table()
            self._deltas.clear()
            self._generation += 1

    def _table(self) -> pa.Table:
        ids = list(self._deltas)
        values = list(self._deltas.values())
        return pa.table([ids, *([v[i] for v in values] for i in range(6))], schema=PENDING_SCHEMA)
