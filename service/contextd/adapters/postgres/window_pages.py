"""A window's pages read by ids on PostgreSQL (WindowPagesMixin).

`window_page` reads a page of a window's narrow columns by the ids of its messages,
which come from the run of a thread's ids this replica keeps (`IdRun`, extended down or
up by `_page_ids`); `window_ordinal` answers from the same runs. Apart from the window's
other reads (window_reads.py) because they share nothing but the SQL module: the runs are
this module's state alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from contextd.adapters.postgres.base import PostgresBase, first
from contextd.adapters.postgres.message_sql import PAGE_IDS, WINDOW_PAGE, context_tenant, page_table
from contextd.ports.store import ContextRef

_OPEN_END = 2**61

# Threads whose run of ids a replica keeps (each at most about HELD_DROPPED_IDS ids and
# their sequences, 160 KB); past this many, the cache starts over.
ID_RUN_THREADS = 256


@dataclass(frozen=True, slots=True)
class IdRun:
    """Every non-summary message of a thread with `low <= sequence < high`: sequences,
    ids and ordinals (-1 where none is stored), ascending (see
    `WindowPagesMixin._page_ids`)."""

    low: int
    high: int
    sequences: npt.NDArray[np.int64]
    ids: npt.NDArray[np.int64]
    ordinals: npt.NDArray[np.int64]

    def count_in(self, low: int, high: int) -> int:
        a, b = np.searchsorted(self.sequences, [low, high])
        return int(b - a)

    def newest(self, low: int, high: int, limit: int) -> npt.NDArray[np.int64]:
        """The ids of the newest `limit` messages with low <= sequence < high (the run
        must hold them: it covers [low, high), or `limit` of them within it)."""
        a, b = (int(i) for i in np.searchsorted(self.sequences, [low, high]))
        return self.ids[max(a, b - limit) : b]

    def extended(
        self,
        sequences: npt.NDArray[np.int64],
        ids: npt.NDArray[np.int64],
        ordinals: npt.NDArray[np.int64],
        high: int,
    ) -> IdRun:
        """This run and every message from its end up to `high` (`sequences`, `ids`,
        `ordinals`), keeping at most the newest ID_RUN_SIZE."""
        seqs = np.concatenate([self.sequences, sequences])
        every = np.concatenate([self.ids, ids])
        ordinals = np.concatenate([self.ordinals, ordinals])
        if len(seqs) > ID_RUN_SIZE:
            cut = len(seqs) - ID_RUN_SIZE
            return IdRun(int(seqs[cut]), high, seqs[cut:], every[cut:], ordinals[cut:])
        return IdRun(self.low, high, seqs, every, ordinals)


# The most ids a run holds (a build asks at most HELD_DROPPED_IDS, with some to spare as
# the thread grows).
ID_RUN_SIZE = 16_384


class WindowPagesMixin(PostgresBase):
    # Runs of threads' ids this replica read, by (tenant, context_id): see `_page_ids`.
    _id_runs: dict[tuple[str, int], IdRun]

    def window_page(
        self,
        context: ContextRef,
        from_sequence: int,
        before_sequence: int,
        limit: int,
        ids_only: bool = False,
    ) -> pa.Table:
        """Newest first by the primary key, at most `limit` rows, encoded as
        `window_columns` encodes them (one row of binary arrays, no object per row)."""
        if ids_only:
            ids = self._page_ids(context, from_sequence, before_sequence, limit)
            return pa.table({"id": pa.array(ids)})
        params = [
            context_tenant(context),
            context.context_id,
            from_sequence,
            before_sequence,
            limit,
        ]
        with self._reading() as conn:
            row = first(conn, WINDOW_PAGE, params)
        assert row is not None
        return page_table(row)

    def _page_ids(
        self, context: ContextRef, from_sequence: int, before_sequence: int, limit: int
    ) -> npt.NDArray[np.int64]:
        """`window_page`'s ids alone (the held ids of what a build leaves out, up to
        10,000 of them), through this replica's cache of runs of a thread's ids: a run
        read once (every non-summary message between two sequences) stays true while
        its messages are stored, and a window `window_bounds` answered has none deleted
        inside it, so only the part after the run (what was appended since) is read."""
        if before_sequence >= _OPEN_END:  # no end to the range: nothing to keep
            return self._read_page_ids(context, from_sequence, before_sequence, limit)[1]
        key = (context_tenant(context), context.context_id)
        run = self._id_runs.get(key)
        below = run is not None and run.low > from_sequence
        if run is not None and below and run.low <= before_sequence <= run.high:
            have = run.count_in(run.low, before_sequence)
            if have < limit:  # the newest `limit` reach below the run: read only those
                older = self._extend_run_down(context, key, run, from_sequence, limit - have)
                return np.concatenate([older, run.newest(run.low, before_sequence, have)])
        if run is not None and below and run.count_in(run.low, before_sequence) < limit:
            run = None  # the newest `limit` reach below the run
        if run is not None and before_sequence <= run.high:
            return run.newest(from_sequence, before_sequence, limit)
        low = from_sequence if run is None else max(from_sequence, run.high)
        seqs, ids, ordinals = self._read_page_ids(context, low, before_sequence, limit)
        # What was read is every message of [`low`, before) when fewer than `limit`
        # came, else of [its oldest's sequence, before).
        covered = low if len(ids) < limit else int(seqs[0])
        if run is not None and covered <= run.high and len(ids) < limit:
            run = run.extended(seqs, ids, ordinals, before_sequence)
        else:
            run = IdRun(covered, before_sequence, seqs, ids, ordinals)
        if len(self._id_runs) >= ID_RUN_THREADS and key not in self._id_runs:
            self._id_runs.clear()
        self._id_runs[key] = run
        return run.newest(from_sequence, before_sequence, limit)

    def _extend_run_down(
        self,
        context: ContextRef,
        key: tuple[str, int],
        run: IdRun,
        from_sequence: int,
        missing: int,
    ) -> npt.NDArray[np.int64]:
        """The newest `missing` ids of [`from_sequence`, the run's start), read: the run
        grows down by them (unless that would pass ID_RUN_SIZE: then it is left as it
        was), instead of being read again whole."""
        seqs, ids, ordinals = self._read_page_ids(context, from_sequence, run.low, missing)
        covered = from_sequence if len(ids) < missing else int(seqs[0])
        if len(ids) + len(run.ids) <= ID_RUN_SIZE:
            self._id_runs[key] = IdRun(
                covered,
                run.high,
                np.concatenate([seqs, run.sequences]),
                np.concatenate([ids, run.ids]),
                np.concatenate([ordinals, run.ordinals]),
            )
        return ids

    def _read_page_ids(
        self, context: ContextRef, from_sequence: int, before_sequence: int, limit: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Sequences, ids and ordinals (-1: none stored) of the newest `limit` messages of
        the range, ascending."""
        params = [
            context_tenant(context),
            context.context_id,
            from_sequence,
            before_sequence,
            limit,
        ]
        with self._reading() as conn:
            row = first(conn, PAGE_IDS, params)
        assert row is not None
        ids, seqs, ordinals = (
            np.frombuffer(bytes(v), ">i8")[::-1].astype(np.int64) for v in row[:3]
        )
        return seqs, ids, ordinals

    def window_ordinal(self, context: ContextRef, message_id: int) -> int | None:
        """One index lookup, or none when this replica's run of the thread's ids (see
        `_page_ids`) spans the id: ids grow along a thread, so when the run does not
        hold it, no message of it has that id (a thread written in turns with others);
        when it does, the run holds its ordinal too (written with the message, never
        changed after: only the migration that added the column filled it in)."""
        run = self._id_runs.get((context_tenant(context), context.context_id))
        if run is not None and len(run.ids) and run.ids[0] <= message_id <= run.ids[-1]:
            at = int(np.searchsorted(run.ids, message_id))
            if int(run.ids[at]) != message_id:
                return None
            if int(run.ordinals[at]) >= 0:
                return int(run.ordinals[at])
        with self._reading() as conn:
            row = first(  # by (tenant, id) alone: no plan may look for it along the thread
                conn,
                "SELECT context_id, ordinal FROM messages WHERE tenant = %s AND id = %s "
                "AND NOT is_summary",
                [context_tenant(context), message_id],
            )
        if row is None or row[0] != context.context_id or row[1] is None:
            return None
        return int(row[1])
