"""The writer thread: the mechanics of writing, and nothing of what is written.

DuckDB allows one writing process; one thread turns that into group commit. It takes
queued jobs (a run of appends, committed as one transaction whose rows
`MessagesMixin._insert_appends` builds as one Arrow batch; or a run of calls, each one
transaction of an aggregate module's SQL), answers every caller only after its commit,
bounds every caller's wait, answers retries from request records, flushes the lazy thread
counters when idle, and reports its health.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from queue import Empty
from typing import Any

import duckdb

from contextd.adapters.duckdb.base import (
    _ADD_TO_THREAD_COUNTERS,
    _STOP,
    EVERYTHING,
    NOTHING,
    RETRY_AFTER_S,
    DuckDBBase,
    T,
    Touches,
    _AppendJob,
    _ApplyJob,
    _CallJob,
    _first,
    _remembered,
    _remembered_keys,
    _save_records,
    log,
    store_error,
)
from contextd.adapters.duckdb.checkpoints import (
    IDLE_CHECKPOINT_BYTES,
    IDLE_CHECKPOINT_S,
    RETRY_BUSY_CHECKPOINT_S,
    RETRY_CHECKPOINT_S,
    refused_for_readers,
    wal_bytes,
)
from contextd.adapters.duckdb.journal import (
    APPLY_BYTES,
    APPLY_ROWS,
    DIRECT_ROWS,
    GroupWrite,
)
from contextd.adapters.duckdb.reply import Reply
from contextd.adapters.duckdb.request_filter import MIN_CAPACITY, Rebuild, RequestFilter
from contextd.adapters.duckdb.thread_counters import (
    FLUSH_INTERVAL_S,
    IDLE_FLUSH_S,
)
from contextd.domain.errors import (
    ContextdError,
    InvalidArgument,
    StoreBusy,
    StoreUnavailable,
    Unavailable,
)
from contextd.domain.idempotency import (
    CLEANUP_BACKLOG_EVERY_US,
    CLEANUP_CHUNK,
    CLEANUP_EVERY_US,
    RETENTION_US,
    AlreadyDone,
    Remembered,
    RequestRecord,
    record_key,
    replay,
)


class WriterMixin(DuckDBBase):
    def _submit(self, job: _AppendJob | _CallJob | _ApplyJob) -> Any:
        """Queue `job` for the writer and wait for its result, at most the write timeout.

        A caller must never hang on a stuck writer. When the wait times out, a job the
        writer has not taken yet is withdrawn (it is never written); one it has taken may
        still commit after its caller was answered STORE_BUSY. That is acceptable only
        because client-chosen request ids make the retry safe: an append retried with its
        request id after its first attempt committed is not written twice.
        """
        with self._submit_lock:
            if self._closed:
                raise Unavailable(
                    "the server is shutting down",
                    reason="SHUTTING_DOWN",
                    retry_after_s=RETRY_AFTER_S,
                )
            submitted = time.monotonic()
            self._queue.put(job)
        try:
            return job.future.result(timeout=self._write_timeout_s)
        except TimeoutError:
            if job.future.done():
                raise  # the job's own error, not the wait's
        withdrawn = job.future.cancel()
        if not withdrawn and job.future.done():
            return job.future.result()  # it finished as the wait ended
        self._wait_timed_out(submitted)
        timeout = f"{self._write_timeout_s:g}"
        if withdrawn:
            raise StoreBusy(
                f"the store did not take this write within {timeout}s; it was not written; "
                "retry later",
                retry_after_s=RETRY_AFTER_S,
            )
        raise StoreBusy(
            f"the store did not finish this write within {timeout}s; it may still be "
            "written: retry with the same request id",
            retry_after_s=RETRY_AFTER_S,
        )

    def _write(
        self,
        fn: Callable[[duckdb.DuckDBPyConnection], T],
        record: RequestRecord | None = None,
        touches: Touches | None = None,
    ) -> T:
        """Run `fn` in its own transaction on the writer thread and return its result.

        `touches` names what the write changes of the hot cache (hot.py); None, the
        default, drops all of it after the commit.

        With a record, the transaction first looks the request id up (AlreadyDone with
        the first payload, or REQUEST_ID_REUSED) and, after `fn`, records its result.
        """
        if record is None:
            result: T = self._submit(_CallJob(fn=fn, future=Reply(), touches=touches))
            return result

        def recorded(cur: duckdb.DuckDBPyConnection) -> T:
            # A fresh id (the filter says so for certain) needs no lookup.
            if self._requests.maybe(record.key):
                found = _remembered(cur, record.tenant, record.request_id)
                if found is not None:
                    raise AlreadyDone(replay(record, found))
            value = fn(cur)
            self._note_requests([record.key])  # before its commit makes it visible
            _save_records(cur, [(record, record.encode(value))], self.clock.tick())
            return value

        recorded_result: T = self._submit(_CallJob(fn=recorded, future=Reply(), touches=touches))
        return recorded_result

    def remembered(self, tenant: str, request_id: str) -> Remembered | None:
        """The recorded request of this id, if any (a read: the fast path of retries).

        Without the read barrier (every write with a request id asks this first, and
        waiting for the journal's apply on each would undo it): a record is in the
        journal's pending records until the apply's commit and in the table from then
        on (the writer forgets it only after that commit), so looking there first and
        then in the table finds every record acknowledged before the call. A miss is
        only a fast path missed: the writer checks again before writing.

        A key the request filter has never seen is fresh for certain (the writer adds
        every key before its record is visible): then no statement is run."""
        key = record_key(tenant, request_id)
        pending = self._journal_requests.get(key)
        if pending is not None:
            return pending
        if not self._requests.maybe(key):
            return None
        return _remembered_keys(self._thread_cursor("live_cursor"), [key]).get(key)

    def _note_requests(self, keys: Iterable[str]) -> None:
        """Add these keys to the request filter (the writer, before their records are
        visible: before the commit or the journal's write that holds them)."""
        requests = self._requests
        for key in keys:
            requests.add(key)

    def _load_request_filter(
        self, cur: duckdb.DuckDBPyConnection, journal_keys: list[str] | None = None
    ) -> RequestFilter:
        """A request filter of every recorded key: the table's (read in chunks, so the
        build's memory beyond the filter stays a few MB; hashed from the Arrow buffers
        without the GIL) and the journal's pending ones (`journal_keys`, default the
        journal's now), sized for twice as many (request_filter.py)."""
        if journal_keys is None:
            journal_keys = list(self._journal_requests)
        row = _first(cur.execute("SELECT count(*) FROM request_records"))
        rows = (int(row[0]) if row else 0) + len(journal_keys)
        requests = RequestFilter(capacity=max(MIN_CAPACITY, 2 * rows))
        for batch in cur.sql("SELECT id_key FROM request_records").to_arrow_reader(100_000):
            requests.add_arrow(batch.column(0))
        requests.add_many(journal_keys)
        return requests

    def _build_request_filter(self, journal_keys: list[str]) -> RequestFilter:
        """The rebuild's work, on its own thread and cursor (request_filter.Rebuild)."""
        cur = self._con.cursor()
        try:
            return self._load_request_filter(cur, journal_keys)
        finally:
            cur.close()

    def _rebuild_request_filter(self) -> None:
        """Build the request filter again once it took as many keys as it was sized for:
        from the keys recorded now (which sheds those the cleanup removed), sized for
        twice as many (request_filter.py). Started on the writer, between groups (every
        key added so far is committed or journaled), and built on a thread of its own
        while the writer goes on; swapped in, with the keys added meanwhile, between the
        groups after it is done. A failure keeps the old filter (more false positives,
        never a wrong answer) and is retried a second later."""
        requests = self._requests
        rebuild = requests.rebuild
        if rebuild is not None:
            if not rebuild.done():
                return
            try:
                rebuilt = rebuild.result()
            except Exception:  # whatever failed the build: the writer goes on
                requests.rebuild = None
                self._request_filter_retry_at = time.monotonic() + RETRY_AFTER_S
                log.exception("rebuilding the request filter failed; the old one is kept")
                return
            self._requests = rebuilt
            return
        if not requests.full() or time.monotonic() < self._request_filter_retry_at:
            return
        journal_keys = list(self._journal_requests)
        requests.rebuild = Rebuild(lambda: self._build_request_filter(journal_keys))

    def _wait_request_filter_rebuild(self) -> None:
        """At the writer's end: a running build's cursor must be done before the store
        closes its connection (a build takes a fraction of a second)."""
        rebuild = self._requests.rebuild
        if rebuild is not None:
            rebuild.join(self._write_timeout_s)

    def _forget_old_requests(self, writer: duckdb.DuckDBPyConnection) -> None:
        """Remove request records past their retention, at most CLEANUP_CHUNK per pass
        (a few milliseconds), once a minute by the store's clock; a pass that found a
        full chunk brings the next one to a second later, so a backlog drains without
        any pass holding the writer for long."""
        now = self.clock.now_us()
        if now < self._next_request_cleanup_us:
            return
        # Records of journaled appends are not in the table yet: apply them first (a
        # pass removes records by age, whichever way they were written).
        if self._journal_pending and not self._apply_journal_quietly(writer):
            return
        self._next_request_cleanup_us = now + CLEANUP_EVERY_US
        try:
            row = _first(
                writer.execute(
                    "DELETE FROM request_records WHERE rowid IN (SELECT rowid FROM "
                    "request_records WHERE create_time_us < ? LIMIT ?)",
                    [now - RETENTION_US, CLEANUP_CHUNK],
                )
            )
        except duckdb.Error:
            self._rollback(writer)
            log.exception("removing old request records failed; the next pass retries")
            return
        if row and int(row[0]) >= CLEANUP_CHUNK:
            self._next_request_cleanup_us = now + CLEANUP_BACKLOG_EVERY_US

    def _write_loop(self) -> None:
        writer = self._con.cursor()
        try:
            while True:
                job, self._held = self._held, None
                if job is None:
                    try:
                        # With counters pending, wait only so long for work: a writer that
                        # stays idle that long writes them while no caller is waiting.
                        # After a failed flush (a full disk, say) retry less eagerly.
                        wait = FLUSH_INTERVAL_S if self._flush_failed else IDLE_FLUSH_S
                        flush = len(self._pending) and self._fatal is None
                        # Work queued meanwhile is taken without computing the idle wait,
                        # whose WAL size check is a system call: each releases the GIL,
                        # which the writer must then win back from the handler threads.
                        try:
                            job = self._queue.get_nowait()
                        except Empty:
                            job = self._queue.get(timeout=self._idle_wait(wait if flush else None))
                    except Empty:
                        self._busy_since = time.monotonic()
                        if time.monotonic() >= self._journal_due_at():
                            self._apply_journal_quietly(writer)
                        # Not while a checkpoint is about due: the counters' update would
                        # make DuckDB refuse it for as long as reads run (checkpoints.py).
                        if not self._checkpoint_due():
                            self._flush_counters(writer)
                        self._forget_old_requests(writer)
                        self._checkpoint_when_idle(writer)
                        self._writer_waiting()
                        continue
                self._busy_since = time.monotonic()
                if job is _STOP:
                    self._flush_counters(writer, journal=True)
                    return
                # Before the group, so a write answered after the clock passed a due
                # pass was preceded by it (also on a writer that is never idle).
                self._forget_old_requests(writer)
                appends: list[_AppendJob] = []
                calls: list[_CallJob | _ApplyJob] = []
                stop = self._gather(job, appends, calls)
                try:
                    if appends:
                        self._commit_appends(writer, appends)
                    if calls:
                        self._run_calls(writer, calls)
                except BaseException as exc:
                    # The writer must outlive any failure, or every later caller would
                    # wait forever: fail what is unanswered and go on.
                    log.exception("writer failed a group; its unanswered calls get the error")
                    futures: list[Reply[Any]] = [j.future for j in appends]
                    futures += [c.future for c in calls]
                    for future in futures:
                        if not future.done():
                            future.set_exception(exc)
                    self._rollback(writer)
                self._last_group_at = time.monotonic()
                if self._journal_full() and time.monotonic() >= self._journal_retry_at:
                    self._apply_journal_quietly(writer)  # its callers are answered
                self._rebuild_request_filter()  # when full; its callers are answered
                if stop:
                    self._flush_counters(writer, journal=True)
                    return
                if self._pending.flush_due():
                    self._flush_counters(writer)
                self._writer_waiting()
        finally:
            self._wait_request_filter_rebuild()
            writer.close()

    def _idle_wait(self, flush_wait: float | None) -> float | None:
        """How long the idle writer waits for work before it acts on its own: the counters'
        wait (None: none pending), or less if the journal is due its idle apply or the WAL
        an idle checkpoint."""
        if self._journal_pending:
            left = max(0.0, self._journal_due_at() - time.monotonic())
            flush_wait = left if flush_wait is None else min(flush_wait, left)
        due = max(self._last_group_at + IDLE_CHECKPOINT_S, self._next_checkpoint_at)
        left = max(0.0, due - time.monotonic())
        # The WAL's size (a stat, which releases the GIL) matters only when the idle
        # checkpoint would come first; with the journal pending it hardly ever does.
        if flush_wait is not None and flush_wait <= left:
            return flush_wait
        if self._fatal is not None or wal_bytes(self._wal_path) < IDLE_CHECKPOINT_BYTES:
            return flush_wait
        return left if flush_wait is None else min(flush_wait, left)

    def _checkpoint_due(self) -> bool:
        """Whether the idle writer is to checkpoint at its next turn (or this one): the WAL
        is worth it and no failed attempt is waiting out its retry delay."""
        return (
            self._fatal is None
            and time.monotonic() >= self._next_checkpoint_at
            and wal_bytes(self._wal_path) >= IDLE_CHECKPOINT_BYTES
        )

    def _checkpoint_when_idle(self, writer: duckdb.DuckDBPyConnection) -> None:
        """Checkpoint if the writer has been idle IDLE_CHECKPOINT_S and the WAL is worth
        it, so that the next appends find a short WAL and no checkpoint in their way
        (checkpoints.py). A failure is logged and retried later: the WAL keeps every
        commit, and the next commit past the threshold checkpoints anyway."""
        now = time.monotonic()
        if (
            self._fatal is not None
            or now < self._last_group_at + IDLE_CHECKPOINT_S
            or now < self._next_checkpoint_at
            or wal_bytes(self._wal_path) < IDLE_CHECKPOINT_BYTES
        ):
            return
        try:
            writer.execute("CHECKPOINT")
        except duckdb.Error as exc:
            if refused_for_readers(exc):  # expected and brief: one line, an early retry
                self._next_checkpoint_at = time.monotonic() + RETRY_BUSY_CHECKPOINT_S
                log.info("idle checkpoint deferred: running reads hold back a committed update")
                return
            self._next_checkpoint_at = time.monotonic() + RETRY_CHECKPOINT_S
            if self._failed(exc) is not None:  # logged (and, if fatal, reported) there
                log.warning("idle checkpoint failed; the WAL keeps every commit")
            else:
                log.exception("idle checkpoint failed; the WAL keeps every commit")
            return
        # A checkpoint that left the WAL as long (another transaction held it back) is
        # not retried at once.
        if wal_bytes(self._wal_path) >= IDLE_CHECKPOINT_BYTES:
            self._next_checkpoint_at = time.monotonic() + RETRY_CHECKPOINT_S

    def _flush_counters(self, writer: duckdb.DuckDBPyConnection, journal: bool = False) -> None:
        """Write the pending thread counters and the id they count through, in one
        transaction; on failure they stay pending and the next flush retries.

        The counters count journaled messages too, and the id they count through must
        name only messages in the table: while the journal holds appends the flush waits
        for its apply, or with `journal` (at stop) applies it first."""
        if self._fatal is not None:
            return  # DuckDB refuses every statement now; the next start recounts
        if self._journal_pending and not (journal and self._apply_journal_quietly(writer)):
            return
        through_id = self._next_message_id - 1  # every id below it is committed
        try:
            with self._pending.flushing() as contextd_flush:  # noqa: F841 - scanned by the script
                writer.execute(
                    "BEGIN TRANSACTION;\n"
                    + _ADD_TO_THREAD_COUNTERS.format(counts="contextd_flush")
                    + f";\nUPDATE store_state SET value = {int(through_id)} "
                    "WHERE key = 'thread_counters_through_id';\n"
                    "COMMIT"
                )
            self._flush_failed = False
        except Exception as exc:  # the writer must survive: every later write depends on it
            self._rollback(writer)
            self._flush_failed = True
            if isinstance(exc, duckdb.Error) and self._failed(exc) is not None:
                # Logged (and, if fatal, reported to the server) by _failed.
                log.warning("writing thread counters failed; they stay pending")
            else:
                log.exception("writing thread counters failed; they stay pending")

    def _recount_threads(self) -> None:
        """Add the messages after the counted id to their threads' counters: the counts
        that were pending when the process last stopped without flushing them."""
        uncounted = """(
            SELECT context_id, count(*) AS n, sum(token_estimate) AS tokens,
                   min(create_time_us) AS first_us, max(create_time_us) AS last_us,
                   min(source_time_us) AS min_source_us,
                   sum(strlen(content) + strlen(tool_calls) + strlen(metadata)) AS bytes
            FROM messages
            WHERE id > (SELECT value FROM store_state WHERE key = 'thread_counters_through_id')
            GROUP BY context_id)"""
        self._con.execute(
            "BEGIN TRANSACTION;\n"
            + _ADD_TO_THREAD_COUNTERS.format(counts=uncounted)
            + ";\nUPDATE store_state SET value = (SELECT coalesce(max(id), 0) FROM messages) "
            "WHERE key = 'thread_counters_through_id';\n"
            "COMMIT"
        )

    def _gather(
        self, first: Any, appends: list[_AppendJob], calls: list[_CallJob | _ApplyJob]
    ) -> bool:
        """Take `first` and whatever of the same kind is queued right behind it, up to the
        group limit: a run of appends (committed together) or a run of calls.

        A job of the other kind ends the group and is held for the next one, so writes
        commit in the order they arrived: an append queued after a DeleteAgent must not be
        committed before the delete (it would be acknowledged, then deleted).
        """
        rows = 0
        job = first
        while True:
            if job is _STOP:
                return True  # finish this group, then stop
            # A job whose caller gave up waiting (and withdrew it) is dropped unwritten.
            if isinstance(job, _AppendJob) and not calls:
                if job.future.set_running_or_notify_cancel():
                    appends.append(job)
                    rows += job.rows
            elif isinstance(job, _CallJob | _ApplyJob) and not appends:
                if job.future.set_running_or_notify_cancel():
                    calls.append(job)
            else:
                self._held = job
                return False
            if rows >= self._max_group_rows:
                return False
            try:
                job = self._queue.get_nowait()
            except Empty:
                return False

    def _run_calls(
        self, writer: duckdb.DuckDBPyConnection, calls: list[_CallJob | _ApplyJob]
    ) -> None:
        """Run a group of calls, each in its own transaction, after applying the journal:
        calls read what appends wrote, and a read's barrier (`_ApplyJob`) asks for just
        that. If the journal cannot be applied, every call of the group gets the error."""
        try:
            self._apply_journal(writer)
        except ContextdError as exc:
            for call in calls:
                call.future.set_exception(exc)
            return
        for call in calls:
            if isinstance(call, _ApplyJob):
                call.future.set_result(None)
            else:
                self._run_call(writer, call)

    def _run_call(self, writer: duckdb.DuckDBPyConnection, call: _CallJob) -> None:
        began = False
        try:
            writer.execute("BEGIN TRANSACTION")
            result = call.fn(writer)
            self._hot.begin_commit()
            began = True
            writer.execute("COMMIT")
        except BaseException as exc:
            self._rollback(writer)
            if began:  # the commit failed: nothing changed, but drop all to be sure
                self._hot.end_commit(EVERYTHING)
            call.future.set_exception(exc)
        else:
            # The cache follows the commit before its caller hears of it (hot.py).
            self._hot.end_commit(call.touches)
            call.future.set_result(result)

    @staticmethod
    def _rollback(writer: duckdb.DuckDBPyConnection) -> None:
        with contextlib.suppress(duckdb.Error):  # no transaction was open
            writer.execute("ROLLBACK")

    def _without_replays(
        self, writer: duckdb.DuckDBPyConnection, jobs: list[_AppendJob]
    ) -> tuple[list[_AppendJob], list[tuple[_AppendJob, _AppendJob]]]:
        """The jobs to write: those whose request id was recorded before are answered
        here (their first payload, or REQUEST_ID_REUSED); a job repeating the id of an
        earlier job of this group waits for that one (returned as (job, first) pairs)."""
        recorded = [j for j in jobs if j.record is not None]
        if not recorded:
            return jobs, []
        keep: list[_AppendJob] = []
        repeats: list[tuple[_AppendJob, _AppendJob]] = []
        first_of: dict[str, _AppendJob] = {}
        # Records of journaled appends are not in the table yet: answered from memory.
        pending = self._journal_requests
        stored = {k: pending[k] for j in recorded if j.record and (k := j.record.key) in pending}
        # Keys the request filter has never seen are fresh for certain: not looked up.
        maybe = self._requests.maybe
        unknown = [
            k for j in recorded if j.record and (k := j.record.key) not in stored and maybe(k)
        ]
        if unknown:
            stored.update(_remembered_keys(writer, unknown))
        for job in jobs:
            record = job.record
            if record is None:
                keep.append(job)
                continue
            id_key = record.key
            if id_key in first_of:
                repeats.append((job, first_of[id_key]))
                continue
            found = stored.get(id_key)
            if found is None:
                first_of[id_key] = job
                keep.append(job)
                continue
            try:
                job.future.set_exception(AlreadyDone(replay(record, found)))
            except InvalidArgument as exc:
                job.future.set_exception(exc)
        return keep, repeats

    def _answer_repeats(self, repeats: list[tuple[_AppendJob, _AppendJob]]) -> None:
        for job, first in repeats:
            assert job.record is not None and first.record is not None
            exc = first.future.exception()
            if exc is not None:
                job.future.set_exception(exc)
                continue
            remembered = Remembered(
                first.record.method,
                first.record.fingerprint,
                first.record.encode(first.future.result()),
            )
            try:
                job.future.set_exception(AlreadyDone(replay(job.record, remembered)))
            except InvalidArgument as error:
                job.future.set_exception(error)

    def _commit_appends(self, writer: duckdb.DuckDBPyConnection, jobs: list[_AppendJob]) -> None:
        """Commit a group of appends in one transaction; isolate a failing job on error."""
        jobs, repeats = self._without_replays(writer, jobs)
        try:
            if jobs:
                self._commit_new_appends(writer, jobs)
        finally:
            self._answer_repeats(repeats)

    def _commit_new_appends(
        self, writer: duckdb.DuckDBPyConnection, jobs: list[_AppendJob]
    ) -> None:
        # Journaled (journal.py) when small and every agent named is known (creating one
        # reads and writes the agents table); otherwise committed directly, after what
        # is journaled, so that writes reach the tables in the order they were answered.
        journal = (
            self._journal is not None
            and self._fatal is None
            and not self._journal_full()  # only if an apply failed: then appends fail
            and sum(job.rows for job in jobs) < DIRECT_ROWS
            and all((job.key.tenant, job.key.agent) in self._known_agents for job in jobs)
        )
        if not journal:
            try:
                self._apply_journal(writer)
            except ContextdError as exc:
                for job in jobs:
                    job.future.set_exception(exc)
                return
        # New context ids enter the cache only after their commit, so it needs no restore.
        saved = (self._next_message_id, self._next_context_id)
        self._hot_appended = None
        self._hot.begin_commit()
        try:
            receipts, counted = self._insert_appends(writer, jobs, journal)  # commits
        except BaseException as exc:
            self._hot.end_commit(EVERYTHING)
            self._rollback(writer)
            self._next_message_id, self._next_context_id = saved
            self._calls.clear()  # may name ids of the rolled-back rows; the table still knows
            self._known_agents.clear()  # may name agents whose insert was rolled back
            self._last_sequence.clear()  # re-read from the rows, whoever numbered them
            if len(jobs) == 1:
                jobs[0].future.set_exception(exc)
                return
            log.warning("group commit failed; retrying its %d calls one by one", len(jobs))
            for job in jobs:
                self._commit_new_appends(writer, [job])
            return
        for context_id, (n, tokens, first_us, last_us, min_source_us, nbytes) in counted.items():
            self._pending.add(context_id, n, tokens, first_us, last_us, min_source_us, nbytes)
        # The hot cache takes the committed rows before any caller is answered (hot.py).
        self._hot.end_commit(NOTHING, self._hot_appended)
        self._hot_appended = None
        for job, job_receipts in zip(jobs, receipts, strict=True):
            job.future.set_result(job_receipts)

    # ----------------------------------------------------------------- the journal

    def _journal_append(self, group: GroupWrite) -> None:
        """Make `group` durable in the journal (one synchronous write); on return its
        callers may be answered. A failed write is cut back out of the file, so it is
        never replayed; if it cannot be, the store stops serving (a restart reads the
        file and keeps only whole records)."""
        journal = self._journal
        assert journal is not None
        number = self._journal_group + 1
        try:
            journal.append(number, group.encode())
        except OSError as exc:
            if not getattr(exc, "cut_back", False):
                with self._health_lock:
                    log.error("the append journal could not be written nor cut back")
                    self._update_health(fatal=f"append journal: {exc}")
            else:
                log.error("writing the append journal failed", extra={"detail": str(exc)})
            raise StoreUnavailable(
                "the store could not write this append to disk (I/O error); nothing of it "
                "was saved; retry later",
                retry_after_s=RETRY_AFTER_S,
            ) from exc
        self._journal_pending.append(group)
        self._journal_rows += group.rows
        self._journal_group = number  # before any caller is answered: reads' barrier

    def _apply_journal(self, writer: duckdb.DuckDBPyConnection) -> None:
        """Write every journaled group to the tables in one transaction that also records
        the last group's number, then empty the journal. On failure nothing is dropped:
        the groups stay pending (and in the file), and StoreUnavailable is raised to
        whoever needed them applied (a read, a write, a large append)."""
        if not self._journal_pending:
            return
        last = self._journal_group
        try:
            self._apply_group(writer, GroupWrite.merged(self._journal_pending), applied_group=last)
        except Exception as exc:
            self._rollback(writer)
            # Reads served from memory would answer while those by SQL cannot: drop the
            # hot cache, so that every read waits for the journal alike.
            self._hot.begin_commit()
            self._hot.end_commit(EVERYTHING)
            error = self._failed(exc) if isinstance(exc, duckdb.Error) else None
            if error is not None and self._fatal is not None:
                # DuckDB must be reopened (no retry helps); the journal is kept for it.
                raise error from exc
            log.exception(
                "applying the append journal to the tables failed; it is kept, and reads "
                "are answered UNAVAILABLE until it applies",
                extra={"groups": len(self._journal_pending), "rows": self._journal_rows},
            )
            raise StoreUnavailable(
                "the store could not apply acknowledged appends to its tables; they are "
                "kept in its journal (nothing is lost), but it cannot answer this call "
                "until they are applied; retry later",
                retry_after_s=RETRY_AFTER_S,
            ) from exc
        self._journal_pending = []
        self._journal_rows = 0
        self._journal_requests.clear()
        self._journal_applied = last
        assert self._journal is not None
        self._journal.empty()

    def _apply_journal_quietly(self, writer: duckdb.DuckDBPyConnection) -> bool:
        """`_apply_journal` on the writer's own account (idle, past its bounds, at stop):
        a failure is logged there; the writer tries again on its own only a second later
        (reads and writes that need it try at once). True: all applied."""
        try:
            self._apply_journal(writer)
        except ContextdError:
            self._journal_retry_at = time.monotonic() + RETRY_AFTER_S
            return False
        return True

    def _journal_full(self) -> bool:
        """Whether the journal holds as much as it may (journal.py's bounds)."""
        journal = self._journal
        return self._journal_rows >= APPLY_ROWS or (
            journal is not None and journal.size >= APPLY_BYTES
        )

    def _journal_due_at(self) -> float:
        """When the idle writer applies the journal (monotonic seconds)."""
        return max(self._last_group_at + self._journal_idle_s, self._journal_retry_at)

    # ----------------------------------------------------------------- health

    def watch(self, listener: Callable[[bool], None]) -> None:
        """Call `listener(serving)` whenever the store turns unable to serve (a fatal
        DuckDB error, for good; the writer stuck on one job for longer than the write
        timeout) or able again (the stuck writer finished its job). Listeners are called
        in order, under a lock: they must be quick and must not call the store."""
        with self._health_lock:
            self._listeners.append(listener)
            if not self._serving():
                listener(False)

    def serving(self) -> bool:
        """Whether the store can serve: no fatal error and no writer stuck on a job."""
        with self._health_lock:
            return self._serving()

    def _serving(self) -> bool:
        return self._fatal is None and not self._wedged

    def _update_health(self, *, wedged: bool | None = None, fatal: str | None = None) -> None:
        """Record a change (the caller holds `_health_lock`); tell listeners if serving
        changed."""
        before = self._serving()
        if wedged is not None:
            self._wedged = wedged
        if fatal is not None and self._fatal is None:
            self._fatal = fatal
        after = self._serving()
        if after != before:
            for listener in self._listeners:
                listener(after)

    def _failed(self, exc: duckdb.Error) -> ContextdError | None:
        """The domain error for a DuckDB failure (None: not a store failure, a bug); logs
        it with DuckDB's own text, and a fatal one makes the store stop serving."""
        error = store_error(exc)
        if error is None or isinstance(exc, duckdb.ConnectionException):
            return error
        detail = {"error": type(exc).__name__, "detail": str(exc)[:1000]}
        if isinstance(exc, duckdb.FatalException | duckdb.InternalException):
            with self._health_lock:
                if self._fatal is None:
                    log.error(
                        "the store failed fatally; every call is answered UNAVAILABLE until "
                        "the server is restarted",
                        extra=detail,
                    )
                self._update_health(fatal=detail["detail"])
        else:
            log.error("store failure", extra=detail)
        return error

    def _writer_waiting(self) -> None:
        """The writer finished what it was doing: a stuck writer, if one was reported,
        is taking work again."""
        with self._health_lock:
            self._busy_since = None
            if self._wedged:
                log.warning("the store's writer is taking calls again")
                self._update_health(wedged=False)

    def _wait_timed_out(self, submitted: float) -> None:
        """A caller waited the whole write timeout. If the writer has been on the same
        job since before the call was queued, it is stuck, not merely busy: report it."""
        with self._health_lock:
            since = self._busy_since
            if since is not None and since <= submitted and not self._wedged:
                log.error(
                    "the store's writer has been on one job for longer than the write "
                    "timeout; calls that wait for it are answered STORE_BUSY",
                    extra={"write_timeout_s": self._write_timeout_s},
                )
                self._update_health(wedged=True)
