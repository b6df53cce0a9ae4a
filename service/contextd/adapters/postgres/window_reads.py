"""The build's reads of a thread's window on PostgreSQL (WindowReadsMixin).

Its bounds, as one statement of index lookups with the first page of messages
(`window_bounds`, queued ahead by `_queue_bounds`), its messages from a point on
(`window_messages_from`, `window_columns`), the messages appended since a remembered
window (`appended_messages`), the unread tool results before a range
(`window_unread_orphans`), the latest summary, and the windows this replica saw
(`WindowSeen`, `build_token`). Apart from the appends (messages.py) because a build, not
an append, reads them; apart from the one-statement hot read (build_reads.py), which
builds on these, and from the pages read by ids (window_pages.py), which need none of it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa

from contextd.adapters.postgres.base import Conn, PostgresBase, first
from contextd.adapters.postgres.message_cache import MessageCache
from contextd.adapters.postgres.message_sql import (
    APPENDED_MESSAGES,
    APPENDED_ROWS,
    NARROW_COLUMNS,
    SELECT_MESSAGES,
    UNREAD_ORPHANS,
    WINDOW_BOUNDS,
    WINDOW_MESSAGES,
    context_tenant,
    page_table,
    window_predicate,
)
from contextd.adapters.rows import message_from_row
from contextd.domain.model import ContextKey, StoredMessage
from contextd.domain.window import WindowSpec
from contextd.ports.store import ContextRef, WindowBounds

# The farthest a result may lie after its call for `window_unread_orphans` to answer:
# past it, finding the results whose call is before a range costs a scan of that many rows.
MAX_TOOL_SPAN = 4_096

_NEVER = 2**63 - 1  # the first commit time of an empty window
# Threads whose window a replica remembers having seen (`_saw_window`): past this many,
# it starts over.
WINDOWS_SEEN = 4_096


@dataclass(frozen=True, slots=True)
class ThreadState:
    """What `context_ref` read of a thread's row besides its version (schema version
    15's `rewrites`, its last sequence, its count of messages, whether none of them has
    a source_time): an append by the service moves the last two counts alone."""

    context_id: int
    rewrites: int
    last_sequence: int
    message_count: int
    no_source: bool


@dataclass(frozen=True, slots=True)
class WindowSeen:
    """A window `window_bounds` read: the thread row's version, the window's lower bound
    then, and the commit time of its first message (`_NEVER`: it had none); and, for
    `appended_messages`, the thread's state, clear marker and latest summary then."""

    version: str
    after_us: int
    first_time_us: int
    state: ThreadState | None = None
    clear_us: int | None = None
    summary_id: int = 0


def window_after(window: WindowSpec) -> int:
    """The commit time a window's messages are after, in a thread with no source_time."""
    return max(window.clear_after_us, window.age_after_us)


