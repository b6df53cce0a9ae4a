"""The store, as the use cases see it: one Protocol per aggregate, and `Store` for all.

Every engine (`contextd.adapters.duckdb`, `contextd.adapters.postgres`) implements `Store`
and passes the same suite (tests/contract/). What the contract asks of every engine:

- Times: every commit time, clear marker and update time comes from the store's `clock`
  (one per server, injectable); within a thread, commit times never go back.
- Order: a thread's messages are numbered 1, 2, 3, ... in append order (`sequence`);
  numbers are never taken twice, whichever process appended.
- Ids: message and event ids are unique within the store and never reused, also after a
  delete.
- Retries: a write given a `RequestRecord` is recorded in its own transaction; the same
  request again raises `AlreadyDone` with the first payload and writes nothing; another
  request under the same id raises REQUEST_ID_REUSED.
- Scope: every read names its full context (tenant, agent, scope and thread, or a
  `ThreadFilter`); nothing is read across tenants, agents or scopes.
- Failures of the engine reach callers as domain errors (StoreUnavailable,
  StoreExhausted, StoreBusy, Unavailable while shutting down), never as driver errors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import pyarrow as pa

from contextd.domain.access import ApiKey
from contextd.domain.clock import MonotonicClock
from contextd.domain.context import StatusEntry, ThreadActivity
from contextd.domain.idempotency import Remembered, RequestRecord
from contextd.domain.model import (
    Agent,
    AgentSettings,
    ContextKey,
    Event,
    MessageBatch,
    MessageReceipt,
    StoredMessage,
    Thread,
)
from contextd.domain.search import SearchQuery
from contextd.domain.snapshots import SnapshotInfo
from contextd.domain.window import WindowSpec
from contextd.ports.tool_outputs import ToolOutputStore

T = TypeVar("T")


class SnapshotMoved(Exception):
    """Raised by a read inside `snapshot()` of an engine that serves some reads from
    memory (DuckDB's hot cache) when a commit happened between those reads and one it
    must make by SQL: the reads would not be of one state; or (PostgreSQL) by a read
    the snapshot cannot make any more, as it ended with the reads sent ahead of a build
    expected to need no other (`plan_build_reads`). The block is run again
    (`read_consistently`), and then reads by SQL alone, in a snapshot that ends last."""


def read_consistently(store: ContextReader, block: Callable[[], T]) -> T:
    """`block()` inside `store.snapshot()`, run again once if the snapshot moved."""
    try:
        with store.snapshot():
            return block()
    except SnapshotMoved:
        with store.snapshot():
            return block()


def status_and_activity(
    store: Store,
    tenant: str,
    agent: str,
    scope: str,
    live_at_us: int,
    entries: int,
    window: WindowSpec,
    threads: int,
) -> tuple[list[StatusEntry], list[ThreadActivity]]:
    """What a build's status block reads: the first `entries` status entries live at
    `live_at_us` (`list_status`) and the `threads` most recently active threads
    (`thread_activity`), in one read where the store offers one (`status_and_activity`,
    PostgreSQL: one round trip), else in two. Either way the same lists."""
    both = getattr(store, "status_and_activity", None)
    if both is not None:
        found: tuple[list[StatusEntry], list[ThreadActivity]]
        found = both(tenant, agent, scope, live_at_us, entries, window, threads)
        return found
    return (
        store.list_status(tenant, agent, scope, None, entries, live_at_us),
        store.thread_activity(tenant, agent, scope, window, threads),
    )


@dataclass(frozen=True, slots=True)
class ThreadFilter:
    """Which messages of an agent in a scope a read covers."""

    tenant: str
    agent: str
    scope: str
    thread: str | None  # None: every thread of the agent in the scope


@dataclass(frozen=True, slots=True)
class ContextRef:
    """A thread as the store addresses it: what a build resolves once, then reads by."""

    context_id: int
    last_clear_time_us: int | None
    latest_summary_id: int  # 0: the thread has no stored summary
    # The thread's key, for engines that address rows by tenant (None: not needed).
    key: ContextKey | None = None


@dataclass(frozen=True, slots=True)
class BuildReads:
    """What a build will read after the thread's ref, as far as the builder knows it
    before that read (an engine with optional `plan_build_reads` may send those reads
    with the ref's, when it can tell the rest of their arguments from what it read
    before; a read is taken only when called with the very arguments it was sent with)."""

    key: ContextKey
    now_us: int  # the build's time (its status block's and window's)
    status_entries: int  # `status_and_activity`'s entries
    status_threads: int  # ... and threads
    first_page: int  # `window_bounds`' first_page
    held: int  # ... and held
    # The builder keeps a window of the thread it may extend by appended messages (an
    # engine with `appended_messages` may then send that read instead of the bounds).
    extend: bool = False
    # The builder keeps a window of the thread from an earlier build (an engine may then
    # end the snapshot with the reads it sends ahead, in one round trip: a build that
    # needs another read is run again, `SnapshotMoved`).
    kept: bool = False


class AgentStore(Protocol):
    """Agents and their settings."""

    def create_agent(
        self, tenant: str, name: str, settings: AgentSettings, record: RequestRecord | None = None
    ) -> Agent:
        """AGENT_EXISTS when the name is taken."""

    def get_agent(self, tenant: str, name: str) -> Agent:
        """AGENT_NOT_FOUND when there is none."""

    def find_agent(self, tenant: str, name: str) -> Agent | None: ...

    def update_agent(
        self,
        tenant: str,
        name: str,
        settings: AgentSettings,
        fields: frozenset[str],
        etag: str = "",
        record: RequestRecord | None = None,
    ) -> Agent:
        """Set the named fields ("build_options.<option>" for one option) in one
        transaction; with an etag, only while it is still current (ETAG_MISMATCH)."""

    def list_agents(self, tenant: str, after_name: str | None, limit: int) -> list[Agent]:
        """By name, strictly after `after_name`."""

    def delete_agent(
        self, tenant: str, name: str, etag: str = "", record: RequestRecord | None = None
    ) -> int:
        """Delete the agent and all it holds (final: nothing lands under it afterwards);
        returns how many messages it had."""


class MessageStore(Protocol):
    """Appends and the reads of messages, by filter or by id."""

    def append(
        self,
        key: ContextKey,
        batch: MessageBatch,
        default_settings: AgentSettings | None,
        record: RequestRecord | None = None,
    ) -> list[MessageReceipt]:
        """Append durably (acknowledged means committed). A missing agent is created
        with `default_settings`, or is AGENT_NOT_FOUND when they are None. The batch was
        counted under the model `batch.tokenizer` names; an engine shared by several
        processes raises StaleModel when the agent's model changed meanwhile."""

    def append_many(
        self,
        parts: Sequence[tuple[ContextKey, MessageBatch]],
        record: RequestRecord | None = None,
    ) -> list[MessageReceipt]:
        """Append batches to several threads of one existing agent in one transaction
        (all or nothing, one request record): a restore. Parts come in thread-name order
        (the order locks are taken in); receipts come back in part order."""

    def list_messages(
        self,
        where: ThreadFilter,
        window: WindowSpec | None,
        after: tuple[int, int] | None,
        limit: int,
    ) -> list[StoredMessage]:
        """One thread in sequence order, after (sequence, id); or every thread of the
        scope by (create_time, id), after that pair. With a window, only its messages
        (each thread's own clear marker applies)."""

    def messages_by_ids(self, key: ContextKey, ids: Sequence[int]) -> list[StoredMessage]:
        """Whole messages of this one context, by (create_time, id); ids of any other
        context are never returned."""


class ContextReader(Protocol):
    """What a build reads of one thread."""

    def snapshot(self) -> AbstractContextManager[None]:
        """Reads of the calling thread inside the block see one consistent state of the
        store, the one its first read saw (a read transaction): a build reads its agent,
        window, summary and status from one snapshot, not from six moments. Nested blocks
        join the outer one. Never hold it across a slow call."""

    def context_ref(self, key: ContextKey) -> ContextRef | None:
        """None while the thread has no messages."""

    def window_columns(self, context: ContextRef, window: WindowSpec) -> pa.Table:
        """The window without content, summaries left out, in sequence order: columns
        id (int64), role (uint8), token_count (uint64), chars (uint64), group_id (int64),
        sequence (int64), one chunk each."""

    def window_messages_from(
        self,
        context: ContextRef,
        window: WindowSpec,
        from_sequence: int,
        id_range: tuple[int, int],
    ) -> list[StoredMessage]:
        """The window's messages from `from_sequence` on whose ids are in `id_range`
        (what `window_columns` planned), summaries left out, in sequence order."""

    def latest_summary(self, context: ContextRef) -> StoredMessage | None: ...

    def window_bounds(
        self,
        context: ContextRef,
        window: WindowSpec,
        summary_last_id: int,
        first_page: int = 0,
        held: int = 0,
    ) -> WindowBounds | None:
        """What a build must know of a window without reading it, at a cost that does
        not grow with the thread (index lookups), or None when this engine cannot answer
        so (the build then reads `window_columns`). Answering means: the window is
        exactly the thread's non-summary messages from `first_sequence` on, each numbered
        at insert by a running count (`ordinal`) and a running count of tool rows (a
        message with a tool group or a tool_result role), so any range's count is a
        difference. `summary_last_id` is the last message a stored summary stands for
        (0: none). In the same statement: the newest `first_page` messages of the window
        after that summary (as `window_page` reads them), and whether the ids of the up to
        `held` window messages just before them are contiguous (see
        `WindowBounds.contiguous_before`)."""

    def window_page(
        self,
        context: ContextRef,
        from_sequence: int,
        before_sequence: int,
        limit: int,
        ids_only: bool = False,
    ) -> pa.Table:
        """The newest `limit` non-summary messages with `from_sequence <= sequence <
        before_sequence`, in sequence order, as `window_columns` gives them plus the
        running columns ordinal and tools_total (int64); with `ids_only`, the id column
        alone. Only valid for a window `window_bounds` answered (the caller passes its
        `first_sequence` or later)."""

    def window_ordinal(self, context: ContextRef, message_id: int) -> int | None:
        """The running count (`ordinal`) of this thread's non-summary message
        `message_id`, or None when there is none (one index lookup). A build checks
        with it whether a run of the window's ids is contiguous, instead of reading it."""

    def window_unread_orphans(
        self, context: ContextRef, from_sequence: int, before_sequence: int
    ) -> list[int] | None:
        """The ids, in sequence order, of the non-summary messages with `from_sequence <=
        sequence < before_sequence` that are orphans of a window part starting at
        `from_sequence` (a tool_result whose call is not before it in that part, a
        tool-using message none of whose results is stored), at a cost that follows
        those orphans and not the range; None when this engine cannot say so (the build
        then reads the whole window). Only valid where `window_page` is."""


@dataclass(frozen=True, slots=True)
class WindowBounds:
    """A window's size and edges from its running counts (see `window_bounds`).

    Positions are 0-based in window (sequence) order; a message's position is its
    ordinal minus `base_ordinal` minus one."""

    count: int  # messages in the window
    first_sequence: int  # sequence of its oldest message
    first_id: int  # id of its oldest message
    base_ordinal: int  # running count before its oldest message
    base_tools: int  # running tool-row count before its oldest message
    # Messages up to and including the summary's last message (-1: that message is not
    # in the window, so the summary stands for none of it), the tool rows through it,
    # and the id and sequence of the next window message (0 when there is none).
    summarized: int = -1
    summary_tools: int = 0
    after_summary_id: int = 0
    after_summary_sequence: int = 0
    # The first page asked for (None: none was), and how many window messages just
    # before its oldest have ids that run without a gap up to that message's id.
    first_page: pa.Table | None = None
    contiguous_before: int = 0


class ThreadStore(Protocol):
    """Threads, their counters and clear markers."""

    def get_thread(self, key: ContextKey) -> Thread | None: ...

    def list_threads(
        self, tenant: str, agent: str, scope: str, after_thread: str | None, limit: int
    ) -> list[Thread]: ...

    def thread_activity(
        self, tenant: str, agent: str, scope: str, window: WindowSpec, limit: int
    ) -> list[ThreadActivity]:
        """Threads with messages in their windows, most recently active first."""

    def context_counts(self, where: ThreadFilter, window: WindowSpec) -> tuple[int, ...]:
        """(window count, window tokens, total count, total tokens, oldest commit time,
        newest commit time, threads)."""

    def clear_agent(self, tenant: str, agent: str, record: RequestRecord | None = None) -> int:
        """Move the agent's clear marker to now; returns it."""

    def clear_scope(
        self, tenant: str, agent: str, scope: str, record: RequestRecord | None = None
    ) -> int:
        """Move the clear marker of every thread of the scope to now; returns it."""

    def clear_thread(self, key: ContextKey, record: RequestRecord | None = None) -> int:
        """THREAD_NOT_FOUND when the thread has no messages."""


class StatusStore(Protocol):
    def set_status(
        self,
        tenant: str,
        agent: str,
        scope: str,
        entry: StatusEntry,
        record: RequestRecord | None = None,
    ) -> StatusEntry: ...

    def list_status(
        self,
        tenant: str,
        agent: str,
        scope: str,
        after_key: str | None,
        limit: int,
        live_at_us: int | None,
    ) -> list[StatusEntry]: ...

    def clear_status(
        self,
        tenant: str,
        agent: str,
        scope: str,
        key: str | None,
        record: RequestRecord | None = None,
    ) -> int: ...


class EventStore(Protocol):
    def record_event(self, key: ContextKey, event_type: str, data: dict[str, Any]) -> Event:
        """THREAD_NOT_FOUND when the thread is gone (its agent was deleted)."""

    def list_events(
        self,
        where: ThreadFilter,
        event_type: str,
        start_us: int | None,
        end_us: int | None,
        after_id: int,
        limit: int,
    ) -> list[Event]: ...


class SnapshotStore(Protocol):
    """Snapshots: metadata for lists, and one document per snapshot (see
    domain/snapshots.py). Every read names the full scope: a snapshot of another scope is
    None, never returned."""

    def save_snapshot(
        self,
        info: SnapshotInfo,
        document: bytes,
        agent_created_us: int,
        record: RequestRecord | None = None,
    ) -> SnapshotInfo:
        """Store the document durably, then the metadata; both or neither (a document
        whose metadata did not commit is removed). AGENT_NOT_FOUND, storing nothing, when
        the agent created at `agent_created_us` is gone by then (deleted while the
        summary was written), so a deleted agent's snapshot never appears."""

    def list_snapshots(
        self,
        tenant: str,
        agent: str,
        scope: str,
        after: tuple[int, str] | None,
        limit: int,
    ) -> list[SnapshotInfo]:
        """Newest first by (create_time, id), strictly after the position `after`."""

    def get_snapshot(
        self, tenant: str, agent: str, scope: str, snapshot_id: str
    ) -> SnapshotInfo | None: ...

    def snapshot_document(self, info: SnapshotInfo) -> bytes:
        """The document's bytes; DataLoss when it is missing or does not match what was
        stored (the decoding checks the rest)."""

    def delete_snapshot(
        self,
        tenant: str,
        agent: str,
        scope: str,
        snapshot_id: str,
        record: RequestRecord | None = None,
    ) -> SnapshotInfo:
        """Delete the metadata, then the document; SNAPSHOT_NOT_FOUND when there is none."""


@dataclass(frozen=True, slots=True)
class RetainedThread:
    """A thread as the retention sweep sees it (live counters)."""

    key: ContextKey
    context_id: int
    last_sequence: int
    last_message_time_us: int
    # Messages up to this sequence belong to a time the thread had expired (0: none).
    expired_through: int
    # The smallest sequence, and the smallest tool-group start, of its stored messages
    # (None: it holds none): what a pass needs to delete nothing more is told apart
    # without a transaction.
    oldest_sequence: int | None = None
    oldest_group_start: int | None = None
    # Its tool outputs stored up to this time belong to a time the thread had expired
    # (an append after expiry set it; 0: none): the sweep deletes them.
    outputs_expired_through_us: int = 0


class RetentionStore(Protocol):
    """What the retention sweep reads and deletes (see domain/retention.py). Each call is
    one short transaction; deletes keep the thread counters right, never touch sequence
    numbers (a thread's next message still takes the next number), request records or
    anything a page token names."""

    def sweep_lock(self) -> AbstractContextManager[bool]:
        """Yields True for the one sweeper of the store at a time (on PostgreSQL across
        every replica, by an advisory lock), False to every other caller meanwhile."""

    def retention_agents(self, after: tuple[str, str] | None, limit: int) -> list[Agent]:
        """Agents of every tenant with a retention policy or override, by (tenant,
        name), strictly after `after`."""

    def retention_threads(
        self, tenant: str, agent: str, after_context_id: int, limit: int
    ) -> list[RetainedThread]:
        """The agent's threads by context id, strictly after `after_context_id`."""

    def mark_expired(self, thread: RetainedThread, cutoff_us: int) -> int:
        """If the thread's newest message is still at or before `cutoff_us`, record that
        its messages up to its last sequence expired; returns the expired-through
        sequence (unchanged when the thread was appended to meanwhile)."""

    def delete_retained(
        self, thread: RetainedThread, through: int, by_group: bool, limit: int
    ) -> int:
        """Delete at most `limit` messages of the thread: those up to sequence `through`
        and the thread's expired-through mark (`by_group` False), or those whose tool
        group starts at or before `through` (`by_group` True: the overflow of a cap).
        Returns how many were deleted (fewer than `limit`: none are left)."""


class KeyStore(Protocol):
    """API keys (see contextd.domain.access): only hashes of their secrets are kept."""

    # Whether every write of a call checks, in its own transaction, a key the call owes a
    # check of (domain/access.py `owed_key_check`), so that a call may be admitted from
    # what the replica knows of its key without a look-up of its own.
    confirms_owed_keys: bool

    def create_key(
        self, key: ApiKey, secret_hash: str, record: RequestRecord | None = None
    ) -> ApiKey: ...

    def find_key(self, key_id: str) -> tuple[ApiKey, str] | None:
        """The key and its secret's hash, revoked or not."""

    def list_keys(
        self, tenant: str, after_key_id: str | None, limit: int, include_revoked: bool
    ) -> list[ApiKey]:
        """The tenant's keys by key id."""

    def revoke_key(self, tenant: str, key_id: str, record: RequestRecord | None = None) -> ApiKey:
        """KEY_NOT_FOUND unless the tenant has this key; revoking twice keeps the first time."""

    def any_active_key(self) -> bool:
        """Whether any tenant has an active key (then every call needs one)."""


class UsageStore(Protocol):
    """What a tenant stores (see contextd.domain.quota)."""

    def tenant_stored_bytes(self, tenant: str) -> int:
        """Content, tool_calls and metadata bytes (UTF-8) of every message of the
        tenant's threads, plus the size_bytes of its snapshots and of its tool outputs;
        read from per-thread counters, never by scanning messages."""


class MessageSearch(Protocol):
    """Search over message history (see domain/search.py)."""

    def search_messages(self, query: SearchQuery) -> list[tuple[StoredMessage, float]]:
        """The `query.k` messages of the scope (of `query.thread` when set; within
        `query.window` when set, each thread's own clear marker applying) that best match
        any of `query.terms`, best first with their scores, ties by ascending id. Stored
        summaries are never returned, nor anything of another tenant, agent (also an
        earlier agent of the same name) or scope. Every append acknowledged before the
        call is searchable."""


class RequestLog(Protocol):
    # Whether `append` reads the request id's record before it writes anything, in a
    # statement it makes anyway: the caller's own look-up beforehand is then only a cost.
    append_reads_record: bool

    def remembered(self, tenant: str, request_id: str) -> Remembered | None:
        """The recorded request of this id (the fast path of a retry)."""


class Store(
    KeyStore,
    AgentStore,
    MessageStore,
    ContextReader,
    ThreadStore,
    StatusStore,
    EventStore,
    SnapshotStore,
    RetentionStore,
    ToolOutputStore,
    UsageStore,
    MessageSearch,
    RequestLog,
    Protocol,
):
    """Every aggregate of one engine, plus its life cycle and health."""

    clock: MonotonicClock

    def schema_version(self) -> int: ...

    def page_token_key(self) -> bytes:
        """The key that signs page tokens, the same for every process of this store."""

    def watch(self, listener: Callable[[bool], None]) -> None:
        """Call `listener(serving)` when the store turns unable to serve and back."""

    def serving(self) -> bool: ...

    def stop_background_work(self) -> None:
        """Stop long background work (removals) after the current step: shutting down."""

    def close(self) -> None: ...
