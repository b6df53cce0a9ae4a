"""A build's first read on PostgreSQL: the thread's ref and what rides with it.

`context_ref` reads the thread's row, its latest summary and its agent's version; for a
hot build (the thread's window seen, nothing moved under it) it makes every read of the
build in one statement (`_read_in_one`: the ref, the status block and the appended rows
as one UNION ALL, prepared per connection), or sends the window's reads ahead in the
same round trip (`plan_build_reads`, `_send_planned`). Apart from the window's reads
(window_reads.py, which this mixin extends) because it is the plan of a build's round
trips, not a read of the window itself.
"""

from __future__ import annotations

import functools
import re
import weakref
from collections.abc import Sequence
from typing import Any

import psycopg

from contextd.adapters.postgres.agents import AGENT_VERSION_OF_THREAD
from contextd.adapters.postgres.base import Conn, StatusArgs
from contextd.adapters.postgres.message_sql import (
    APPENDED_COLUMNS,
    APPENDED_JOIN,
    APPENDED_ROWS,
    APPENDED_WIDTH,
    SELECT_MESSAGES,
    WINDOW_BOUNDS,
    context_tenant,
)
from contextd.adapters.postgres.window_reads import ThreadState, WindowReadsMixin
from contextd.adapters.rows import message_from_row
from contextd.domain.model import ContextKey
from contextd.domain.window import WindowSpec
from contextd.ports.store import BuildReads, ContextRef


