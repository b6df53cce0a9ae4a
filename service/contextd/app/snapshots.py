"""Snapshots: save a consistent cut of a window, list, read, delete and restore it.

A save reads everything it keeps inside one `store.snapshot()` (one read transaction), so
an append that races it is in the snapshot whole or not at all; the summary (a network
call) comes after that read, and the write after the summary. A restore appends the saved
messages again in one transaction: each thread's in its saved order, tool calls and their
results in one batch (so the results tie to the restored call), marked with the
snapshot's id.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from contextd.app.base import UseCases
from contextd.app.build.ledger import restore as restore_ledger
from contextd.app.build.summarizer import collect_specifics, parse_specifics
from contextd.app.paging import page_size
from contextd.domain.batches import prepare_batch
from contextd.domain.context import HistoryItem
from contextd.domain.errors import (
    AlreadyExists,
    DataLoss,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StaleModel,
    Unavailable,
)
from contextd.domain.idempotency import RequestRecord
from contextd.domain.model import (
    Agent,
    ContextKey,
    MessageReceipt,
    NewMessage,
    Page,
    StoredMessage,
)
from contextd.domain.quota import stored_bytes
from contextd.domain.snapshots import (
    SnapshotContents,
    SnapshotInfo,
    check_description,
    check_snapshot_id,
    decode_document,
    encode_document,
    info_of,
    message_size,
    new_snapshot_id,
)
from contextd.domain.validation import check_name, tool_call_ids
from contextd.domain.window import WindowSpec
from contextd.ports.store import ThreadFilter, read_consistently

log = logging.getLogger(__name__)

# Messages read per query while saving: the limits are checked page by page, so a
# window over them is refused having read at most this much past them.
SAVE_PAGE = 200


@dataclass(frozen=True, slots=True)
class RestoreResult:
    count: int
    threads: tuple[str, ...]
    receipts: tuple[MessageReceipt, ...]


class SnapshotCalls(UseCases):
    def save_snapshot(
        self,
        tenant: str,
        agent: str,
        scope: str,
        thread: str,
        description: str,
        record: RequestRecord | None = None,
    ) -> SnapshotInfo:
        check_name(agent, "agent")
        check_name(scope, "scope", allow_empty=True)
        check_name(thread, "thread", allow_empty=True)
        check_description(description)

        def read() -> tuple[Agent, int, list[StoredMessage], list[list[str]]]:
            found = self._store.get_agent(tenant, agent)
            if thread and self._store.get_thread(ContextKey(tenant, agent, scope, thread)) is None:
                raise NotFound(
                    f"agent {agent!r} has no thread {thread!r} in scope {scope!r}",
                    reason="THREAD_NOT_FOUND",
                )
            now = self._clock.tick()
            window = found.window_at(scope, now)
            where = ThreadFilter(tenant, agent, scope, thread or None)
            return found, now, *self._read_cut(where, window)

        # One snapshot (run again if an engine's cached reads moved under it).
        found, now, messages, ledgers = read_consistently(self._store, read)
        items = [HistoryItem.from_stored(m) for m in messages]
        previous: list[str] = []
        for ledger in ledgers:
            previous += [s for s in ledger if s not in previous]
        specifics = collect_specifics(items, previous)
        summary = ""
        if messages:
            result = self._session_summarizer.summarize_session(items)
            summary = result.text
            if result.error is not None:
                log.warning(
                    "the snapshot's summary could not be written",
                    extra={"agent": agent, "error": result.error},
                )
        info = info_of(new_snapshot_id(), found, scope, thread, now, description, summary, messages)
        document = encode_document(SnapshotContents(info, tuple(messages), found, tuple(specifics)))
        with self._quota.admitting(tenant, info.size_bytes, "this snapshot"):
            return self._store.save_snapshot(info, document, found.create_time_us, record)

    def _read_cut(
        self, where: ThreadFilter, window: WindowSpec
    ) -> tuple[list[StoredMessage], list[list[str]]]:
        """The window's messages (stored summaries left out) and the ledgers of the
        newest summary in each thread's window; RESOURCE_EXHAUSTED past the limits.
        Called inside the store's snapshot: every page sees the same state."""
        limits = self._limits
        kept: list[StoredMessage] = []
        summaries: dict[str, StoredMessage] = {}
        size = 0
        after: tuple[int, int] | None = None
        while True:
            page = self._store.list_messages(where, window, after, SAVE_PAGE)
            for m in page:
                if m.is_summary:
                    summaries[m.thread] = m  # pages are in order: the newest stays
                    continue
                kept.append(m)
                size += message_size(m)
                if len(kept) > limits.snapshot_max_messages:
                    raise ResourceExhausted(
                        f"the window holds more than {limits.snapshot_max_messages:,} "
                        f"messages, the most a snapshot holds (snapshot_max_messages); "
                        "save one thread, or clear older messages first",
                        reason="SNAPSHOT_TOO_LARGE",
                    )
                if size > limits.snapshot_max_bytes:
                    raise ResourceExhausted(
                        f"the window's messages hold more than {limits.snapshot_max_bytes:,} "
                        "bytes, the most a snapshot holds (snapshot_max_bytes); save one "
                        "thread, or clear older messages first",
                        reason="SNAPSHOT_TOO_LARGE",
                    )
            if len(page) < SAVE_PAGE:
                break
            last = page[-1]
            after = (last.sequence, last.id) if where.thread else (last.create_time_us, last.id)
        # Each ledger whole: the entries a build held out of its rendering (kept in the
        # summary's metadata) go back in first.
        ledgers = [
            parse_specifics(restore_ledger(HistoryItem.from_stored(summaries[t])).content)
            for t in sorted(summaries)
        ]
        return kept, ledgers

    def list_snapshots(
        self, tenant: str, agent: str, scope: str, requested_size: int, token: str
    ) -> Page[SnapshotInfo]:
        check_name(agent, "agent")
        check_name(scope, "scope", allow_empty=True)
        size = page_size(requested_size)
        params = ("snapshots", tenant, agent, scope)
        position = self._pages.decode(token, params, (int, str))
        self._store.get_agent(tenant, agent)
        after = (int(position.position[0]), str(position.position[1])) if position else None
        found = self._store.list_snapshots(tenant, agent, scope, after, size + 1)
        return Page(*self._pages.cut(found, size, params, lambda s: (s.create_time_us, s.id)))

    def get_snapshot(
        self, tenant: str, agent: str, scope: str, snapshot_id: str, full: bool
    ) -> tuple[SnapshotInfo, SnapshotContents | None]:
        """The metadata, and with `full` what the document holds (DATA_LOSS when the
        document is missing or corrupt)."""
        info = self._find_snapshot(tenant, agent, scope, snapshot_id)
        return info, (self._contents(info) if full else None)

    def delete_snapshot(
        self,
        tenant: str,
        agent: str,
        scope: str,
        snapshot_id: str,
        record: RequestRecord | None = None,
    ) -> SnapshotInfo:
        check_name(agent, "agent")
        check_name(scope, "scope", allow_empty=True)
        check_snapshot_id(snapshot_id)
        self._store.get_agent(tenant, agent)
        deleted = self._store.delete_snapshot(tenant, agent, scope, snapshot_id, record)
        self._quota.forget(tenant)  # its bytes no longer count
        return deleted

    def restore_snapshot(
        self,
        tenant: str,
        agent: str,
        scope: str,
        snapshot_id: str,
        branch_thread: str,
        record: RequestRecord | None = None,
    ) -> RestoreResult:
        """Append the saved messages again, one batch per thread in one transaction."""
        check_name(branch_thread, "branch_thread", allow_empty=True)
        info = self._find_snapshot(tenant, agent, scope, snapshot_id)
        if branch_thread:
            if len(info.threads) > 1:
                raise InvalidArgument(
                    f"snapshot {snapshot_id!r} holds messages of {len(info.threads)} threads; "
                    "a branch takes one thread's: restore it without branch_thread",
                    field="branch_thread",
                )
            if self._store.get_thread(ContextKey(tenant, agent, scope, branch_thread)):
                raise AlreadyExists(
                    f"thread {branch_thread!r} already holds messages; name a new thread "
                    "to restore into",
                    reason="THREAD_EXISTS",
                    field="branch_thread",
                )
        contents = self._contents(info)
        by_thread: dict[str, list[StoredMessage]] = {}
        for m in contents.messages:
            by_thread.setdefault(branch_thread or m.thread, []).append(m)
        threads = tuple(sorted(by_thread))
        plan: list[tuple[ContextKey, list[NewMessage], list[tuple[str, ...]]]] = []
        for name in threads:
            saved = sorted(by_thread[name], key=lambda m: (m.sequence, m.id))
            plan.append(
                (
                    ContextKey(tenant, agent, scope, name),
                    [_restored(m) for m in saved],
                    [_call_ids(m, snapshot_id) for m in saved],
                )
            )
        if record is not None:
            encode = record.encode
            record = record.with_encoder(
                lambda receipts: encode(RestoreResult(len(receipts), threads, tuple(receipts)))
            )
        model = self._model_of(tenant, agent)
        ttl_us = self._ttl_of(tenant, agent, scope)  # a restore restarts an expired thread
        adding = sum(stored_bytes(new) for _, new, _ in plan) if self._quota.limit else 0
        for _ in range(3):
            parts = [
                (
                    key,
                    replace(
                        prepare_batch(new, model, ids, restored_from=snapshot_id), ttl_us=ttl_us
                    ),
                )
                for key, new, ids in plan
            ]
            try:
                with self._quota.admitting(tenant, adding, "this restore"):
                    receipts = self._store.append_many(parts, record)
            except StaleModel as changed:
                # Another replica changed the agent's model since this one cached it.
                model = changed.model
                self._models[(tenant, agent)] = model
                continue
            return RestoreResult(len(receipts), threads, tuple(receipts))
        raise Unavailable(
            "the agent's model kept changing during this restore; retry",
            retry_after_s=0.1,
        )

    # ----------------------------------------------------------------- helpers

    def _find_snapshot(self, tenant: str, agent: str, scope: str, snapshot_id: str) -> SnapshotInfo:
        check_name(agent, "agent")
        check_name(scope, "scope", allow_empty=True)
        check_snapshot_id(snapshot_id)
        self._store.get_agent(tenant, agent)
        info = self._store.get_snapshot(tenant, agent, scope, snapshot_id)
        if info is None:
            raise NotFound(
                f"no snapshot {snapshot_id!r} in this scope of agent {agent!r}",
                reason="SNAPSHOT_NOT_FOUND",
            )
        return info

    def _contents(self, info: SnapshotInfo) -> SnapshotContents:
        return decode_document(self._store.snapshot_document(info), info)


def _restored(m: StoredMessage) -> NewMessage:
    """A saved message as appended again: its own time is the restore's (no source_time),
    so it is in the rolling window; the saved times stay in the snapshot."""
    return NewMessage(
        role=m.role,
        content=m.content,
        tool_calls=m.tool_calls,
        tool_call_id=m.tool_call_id,
        external_id=m.external_id,
        metadata=m.metadata,
    )


def _call_ids(m: StoredMessage, snapshot_id: str) -> tuple[str, ...]:
    if not m.tool_calls:
        return ()
    try:
        return tool_call_ids(m.tool_calls, "tool_calls")
    except InvalidArgument as exc:  # it was valid when appended: the document is damaged
        raise DataLoss(
            f"the document of snapshot {snapshot_id!r} holds a message {m.id} whose "
            "tool_calls are not valid JSON; restore it from a backup"
        ) from exc
