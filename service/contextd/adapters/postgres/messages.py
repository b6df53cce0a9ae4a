"""Messages on PostgreSQL: the append transaction, and listing a thread's messages.

An append is one transaction: lock the agent's row (FOR KEY SHARE; create the agent if
asked), check that the batch was counted under the agent's current model, lock the
thread's row (creating it), take the next sequence numbers and ids, stamp the commit time
(never before the thread's newest message or any clear marker that applies to it), COPY
the rows in, move the thread's counters, and record the request id. Nothing of it lives
in the process: any replica can append to any thread.

The common one-message append (an existing thread, no tool call, no retention, the
model's label as counted) does all of that in one statement in autocommit
(`_ONE_STATEMENT_APPEND`): one round trip and one commit. Whatever it does not cover it
leaves, having written nothing, to the transaction above.

A build's reads live apart: its first read and the plan of its round trips in
build_reads.py, the window's reads in window_reads.py, its pages by ids in
window_pages.py, and the SQL they share with this module in message_sql.py.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from psycopg import errors as pg_errors
from psycopg import pq

from contextd.adapters.postgres.agents import INSERT_AGENT
from contextd.adapters.postgres.base import (
    KEY_STANDS,
    RECEIPTS_RECORD,
    RECORD_VALUES,
    Conn,
    PostgresBase,
    agent_missing,
    check_remembered,
    first,
    owed_key_param,
    receipt_tail,
    thread_gone,
)
from contextd.adapters.postgres.message_sql import APPENDED_ROWS, SELECT_MESSAGES, window_predicate
from contextd.adapters.postgres.pending_list import PendingListMerger
from contextd.adapters.postgres.search_vector import search_vectors
from contextd.adapters.postgres.window_reads import WINDOWS_SEEN
from contextd.adapters.rows import agent_row, message_from_row
from contextd.domain.access import key_check_answered, owed_key_check
from contextd.domain.batches import stored_tokenizer
from contextd.domain.errors import StaleModel
from contextd.domain.idempotency import RequestRecord
from contextd.domain.model import (
    AgentSettings,
    ContextKey,
    MessageBatch,
    MessageReceipt,
    Role,
    StoredMessage,
)
from contextd.domain.quota import stored_bytes
from contextd.domain.retention import policy_for, retention_of
from contextd.domain.window import WindowSpec
from contextd.ports.store import ThreadFilter

_COPY_COLUMNS = (
    "tenant, context_id, sequence, id, role, content, tool_calls, tool_call_id, external_id, "
    "metadata, token_estimate, create_time_us, source_time_us, token_count, tokenizer, chars, "
    "group_id, tool_call_ids, is_summary, first_summarized_id, last_summarized_id, restored_from, "
    "group_start, search_tsv, ordinal, tools_total"
)
_INSERT_MESSAGE = (
    f"INSERT INTO messages ({_COPY_COLUMNS}) VALUES "
    f"({', '.join(['%s'] * len(_COPY_COLUMNS.split(',')))})"
)

_LOCK_AGENT = (
    "SELECT model, last_clear_us, settings_json FROM agents WHERE tenant = %s AND name = %s "
    "FOR KEY SHARE"
)


def _ttl_of(settings: str, scope: str) -> int:
    """The retention ttl of a scope from the agent's settings JSON as this transaction
    reads it (another replica may have changed the policy since the caller looked)."""
    if "retention" not in settings:
        return 0
    policy, overrides = retention_of(json.loads(settings))
    return policy_for(policy, overrides, scope).ttl_us


_LOCK_THREAD = (
    "SELECT context_id, last_sequence, last_message_time_us, last_clear_us, ordinal_total, "
    "tools_total, totals_through FROM threads "
    "WHERE tenant = %s AND agent = %s AND scope = %s AND thread = %s FOR UPDATE"
)


# The head of both ways of appending (`_BEGIN_APPEND`, `_ONE_STATEMENT_APPEND`): the
# request id's record (r), the agent's row locked FOR KEY SHARE (a), then the thread's row
# locked FOR UPDATE (t): in that order, as everywhere, so that appends never deadlock
# with each other whichever way each takes.
_APPEND_HEAD = """
WITH r AS MATERIALIZED (
    SELECT method, fingerprint, payload FROM request_records
    WHERE tenant = %(tenant)s AND request_id = %(request_id)s::text
), a AS MATERIALIZED (
    SELECT model, last_clear_us, settings_json FROM agents
    WHERE tenant = %(tenant)s AND name = %(agent)s FOR KEY SHARE
), t AS MATERIALIZED (
    SELECT context_id, last_sequence, last_message_time_us, last_clear_us, ordinal_total,
           tools_total, totals_through FROM threads
    WHERE tenant = %(tenant)s AND agent = %(agent)s AND scope = %(scope)s
      AND thread = %(thread)s
    FOR UPDATE
)"""


# The first statement of an append: the request id's record (see `PostgresBase._write`,
# `records_itself`), the agent's row locked FOR KEY SHARE, the thread's
# row locked FOR UPDATE (in that order, as everywhere), and, when the thread exists, the
# append's message ids, taken after its lock (ids grow along a thread) by a subquery
# evaluated per output row. The CTEs are materialized so each runs once, as written. It
# also sets this transaction's gin_pending_list_limit (see pending_list.py).
_BEGIN_APPEND = (
    _APPEND_HEAD
    + """