class BuildReadsMixin(WindowReadsMixin):
    # The connections that prepared `_read_in_one`'s statement (in a pipeline, so that
    # its Parse went with its first run, not in a round trip of its own).
    _one_prepared: weakref.WeakSet[Conn]

    def context_ref(self, key: ContextKey) -> ContextRef | None:
        """The thread's ref, and with it (one round trip, not two) its latest summary,
        which `latest_summary` then answers from memory inside the same snapshot, and
        the version of its agent's row, with which `get_agent` may answer from this
        replica's cache of agents (see agents.py)."""
        appended = self._appended_after(key)
        params: list[Any] = [key.tenant, key.agent, key.scope, key.thread]
        holder: list[Any] = []
        if appended is not None:
            # The rows appended since the window this replica saw, in this statement
            # (`appended_messages` takes them): one more would cost a hot build the
            # time it saves by ending its snapshot early.
            guess, after = appended
            params = [after, after, APPENDED_ROWS + 1, *params]
            self._local.appended = ((key.tenant, guess.context_id, after), lambda: holder)
        pinned: Conn | None = getattr(self._local, "conn", None)
        status = (
            self._one_statement_status(key, appended is not None)
            if pinned is not None and self._unbegun(pinned)
            else None
        )
        if pinned is not None and status is not None:
            rows = self._read_in_one(pinned, key, params, appended is not None, status)
        else:
            with self._reading() as conn:
                cursor = conn.execute(_REF_SQL[appended is not None], params)
                if getattr(self._local, "conn", None) is conn:
                    self._send_planned(conn, key)  # in this round trip
                rows = cursor.fetchall()
        if not rows:
            return None
        row = rows[0]
        if appended is not None:
            n = len(row) - APPENDED_WIDTH
            holder.extend(r[n:] for r in rows if r[n + 1] is not None)
            row = row[:n]
        ref = ContextRef(int(row[0]), row[1], int(row[2]), key)
        if getattr(self._local, "conn", None) is not None:
            self._local.ref = ref  # for `_queue_bounds`, in this snapshot
            # The thread row's version, for `build_token` and `window_bounds`.
            self._local.thread_version = (ref.context_id, str(row[4]))
            # What `appended_messages` compares with the state a window was read at.
            self._local.thread_state = ThreadState(
                ref.context_id, int(row[5]), int(row[6]), int(row[7]), bool(row[8])
            )
            if row[3] is not None:  # for get_agent, in this snapshot
                self._local.agent_version = (key.tenant, key.agent, str(row[3]))
            if ref.latest_summary_id:
                summary = message_from_row(row[9:]) if row[9] is not None else None
                self._local.summary = (ref.context_id, ref.latest_summary_id, summary)
        return ref

    def _appended_after(self, key: ContextKey) -> tuple[ContextRef, int] | None:
        """When the build announced for `key` in this snapshot keeps a window it may
        extend by appended rows (`BuildReads.extend`) and this replica saw one of the
        thread it may extend (`_extendable`), not more rows behind than an extension
        takes: the thread's ref it last read and the last sequence of the window seen,
        after which `context_ref` reads the appended rows with the thread's row."""
        reads: BuildReads | None = getattr(self._local, "planned", None)
        if reads is None or reads.key != key or not reads.extend or not self._in_snapshot():
            return None
        guess = self._bounds_guess.get(key)
        moved = self._moved_here.get(key)
        if guess is None or (moved is not None and moved > APPENDED_ROWS):
            return None
        seen = self._extendable(guess[0])
        if seen is None or seen.state is None:
            return None
        return guess[0], seen.state.last_sequence

    def _one_statement_status(self, key: ContextKey, appended: bool) -> StatusArgs | None:
        """The status block's arguments when the build announced for `key` is one
        `_send_planned` would end the snapshot for with the status block's read alone
        (the appended rows, if any, travelling with the thread's read: `appended`);
        None otherwise. Then `context_ref` makes both reads one statement, in a
        snapshot of its own, with no BEGIN and no COMMIT (`_read_in_one`): three
        statements fewer for the server and the driver than `_send_planned`'s."""
        reads: BuildReads | None = getattr(self._local, "planned", None)
        if reads is None or reads.key != key:
            return None
        cached = self._agent_cache.get((key.tenant, key.agent))
        guess = self._bounds_guess.get(key)
        if cached is None or guess is None:
            return None
        moved = self._moved_here.get(key)
        if moved is not None and (moved > APPENDED_ROWS or not appended):
            return None  # the window's bounds are read too (`_send_planned`)
        agent_window = cached[1].window_at(key.scope, reads.now_us)
        if agent_window.with_thread_clear(guess[0].last_clear_time_us).retains:
            return None
        if not self._hot_build(reads, guess[0]):
            return None
        return _status_args(key, reads, agent_window)

    def _read_in_one(
        self, conn: Conn, key: ContextKey, params: list[Any], appended: bool, status: StatusArgs
    ) -> list[Any]:
        """The thread's read (`_REF_SQL`) and the status block's (taken by
        `status_and_activity` with these very arguments) as one statement (`_one_sql`),
        ending the snapshot with it: one statement sees one state, so it needs no
        transaction of its own, and the Sync that ends the pipeline ends its implicit
        one. The thread's rows (the status block's stand apart, `_TakenRows`).

        Its plan is the generic one from its sixth run on a connection (`_one_sql`
        hides the values from the planner): planned for its values, the union costs
        about 2 ms a build, four times the rest of it."""
        reads: BuildReads | None = self._local.planned
        self._local.planned = None
        status_sql, status_params = self._status_statement(status)
        if not appended:
            # One kind of statement, so one to prepare per connection: the appended
            # rows' join finds none after the largest sequence (nor probes for them).
            params = [_NO_SEQUENCE_AFTER, _NO_SEQUENCE_AFTER, 1, *params]
        # Every value as text (None as NULL), typed by the statement (`_ONE_TYPES`):
        # the driver types an int by its size and a None not at all, and prepares a
        # statement per parameter types; so one statement per connection.
        sql, names = _one_sql(status_sql)
        named = dict(zip(_REF_PARAMS, params, strict=True)) | status_params
        values = [None if (v := named[name]) is None else str(v) for name in names]
        # Prepared at its first run on a connection, not at the driver's fifth (the runs
        # before would each be planned afresh); that run in a pipeline, where the Parse
        # goes with it (out of one, the driver prepares in a round trip of its own); the
        # later ones alone, which spares the pipeline's own work. (Should the driver
        # have dropped it from its cache since, one run takes that round trip more.)
        # A raw cursor: the statement is in PostgreSQL's own form ($1, ...), which the
        # driver sends as it is (it parsed the placeholders of a statement this long
        # afresh at each run, about 0.1 ms a build: it caches statements of 4 KB at most).
        cursor = psycopg.RawCursor(conn)
        if conn in self._one_prepared:
            cursor.execute(sql, values, prepare=True)
        else:
            with conn.pipeline():
                cursor.execute(sql, values, prepare=True)
            self._one_prepared.add(conn)
        self._local.extend = key if reads is not None and reads.extend else None
        self._end_snapshot_early(conn)
        rows = cursor.fetchall()
        n = _REF_WIDTH[True]
        # The status block's rows in its statement's order (part, then rank), which the
        # union need not keep; the thread's rows (its appended rows by sequence) come
        # from the join's inner side in order, as from `_REF_SQL` alone.
        found = sorted((r[n:] for r in rows if r[n] is not None), key=_status_order)
        self._local.status = (status, _TakenRows(found))
        return [r[: _REF_WIDTH[appended]] for r in rows if r[n] is None]

    def plan_build_reads(self, reads: BuildReads) -> None:
        """Inside a snapshot, the build's next read is its thread's ref (`context_ref`):
        with it, in its round trip, go the status block's read and the window's bounds,
        with the arguments this replica can tell they will have (`_send_planned`)."""
        if self._in_snapshot():
            self._local.planned = reads

    def _send_planned(self, conn: Conn, key: ContextKey) -> None:
        """Queue the reads `plan_build_reads` announced for the build of `key`, behind
        the ref's statement: the status block's, with the agent's window from this
        replica's cache of agents (its settings as last read; the build computes the
        window from the agent as the snapshot reads it); and, when this replica
        appended to the thread since its last build of it (an agent's turn: append,
        then build), the window's bounds, for the thread's ref, window and summary as
        that build read them (`_bounds_guess`), or, when those appends were all of
        plain messages and the builder keeps a window it can extend by them
        (`BuildReads.extend`), the rows appended since instead (`_queue_appended`).
        (Not otherwise: a build of a state it read the window of reads no bounds, and
        the bounds of one another replica moved travel with the status block's read
        when that one is not sent ahead.) Each read is taken only by a call with the
        very arguments it was sent with (`status_and_activity`, `window_bounds`,
        `appended_messages`), so a wrong guess costs a statement's server time, never a
        wrong answer."""
        reads: BuildReads | None = getattr(self._local, "planned", None)
        self._local.planned = None
        if reads is None or reads.key != key:
            return
        cached = self._agent_cache.get((key.tenant, key.agent))
        if cached is None:
            return
        agent_window = cached[1].window_at(key.scope, reads.now_us)
        self._send_status(conn, _status_args(key, reads, agent_window))
        self._local.extend = key if reads.extend else None
        guess = self._bounds_guess.get(key)
        if guess is None:
            return
        moved = self._moved_here.get(key)
        ref, summary_last = guess
        window = agent_window.with_thread_clear(ref.last_clear_time_us)
        if window.retains:
            return
        if moved is None or moved <= APPENDED_ROWS:
            # The rows appended since the window this replica saw (by any replica; none
            # when the thread is as it was): with them the build keeps or extends the
            # window it holds, and needs no other read.
            appended = self._queue_appended(conn, ref)
            if (appended or moved is None) and self._hot_build(reads, ref):
                self._end_snapshot_early(conn)
            if appended or moved is None:
                return
        params, tags = self._bounds_params(ref, window, summary_last, reads.first_page, reads.held)
        cursor = conn.execute(WINDOW_BOUNDS, params, binary=True)
        match = (ref, window, summary_last, reads.first_page, reads.held)
        self._local.bounds = (match, cursor, tags)

    def _hot_build(self, reads: BuildReads, guess: ContextRef) -> bool:
        """Whether the build `reads` announces is likely one its reads sent ahead answer
        whole (so that `_send_planned` ends its snapshot with them): its builder keeps a
        window of the thread, and this replica saw the thread's window (read or extended
        it) at the ref it last read. A wrong guess costs the build a second snapshot
        (`SnapshotMoved`), never a wrong answer: the snapshot ends, and no read is made
        outside it."""
        return reads.kept and (context_tenant(guess), guess.context_id) in self._windows_seen


