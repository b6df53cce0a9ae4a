"""What every aggregate module of the PostgreSQL store shares: the pool, transactions
with retries and request records, and the translation of driver failures.

Writes run in READ COMMITTED transactions that lock the rows they depend on (the agent's
row FOR KEY SHARE, the thread's row FOR UPDATE), in that order everywhere, so concurrent
writers serialise per thread and never interleave numbers. A transaction PostgreSQL
aborts for a conflict (deadlock, serialization failure, a concurrent duplicate request
id) is run again from the start, a few times, before the caller sees an error.
"""

from __future__ import annotations

import functools
import inspect
import logging
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import psycopg
import psycopg_pool
from psycopg import errors as pg_errors

from contextd.domain.access import key_check_answered, owed_key_check
from contextd.domain.clock import MonotonicClock
from contextd.domain.errors import (
    ContextdError,
    NotFound,
    StoreBusy,
    StoreExhausted,
    StoreUnavailable,
    Unavailable,
)
from contextd.domain.idempotency import AlreadyDone, Remembered, RequestRecord, replay
from contextd.domain.model import Agent, MessageReceipt
from contextd.domain.window import WindowSpec
from contextd.ports.store import SnapshotMoved

log = logging.getLogger(__name__)

T = TypeVar("T")
P = ParamSpec("P")
Conn = psycopg.Connection[tuple[Any, ...]]

RETRY_AFTER_S = 1.0
# How many times a write aborted by a conflict is run again before the caller is told.
CONFLICT_ATTEMPTS = 8


def store_error(exc: psycopg.Error | psycopg_pool.PoolTimeout) -> ContextdError | None:
    """The domain error a driver failure stands for, or None for one that is a bug (our
    SQL). Messages never quote the driver's text (it may name hosts and users); the
    store logs that."""
    if isinstance(exc, psycopg_pool.PoolTimeout):
        return StoreBusy(
            "no database connection became free in time; retry later",
            retry_after_s=RETRY_AFTER_S,
        )
    if isinstance(exc, pg_errors.OutOfMemory | pg_errors.DiskFull | pg_errors.TooManyConnections):
        return StoreExhausted(
            "the database is out of a resource (memory, disk or connections); retry later",
            retry_after_s=2 * RETRY_AFTER_S,
        )
    if isinstance(exc, pg_errors.AdminShutdown | pg_errors.CannotConnectNow):
        return StoreUnavailable(
            "the database is shutting down or starting; retry later",
            retry_after_s=RETRY_AFTER_S,
        )
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        return StoreUnavailable(
            "the database connection failed; nothing of this call was saved unless it "
            "was acknowledged; retry later (with the same request id)",
            retry_after_s=RETRY_AFTER_S,
        )
    return None