class WindowReadsMixin(PostgresBase):
    # The page sizes (first_page, held) of this replica's last `window_bounds` read.
    _bounds_shape: tuple[int, int] | None = None
    _messages: MessageCache  # messages builds loaded, by thread (message_cache.py)
    # The windows `window_bounds` read, by (tenant, context_id): the thread row's version
    # it read them under and the run of the window's lower bound that selects the same
    # messages of that state (see `build_token`).
    _windows_seen: dict[tuple[str, int], WindowSeen]
    # The ref and summary's last id of each thread's last `window_bounds` call, by key:
    # what `_send_planned` sends the next build's bounds for.
    _bounds_guess: dict[ContextKey, tuple[ContextRef, int]]
    # Threads this replica appended to since its last build of them (see
    # `MessagesMixin._appended_here`).
    _moved_here: dict[ContextKey, int]
    # `build_token` names a state once this replica's reads saw it (ContextBuilder).
    tokens_after_reads = True

    def window_columns(self, context: ContextRef, window: WindowSpec) -> pa.Table:
        """The window's narrow columns as one row of six binary arrays (PostgreSQL's
        big-endian `*send` encodings, aggregated in sequence order over the primary
        key's range), so no Python object is made per message: each array becomes a
        NumPy column with one byte swap."""
        predicate, params = window_predicate(window, None)
        with self._reading() as conn:
            row = first(
                conn,
                "SELECT "
                + ", ".join(
                    f"coalesce(string_agg({send}({column}), ''::bytea ORDER BY sequence), "
                    "''::bytea)"
                    for send, column in NARROW_COLUMNS
                )
                + " FROM messages m "
                f"WHERE tenant = %s AND context_id = %s AND {predicate} AND NOT is_summary",
                [context_tenant(context), context.context_id, *params],
            )
        assert row is not None
        ids, roles, tokens, chars, groups, sequences = (bytes(v) for v in row)
        return pa.table(
            {
                "id": pa.array(np.frombuffer(ids, ">i8").astype(np.int64)),
                "role": pa.array(np.frombuffer(roles, ">i2").astype(np.uint8)),
                "token_count": pa.array(np.frombuffer(tokens, ">i4").astype(np.uint64)),
                "chars": pa.array(np.frombuffer(chars, ">i4").astype(np.uint64)),
                "group_id": pa.array(np.frombuffer(groups, ">i8").astype(np.int64)),
                "sequence": pa.array(np.frombuffer(sequences, ">i8").astype(np.int64)),
            }
        )

    def window_messages_from(
        self,
        context: ContextRef,
        window: WindowSpec,
        from_sequence: int,
        id_range: tuple[int, int],
    ) -> list[StoredMessage]:
        """The window's messages from `from_sequence` on with ids in `id_range`, whole.
        Read from the messages alone, along the primary key: the thread's names come
        from the ref's key (a join to threads had PostgreSQL look the thread's row up
        once per message, by a scan of the tenant's threads). Messages this replica
        holds in its cache at the version the snapshot reads come from there, the
        others' columns are read (see message_cache.py)."""
        key = context.key
        assert key is not None, "a PostgreSQL ContextRef carries its key"
        page = getattr(self._local, "page", None)
        if page is not None and getattr(self._local, "conn", None) is not None:
            context_id, page_window, whole = page
            if (context_id, page_window) == (context.context_id, window) and (
                whole and whole[0].sequence <= from_sequence
            ):
                # What `window_bounds` read of this snapshot's newest window messages
                # holds every one from `from_sequence` on.
                low, high = id_range
                return [m for m in whole if m.sequence >= from_sequence and low <= m.id <= high]
        held = self._messages.held(key, context.context_id, id_range[0], id_range[1])
        predicate, params = window_predicate(window, None)
        with self._reading() as conn:
            rows = conn.execute(
                WINDOW_MESSAGES.format(predicate=predicate),
                [
                    " ".join(held),
                    context_tenant(context),
                    context.context_id,
                    from_sequence,
                    id_range[0],
                    id_range[1],
                    *params,
                ],
            ).fetchall()
        names = (key.agent, key.scope, key.thread)
        out: list[StoredMessage] = []
        read: list[tuple[str, StoredMessage]] = []
        for row in rows:
            tag = row[0]
            message = held.get(tag) if row[1] else None
            if message is None:
                r = row[2:]
                message = message_from_row((*r[:2], *names, *r[2:]))
                read.append((tag, message))
            out.append(message)
        self._messages.put(key, context.context_id, read)
        return out

    def window_bounds(
        self,
        context: ContextRef,
        window: WindowSpec,
        summary_last_id: int,
        first_page: int = 0,
        held: int = 0,
    ) -> WindowBounds | None:
        """The window's size and edges from the running counts (schema version 9), in one
        statement of index lookups: the thread's row, its first message, the window's
        first message (by commit time), its newest, and the summary's last message.

        None (the build reads `window_columns`) unless the window is a plain suffix
        of the thread whose counts are exact: no retention bounds (a cap counts by tool
        group, not by position), no client source_time in the thread (a message's own
        time then is its commit time, which never goes back, so the age bound cuts the
        thread at one point, as the clear marker does), no message deleted between its
        first and last (retention deletes by tool group may leave holes), and every
        append of the thread wrote the counts (`totals_through`)."""
        if window.retains:
            return None
        self._bounds_shape = (first_page, held)
        key = context.key
        assert key is not None, "a PostgreSQL ContextRef carries its key"
        match = (context, window, summary_last_id, first_page, held)
        if len(self._bounds_guess) >= WINDOWS_SEEN and key not in self._bounds_guess:
            self._bounds_guess.clear()
        self._bounds_guess[key] = (context, summary_last_id)  # for `_send_planned`
        self._moved_here.pop(key, None)
        queued = getattr(self._local, "bounds", None)
        self._local.bounds = None
        if queued is not None and queued[0] == match and self._in_snapshot():
            # Queued in this snapshot, with these arguments (with the thread's read by
            # `_send_planned`, or with the status block's by `status_and_activity`).
            row, cached = queued[1].fetchone(), queued[2]
        else:
            params, cached = self._bounds_params(context, window, summary_last_id, first_page, held)
            with self._reading() as conn:
                row = conn.execute(WINDOW_BOUNDS, params, binary=True).fetchone()
        self._local.page = None
        if row is None:
            return None
        (last_sequence, through, count, no_source, first_sequence) = row[:5]
        if not no_source:
            return None
        self._saw_window(context, window, row[28])
        if through != last_sequence or first_sequence is None:
            return None
        if count != last_sequence - first_sequence + 1:
            return None  # a hole: a range's count is not a difference of ordinals
        f_sequence, f_id, f_ordinal, f_tools, newest = row[5:10]
        if f_sequence is None:  # nothing in the window
            return WindowBounds(0, 0, 0, 0, 0)
        if f_ordinal is None or f_tools is None or newest is None:
            return None
        base, base_tools = int(f_ordinal) - 1, int(f_tools)
        bounds = WindowBounds(int(newest) - base, int(f_sequence), int(f_id), base, base_tools)
        s_sequence, s_ordinal, s_tools, a_id, a_sequence = row[10:15]
        g_context, g_ordinal, oldest_ordinal = row[15:18]
        page = page_table(row[18:26]) if first_page else None
        if page is not None and page.num_rows and getattr(self._local, "conn", None) is not None:
            # The page's messages, whole, for `window_messages_from` in this snapshot.
            whole = self._page_messages(key, context.context_id, row[26], row[27], cached)
            self._local.page = (context.context_id, window, whole)
        if page is not None and page.num_rows and oldest_ordinal is not None:
            c = int(oldest_ordinal) - base - 1
            k = min(held, c)
            if g_context == context.context_id and g_ordinal == oldest_ordinal - k:
                bounds = replace(bounds, contiguous_before=k)
        bounds = replace(bounds, first_page=page)
        if s_sequence is None or s_sequence < f_sequence:
            return bounds
        if s_ordinal is None or s_tools is None:
            return None
        return replace(
            bounds,
            summarized=int(s_ordinal) - base,
            summary_tools=int(s_tools),
            after_summary_id=int(a_id or 0),
            after_summary_sequence=int(a_sequence or 0),
        )

    def _in_snapshot(self) -> bool:
        return getattr(self._local, "conn", None) is not None

    def _saw_window(self, context: ContextRef, window: WindowSpec, first_time: int | None) -> None:
        """Remember what `window_bounds` found of this snapshot's state of the thread: no
        message of it has a source_time (so the window is every message committed after
        `window_after`; commit times never go back along a thread), and the first such
        message was committed at `first_time` (None: none was). The window then selects
        the same messages of this state at any lower bound from this one up to (not
        including) `first_time`."""
        version: tuple[int, str] | None = getattr(self._local, "thread_version", None)
        if not self._in_snapshot() or version is None or version[0] != context.context_id:
            return
        if len(self._windows_seen) >= WINDOWS_SEEN:
            self._windows_seen.clear()
        state: ThreadState | None = getattr(self._local, "thread_state", None)
        if state is not None and state.context_id != context.context_id:
            state = None
        self._windows_seen[(context_tenant(context), context.context_id)] = WindowSeen(
            version[1],
            window_after(window),
            _NEVER if first_time is None else int(first_time),
            state,
            context.last_clear_time_us,
            context.latest_summary_id,
        )

    def _extendable(self, context: ContextRef) -> WindowSeen | None:
        """The window this replica saw of the thread, when it is one `appended_messages`
        may extend: read with the thread's state, a first message, and the same clear
        marker and latest summary as `context` names."""
        seen = self._windows_seen.get((context_tenant(context), context.context_id))
        if seen is None or seen.state is None or seen.first_time_us == _NEVER:
            return None
        if (seen.clear_us, seen.summary_id) != (
            context.last_clear_time_us,
            context.latest_summary_id,
        ):
            return None
        return seen

    def _queue_appended(self, conn: Conn, ref: ContextRef) -> bool:
        """Queue `appended_messages`' read of the thread `ref` names (the rows after the
        window this replica saw of it), when the build in progress said it keeps a
        window it can extend (`BuildReads.extend`) and that window is one
        `appended_messages` may extend; whether it did. Taken only by a call for the
        same thread and sequence in this snapshot."""
        key = ref.key
        if key is None or getattr(self._local, "extend", None) != key:
            return False
        if getattr(self._local, "bounds", None) is not None:
            return False  # the bounds went already (`_send_planned`)
        seen = self._extendable(ref)
        if seen is None or seen.state is None:
            return False
        after = seen.state.last_sequence
        queued = getattr(self._local, "appended", None)
        if queued is not None and queued[0] == (key.tenant, ref.context_id, after):
            return True
        cursor = conn.execute(
            APPENDED_MESSAGES, [key.tenant, ref.context_id, after, APPENDED_ROWS + 1], binary=True
        )
        self._local.appended = ((key.tenant, ref.context_id, after), cursor.fetchall)
        return True

    def appended_messages(
        self, context: ContextRef, window: WindowSpec, since: Hashable
    ) -> tuple[list[StoredMessage], list[int]] | None:
        """The messages appended to the thread since the state `since` names (the second
        item of a `build_token` of this replica), oldest first, with their stored `chars`
        (the column the trimmer reads), when this snapshot's state of the thread differs
        from that one by appended plain messages alone and the window still starts where
        it did; None otherwise (the builder reads the window afresh:
        `WindowExtension._extended_tail`).

        The proof: schema version 15's `rewrites` is as it was (no stored message was
        changed or deleted, and none inserted but by the service's appends, which number
        theirs after the thread's last sequence under its row's lock), the clear marker
        and latest summary are as they were, and the thread's message count grew by the
        rows after the last sequence then, which are consecutive, no summary, and carry
        no source_time. The window's state is then remembered at this version, as
        `window_bounds` remembers it."""
        state: ThreadState | None = getattr(self._local, "thread_state", None)
        version: tuple[int, str] | None = getattr(self._local, "thread_version", None)
        queued = getattr(self._local, "appended", None)
        self._local.appended = None
        key = context.key
        if (
            key is None
            or not self._in_snapshot()
            or window.retains
            or state is None
            or version is None
            or state.context_id != context.context_id
            or version[0] != context.context_id
            or not state.no_source
            or not isinstance(since, tuple)
            or len(since) != 4
        ):
            return None
        seen = self._extendable(context)
        if seen is None or seen.state is None:
            return None
        old = seen.state
        if tuple(since[:3]) != (context.context_id, seen.version, seen.first_time_us):
            return None  # a window of another state than the one seen last
        if old.rewrites != state.rewrites or not seen.after_us <= window_after(window):
            return None
        if window_after(window) >= seen.first_time_us:
            return None  # the window's start moved past its first message
        count = state.last_sequence - old.last_sequence
        if not 0 < count <= APPENDED_ROWS or state.message_count - old.message_count != count:
            return None
        if queued is not None and queued[0] == (key.tenant, context.context_id, old.last_sequence):
            rows = queued[1]()
        elif (
            getattr(self._local, "bounds", None) is not None
            or self._moved_here.get(key, 0) > APPENDED_ROWS
        ):
            # The bounds travel with this snapshot's reads already (this replica appended
            # tool rows, which no window extends by, or more rows than one extends by):
            # no round trip for rows not taken.
            return None
        else:
            with self._reading() as conn:
                rows = conn.execute(
                    APPENDED_MESSAGES,
                    [key.tenant, context.context_id, old.last_sequence, APPENDED_ROWS + 1],
                    binary=True,
                ).fetchall()
        if len(rows) != count:
            return None
        names = (key.agent, key.scope, key.thread)
        # In sequence order (the thread's read returns them joined, in no set order).
        read = sorted(
            ((message_from_row((*r[1:3], *names, *r[3:])), int(r[0])) for r in rows),
            key=lambda pair: pair[0].sequence,
        )
        appended = [m for m, _ in read]
        for at, m in enumerate(appended, old.last_sequence + 1):
            if m.sequence != at or m.is_summary or m.source_time_us is not None:
                return None
        self._windows_seen[(key.tenant, context.context_id)] = replace(
            seen, version=version[1], state=state
        )
        self._moved_here.pop(key, None)
        guess = self._bounds_guess.get(key)
        if guess is not None:
            self._bounds_guess[key] = (context, guess[1])
        return appended, [chars for _, chars in read]

    def _window_unchanged(self, context: ContextRef, window: WindowSpec) -> WindowSeen | None:
        """What `_saw_window` remembered of the thread, if it holds in this snapshot: the
        snapshot reads the thread's row at the version it was seen under (every change
        to the thread's messages writes that row in its transaction: schema version 14's
        triggers), and the window's lower bound selects the same messages of it."""
        version: tuple[int, str] | None = getattr(self._local, "thread_version", None)
        if window.retains or version is None or version[0] != context.context_id:
            return None
        seen = self._windows_seen.get((context_tenant(context), context.context_id))
        if seen is None or seen.version != version[1]:
            return None
        if not seen.after_us <= window_after(window) < seen.first_time_us:
            return None
        return seen

    def build_token(
        self, context: ContextRef, window: WindowSpec
    ) -> tuple[int, tuple[int, str, int, str]] | None:
        """What this snapshot's reads of the thread and its agent are, for a builder's
        memos (see `ContextBuilder._read`; the embedded engine's has the same shape):
        None unless the thread's row, read by `context_ref` in this snapshot, is at a
        version under which this replica read the window, and the window selects the
        same messages. Then (0, (context id, the row's version, the window's first commit
        time, the agent row's version)): equal tokens mean equal reads, on any replica,
        as the versions are the database's. The first item (the embedded engine's
        generation) never moves: the second names everything the result depends on
        besides the request and the status block, which the builder keys by too."""
        if not self._in_snapshot():
            return None
        seen = self._window_unchanged(context, window)
        agent: tuple[str, str, str] | None = getattr(self._local, "agent_version", None)
        key = context.key
        if seen is None or agent is None or key is None or agent[:2] != (key.tenant, key.agent):
            return None
        return (0, (context.context_id, seen.version, seen.first_time_us, agent[2]))

    def _bounds_params(
        self,
        context: ContextRef,
        window: WindowSpec,
        summary_last_id: int,
        first_page: int,
        held: int,
    ) -> tuple[list[Any], dict[str, StoredMessage]]:
        """`WINDOW_BOUNDS`'s parameters, and the cached messages whose tags they send."""
        key = context.key
        assert key is not None, "a PostgreSQL ContextRef carries its key"
        cached = self._messages.newest(key, context.context_id, first_page)
        after_us = max(window.clear_after_us, window.age_after_us)
        tenant = key.tenant
        params = [
            tenant,
            summary_last_id,
            after_us,
            " ".join(cached),
            first_page,
            held,
            tenant,
            context.context_id,
        ]
        return params, cached

    def _queue_bounds(
        self, conn: Conn, tenant: str, agent: str, scope: str, agent_window: WindowSpec
    ) -> None:
        """Queue, in this snapshot's pipeline, the `window_bounds` read the build of the
        thread `context_ref` read in it will make next (its window: the agent's with the
        thread's clear; the summary's last message, as `latest_summary` answers; the page
        sizes of this replica's last such read), so that it travels with the status
        block's statement. `window_bounds` takes its result only when called with the
        same arguments in the same snapshot: a guess that misses costs a statement's
        server time, never a wrong answer."""
        ref: ContextRef | None = getattr(self._local, "ref", None)
        shape = self._bounds_shape
        if ref is None or shape is None or ref.key is None:
            return
        if (ref.key.tenant, ref.key.agent, ref.key.scope) != (tenant, agent, scope):
            return
        window = agent_window.with_thread_clear(ref.last_clear_time_us)
        if window.retains or self._window_unchanged(ref, window) is not None:
            return  # no bounds to read, or the builder keeps the window (`build_token`)
        if self._queue_appended(conn, ref):
            return  # the builder extends the window it keeps (`appended_messages`)
        summary_last = 0
        read = getattr(self._local, "summary", None)
        if ref.latest_summary_id and read is not None:
            summary = read[2]
            if summary is not None and summary.summarized_ids is not None:
                summary_last = summary.summarized_ids[1]
                if summary_last > summary.id:
                    return  # the build reads the whole window
        match = (ref, window, summary_last, *shape)
        queued = getattr(self._local, "bounds", None)
        if queued is not None and queued[0] == match:
            return  # sent with the thread's read (`_send_planned`)
        params, cached = self._bounds_params(ref, window, summary_last, *shape)
        cursor = conn.execute(WINDOW_BOUNDS, params, binary=True)
        self._local.bounds = (match, cursor, cached)

    def _page_messages(
        self,
        key: ContextKey,
        context_id: int,
        tags: Sequence[str] | None,
        fresh: Sequence[Sequence[Any]] | None,
        cached: dict[str, StoredMessage],
    ) -> list[StoredMessage]:
        """The first page's messages, oldest first: those the replica sent the tags of
        from its cache, the others from their columns (`fresh`, as JSON arrays: the tag,
        then `_KEYLESS_MESSAGES`), which the cache then keeps."""
        names = (key.agent, key.scope, key.thread)
        read: dict[str, StoredMessage] = {}
        for r in fresh or ():
            message = message_from_row((*r[1:3], *names, *r[3:]))
            read[r[0]] = message
        self._messages.put(key, context_id, list(read.items()))
        whole = [cached.get(tag) or read[tag] for tag in tags or ()]
        whole.reverse()
        return whole

    def window_unread_orphans(
        self, context: ContextRef, from_sequence: int, before_sequence: int
    ) -> list[int] | None:
        """From `tool_open` and `tool_span` (schema version 13, kept by triggers): a
        result in the range is an orphan of the part from `from_sequence` when it answers
        no call (kept in tool_open) or its call is before `from_sequence` (then it lies
        within tool_span rows of it); a tool-using message when no result of it is stored
        (in tool_open until one is; results follow their call, so a stored one is in any
        window part that holds the call). Only for a range of a window `window_bounds`
        answered: no message deleted inside it."""
        with self._reading() as conn:
            row = first(
                conn,
                UNREAD_ORPHANS,
                {
                    "tenant": context_tenant(context),
                    "context": context.context_id,
                    "from": from_sequence,
                    "before": before_sequence,
                    "max_span": MAX_TOOL_SPAN,
                },
            )
        if row is None or int(row[0]) > MAX_TOOL_SPAN:
            return None
        return [int(i) for i in np.frombuffer(bytes(row[1]), ">i8")]

    def latest_summary(self, context: ContextRef) -> StoredMessage | None:
        if not context.latest_summary_id:
            return None
        read = getattr(self._local, "summary", None)  # by context_ref, in this snapshot
        if read is not None and getattr(self._local, "conn", None) is not None:
            context_id, summary_id, summary = read
            if (context_id, summary_id) == (context.context_id, context.latest_summary_id):
                stored: StoredMessage | None = summary
                return stored
        with self._reading() as conn:
            row = first(
                conn,
                f"SELECT {SELECT_MESSAGES} FROM messages m JOIN threads t "
                "ON t.tenant = m.tenant AND t.context_id = m.context_id "
                "WHERE m.tenant = %s AND m.id = %s AND m.context_id + 0 = %s",  # by id alone
                [context_tenant(context), context.latest_summary_id, context.context_id],
            )
        return message_from_row(row) if row else None