def _status_args(key: ContextKey, reads: BuildReads, agent_window: WindowSpec) -> StatusArgs:
    """The status block's arguments of the build `reads` announces for `key`, with the
    agent's window from this replica's cache of agents (`_send_planned`)."""
    return StatusArgs(
        key.tenant,
        key.agent,
        key.scope,
        reads.now_us,
        reads.status_entries,
        agent_window,
        reads.status_threads,
    )


def _ref_sql(appended: bool) -> str:
    """`context_ref`'s statement: the thread's row, its latest summary and its agent's
    row version, and with `appended` the rows appended after a sequence (parameters:
    that sequence twice and a row limit, then the thread's key)."""
    columns, join = (", " + APPENDED_COLUMNS, APPENDED_JOIN) if appended else ("", "")
    return (
        "SELECT t.context_id, t.last_clear_us, t.latest_summary_id, "
        f"({AGENT_VERSION_OF_THREAD}), t.xmin::text || ':' || t.ctid::text, "
        "t.rewrites, t.last_sequence, t.message_count, t.min_source_time_us IS NULL, "
        f"{SELECT_MESSAGES}{columns} "
        # By (tenant, id) alone (`+ 0` keeps the thread's key out of the index
        # condition): a plan along the thread's primary key scanned all of it.
        "FROM threads t LEFT JOIN messages m ON m.tenant = t.tenant "
        f"AND m.context_id + 0 = t.context_id AND m.id = t.latest_summary_id {join}"
        "WHERE t.tenant = %s AND t.agent = %s AND t.scope = %s AND t.thread = %s"
    )


