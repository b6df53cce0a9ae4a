"""Messages on DuckDB: the append (queued for the writer) and every read of messages."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import pyarrow as pa

from contextd.adapters.duckdb.base import (
    DuckDBBase,
    _AppendJob,
    _first,
    _in_sequence_order,
    window_predicate,
)
from contextd.adapters.rows import (
    MESSAGE_COLUMNS,
    message_from_row,
)
from contextd.domain.context import ThreadActivity
from contextd.domain.idempotency import (
    RequestRecord,
)
from contextd.domain.model import (
    AgentSettings,
    ContextKey,
    MessageBatch,
    MessageReceipt,
    StoredMessage,
)
from contextd.domain.window import MAX_SOURCE_LEAD_US, WindowSpec
from contextd.ports.store import ContextRef, ThreadFilter


class MessagesMixin(DuckDBBase):
    def append(
        self,
        key: ContextKey,
        batch: MessageBatch,
        default_settings: AgentSettings | None,
        record: RequestRecord | None = None,
    ) -> list[MessageReceipt]:
        """Append durably; a missing agent is created with `default_settings`, or is
        NOT_FOUND when they are None. With a record, a repeated request id raises
        AlreadyDone with the first append's payload and writes nothing."""
        receipts: list[MessageReceipt] = self._submit(
            _AppendJob(
                key=key,
                batch=batch,
                default_settings=default_settings,
                future=Future(),
                record=record,
            )
        )
        return receipts

    def list_messages(
        self,
        where: ThreadFilter,
        window: WindowSpec | None,
        after: tuple[int, int] | None,
        limit: int,
    ) -> list[StoredMessage]:
        """Messages of one thread in sequence order, or of every thread of the agent in
        the scope by (create_time, id); strictly after the position `after`, which is a
        (sequence, id) for one thread and a (create_time, id) for all.

        With a window, only its messages; each thread's own clear marker applies to it.
        """
        params: list[Any] = [where.tenant, where.agent, where.scope]
        thread_clause = ""
        if where.thread is not None:
            thread_clause = "AND t.thread = ?"
            params.append(where.thread)
        window_clause = ""
        if window is not None:
            predicate, window_params = window_predicate(window)
            window_clause = f"AND {predicate}"
            params += window_params
        if where.thread is not None:
            after_clause = "AND m.sequence > ?"
            params.append(after[0] if after is not None else 0)
            order = "m.sequence"
        else:
            after_time, after_id = after if after is not None else (-(2**63), -(2**63))
            after_clause = "AND (m.create_time_us > ? OR (m.create_time_us = ? AND m.id > ?))"
            params += [after_time, after_time, after_id]
            order = "m.create_time_us, m.id"
        params.append(limit)
        sql = f"""
            SELECT {", ".join("m." + c.strip() for c in MESSAGE_COLUMNS.split(","))}
            FROM threads t JOIN messages m ON m.context_id = t.context_id
            WHERE t.tenant = ? AND t.agent = ? AND t.scope = ? {thread_clause}
              {window_clause} {after_clause}
            ORDER BY {order}
            LIMIT ?
        """
        rows = self._cursor().execute(sql, params).fetchall()
        return [message_from_row(r) for r in rows]

    def context_ref(self, key: ContextKey) -> ContextRef | None:
        """What a build needs to know of a thread before reading it, in one lookup; None
        when the thread has no messages yet."""
        row = _first(
            self._cursor().execute(
                "SELECT context_id, last_clear_us, latest_summary_id FROM threads "
                "WHERE tenant = ? AND agent = ? AND scope = ? AND thread = ?",
                [key.tenant, key.agent, key.scope, key.thread],
            )
        )
        return ContextRef(int(row[0]), row[1], int(row[2])) if row else None

    def window_columns(self, context: ContextRef, window: WindowSpec) -> pa.Table:
        """The window of one thread as columns, without content: the first read of a build.

        Columns: id (int64), role (uint8), token_count (uint64), chars (uint64), group_id
        (int64), sequence (int64), in sequence order, in one chunk each (ready for
        zero-copy NumPy views). Stored summaries are left out (see `latest_summary`). A
        build trims on these and then loads content only for the newest messages it can
        keep (`window_messages_from`), so its cost follows the budget, not the window.
        `window` is the thread's (its own clear marker included).
        """
        predicate, params = window_predicate(window, "m", None)
        # No ORDER BY: rows come back in insertion order, which is sequence order;
        # `_in_sequence_order` checks and sorts only if not, which saves the sort of a
        # long window on every build.
        table: pa.Table = (
            self._cursor()
            .sql(
                "SELECT id, role, token_count::UBIGINT AS token_count, "
                "chars::UBIGINT AS chars, group_id, sequence FROM messages m "
                f"WHERE context_id = ? AND {predicate} AND NOT is_summary",
                params=[context.context_id, *params],
            )
            .to_arrow_table()
            .combine_chunks()
        )
        return _in_sequence_order(table)

    def window_messages_from(
        self,
        context: ContextRef,
        window: WindowSpec,
        from_sequence: int,
        id_range: tuple[int, int],
    ) -> list[StoredMessage]:
        """The window's messages from `from_sequence` on, in sequence order, without
        stored summaries: the newest suffix a build keeps, read as one range.

        `id_range` (smallest and largest id of that suffix, from `window_columns`) adds
        nothing to the result; it lets DuckDB skip every row group outside it by its
        min/max statistics (ids grow with insertion), so the read costs the suffix, not
        the thread. It also leaves out messages appended since the columns were read,
        so a build loads exactly what it planned.
        """
        predicate, params = window_predicate(window, "m", None)
        rows = (
            self._cursor()
            .execute(
                f"SELECT {MESSAGE_COLUMNS} FROM messages m "
                "WHERE id BETWEEN ? AND ? AND context_id = ? "
                f"AND {predicate} AND NOT is_summary AND sequence >= ? "
                "ORDER BY sequence",
                [id_range[0], id_range[1], context.context_id, *params, from_sequence],
            )
            .fetchall()
        )
        return [message_from_row(r) for r in rows]

    def latest_summary(self, context: ContextRef) -> StoredMessage | None:
        """The newest stored summary of a thread, whatever the window."""
        if not context.latest_summary_id:
            return None
        row = _first(
            self._cursor().execute(
                f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE id = ? AND context_id = ?",
                [context.latest_summary_id, context.context_id],
            )
        )
        return message_from_row(row) if row else None

    def messages_by_ids(self, key: ContextKey, ids: Sequence[int]) -> list[StoredMessage]:
        """Whole messages of one context by id, ordered by (create_time, id). Ids are
        matched within the full context key only: an id of another thread, scope, agent
        or tenant is never returned, whoever asks."""
        if not ids:
            return []
        rows = (
            self._cursor()
            .execute(
                f"SELECT {MESSAGE_COLUMNS} FROM messages "
                "WHERE context_id = (SELECT context_id FROM threads WHERE tenant = ? "
                "AND agent = ? AND scope = ? AND thread = ?) "
                "AND id IN (SELECT unnest(?::BIGINT[])) "
                "ORDER BY create_time_us, id",
                [key.tenant, key.agent, key.scope, key.thread, list(ids)],
            )
            .fetchall()
        )
        return [message_from_row(r) for r in rows]

    def thread_activity(
        self, tenant: str, agent: str, scope: str, window: WindowSpec, limit: int
    ) -> list[ThreadActivity]:
        """The agent's threads with messages in their windows (`window` is the agent's;
        each thread's own clear marker applies too), most recently active first, with
        how many messages each has in its window.

        A thread whose first message was committed after its clear marker and whose
        oldest message time (source or commit) is inside the age limit has all its
        messages in its window, so its count comes from its metadata; only the others
        are counted from the messages, with the window's own predicate.
        """
        cur = self._cursor()
        clear = "greatest(?, coalesce(last_clear_us, ?))"
        # A message's own time is at most MAX_SOURCE_LEAD_US after its commit, so a thread
        # whose newest commit is that much older than the age limit has nothing inside.
        oldest_commit = window.age_after_us - MAX_SOURCE_LEAD_US
        rows = self._thread_rows(
            "SELECT thread, last_message_time_us, message_count, context_id, last_clear_us, "
            f"create_time_us > {clear} "
            "AND least(create_time_us, coalesce(min_source_time_us, create_time_us)) > ? "
            "AS whole FROM live_threads "
            "WHERE tenant = ? AND agent = ? AND scope = ? "
            f"AND last_message_time_us > {clear} AND last_message_time_us > ? "
            "ORDER BY last_message_time_us DESC, thread LIMIT ?",
            [
                window.clear_after_us,
                window.clear_after_us,
                window.age_after_us,
                tenant,
                agent,
                scope,
                window.clear_after_us,
                window.clear_after_us,
                oldest_commit,
                limit,
            ],
        )
        # The others are counted all in one statement: one branch per thread, each an
        # equality on context_id (which the index serves), instead of a query per thread.
        partial = [(r[3], window.with_thread_clear(r[4])) for r in rows if not r[5]]
        counted: dict[int, int] = {}
        if partial:
            predicate, _ = window_predicate(window, "m", None)
            branch = f"SELECT ?, count(*) FROM messages m WHERE context_id = ? AND {predicate}"
            params: list[Any] = []
            for context_id, own in partial:
                params += [context_id, context_id, *window_predicate(own, "m", None)[1]]
            counted = dict(
                cur.execute(" UNION ALL ".join([branch] * len(partial)), params).fetchall()
            )
        activity = [
            ThreadActivity(thread, last_us, int(counted.get(context_id, count)))
            for thread, last_us, count, context_id, _clear, _whole in rows
        ]
        return [a for a in activity if a.window_message_count > 0]
