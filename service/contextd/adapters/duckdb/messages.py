"""Messages on DuckDB: the append (queued for the writer) and every read of messages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import duckdb
import pyarrow as pa

from contextd.adapters.duckdb.base import (
    _ARROW_COLUMNS,
    _ARROW_NAMES,
    _ARROW_SCHEMA,
    _INSERT_AGENT,
    _INSERT_REQUESTS,
    _REMEMBERED_CALLS,
    ID_BLOCK,
    DuckDBBase,
    _AppendJob,
    _context_row,
    _first,
    _in_sequence_order,
    window_predicate,
)
from contextd.adapters.duckdb.journal import DIRECT_CHARS, Columns, GroupWrite
from contextd.adapters.duckdb.reply import Reply
from contextd.adapters.duckdb.schema import is_long_content
from contextd.adapters.duckdb.thread_counters import (
    NO_SOURCE_TIME,
)
from contextd.adapters.rows import (
    MESSAGE_COLUMNS,
    agent_row,
    message_from_row,
)
from contextd.domain.context import ThreadActivity
from contextd.domain.errors import (
    NotFound,
)
from contextd.domain.idempotency import (
    Remembered,
    RequestRecord,
)
from contextd.domain.model import (
    AgentSettings,
    ContextKey,
    MessageBatch,
    MessageReceipt,
    NewMessage,
    Role,
    StoredMessage,
)
from contextd.domain.quota import stored_bytes
from contextd.domain.window import MAX_SOURCE_LEAD_US, WindowSpec
from contextd.ports.store import ContextRef, ThreadFilter, WindowBounds


class MessagesMixin(DuckDBBase):
    # The batch's schema and INSERT (see `_message_insert`), found by the writer.
    _insert_plan: tuple[pa.Schema, str] | None = None

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
                future=Reply(),
                record=record,
            )
        )
        return receipts

    def append_many(
        self,
        parts: Sequence[tuple[ContextKey, MessageBatch]],
        record: RequestRecord | None = None,
    ) -> list[MessageReceipt]:
        """Append to several threads of one existing agent as one writer job: one
        transaction (in the group commit), one commit time, one request record."""
        if not parts:
            return []
        (key, batch), *more = parts
        receipts: list[MessageReceipt] = self._submit(
            _AppendJob(
                key=key,
                batch=batch,
                default_settings=None,
                future=Reply(),
                record=record,
                more=tuple(more),
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
        predicate, params = window_predicate(window, "m", None, context.context_id)
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

    def window_bounds(
        self,
        context: ContextRef,
        window: WindowSpec,
        summary_last_id: int,
        first_page: int = 0,
        held: int = 0,
    ) -> WindowBounds | None:
        """None: a build reads `window_columns`, which the hot cache serves from memory
        (and DuckDB reads a cold window's narrow columns by one columnar scan), so this
        engine keeps no running counts."""
        return None

    def window_page(
        self,
        context: ContextRef,
        from_sequence: int,
        before_sequence: int,
        limit: int,
        ids_only: bool = False,
    ) -> pa.Table:
        """Never called: `window_bounds` answers None on this engine."""
        raise NotImplementedError("DuckDB builds read window_columns")

    def window_ordinal(self, context: ContextRef, message_id: int) -> int | None:
        """Never called: `window_bounds` answers None on this engine."""
        raise NotImplementedError("DuckDB builds read window_columns")

    def window_unread_orphans(
        self, context: ContextRef, from_sequence: int, before_sequence: int
    ) -> list[int] | None:
        """Never called: `window_bounds` answers None on this engine."""
        raise NotImplementedError("DuckDB builds read window_columns")

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
        predicate, params = window_predicate(window, "m", None, context.context_id)
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
        # (Under retention no thread counts from its metadata: its bounds are per message.)
        partial = [
            (r[3], window.with_thread_clear(r[4])) for r in rows if window.retains or not r[5]
        ]
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

    # ----------------------------------------------------------------- the append, on the writer

    def _context_id(self, writer: duckdb.DuckDBPyConnection, key: ContextKey) -> int | None:
        cached = self._context_ids.get(key)
        if cached is not None:
            return cached
        row = _context_row(writer, key)
        if row is None:
            return None
        self._context_ids[key] = int(row[0])
        return int(row[0])

    def _sequence_of(self, writer: duckdb.DuckDBPyConnection, context_id: int) -> int:
        """The last sequence of a stored thread: its row's, plus the messages not yet
        counted there (see thread_counters.py), cached while the writer numbers it."""
        cached = self._last_sequence.get(context_id)
        if cached is not None:
            return cached
        row = _first(
            writer.execute("SELECT last_sequence FROM threads WHERE context_id = ?", [context_id])
        )
        return (int(row[0]) if row else 0) + self._pending.count_of(context_id)

    def _last_update_of(self, writer: duckdb.DuckDBPyConnection, context_id: int) -> int:
        """The commit time of a stored thread's newest message (its row's, or a newer
        one not yet counted there)."""
        row = _first(
            writer.execute(
                "SELECT last_message_time_us FROM threads WHERE context_id = ?", [context_id]
            )
        )
        return max(int(row[0]) if row else 0, self._pending.last_of(context_id))

    def _insert_appends(
        self, writer: duckdb.DuckDBPyConnection, jobs: list[_AppendJob], journal: bool = False
    ) -> tuple[list[list[MessageReceipt]], dict[int, list[int]]]:
        """Insert and commit the group (or, with `journal`, append it to the journal:
        every agent it names is known, journal.py); return its receipts and, per context
        id, the counts it adds to its thread ([messages, tokens, first time, last time,
        oldest source time, bytes]), which the caller leaves pending (thread_counters.py).

        Each call gets one commit time from the server's clock (client times never move
        it) and its thread's next sequence numbers. Sequences are numbered here from the
        thread's row, and the unique index on (context_id, sequence) checks them in the
        transaction: a number taken by any other writer fails the commit instead of
        being stored twice. (Numbering in SQL with an UPDATE of the thread's row would
        check the same but costs about 2 ms a commit, as much as the insert itself.)
        """
        columns: dict[str, list[Any]] = {name: [] for name in _ARROW_NAMES}
        all_receipts: list[list[MessageReceipt]] = []
        # per context: [count, tokens, first commit, last commit, oldest source time, bytes]
        thread_deltas: dict[ContextKey, list[int]] = {}
        numbered: dict[int, int] = {}  # context id -> its last sequence in this group
        new_contexts: dict[ContextKey, int] = {}
        agents_seen: dict[tuple[str, str], AgentSettings | None] = {}
        summaries: dict[int, int] = {}  # context id -> id of its newest stored summary
        # context id -> (clear marker, last expired sequence) of threads found expired
        expiries: dict[int, tuple[int, int, int]] = {}

        for job in jobs:
            agent_key = (job.key.tenant, job.key.agent)
            if agents_seen.get(agent_key) is None:
                agents_seen[agent_key] = job.default_settings
        # Ticked before any message time: an auto-created agent's clear marker (its create
        # time) must precede the messages that created it, or they would start outside.
        now_us = self.clock.tick()
        in_transaction = False  # opened early only when an agent must be created
        for (tenant, name), settings in agents_seen.items():
            # Known agents skip the lookup: a statement costs more than a commit's rows.
            if (tenant, name) in self._known_agents:
                continue
            exists = _first(
                writer.execute("SELECT 1 FROM agents WHERE tenant = ? AND name = ?", [tenant, name])
            )
            if not exists:
                if settings is None:
                    # Raised before anything is written; the group is then retried call by
                    # call, so only the calls for this agent fail.
                    raise NotFound(f"agent {name!r} does not exist", reason="AGENT_NOT_FOUND")
                if not in_transaction:
                    writer.execute("BEGIN TRANSACTION")
                    in_transaction = True
                writer.execute(_INSERT_AGENT, agent_row(tenant, name, settings, now_us))
            self._known_agents.add((tenant, name))

        for job in jobs:
            job_receipts: list[MessageReceipt] = []
            all_receipts.append(job_receipts)
            # One commit time per call, shared by every thread it writes.
            commit_time = self.clock.tick()
            for key, batch in job.parts():
                self._add_rows(
                    writer,
                    key,
                    batch,
                    commit_time,
                    columns,
                    job_receipts,
                    thread_deltas,
                    numbered,
                    new_contexts,
                    summaries,
                    expiries,
                )

        high_water = self._id_high_water
        if self._next_message_id - 1 > high_water:
            # Reserve the next block of ids with this group: no id it commits is ever
            # above the stored mark, so none is issued again after a restart.
            high_water = self._next_message_id - 1 + ID_BLOCK
        counted = {
            new_contexts.get(key) or self._context_ids[key]: delta
            for key, delta in thread_deltas.items()
        }
        requests = [
            (job.record, job.record.encode(receipts))
            for job, receipts in zip(jobs, all_receipts, strict=True)
            if job.record is not None
        ]
        request_rows = [
            (r.key, r.tenant, r.request_id, r.method, r.fingerprint, payload, now_us)
            for r, payload in requests
        ]
        # New threads start with zero counters: like every other append, theirs are
        # added by the next counter flush (or by the recount after a crash), so no
        # message is ever counted twice.
        group = GroupWrite(
            columns=columns,
            new_threads=[
                (c, thread_deltas[k][2], thread_deltas[k][3]) for k, c in new_contexts.items()
            ],
            summaries=summaries,
            expiries=expiries,
            requests=request_rows,
            high_water=high_water if high_water != self._id_high_water else None,
        )
        if journal and group.text_chars() >= DIRECT_CHARS:
            # Large: committed directly (no transaction is open: its agents are known),
            # after what is journaled, in order.
            self._apply_journal(writer)
            journal = False
        rows: pa.Table | Columns = columns
        # Into the request filter before the records are visible (journaled or committed).
        self._note_requests(r.key for r, _ in requests)
        if journal:
            self._journal_append(group)  # durable once it returns
            for record, payload in requests:
                self._journal_requests[record.key] = Remembered(
                    record.method, record.fingerprint, payload
                )
        else:
            rows = self._apply_group(writer, group, in_transaction)
        self._hot_appended = (rows, tuple(expiries))  # for the hot cache (hot.py)
        self._context_ids.update(new_contexts)
        self._last_sequence.update(numbered)
        self._id_high_water = high_water
        return all_receipts, counted

    def _apply_group(
        self,
        writer: duckdb.DuckDBPyConnection,
        group: GroupWrite,
        in_transaction: bool = False,
        applied_group: int | None = None,
    ) -> pa.Table:
        """Write `group` to the tables and commit: a group committed directly, or the
        journal's pending groups merged into one (then `applied_group` is the number of
        the last of them, recorded in the same transaction; journal.py).

        The whole write is one client call: a script of BEGIN, the inserts (and a summary
        pointer's update), and COMMIT. Every call into DuckDB gives up the GIL and must
        win it back, and with dozens of handler threads waiting that costs more than the
        statements themselves, so a group makes one call. The scripts read their rows
        from the Arrow tables below through DuckDB's replacement scans (the names of this
        frame's local variables); they carry no parameters. Returns the messages' table.
        """
        schema, insert = self._message_insert(writer)
        contextd_batch = group.table(schema)  # scanned by the script
        script = [] if in_transaction else ["BEGIN TRANSACTION"]
        script.append(insert)
        if group.high_water is not None:
            script.append(
                f"UPDATE store_state SET value = greatest(value, {int(group.high_water)}) "
                "WHERE key = 'message_id_high_water'"
            )
        if group.new_threads:
            contextd_new_threads = group.threads_table()  # noqa: F841 - scanned by the script
            script.append(
                "INSERT INTO threads (context_id, tenant, agent, scope, thread, create_time_us, "
                "last_message_time_us, message_count, token_estimate) "
                "SELECT d.context_id, b.tenant, b.agent, b.scope, b.thread, d.first_us, "
                "d.last_us, 0, 0 FROM contextd_new_threads d JOIN (SELECT DISTINCT "
                "context_id, tenant, agent, scope, thread FROM contextd_batch) b "
                "ON b.context_id = d.context_id"
            )
        if group.summaries:
            contextd_summaries = pa.table(  # noqa: F841 - scanned by the script
                {
                    "context_id": pa.array(list(group.summaries), pa.int64()),
                    "summary_id": pa.array(list(group.summaries.values()), pa.int64()),
                }
            )
            script.append(
                "UPDATE threads SET latest_summary_id = d.summary_id FROM contextd_summaries d "
                "WHERE threads.context_id = d.context_id"
            )
        for context_id, (marker, through, outputs_through) in group.expiries.items():
            # Integers only (no client text): safe to write into the script.
            script.append(
                f"UPDATE threads SET last_clear_us = greatest(coalesce(last_clear_us, "
                f"{int(marker)}), {int(marker)}), expired_through = greatest(expired_through, "
                f"{int(through)}), outputs_expired_through_us = greatest("
                f"outputs_expired_through_us, {int(outputs_through)}) "
                f"WHERE context_id = {int(context_id)}"
            )
        if group.requests:
            contextd_requests = group.requests_table()  # noqa: F841 - scanned by the script
            script.append(_INSERT_REQUESTS)
        if applied_group is not None:
            script.append(
                f"UPDATE store_state SET value = {int(applied_group)} "
                "WHERE key = 'journal_applied_group'"
            )
        script.append("COMMIT")
        writer.execute(";\n".join(script))
        return contextd_batch

    def _message_insert(self, writer: duckdb.DuckDBPyConnection) -> tuple[pa.Schema, str]:
        """The batch's Arrow schema and its INSERT, found once per store.

        When the batch's columns are the table's, the batch takes the table's column
        order and the INSERT names no column: DuckDB parses and binds a statement on every
        commit, and a single-message append spent a sixth of its commit on the two lists
        of 26 names. Otherwise (a table with a column the batch does not fill) the names
        are listed."""
        found = self._insert_plan
        if found is None:
            # `content` is virtual (version 22): an INSERT neither names nor fills it.
            names = [
                str(r[0])
                for r in writer.execute(
                    "SELECT column_name FROM duckdb_columns() WHERE schema_name = 'main' "
                    "AND table_name = 'messages' AND column_name <> 'content' "
                    "ORDER BY column_index"
                ).fetchall()
            ]
            if sorted(names) == sorted(_ARROW_NAMES):
                schema = pa.schema([_ARROW_SCHEMA.field(name) for name in names])
                found = (schema, "INSERT INTO messages SELECT * FROM contextd_batch")
            else:
                found = (
                    _ARROW_SCHEMA,
                    f"INSERT INTO messages ({_ARROW_COLUMNS}) "
                    f"SELECT {_ARROW_COLUMNS} FROM contextd_batch",
                )
            self._insert_plan = found
        return found

    def _add_rows(
        self,
        writer: duckdb.DuckDBPyConnection,
        key: ContextKey,
        batch: MessageBatch,
        commit_time: int,
        columns: dict[str, list[Any]],
        receipts: list[MessageReceipt],
        thread_deltas: dict[ContextKey, list[int]],
        numbered: dict[int, int],
        new_contexts: dict[ContextKey, int],
        summaries: dict[int, int],
        expiries: dict[int, tuple[int, int, int]],
    ) -> None:
        """Add one thread's batch to the group's columns: its context (new or known), ids,
        sequences and tool groups; its receipts and its thread's counts; and, when the
        batch finds its thread expired, the expiry marker to write (see retention.py)."""
        context_id = new_contexts.get(key) or self._context_id(writer, key)
        if context_id is None:
            if batch.summarized_ids is not None:
                # A summary stands for messages of an existing thread; if the thread
                # is gone (its agent deleted meanwhile) the summary has nothing to
                # stand for and must not bring the context back.
                raise NotFound(
                    f"thread {key.thread!r} of agent {key.agent!r} no longer exists",
                    reason="THREAD_NOT_FOUND",
                )
            context_id = self._next_context_id
            self._next_context_id += 1
            new_contexts[key] = context_id
        messages = batch.messages
        n = len(messages)
        first_id = self._next_message_id
        self._next_message_id += n
        ids = range(first_id, first_id + n)
        last = numbered.get(context_id)
        if last is None:
            last = 0 if key in new_contexts else self._sequence_of(writer, context_id)
        sequences = range(last + 1, last + 1 + n)
        numbered[context_id] = last + n
        if batch.ttl_us and last and key not in new_contexts:
            earlier = thread_deltas.get(key)  # an earlier call of this group appended
            last_us = earlier[3] if earlier else self._last_update_of(writer, context_id)
            if last_us + batch.ttl_us <= commit_time:
                # The clear marker at the moment it expired, its messages so far, and its
                # tool outputs old enough for the sweep now (see tool_outputs.py).
                expiries[context_id] = (
                    min(last_us + batch.ttl_us, commit_time - 1),
                    last,
                    commit_time - batch.ttl_us,
                )
        summary = batch.summarized_ids
        if summary is not None:
            summaries[context_id] = ids[-1]
        if n == 1 and not batch.tool_call_ids[0] and not messages[0].tool_call_id:
            # The common append, one message outside any tool group: its row by plain
            # appends (the writer's hot path, under the GIL; the general way below
            # builds a list per column, twice the time for one row).
            _append_one_row(
                columns, messages[0], first_id, context_id, key, commit_time, last + 1, batch
            )
        else:
            self._extend_rows(
                writer, columns, messages, ids, sequences, context_id, key, commit_time, batch
            )
        receipts.extend(
            MessageReceipt(i, commit_time, e, c, q)
            for i, e, c, q in zip(
                ids, batch.token_estimates, batch.token_counts, sequences, strict=True
            )
        )
        delta = thread_deltas.setdefault(key, [0, 0, commit_time, 0, NO_SOURCE_TIME, 0])
        delta[0] += n
        delta[1] += sum(batch.token_estimates)
        delta[5] += stored_bytes(messages)
        delta[3] = commit_time
        given = [m.source_time_us for m in messages if m.source_time_us is not None]
        if given:
            delta[4] = min(delta[4], *given)

    def _extend_rows(
        self,
        writer: duckdb.DuckDBPyConnection,
        columns: dict[str, list[Any]],
        messages: Sequence[NewMessage],
        ids: range,
        sequences: range,
        context_id: int,
        key: ContextKey,
        commit_time: int,
        batch: MessageBatch,
    ) -> None:
        """Add a batch's rows to the group's columns (any batch; see `_append_one_row`)."""
        n = len(messages)
        summary = batch.summarized_ids
        sources = [m.source_time_us for m in messages]
        columns["id"].extend(ids)
        columns["context_id"].extend([context_id] * n)
        columns["tenant"].extend([key.tenant] * n)
        columns["agent"].extend([key.agent] * n)
        columns["scope"].extend([key.scope] * n)
        columns["thread"].extend([key.thread] * n)
        columns["role"].extend([int(m.role) for m in messages])
        for m in messages:
            if is_long_content(m.content):
                columns["content_short"].append("")
                columns["content_long"].append(m.content)
            else:
                columns["content_short"].append(m.content)
                columns["content_long"].append(None)
        columns["tool_calls"].extend([m.tool_calls for m in messages])
        columns["tool_call_id"].extend([m.tool_call_id for m in messages])
        columns["external_id"].extend([m.external_id for m in messages])
        columns["metadata"].extend([m.metadata for m in messages])
        columns["token_estimate"].extend(batch.token_estimates)
        columns["create_time_us"].extend([commit_time] * n)
        columns["source_time_us"].extend(sources)
        columns["sequence"].extend(sequences)
        columns["token_count"].extend(batch.token_counts)
        columns["tokenizer"].extend([batch.tokenizer] * n)
        columns["chars"].extend(batch.chars)
        if any(batch.tool_call_ids) or any(m.tool_call_id for m in messages):
            groups = [
                self._group_of(writer, context_id, i, q, m, calls)
                for i, q, m, calls in zip(
                    ids, sequences, messages, batch.tool_call_ids, strict=True
                )
            ]
            columns["group_id"].extend(g for g, _ in groups)
            columns["group_start"].extend(start for _, start in groups)
            columns["tool_call_ids"].extend([",".join(c) for c in batch.tool_call_ids])
        else:
            # No message declares a tool call or answers one, so none is in a group:
            # what `_group_of` would give each, without a call per message.
            columns["group_id"].extend([-1] * n)
            columns["group_start"].extend([None] * n)
            columns["tool_call_ids"].extend([""] * n)
        columns["is_summary"].extend([summary is not None] * n)
        columns["first_summarized_id"].extend([summary[0] if summary else 0] * n)
        columns["last_summarized_id"].extend([summary[1] if summary else 0] * n)
        columns["restored_from"].extend([batch.restored_from] * n)

    def _group_of(
        self,
        writer: duckdb.DuckDBPyConnection,
        context_id: int,
        message_id: int,
        sequence: int,
        message: NewMessage,
        call_ids: tuple[str, ...],
    ) -> tuple[int, int | None]:
        """The tool group of a message: the id of the tool_use it belongs to, or -1, and
        that tool_use's sequence (None outside a group: the message's own counts).

        Computed once at insert so that trimming and retention caps read integers, never
        JSON.
        """
        if call_ids:
            for call_id in call_ids:
                self._calls[(context_id, call_id)] = (message_id, sequence)
                self._calls.move_to_end((context_id, call_id))
            while len(self._calls) > _REMEMBERED_CALLS:
                self._calls.popitem(last=False)
            return message_id, sequence
        if message.role != Role.TOOL_RESULT or not message.tool_call_id:
            return -1, None
        known = self._calls.get((context_id, message.tool_call_id))
        if known is not None:
            return known
        # The tool_use may be journaled and not yet in the table (a group that journals
        # has no transaction open: applying now is in order).
        self._apply_journal(writer)
        row = _first(
            writer.execute(
                "SELECT id, sequence FROM messages WHERE context_id = ? AND tool_call_ids <> '' "
                "AND list_contains(string_split(tool_call_ids, ','), ?) "
                "ORDER BY sequence DESC LIMIT 1",
                [context_id, message.tool_call_id],
            )
        )
        return (int(row[0]), int(row[1])) if row else (-1, None)


def _append_one_row(
    columns: dict[str, list[Any]],
    m: NewMessage,
    message_id: int,
    context_id: int,
    key: ContextKey,
    commit_time: int,
    sequence: int,
    batch: MessageBatch,
) -> None:
    """The row of a batch of one message outside any tool group: what
    `MessagesMixin._extend_rows` adds for it, without its per-column lists."""
    long = is_long_content(m.content)
    summary = batch.summarized_ids
    columns["id"].append(message_id)
    columns["context_id"].append(context_id)
    columns["tenant"].append(key.tenant)
    columns["agent"].append(key.agent)
    columns["scope"].append(key.scope)
    columns["thread"].append(key.thread)
    columns["role"].append(int(m.role))
    columns["content_short"].append("" if long else m.content)
    columns["content_long"].append(m.content if long else None)
    columns["tool_calls"].append(m.tool_calls)
    columns["tool_call_id"].append(m.tool_call_id)
    columns["external_id"].append(m.external_id)
    columns["metadata"].append(m.metadata)
    columns["token_estimate"].append(batch.token_estimates[0])
    columns["create_time_us"].append(commit_time)
    columns["source_time_us"].append(m.source_time_us)
    columns["sequence"].append(sequence)
    columns["token_count"].append(batch.token_counts[0])
    columns["tokenizer"].append(batch.tokenizer)
    columns["chars"].append(batch.chars[0])
    columns["group_id"].append(-1)
    columns["group_start"].append(None)
    columns["tool_call_ids"].append("")
    columns["is_summary"].append(summary is not None)
    columns["first_summarized_id"].append(summary[0] if summary else 0)
    columns["last_summarized_id"].append(summary[1] if summary else 0)
    columns["restored_from"].append(batch.restored_from)