SELECT r.method, r.fingerprint, r.payload, a.model, a.last_clear_us, a.settings_json,
       t.context_id, t.last_sequence, t.last_message_time_us, t.last_clear_us,
       t.ordinal_total, t.tools_total, t.totals_through,
       ARRAY(SELECT nextval('message_ids') FROM generate_series(1, %(n)s)
             WHERE t.context_id IS NOT NULL),
       set_config('gin_pending_list_limit',
                  coalesce(%(pending_kb)s::text, current_setting('gin_pending_list_limit')),
                  true)
FROM (SELECT) AS one LEFT JOIN r ON true LEFT JOIN a ON true LEFT JOIN t ON true
"""
)


# The whole of a one-message append in one statement, run in autocommit: one round trip
# and one commit, where the transaction (BEGIN, `_BEGIN_APPEND`, the writes, COMMIT) takes
# four. It covers the common case only and leaves the rest to that transaction (it then
# writes nothing and returns no id): the thread exists; the agent's model is one whose
# label the batch was counted under; its settings have no retention (no ttl to expire the
# thread); the commit time this replica took is past the thread's newest message and
# every clear marker that applies to it; the message declares no tool call and names
# none. With a request id, its record is read first (a record: nothing is written, the
# record comes back) and written with the message, its payload the receipt's values
# (`remembered_of`): the id and sequence are the database's, taken here under the
# thread's lock. A call admitted before its key was confirmed (`owed_key_check`) writes
# only if the key still stands (k, KEY_STANDS), which the last column says, read before
# anything else (a record included). The CTEs are materialized so each runs once, in
# the order written; the data-modifying ones run whether or not the final SELECT reads
# them.
_ONE_STATEMENT_APPEND = (
    _APPEND_HEAD
    + f""", k AS MATERIALIZED (
    SELECT {KEY_STANDS} AS stands
), ok AS MATERIALIZED (
    SELECT t.context_id, t.last_sequence + 1 AS sequence, nextval('message_ids') AS id,
           t.ordinal_total, t.tools_total, t.totals_through = t.last_sequence AS exact,
           set_config('gin_pending_list_limit',
                      coalesce(%(pending_kb)s::text, current_setting('gin_pending_list_limit')),
                      true)
    FROM a, t, k
    WHERE k.stands AND NOT EXISTS (SELECT FROM r) AND a.model = ANY(%(models)s::text::text[])
      AND strpos(a.settings_json, 'retention') = 0
      AND a.last_clear_us < %(commit)s AND t.last_message_time_us < %(commit)s
      AND coalesce(t.last_clear_us, 0) < %(commit)s
), m AS (
    INSERT INTO messages ({_COPY_COLUMNS})
    SELECT %(tenant)s, ok.context_id, ok.sequence, ok.id, %(role)s::smallint, %(content)s::text,
           %(tool_calls)s::text, %(tool_call_id)s::text, %(external_id)s::text,
           %(metadata)s::text, %(token_estimate)s::integer, %(commit)s::bigint,
           %(source_time_us)s::bigint, %(token_count)s::integer, %(tokenizer)s::text,
           %(chars)s::integer, -1, '', false, 0, 0, %(restored_from)s::text, NULL,
           %(search_tsv)s::tsvector,
           CASE WHEN ok.exact THEN ok.ordinal_total + 1 END,
           CASE WHEN ok.exact THEN ok.tools_total + %(tool)s::bigint END
    FROM ok
), u AS (
    UPDATE threads x SET last_sequence = ok.sequence, message_count = x.message_count + 1,
           token_estimate = x.token_estimate + %(token_estimate)s::integer,
           last_message_time_us = %(commit)s::bigint,
           min_source_time_us = least(x.min_source_time_us, %(source_time_us)s::bigint),
           stored_bytes = x.stored_bytes + %(stored_bytes)s::bigint,
           ordinal_total = ok.ordinal_total + 1, tools_total = ok.tools_total + %(tool)s::bigint,
           totals_through = CASE WHEN ok.exact THEN ok.sequence ELSE x.totals_through END
    FROM ok WHERE x.tenant = %(tenant)s AND x.context_id = ok.context_id
), q AS (
    INSERT INTO request_records (tenant, request_id, method, fingerprint, payload,
                                 create_time_us)
    SELECT %(tenant)s, %(request_id)s::text, %(method)s::text, %(fingerprint)s::text,
           int8send(ok.id) || int8send(ok.sequence) || %(receipt_tail)s::bytea,
           %(record_time_us)s::bigint
    FROM ok WHERE %(request_id)s::text IS NOT NULL
)
SELECT ok.id, ok.sequence, r.method, r.fingerprint, r.payload, k.stands
FROM k LEFT JOIN ok ON true LEFT JOIN r ON true
"""
)
# Sent without its runs of blanks: psycopg keeps its conversion of a query of at most
# 4,096 characters.
_ONE_STATEMENT_APPEND = " ".join(_ONE_STATEMENT_APPEND.split())


def _model_label(model: str) -> str:
    return stored_tokenizer(model) if model else "estimate"


def _text_array(items: Sequence[str]) -> str:
    """`items` as the text of a PostgreSQL array literal, every element quoted (a
    backslash before each quote and backslash). The one-statement append sends its
    models as this text, cast in SQL: psycopg's list dumper is Python, run on every call
    (about 4% of a single append's time holding the GIL), where this text is made once
    per label."""
    quoted = ('"' + i.replace("\\", "\\\\").replace('"', '\\"') + '"' for i in items)
    return "{" + ",".join(quoted) + "}"


class MessagesMixin(PostgresBase):
    # Whether appends hand over the search vectors they can make (set when the store
    # opens; see search_vector.py). False: the database computes every one.
    _search_vectors: bool = False
    # Merges the search index's pending list off the append path (pending_list.py).
    _pending: PendingListMerger
    # Threads this replica appended to since its last build of them, by key, each with
    # how many plain messages those appends added, or more than APPENDED_ROWS once one
    # was not plain (see `_appended_here`).
    _moved_here: dict[ContextKey, int]

    # The stores' append reads the request id's record in its own first statement.
    append_reads_record = True
    # The models seen under each batch label (`_model_label`): the one-statement append
    # takes a batch counted under a label only for an agent whose model is among them
    # (the label is a function of the model, so an entry never goes stale), and the
    # array literal of those models the statement is sent (`_text_array`).
    _label_models: dict[str, tuple[tuple[str, ...], str]]
    # Agents whose settings had retention when an append last read them, by (tenant,
    # name): their appends go to the transaction at once (the one statement would find
    # the retention and write nothing, a round trip for naught). Each transaction's
    # append sets its agent's entry from what it read.
    _retention_agents: set[tuple[str, str]]

    def append(
        self,
        key: ContextKey,
        batch: MessageBatch,
        default_settings: AgentSettings | None,
        record: RequestRecord | None = None,
    ) -> list[MessageReceipt]:
        receipts = self._append_in_one_statement(key, batch, record)
        if receipts is None:
            # The append reads the request id's record in its first statement and writes
            # it in its last: a one-message append is BEGIN, two statements and COMMIT.
            receipts = self._write(
                lambda conn: self._append(conn, key, batch, default_settings, record),
                record,
                records_itself=True,
            )
        self._pending.appended(len(receipts))
        self._appended_here(key, batch)
        return receipts

    def _appended_here(self, key: ContextKey, batch: MessageBatch) -> None:
        """Note that this replica appended to the thread: its next build here reads
        what the window it kept lacks (it is of an older state), which `_send_planned`
        then sends with the thread's read: the rows appended since, when every append
        here since was of plain messages (a builder extends a window by those alone:
        `WindowExtension._extended_tail`) and they are at most APPENDED_ROWS (the most an
        extension reads), else the window's bounds: sending the appended rows' read for
        a window they cannot extend would cost the bounds a round trip of their own."""
        if len(self._moved_here) >= WINDOWS_SEEN and key not in self._moved_here:
            self._moved_here.clear()
        plain = batch.summarized_ids is None and all(
            not calls and m.role != Role.TOOL_RESULT and m.source_time_us is None
            for m, calls in zip(batch.messages, batch.tool_call_ids, strict=True)
        )
        rows = self._moved_here.get(key, 0) + len(batch) if plain else APPENDED_ROWS + 1
        self._moved_here[key] = min(rows, APPENDED_ROWS + 1)

    def _append_in_one_statement(
        self, key: ContextKey, batch: MessageBatch, record: RequestRecord | None
    ) -> list[MessageReceipt] | None:
        """A one-message append as `_ONE_STATEMENT_APPEND`, or None when it does not apply
        (or conflicted): the transaction of `_append` then does it, and answers as ever
        (creates what is missing, raises StaleModel, expires the thread, replays a record
        written meanwhile)."""
        if len(batch) != 1 or batch.summarized_ids is not None or batch.tool_call_ids[0]:
            return None
        message = batch.messages[0]
        tool_result = message.role == Role.TOOL_RESULT
        models, models_text = self._label_models.get(batch.tokenizer, ((), ""))
        if not models or (tool_result and message.tool_call_id) or self._closed:
            return None
        if (key.tenant, key.agent) in self._retention_agents:
            return None
        self._forget_old_requests()
        commit_time = self.clock.tick()
        receipt = MessageReceipt(0, commit_time, batch.token_estimates[0], batch.token_counts[0])
        params = {
            "tenant": key.tenant,
            "agent": key.agent,
            "scope": key.scope,
            "thread": key.thread,
            "request_id": record.request_id if record is not None else None,
            "models": models_text,
            "pending_kb": self._pending.limit_kb,
            "commit": commit_time,
            "role": int(message.role),
            "content": message.content,
            "tool_calls": message.tool_calls,
            "tool_call_id": message.tool_call_id,
            "external_id": message.external_id,
            "metadata": message.metadata,
            "token_estimate": receipt.token_estimate,
            "source_time_us": message.source_time_us,
            "token_count": receipt.token_count,
            "tokenizer": batch.tokenizer,
            "chars": batch.chars[0],
            "restored_from": batch.restored_from,
            # None: the database's trigger computes it (search_vector.py).
            "search_tsv": search_vectors(batch.messages)[0] if self._search_vectors else None,
            "tool": int(tool_result),
            "stored_bytes": stored_bytes(batch.messages),
            "method": record.method if record is not None else None,
            "fingerprint": RECEIPTS_RECORD + record.fingerprint if record is not None else None,
            "receipt_tail": receipt_tail(receipt),
            "record_time_us": self.clock.tick() if record is not None else None,
            "owed_key": owed_key_param(),
        }
        with self._pool.connection() as conn:
            conn.autocommit = True  # the statement is its own transaction
            try:
                row = first(conn, _ONE_STATEMENT_APPEND, params)
            except (
                pg_errors.DeadlockDetected,
                pg_errors.SerializationFailure,
                pg_errors.UniqueViolation,  # a concurrent attempt of the request committed
            ):
                return None
            finally:
                if conn.pgconn.transaction_status == pq.TransactionStatus.IDLE:
                    conn.autocommit = False
        owed = owed_key_check()
        if owed is not None:
            key_check_answered(owed, bool(row[5]))
        check_remembered(record, row[2:5])
        if row[0] is None:
            return None
        return [replace(receipt, id=int(row[0]), sequence=int(row[1]))]

    def append_many(
        self,
        parts: Sequence[tuple[ContextKey, MessageBatch]],
        record: RequestRecord | None = None,
    ) -> list[MessageReceipt]:
        """One transaction over every part; threads are locked in the order given
        (thread-name order), so two restores never wait on each other in a cycle."""

        def run(conn: Conn) -> list[MessageReceipt]:
            return [r for key, batch in parts for r in self._append(conn, key, batch, None)]

        if not parts:
            return []
        receipts = self._write(run, record)
        self._pending.appended(len(receipts))
        for key, batch in parts:
            self._appended_here(key, batch)
        return receipts

    def _append(
        self,
        conn: Conn,
        key: ContextKey,
        batch: MessageBatch,
        default_settings: AgentSettings | None,
        record: RequestRecord | None = None,
    ) -> list[MessageReceipt]:
        """Append one batch in `conn`'s transaction. With `record`, its request id is
        looked up in the first statement (AlreadyDone) and recorded in the last."""
        tenant = key.tenant
        n = len(batch)
        # Only what the append needs of the agent (not its prompt and docs, up to MiBs),
        # locked FOR KEY SHARE: a delete of the agent waits for this append.
        begun = first(
            conn,
            _BEGIN_APPEND,
            {
                "tenant": tenant,
                "request_id": record.request_id if record is not None else None,
                "agent": key.agent,
                "scope": key.scope,
                "thread": key.thread,
                "n": n,
                "pending_kb": self._pending.limit_kb,
            },
        )
        check_remembered(record, begun[0:3])
        agent = begun[3:6] if begun[3] is not None else None
        locked = begun[6:] if begun[6] is not None else None
        if agent is None:
            if default_settings is None:
                raise agent_missing(key.agent)
            conn.execute(
                INSERT_AGENT + " ON CONFLICT (tenant, name) DO NOTHING",
                agent_row(tenant, key.agent, default_settings, self.clock.tick()),
            )
            agent = first(conn, _LOCK_AGENT, [tenant, key.agent])
            if agent is None:  # deleted between the insert and the read: let the caller retry
                raise agent_missing(key.agent)
        model, agent_clear_us = str(agent[0]), int(agent[1])
        ttl_us = _ttl_of(str(agent[2]), key.scope)
        if "retention" in str(agent[2]):
            self._retention_agents.add((tenant, key.agent))
        else:
            self._retention_agents.discard((tenant, key.agent))
        if batch.tokenizer != _model_label(model) and batch.summarized_ids is None:
            raise StaleModel(model)
        if model not in self._label_models.get(batch.tokenizer, ((), ""))[0]:
            label = _model_label(model)
            models = (*self._label_models.get(label, ((), ""))[0], model)
            self._label_models[label] = (models, _text_array(models))
        row, ids = (tuple(locked[:7]), [int(i) for i in locked[7]]) if locked else (None, [])
        commit_time = 0  # stamped below, or here when this append creates the thread
        if row is None:
            if batch.summarized_ids is not None:
                # A summary stands for messages of an existing thread: if the thread is
                # gone, it must not bring the context back.
                raise thread_gone(key.agent, key.thread)
            # The thread begins with this append: its create time is this commit's.
            self.clock.advance_to(agent_clear_us)
            commit_time = self.clock.tick()
            created = first(
                conn,
                "INSERT INTO threads (tenant, context_id, agent, scope, thread, create_time_us, "
                "last_message_time_us, message_count, token_estimate, last_sequence) "
                "VALUES (%s, nextval('context_ids'), %s, %s, %s, %s, %s, 0, 0, 0) "
                "ON CONFLICT (tenant, agent, scope, thread) DO NOTHING "
                "RETURNING context_id",
                [tenant, key.agent, key.scope, key.thread, commit_time, commit_time],
            )
            if created is not None:
                row = (int(created[0]), 0, 0, None, 0, 0, 0)
            else:
                # Another replica created the thread meanwhile: lock and use it.
                row = first(conn, _LOCK_THREAD, [tenant, key.agent, key.scope, key.thread])
                assert row is not None
        context_id, last_sequence, last_time, last_clear, ordinal, tools, through = row
        # Commit times of a thread never go back, nor fall at or before a clear that
        # applies to it, whatever this replica's clock says.
        self.clock.advance_to(max(last_time, agent_clear_us, last_clear or 0))
        if last_time or not commit_time:
            commit_time = self.clock.tick()
        if ttl_us and last_sequence and last_time + ttl_us <= commit_time:
            # The thread expired before this append: nothing from before may reappear.
            conn.execute(
                "UPDATE threads SET last_clear_us = greatest(coalesce(last_clear_us, %s), %s), "
                "expired_through = greatest(expired_through, %s), "
                "outputs_expired_through_us = greatest(outputs_expired_through_us, %s) "
                "WHERE tenant = %s AND context_id = %s",
                [
                    *[min(last_time + ttl_us, commit_time - 1)] * 2,
                    last_sequence,
                    commit_time - ttl_us,  # its tool outputs old enough for the sweep now
                    tenant,
                    context_id,
                ],
            )
        if not ids:  # the thread was created above
            ids = [
                int(r[0])
                for r in conn.execute(
                    "SELECT nextval('message_ids') FROM generate_series(1, %s)", [n]
                ).fetchall()
            ]
        sequences = range(last_sequence + 1, last_sequence + 1 + n)
        groups, starts = self._groups(conn, tenant, context_id, ids, sequences, batch)
        summary = batch.summarized_ids
        # The running counts (schema version 9), while they are exact for this thread.
        exact = through == last_sequence
        ordinals: list[int | None] = [None] * n
        tool_totals: list[int | None] = [None] * n
        for i, message in enumerate(batch.messages):
            if summary is None:
                ordinal += 1
                tools += int(groups[i] >= 0 or message.role == Role.TOOL_RESULT)
            if exact:
                ordinals[i], tool_totals[i] = ordinal, tools
        vectors = search_vectors(batch.messages) if self._search_vectors else [None] * len(ids)
        rows = [
            (
                tenant,
                context_id,
                sequences[i],
                ids[i],
                int(message.role),
                message.content,
                message.tool_calls,
                message.tool_call_id,
                message.external_id,
                message.metadata,
                batch.token_estimates[i],
                commit_time,
                message.source_time_us,
                batch.token_counts[i],
                batch.tokenizer,
                batch.chars[i],
                groups[i],
                ",".join(batch.tool_call_ids[i]),
                summary is not None,
                summary[0] if summary else 0,
                summary[1] if summary else 0,
                batch.restored_from,
                starts[i],
                # None: the database's trigger computes it (search_vector.py).
                vectors[i],
                ordinals[i],
                tool_totals[i],
            )
            for i, message in enumerate(batch.messages)
        ]
        receipts = [
            MessageReceipt(i, commit_time, e, c, q)
            for i, e, c, q in zip(
                ids, batch.token_estimates, batch.token_counts, sequences, strict=True
            )
        ]
        sources = [m.source_time_us for m in batch.messages if m.source_time_us is not None]
        # The thread's counters, in one statement with what else remains: the row of a
        # one-message append (one INSERT, where COPY takes two round trips) and the
        # request record.
        ctes: list[str] = []
        params: list[Any] = []
        if n == 1:
            ctes.append(f"m AS ({_INSERT_MESSAGE})")
            params += rows[0]
        if record is not None:
            ctes.append(f"r AS (INSERT INTO request_records {RECORD_VALUES})")
            params += self._record_values(record, receipts)
        conn.execute(
            ("WITH " + ", ".join(ctes) + " " if ctes else "")
            + "UPDATE threads SET last_sequence = last_sequence + %s, "
            "message_count = message_count + %s, token_estimate = token_estimate + %s, "
            "last_message_time_us = %s, "
            "min_source_time_us = least(min_source_time_us, %s::bigint), "
            "stored_bytes = stored_bytes + %s, "
            "latest_summary_id = CASE WHEN %s THEN %s ELSE latest_summary_id END, "
            "ordinal_total = %s, tools_total = %s, "
            "totals_through = CASE WHEN %s THEN %s ELSE totals_through END "
            "WHERE tenant = %s AND context_id = %s",
            [
                *params,
                n,
                n,
                sum(batch.token_estimates),
                commit_time,
                min(sources) if sources else None,
                stored_bytes(batch.messages),
                summary is not None,
                ids[-1],
                ordinal,
                tools,
                exact,
                last_sequence + n,
                tenant,
                context_id,
            ],
        )
        if n > 1:
            # After the thread's row is written: schema version 14's trigger then finds
            # it written by this transaction and leaves it (one version of it, not two).
            with conn.cursor().copy(f"COPY messages ({_COPY_COLUMNS}) FROM STDIN") as copy:
                for values in rows:
                    copy.write_row(values)
        return receipts

    @staticmethod
    def _groups(
        conn: Conn,
        tenant: str,
        context_id: int,
        ids: list[int],
        sequences: range,
        batch: MessageBatch,
    ) -> tuple[list[int], list[int | None]]:
        """The tool group of each message (the id of the tool_use it belongs to, or -1)
        and that tool_use's sequence (None outside a group), recording the call ids this
        batch declares."""
        declared: dict[str, tuple[int, int]] = {}
        groups: list[int] = []
        starts: list[int | None] = []
        wanted = {
            m.tool_call_id
            for m, calls in zip(batch.messages, batch.tool_call_ids, strict=True)
            if not calls and m.role == Role.TOOL_RESULT and m.tool_call_id
        }
        known: dict[str, tuple[int, int | None]] = {}
        if wanted:
            known = {
                call: (message_id, sequence)
                for call, message_id, sequence in conn.execute(
                    "SELECT c.call_id, c.message_id, u.sequence FROM tool_calls c "
                    "LEFT JOIN messages u ON u.tenant = c.tenant AND u.id = c.message_id "
                    "WHERE c.tenant = %s AND c.context_id = %s AND c.call_id = ANY(%s)",
                    [tenant, context_id, list(wanted)],
                ).fetchall()
            }
        for message_id, sequence, message, calls in zip(
            ids, sequences, batch.messages, batch.tool_call_ids, strict=True
        ):
            if calls:
                for call_id in calls:
                    declared[call_id] = (message_id, sequence)
                groups.append(message_id)
                starts.append(sequence)
            elif message.role == Role.TOOL_RESULT and message.tool_call_id:
                call = message.tool_call_id
                group, start = declared.get(call) or known.get(call) or (-1, None)
                groups.append(group)
                starts.append(start)
            else:
                groups.append(-1)
                starts.append(None)
        if declared:
            with conn.cursor() as cur:
                cur.executemany(
                    "INSERT INTO tool_calls (tenant, context_id, call_id, message_id) "
                    "VALUES (%s, %s, %s, %s) ON CONFLICT (tenant, context_id, call_id) "
                    "DO UPDATE SET message_id = excluded.message_id",
                    [(tenant, context_id, c, i) for c, (i, _) in declared.items()],
                )
        return groups, starts

    def list_messages(
        self,
        where: ThreadFilter,
        window: WindowSpec | None,
        after: tuple[int, int] | None,
        limit: int,
    ) -> list[StoredMessage]:
        params: list[Any] = [where.tenant, where.agent, where.scope]
        thread_clause = ""
        if where.thread is not None:
            thread_clause = "AND t.thread = %s"
            params.append(where.thread)
        window_clause = ""
        if window is not None:
            predicate, window_params = window_predicate(window)
            window_clause = f"AND {predicate}"
            params += window_params
        if where.thread is not None:
            after_clause = "AND m.sequence > %s"
            params.append(after[0] if after is not None else 0)
            order = "m.sequence"
        else:
            after_time, after_id = after if after is not None else (-(2**63), -(2**63))
            after_clause = "AND (m.create_time_us, m.id) > (%s, %s)"
            params += [after_time, after_id]
            order = "m.create_time_us, m.id"
        params.append(limit)
        sql = f"""
            SELECT {SELECT_MESSAGES}
            FROM threads t JOIN messages m ON m.tenant = t.tenant AND m.context_id = t.context_id
            WHERE t.tenant = %s AND t.agent = %s AND t.scope = %s {thread_clause}
              {window_clause} {after_clause}
            ORDER BY {order}
            LIMIT %s
        """
        with self._reading() as conn:
            rows = conn.execute(sql, params).fetchall()
        return [message_from_row(r) for r in rows]

    def messages_by_ids(self, key: ContextKey, ids: Sequence[int]) -> list[StoredMessage]:
        if not ids:
            return []
        with self._reading() as conn:
            rows = conn.execute(
                f"SELECT {SELECT_MESSAGES} FROM threads t JOIN messages m "
                "ON m.tenant = t.tenant AND m.context_id + 0 = t.context_id "  # by id alone
                "WHERE t.tenant = %s AND t.agent = %s AND t.scope = %s AND t.thread = %s "
                "AND m.id = ANY(%s) ORDER BY m.create_time_us, m.id",
                [key.tenant, key.agent, key.scope, key.thread, list(ids)],
            ).fetchall()
        return [message_from_row(r) for r in rows]