_REF_SQL = {False: _ref_sql(False), True: _ref_sql(True)}
# Its columns: the thread's nine, a message's, and the appended rows'.
_REF_WIDTH = {
    False: 9 + len(SELECT_MESSAGES.split(", ")),
    True: 9 + len(SELECT_MESSAGES.split(", ")) + APPENDED_WIDTH,
}
_STATUS_WIDTH = 8  # status.py `status_query`'s columns


_NO_SEQUENCE_AFTER = 2**63 - 1  # bigint's largest: no row's sequence is after it


# The names `_one_sql` gives `_REF_SQL[True]`'s parameters, in order.
_REF_PARAMS = tuple(f"r{i}" for i in range(_REF_SQL[True].count("%s")))
# The SQL type of each parameter of `_one_sql`'s statement: `_REF_SQL`'s, then the
# status block's (status.py `status_query`, threads.py `activity_query`).
_ONE_TYPES = {
    **dict.fromkeys(_REF_PARAMS[:2], "bigint"),
    _REF_PARAMS[2]: "integer",
    **dict.fromkeys(_REF_PARAMS[3:], "text"),
    **dict.fromkeys(("tenant", "agent", "scope", "after"), "text"),
    **dict.fromkeys(("live_at", "clear", "age", "oldest", "expire", "cap"), "bigint"),
    **dict.fromkeys(("entries", "limit"), "integer"),
    "retains": "boolean",
}
_NAMED_PARAM = re.compile(r"%\((\w+)\)s")


@functools.lru_cache(maxsize=4)
def _one_sql(status_sql: str) -> tuple[bytes, tuple[str, ...]]:
    """`_REF_SQL` (with the appended rows) and the status block's statement as one
    (`_read_in_one`): a row of either padded with NULLs in the other's columns; a
    status row's first column is never NULL. `_REF_SQL`'s parameters are named r0, r1,
    ... (the status block's are named). The statement with PostgreSQL's placeholders
    ($1, ...), and the name of each parameter, in their order.

    Each parameter is read through a scalar subquery of its own, `(SELECT $n::type)`,
    so that no plan of the statement sees a value: PostgreSQL plans an uncorrelated
    subquery apart (an InitPlan, whose result is known only as the statement runs),
    so a custom plan is estimated as the generic plan is, and its plan cache, which
    plans the first five runs of a prepared statement for their values and then keeps
    the generic plan unless the custom ones were estimated cheaper by more than the
    cost of planning, keeps the generic plan from the sixth run on. With the values
    in sight the appended rows' sequence and LIMIT, and the status block's NULL and
    0 tests, made custom plans look cheaper: on a database with statistics every
    build was planned afresh (about 2 ms, as long as the rest of the build four times
    over). tests/test_pg_build_reads.py checks the plan cache's counters.

    The price: each subquery is a node the executor starts (34 here), about 0.01 ms
    of the server's CPU a build (0.171 against 0.160 ms alone, with the values in
    sight under plan_cache_mode = force_generic_plan), not seen in latency (hot builds
    0.35 against 0.37 ms p50 in process, rounds alternating).
    Not that setting for the connection: it would reach every statement run on it,
    unnamed ones too, and a search needs a plan for its query; one row of the values
    joined laterally to both sides cost 0.1 ms a build; a SET around the statement,
    two statements more."""
    parts = _REF_SQL[True].split("%s")
    ref = parts[0] + "".join(
        f"%({name})s{part}" for name, part in zip(_REF_PARAMS, parts[1:], strict=True)
    )
    sql = (
        f"SELECT q.*, {', '.join(['NULL'] * _STATUS_WIDTH)} FROM ({ref}) q "
        f"UNION ALL SELECT {', '.join(['NULL'] * _REF_WIDTH[True])}, s.* "
        f"FROM ({status_sql}) s"
    )
    numbers: dict[str, int] = {}

    def hidden(match: re.Match[str]) -> str:
        number = numbers.setdefault(match[1], len(numbers) + 1)
        return f"(SELECT ${number}::{_ONE_TYPES[match[1]]})"

    text = _NAMED_PARAM.sub(hidden, sql)
    assert "%" not in text  # no escaped %: the raw statement is sent as it is
    return text.encode(), tuple(numbers)


def _status_order(row: Sequence[Any]) -> tuple[int, int]:
    """A status row's place in `status_query`'s order: entries, then threads, by rank."""
    return int(row[0]), int(row[1])


class _TakenRows:
    """Rows already read, handed to a call that takes them as from a cursor."""

    __slots__ = ("_rows",)

    def __init__(self, rows: list[Any]) -> None:
        self._rows = rows

    def fetchall(self) -> list[Any]:
        return self._rows