def _translating(method: Callable[Concatenate[Any, P], T]) -> Callable[Concatenate[Any, P], T]:
    @functools.wraps(method)
    def call(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return method(self, *args, **kwargs)
        except (psycopg.Error, psycopg_pool.PoolTimeout) as exc:
            error = store_error(exc)
            if error is None:
                raise
            if getattr(self, "_closed", False):
                raise Unavailable(
                    "the server is shutting down",
                    reason="SHUTTING_DOWN",
                    retry_after_s=RETRY_AFTER_S,
                ) from exc
            log.error(
                "store failure",
                extra={"error": type(exc).__name__, "detail": str(exc)[:1000]},
            )
            raise error from exc

    return call


def failures_translated(cls: type[T]) -> type[T]:
    """Wrap every public method (of the class and its bases) so that a driver failure
    reaches callers as the domain error it stands for, on reads and writes alike."""
    wrapped: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("contextd.adapters.postgres"):
            continue
        for name, member in list(vars(klass).items()):
            public = not name.startswith("_") and inspect.isfunction(member)
            if public and name not in wrapped:
                wrapped.add(name)
                setattr(cls, name, _translating(getattr(cls, name)))
    return cls


@dataclass(frozen=True, slots=True)
class StatusArgs:
    """The arguments of `status_and_activity` (status.py): equal ones, in one
    snapshot, read the same."""

    tenant: str
    agent: str
    scope: str
    live_at_us: int
    entries: int
    window: WindowSpec
    threads: int


class PostgresBase:
    """The pool, the clock and the transaction runner every aggregate mixin uses."""

    clock: MonotonicClock
    _local: threading.local  # `conn`: the connection of this thread's snapshot, if any
    _pool: psycopg_pool.ConnectionPool[Conn]
    _closed: bool
    # Agents read by get_agent, by (tenant, name): (row version, agent); see agents.py.
    _agent_cache: dict[tuple[str, str], tuple[str, Agent]]

    @contextmanager
    def _reading(self) -> Iterator[Conn]:
        """A connection for reads: the snapshot's inside `snapshot`, else one from the pool
        (its statements see everything committed before each began)."""
        pinned: Conn | None = getattr(self._local, "conn", None)
        if pinned is not None:
            if getattr(self._local, "ended", False):
                # The snapshot ended with the reads sent ahead (`_end_snapshot_early`):
                # this one would be of another state. The next snapshot of this thread,
                # `read_consistently`'s second run, makes no such guess.
                self._local.no_early_end = True
                raise SnapshotMoved("a read after the snapshot ended with its reads ahead")
            self._begin(pinned)
            yield pinned
            return
        if self._closed:
            raise Unavailable(
                "the server is shutting down", reason="SHUTTING_DOWN", retry_after_s=RETRY_AFTER_S
            )
        with self._pool.connection() as conn:
            yield conn

    @contextmanager
    def _reading_once(self) -> Iterator[Conn]:
        """A connection for a read of one statement: the snapshot's inside `snapshot`,
        else one from the pool in autocommit, so the read is one round trip where a
        transaction of its own makes it three (BEGIN, the read, COMMIT). For the reads
        every call makes (whether the server has API keys, a caller's key, a request
        id's record)."""
        if getattr(self._local, "conn", None) is not None:  # inside a snapshot: join it
            with self._reading() as pinned:
                yield pinned
            return
        with self._reading() as conn:
            conn.autocommit = True
            try:
                yield conn
            finally:
                if conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE:
                    conn.autocommit = False

    @contextmanager
    def snapshot(self) -> Iterator[None]:
        """Reads of this thread inside the block see one consistent state: one READ ONLY
        REPEATABLE READ transaction on one connection. Nested blocks join the outer one.

        From the block's first read on (`_begin`) the connection is in pipeline mode,
        its BEGIN queued: it travels with that read's statement, and its COMMIT with the
        Sync that ends the pipeline, so a snapshot costs no round trip of its own, and a
        read may queue a statement whose result a later read of the block takes
        (`status_and_activity` queues the bounds of the thread `context_ref` read). A
        build expected to need only the reads it sends ahead may end the snapshot with
        them, COMMIT and Sync in the same round trip (`_end_snapshot_early`); when they
        are one statement, sent before anything else, it goes alone, with no pipeline,
        BEGIN or COMMIT (`_unbegun`): one statement sees one state. (No cache of windows on this
        engine: other replicas write too; the few shortcuts it keeps, the windows builds
        read among them, are validated by reads of the snapshot, see
        docs/architecture.md, The hot cache.)"""
        if getattr(self._local, "conn", None) is not None:
            yield
            return
        early = not getattr(self._local, "no_early_end", False)
        self._local.no_early_end = False
        with self._reading() as conn:
            # Autocommit (client side) so that psycopg sends no BEGIN of its own, with a
            # Sync, before the first statement: the block's BEGIN is the queued one.
            conn.autocommit = True
            try:
                # Left by the pipeline's exit, which sends the Sync: at the block's end,
                # or earlier (`_end_snapshot_early`).
                with ExitStack() as pipeline:
                    # The pipeline and its BEGIN go with the block's first read
                    # (`_begin`), so that a build answered by one statement sends it
                    # alone, in a round trip of its own (`_unbegun`).
                    self._local.begun = False
                    self._local.check = None
                    self._local.pipeline = pipeline
                    self._local.conn = conn
                    self._local.end_pipeline = pipeline.close if early else None
                    try:
                        yield
                    finally:
                        self._local.conn = None
                        self._local.pipeline = None
                        ended = bool(getattr(self._local, "ended", False))
                        self._local.ended = False  # by `_end_snapshot_early`
                        self._local.end_pipeline = None  # likewise
                        self._local.summary = None  # read by context_ref in this block
                        self._local.agent_version = None  # likewise
                        self._local.page = None  # read by window_bounds in this block
                        self._local.ref = None  # read by context_ref in this block
                        self._local.thread_version = None  # likewise
                        self._local.thread_state = None  # likewise
                        self._local.appended = None  # sent with context_ref's read
                        self._local.extend = None  # by plan_build_reads
                        self._local.bounds = None  # queued by status_and_activity
                        self._local.status = None  # sent with context_ref's read
                        self._local.planned = None  # by plan_build_reads
                    if not ended and owed_key_check() is not None:
                        # A block that read nothing still answers the key it owes.
                        self._local.pipeline = pipeline
                        self._begin(conn)
                        self._local.pipeline = None
                    check = self._local.check
                    self._local.check = None
                    owed = owed_key_check()
                    if owed is not None and check is not None:
                        stands = check.fetchone()
                        key_check_answered(owed, bool(stands and stands[0]))
                    if not ended and self._local.begun:
                        conn.execute("COMMIT")
            finally:
                if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE and (
                    not conn.closed
                ):
                    conn.rollback()  # the block failed: its transaction ends unused
                if not conn.closed:
                    conn.autocommit = False

    def _begin(self, conn: Conn) -> None:
        """Queue the snapshot's BEGIN before its first read (nothing after the first):
        the READ ONLY REPEATABLE READ transaction the block's reads share. A key the
        call owes a check of is read with it, in the same snapshot, so it costs no round
        trip; its answer is taken at the block's end, before anything read is answered
        (`owed_key_check`)."""
        if getattr(self._local, "begun", True):
            return
        self._local.begun = True
        self._local.pipeline.enter_context(conn.pipeline())
        conn.execute(SNAPSHOT_BEGIN)
        owed = owed_key_check()
        if owed is not None:
            self._local.check = conn.execute("SELECT " + KEY_STANDS, {"owed_key": owed.key_id})

    def _unbegun(self, conn: Conn) -> bool:
        """Whether `conn` is this thread's snapshot and nothing was read in it yet (no
        BEGIN sent), no key check is owed and the snapshot may end with its reads ahead:
        then one statement may make every read of a build, in its own snapshot, with
        no BEGIN or COMMIT around it (build_reads.py `context_ref`)."""
        return (
            getattr(self._local, "conn", None) is conn
            and not getattr(self._local, "begun", True)
            and getattr(self._local, "end_pipeline", None) is not None
            and owed_key_check() is None
        )

    def _end_snapshot_early(self, conn: Conn) -> bool:
        """End this snapshot now, with the statements queued in it: COMMIT, then the
        pipeline's Sync, one round trip for all of them (the COMMIT a block's end sends
        otherwise costs one of its own, as the block reads results before it ends).
        For a build whose reads the replica sent ahead (`_send_planned`): their results
        are taken from their cursors, all of one snapshot; any other read in the block
        raises SnapshotMoved (`_reading`), and `read_consistently` runs the block again
        in a snapshot that ends last. Whether it ended (not in a second run)."""
        end: Callable[[], None] | None = getattr(self._local, "end_pipeline", None)
        if end is None or getattr(self._local, "conn", None) is not conn:
            return False
        if getattr(self._local, "begun", True):
            conn.execute("COMMIT")
        else:
            # Nothing was begun (`_unbegun`): the one statement sent ran alone, outside
            # the pipeline, in a snapshot of its own.
            self._local.begun = True
        self._local.end_pipeline = None
        self._local.ended = True
        end()
        return True

    def _queue_bounds(
        self, conn: Conn, tenant: str, agent: str, scope: str, agent_window: WindowSpec
    ) -> None:
        """Queue the window bounds read the build will make next (see window_reads.py)."""

    def _send_status(self, conn: Conn, args: StatusArgs) -> None:
        """Queue the status block's read a build will make (see status.py)."""

    def _status_statement(self, args: StatusArgs) -> tuple[str, dict[str, Any]]:
        """The status block's statement and its named parameters (see status.py)."""
        raise NotImplementedError

    def _forget_old_requests(self) -> None:
        """Remove request records past their retention, a bounded chunk when one is due."""

    def _record_values(self, record: RequestRecord, value: Any) -> list[Any]:
        """The parameters of `RECORD_VALUES` for `record` and the result it remembers."""
        return [
            record.tenant,
            record.request_id,
            record.method,
            record.fingerprint,
            record.encode(value),
            self.clock.tick(),
        ]

    def _write(
        self,
        fn: Callable[[Conn], T],
        record: RequestRecord | None = None,
        *,
        records_itself: bool = False,
    ) -> T:
        """Run `fn` in one transaction and return its result; run it again from the
        start when PostgreSQL aborts it for a conflict.

        With a record, the transaction first looks its request id up (AlreadyDone with
        the first payload, or REQUEST_ID_REUSED) and records the result before it
        commits; a concurrent duplicate that commits first makes this one conflict on the
        record's key, and the rerun finds that record and replays it.

        `records_itself`: `fn` does both with statements of its own (a small write's
        time goes mostly to round trips, so it reads the record beside its first reads,
        `check_remembered`, and writes it with its last write, `RECORD_VALUES`).
        """
        if self._closed:
            raise Unavailable(
                "the server is shutting down", reason="SHUTTING_DOWN", retry_after_s=RETRY_AFTER_S
            )
        self._forget_old_requests()
        for attempt in range(CONFLICT_ATTEMPTS):
            try:
                with self._pool.connection() as conn, conn.transaction():
                    pay_owed_key_check(conn)
                    if record is not None and not records_itself:
                        found = _remembered(conn, record.tenant, record.request_id)
                        if found is not None:
                            raise AlreadyDone(replay(record, found))
                    value = fn(conn)
                    if record is not None and not records_itself:
                        conn.execute(
                            f"INSERT INTO request_records {RECORD_VALUES}",
                            self._record_values(record, value),
                        )
                return value
            except (
                pg_errors.DeadlockDetected,
                pg_errors.SerializationFailure,
                pg_errors.UniqueViolation,
            ) as exc:
                if isinstance(exc, pg_errors.UniqueViolation) and record is None:
                    raise
                if attempt == CONFLICT_ATTEMPTS - 1:
                    raise
                log.debug("write conflicted; running it again", extra={"attempt": attempt + 1})
        raise AssertionError("unreachable")


# The BEGIN of a snapshot (see `PostgresBase.snapshot`).
SNAPSHOT_BEGIN = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"

# The columns and values of a request record (`PostgresBase._record_values`).
RECORD_VALUES = (
    "(tenant, request_id, method, fingerprint, payload, create_time_us) "
    "VALUES (%s, %s, %s, %s, %s, %s)"
)
# The request record of an id: method, fingerprint, payload.
REMEMBERED = (
    "SELECT method, fingerprint, payload FROM request_records WHERE tenant = %s AND request_id = %s"
)


# The fingerprint of a record whose payload holds an append's receipts rather than its
# response (the one-statement append writes it: messages.py `_ONE_STATEMENT_APPEND`):
# the prefix, then the request's fingerprint. A replica of an earlier version finds the
# fingerprints differ and refuses the retry (REQUEST_ID_REUSED) rather than answer with
# bytes it cannot read.
RECEIPTS_RECORD = "receipts/1:"
# Each receipt in such a payload: id, sequence, commit time, token estimate, token count
# (int8send's big-endian bytes).
_RECEIPT = struct.Struct(">5q")
_RECEIPT_TAIL = struct.Struct(">3q")  # its last three


def remembered_of(method: str, fingerprint: str, payload: bytes) -> Remembered:
    """A record as read: a receipts record gives the receipts, which `replay` encodes."""
    if not fingerprint.startswith(RECEIPTS_RECORD):
        return Remembered(method, fingerprint, payload)
    receipts = [
        MessageReceipt(i, time_us, estimate, count, sequence)
        for i, sequence, time_us, estimate, count in _RECEIPT.iter_unpack(payload)
    ]
    return Remembered(method, fingerprint.removeprefix(RECEIPTS_RECORD), b"", receipts)


def receipt_tail(receipt: MessageReceipt) -> bytes:
    """What a receipts record holds of a receipt after its id and sequence (which the
    database assigns in the statement that writes the record)."""
    return _RECEIPT_TAIL.pack(receipt.create_time_us, receipt.token_estimate, receipt.token_count)


def check_remembered(record: RequestRecord | None, found: Any) -> None:
    """Raise AlreadyDone (or REQUEST_ID_REUSED) when `found`, the (method, fingerprint,
    payload) a write that `records_itself` read for `record`, holds a request record."""
    if record is not None and found is not None and found[0] is not None:
        raise AlreadyDone(replay(record, remembered_of(found[0], found[1], bytes(found[2]))))


def _remembered(conn: Conn, tenant: str, request_id: str) -> Remembered | None:
    row = conn.execute(REMEMBERED, [tenant, request_id]).fetchone()
    return remembered_of(row[0], row[1], bytes(row[2])) if row else None


# Whether the key a call was admitted with still stands (domain/access.py
# `owed_key_check`): `owed_key` NULL, nothing owed; '' (a call without a key), no key is
# active; else that key is active. In the snapshot of the statement it is part of.
KEY_STANDS = (
    "CASE WHEN %(owed_key)s::text IS NULL THEN true "
    "WHEN %(owed_key)s::text = '' THEN NOT EXISTS "
    "(SELECT FROM api_keys WHERE revoke_time_us IS NULL) "
    "ELSE EXISTS (SELECT FROM api_keys WHERE key_id = %(owed_key)s::text "
    "AND revoke_time_us IS NULL) END"
)


def owed_key_param() -> str | None:
    """The `owed_key` parameter of KEY_STANDS for the running call."""
    owed = owed_key_check()
    return None if owed is None else owed.key_id


def pay_owed_key_check(conn: Conn) -> None:
    """Confirm, in `conn`'s transaction before it writes anything, the key the running
    call owes a check of (nothing when none is owed): KeyRefused when it no longer stands.
    Every write a caller's call makes on this engine starts with this (`_write`, a
    tool output's upload) or checks KEY_STANDS in its own statement (the one-message
    append), so a call admitted unconfirmed writes nothing with a key revoked before it
    began; a snapshot (a build's reads) sends the check with its first statement and
    reads its answer before it ends (`snapshot`)."""
    owed = owed_key_check()
    if owed is None:
        return
    row = first(conn, "SELECT " + KEY_STANDS, {"owed_key": owed.key_id})
    key_check_answered(owed, bool(row[0]))


def first(conn: Conn, sql: str, params: list[Any] | dict[str, Any]) -> Any:
    """The first row of a query, or None."""
    return conn.execute(sql, params).fetchone()


def agent_missing(name: str) -> NotFound:
    return NotFound(f"agent {name!r} does not exist", reason="AGENT_NOT_FOUND")


def thread_gone(agent: str, thread: str) -> NotFound:
    return NotFound(
        f"thread {thread!r} of agent {agent!r} no longer exists", reason="THREAD_NOT_FOUND"
    )
