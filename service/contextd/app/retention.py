"""The retention sweep: deletes what retention policies let go (see domain/retention.py).

A pass visits every agent with a retention policy, every thread of it, and for each:

1. when the thread is expired (its newest message `ttl` or more old), records that its
   messages up to its last sequence expired (`mark_expired`, checked again in the
   write's transaction, so an append that just arrived keeps its thread alive);
2. deletes the messages of the thread's expired past (those up to its expired-through
   mark: also what an append after expiry left behind its expiry marker);
3. with `delete_overflow`, deletes the messages a cap left out of the window (those
   whose tool group starts at or before last sequence - max_messages);
4. when the thread is expired, deletes its context's tool outputs (same tenant, agent,
   scope and thread) stored `ttl` or more ago, with their stored data;
5. records a `retention.swept` event on the thread with what it deleted.

Deletes go a chunk at a time (at most `chunk_rows` messages or tool outputs, one short
transaction each), so appends wait at most one chunk. Nothing a pass decides is kept in memory
between chunks: a pass stopped anywhere (a restart, a crash) leaves only marks that are
already true, and the next pass finds what is left and finishes it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from contextd.app.base import UseCases
from contextd.domain.errors import ContextdError
from contextd.domain.model import Agent
from contextd.domain.retention import SWEPT_EVENT
from contextd.ports.store import RetainedThread

log = logging.getLogger("contextd.retention")

# Messages one delete transaction removes at most: a few milliseconds of the writer.
SWEEP_CHUNK_ROWS = 500
_PAGE = 200


@dataclass(slots=True)
class SweepReport:
    """What one pass did."""

    ran: bool = True  # False: another sweeper held the lock, this pass did nothing
    threads: int = 0  # threads it deleted messages of
    expired_deleted: int = 0
    overflow_deleted: int = 0
    tool_outputs_deleted: int = 0
    transactions: int = 0  # delete transactions (chunks)
    complete: bool = True  # False: stopped before the end (shutting down)


class RetentionCalls(UseCases):
    def sweep_retention(
        self, chunk_rows: int = SWEEP_CHUNK_ROWS, stop: threading.Event | None = None
    ) -> SweepReport:
        """One pass over every agent with a retention policy (see the module docstring);
        returns at once, having done nothing, while another sweeper is at work."""
        with self._store.sweep_lock() as held:
            if not held:
                return SweepReport(ran=False)
            report = SweepReport()
            after: tuple[str, str] | None = None
            while True:
                agents = self._store.retention_agents(after, _PAGE)
                for agent in agents:
                    if stop is not None and stop.is_set():
                        report.complete = False
                        return report
                    self._sweep_agent(agent, chunk_rows, report, stop)
                if len(agents) < _PAGE:
                    return report
                after = (agents[-1].tenant, agents[-1].name)

    def _sweep_agent(
        self,
        agent: Agent,
        chunk_rows: int,
        report: SweepReport,
        stop: threading.Event | None,
    ) -> None:
        after = 0
        while True:
            threads = self._store.retention_threads(agent.tenant, agent.name, after, _PAGE)
            for thread in threads:
                if stop is not None and stop.is_set():
                    report.complete = False
                    return
                try:
                    self._sweep_thread(agent, thread, chunk_rows, report)
                except ContextdError as exc:  # e.g. the agent deleted meanwhile
                    log.warning(
                        "retention sweep skipped a thread",
                        extra={"agent": agent.name, "thread": thread.key.thread, "error": str(exc)},
                    )
            if len(threads) < _PAGE:
                return
            after = threads[-1].context_id

    def _sweep_thread(
        self, agent: Agent, thread: RetainedThread, chunk_rows: int, report: SweepReport
    ) -> None:
        policy = agent.retention_for(thread.key.scope)
        now = self._clock.now_us()
        expired_through = thread.expired_through
        if policy.expired(thread.last_message_time_us, now) and (
            expired_through < thread.last_sequence
        ):
            expired_through = self._store.mark_expired(thread, now - policy.ttl_us)
        expired = overflow = 0
        oldest = thread.oldest_sequence
        if oldest is not None and oldest <= expired_through:
            expired = self._delete(thread, expired_through, False, chunk_rows, report)
        floor = thread.last_sequence - policy.max_messages
        start = thread.oldest_group_start
        if policy.delete_overflow and policy.max_messages and start is not None and start <= floor:
            overflow = self._delete(thread, floor, True, chunk_rows, report)
        outputs = 0
        if policy.expired(thread.last_message_time_us, now):
            outputs = self._delete_outputs(thread, now - policy.ttl_us, chunk_rows, report)
        elif thread.outputs_expired_through_us:
            # Restarted by an append after expiry: what was old enough then goes.
            outputs = self._delete_outputs(
                thread, thread.outputs_expired_through_us, chunk_rows, report
            )
        if expired or overflow or outputs:
            report.threads += 1
            report.expired_deleted += expired
            report.overflow_deleted += overflow
            report.tool_outputs_deleted += outputs
            self._store.record_event(
                thread.key,
                SWEPT_EVENT,
                {
                    "expired_deleted": expired,
                    "overflow_deleted": overflow,
                    "deleted": expired + overflow,
                    "tool_outputs_deleted": outputs,
                    "expired_through_sequence": expired_through,
                    "overflow_through_sequence": max(floor, 0) if overflow else 0,
                    "max_messages": policy.max_messages,
                    "ttl_seconds": policy.ttl_us / 1_000_000,
                },
            )

    def _delete_outputs(
        self, thread: RetainedThread, cutoff_us: int, chunk_rows: int, report: SweepReport
    ) -> int:
        """The expired context's tool outputs stored at or before `cutoff_us` (now - ttl),
        a chunk at a time; their bytes stop counting toward the tenant's quota."""
        deleted = 0
        while True:
            n = self._store.delete_expired_tool_outputs(thread, cutoff_us, chunk_rows)
            report.transactions += 1 if n else 0  # the store skips a chunk with nothing to do
            deleted += n
            if n < chunk_rows:
                if deleted:
                    self._quota.forget(thread.key.tenant)
                return deleted

    def _delete(
        self,
        thread: RetainedThread,
        through: int,
        by_group: bool,
        chunk_rows: int,
        report: SweepReport,
    ) -> int:
        if through <= 0:
            return 0
        deleted = 0
        while True:
            n = self._store.delete_retained(thread, through, by_group, chunk_rows)
            report.transactions += 1
            deleted += n
            if n < chunk_rows:
                return deleted
