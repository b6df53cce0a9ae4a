"""Messages on PostgreSQL: the append transaction and the reads of messages.

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
"""

from __future__ import annotations

import functools
import json
import re
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import psycopg
import pyarrow as pa
from psycopg import errors as pg_errors
from psycopg import pq

from contextd.adapters.postgres.agents import AGENT_VERSION_OF_THREAD, INSERT_AGENT
from contextd.adapters.postgres.base import (
    KEY_STANDS,
    RECEIPTS_RECORD,
    RECORD_VALUES,
    Conn,
    PostgresBase,
    StatusArgs,
    agent_missing,
    check_remembered,
    first,
    owed_key_param,
    receipt_tail,
    thread_gone,
)
from contextd.adapters.postgres.message_cache import MESSAGE_TAG, MessageCache
from contextd.adapters.postgres.pending_list import PendingListMerger
from contextd.adapters.postgres.search_vector import search_vectors
from contextd.adapters.rows import MESSAGE_COLUMNS, agent_row, message_from_row
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
from contextd.ports.store import BuildReads, ContextRef, ThreadFilter, WindowBounds

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
_M_COLUMNS = ", ".join("m." + c.strip() for c in MESSAGE_COLUMNS.split(","))
# MESSAGE_COLUMNS names agent, scope and thread, which live in the thread's row here.
_SELECT_MESSAGES = (
    _M_COLUMNS.replace("m.agent", "t.agent")
    .replace("m.scope", "t.scope")
    .replace("m.thread", "t.thread")
)


# MESSAGE_COLUMNS without agent, scope and thread (positions 2 to 4), which a read of
# one thread's messages takes from its key.
_KEYLESS_MESSAGES = ", ".join(
    c for c in _M_COLUMNS.split(", ") if c not in ("m.agent", "m.scope", "m.thread")
)


# `window_messages_from`: every row's tag, whether the replica sent it (it holds that
# message at that version), and the columns of the others. The subquery (kept apart by
# OFFSET 0) computes each row's tag once; `m.*` there instead cost four times the time.
_WINDOW_MESSAGES = (
    "SELECT q.tag, q.held, "
    + ", ".join(
        f"CASE WHEN q.held THEN NULL ELSE q.{c[2:]} END" for c in _KEYLESS_MESSAGES.split(", ")
    )
    + f" FROM (SELECT {_KEYLESS_MESSAGES}, {MESSAGE_TAG} AS tag, "
    f"{MESSAGE_TAG} = ANY(string_to_array(%s, ' ')) AS held "
    "FROM messages m WHERE m.tenant = %s AND m.context_id = %s AND m.sequence >= %s "
    "AND m.id BETWEEN %s AND %s AND {predicate} AND NOT m.is_summary "
    "ORDER BY m.sequence OFFSET 0) q ORDER BY q.sequence"
)


def window_predicate(window: WindowSpec, thread_alias: str | None = "t") -> tuple[str, list[int]]:
    """The SQL of "message m is in the window": the same definition as the embedded
    engine's (see contextd.domain.window). With a threads alias, each thread's own clear
    marker applies where it is later than the window's."""
    if thread_alias:
        clear = f"greatest(%s::bigint, coalesce({thread_alias}.last_clear_us, %s::bigint))"
        params = [window.clear_after_us, window.clear_after_us]
    else:
        clear, params = "%s::bigint", [window.clear_after_us]
    sql = f"m.create_time_us > {clear} AND coalesce(m.source_time_us, m.create_time_us) > %s"
    params.append(window.age_after_us)
    if window.retains:
        # Retention compares with the thread's newest message, which its row (kept
        # current by every append) records.
        if thread_alias:
            row = f"{thread_alias}.{{}}"
        else:
            row = (
                "(SELECT x.{} FROM threads x WHERE x.tenant = m.tenant "
                "AND x.context_id = m.context_id)"
            )
        if window.expire_after_us is not None:
            sql += f" AND {row.format('last_message_time_us')} > %s"
            params.append(window.expire_after_us)
        if window.max_messages:
            sql += f" AND coalesce(m.group_start, m.sequence) > {row.format('last_sequence')} - %s"
            params.append(window.max_messages)
    return f"({sql})", params


# The columns `window_columns` reads, with the function that encodes each as binary.
_NARROW_COLUMNS = (
    ("int8send", "id"),
    ("int2send", "role"),
    ("int4send", "token_count"),
    ("int4send", "chars"),
    ("int8send", "group_id"),
    ("int8send", "sequence"),
)

# `window_bounds`: the thread's row; its oldest stored message (with message_count, holes
# show); the window's first message (the first commit after the window's bounds; commit
# times never go back within a thread) with the counts before it; the newest message's
# ordinal; the summary's last message, if in the thread, and the message after it.
_BOUNDS = (
    """
WITH s AS MATERIALIZED (
    -- by (tenant, id) alone: no plan may look for it along the thread
    SELECT m.context_id, m.sequence, m.ordinal, m.tools_total FROM messages m
    WHERE m.tenant = %s AND m.id = %s AND NOT m.is_summary
)
SELECT t.last_sequence, t.totals_through, t.message_count, t.min_source_time_us IS NULL,
       (SELECT min(x.sequence) FROM messages x
         WHERE x.tenant = t.tenant AND x.context_id = t.context_id),
       f.sequence, f.id, f.ordinal, f.tools_total - f.tool::int,
       (SELECT x.ordinal FROM messages x WHERE x.tenant = t.tenant
         AND x.context_id = t.context_id AND NOT x.is_summary
         ORDER BY x.sequence DESC LIMIT 1),
       s.sequence, s.ordinal, s.tools_total, a.id, a.sequence,
       g.context_id, g.ordinal, p.oldest_ordinal, p.ids, p.roles, p.tokens, p.chars, p.groups,
       p.sequences, p.ordinals, p.tools, p.tags, p.fresh, f.create_time_us
FROM threads t
LEFT JOIN LATERAL (
    SELECT m.sequence, m.id, m.ordinal, m.tools_total, m.create_time_us,
           (m.group_id >= 0 OR m.role = 4) AS tool
    FROM messages m
    WHERE m.tenant = t.tenant AND m.context_id = t.context_id
      AND m.create_time_us > %s AND NOT m.is_summary
    ORDER BY m.create_time_us, m.sequence LIMIT 1) f ON true
LEFT JOIN s ON s.context_id = t.context_id
LEFT JOIN LATERAL (
    SELECT m.id, m.sequence FROM messages m
    WHERE m.tenant = t.tenant AND m.context_id = t.context_id
      AND m.sequence > s.sequence AND NOT m.is_summary
    ORDER BY m.sequence LIMIT 1) a ON true
LEFT JOIN LATERAL (
    -- the first page: the newest rows of the window after the summary; with each row's
    -- tag, and the columns of those whose tag the replica did not send (message_cache.py)
    SELECT min(q.id) AS oldest_id, min(q.ordinal) AS oldest_ordinal, """
    + ", ".join(
        f"coalesce(string_agg({send}({column}), ''::bytea ORDER BY sequence DESC), "
        f"''::bytea) AS {name}"
        for send, column, name in (
            ("int8send", "id", "ids"),
            ("int2send", "role", "roles"),
            ("int4send", "token_count", "tokens"),
            ("int4send", "chars", "chars"),
            ("int8send", "group_id", "groups"),
            ("int8send", "sequence", "sequences"),
            ("int8send", "coalesce(ordinal, -1)", "ordinals"),
            ("int8send", "coalesce(tools_total, -1)", "tools"),
        )
    )
    + """,
           array_agg(q.tag ORDER BY q.sequence DESC) AS tags,
           json_agg(json_build_array(q.tag, """
    + ", ".join("q." + c[2:] for c in _KEYLESS_MESSAGES.split(", "))
    + """) ORDER BY q.sequence DESC) FILTER (WHERE NOT q.held) AS fresh
    -- each row's tag computed once (in q0), then looked up among those sent
    FROM (SELECT q0.*, q0.tag IN (SELECT unnest(string_to_array(%s, ' '))) AS held
          FROM (SELECT """
    + _KEYLESS_MESSAGES
    + """, m.chars, m.ordinal, m.tools_total, """
    + MESSAGE_TAG
    + """ AS tag
          FROM messages m
          WHERE m.tenant = t.tenant AND m.context_id = t.context_id AND NOT m.is_summary
            AND m.sequence >= CASE WHEN s.sequence >= f.sequence
                                   THEN coalesce(a.sequence, 9223372036854775807)
                                   ELSE f.sequence END
          ORDER BY m.sequence DESC LIMIT %s) q0) q) p ON true
LEFT JOIN LATERAL (
    -- the message `held` ids before the page's oldest, by (tenant, id) alone
    SELECT m.context_id, m.ordinal FROM messages m
    WHERE m.tenant = t.tenant
      AND m.id = p.oldest_id - least(%s, p.oldest_ordinal - f.ordinal)) g ON true
WHERE t.tenant = %s AND t.context_id = %s
"""
)

# Its results come in binary (the page's arrays are bytea: half the bytes of their hex
# text, and no decoding). Sent without its comments and runs of blanks: psycopg keeps its
# conversion of a query of at most 4,096 characters (this one is longer as written), and
# the server parses less.
_BOUNDS = " ".join(re.sub(r"--[^\n]*", "", _BOUNDS).split())

# `window_page`: the narrow columns and running counts of the newest rows of a range,
# newest first (see `_page_table`).
_PAGE = (
    "SELECT "
    + ", ".join(
        f"coalesce(string_agg({send}({column}), ''::bytea ORDER BY sequence DESC), ''::bytea)"
        for send, column in (
            *_NARROW_COLUMNS,
            ("int8send", "coalesce(ordinal, -1)"),
            ("int8send", "coalesce(tools_total, -1)"),
        )
    )
    + " FROM (SELECT id, role, token_count, chars, group_id, sequence, ordinal, tools_total "
    "FROM messages WHERE tenant = %s AND context_id = %s AND sequence >= %s AND sequence < %s "
    "AND NOT is_summary ORDER BY sequence DESC LIMIT %s) m"
)

_PAGE_IDS = (
    "SELECT coalesce(string_agg(int8send(id), ''::bytea ORDER BY sequence DESC), ''::bytea), "
    "coalesce(string_agg(int8send(sequence), ''::bytea ORDER BY sequence DESC), ''::bytea), "
    "coalesce(string_agg(int8send(coalesce(ordinal, -1)), ''::bytea ORDER BY sequence DESC), "
    "''::bytea) "
    "FROM (SELECT id, sequence, ordinal FROM messages WHERE tenant = %s AND context_id = %s "
    "AND sequence >= %s AND sequence < %s AND NOT is_summary ORDER BY sequence DESC LIMIT %s) m"
)

# `appended_messages`: the thread's rows after a sequence, whole, oldest first (one more
# than it takes, to tell that there are more).
_APPENDED = (
    f"SELECT m.chars, {_KEYLESS_MESSAGES} FROM messages m WHERE m.tenant = %s "
    "AND m.context_id = %s "
    "AND m.sequence > %s ORDER BY m.sequence LIMIT %s"
)
# The most appended rows a build takes to extend a window it keeps (past it, it reads the
# window afresh).
APPENDED_ROWS = 64
# `_APPENDED`'s read joined to the thread's read of a build (`context_ref`): a row per
# appended row (the thread's columns repeated), or one with these NULL.
_APPENDED_JOIN = (
    "LEFT JOIN LATERAL (SELECT * FROM messages x WHERE x.tenant = t.tenant "
    "AND x.context_id = t.context_id AND x.sequence > %s "
    # Outer alone: a filter once per thread row, so an unchanged thread probes nothing.
    "AND t.last_sequence > %s ORDER BY x.sequence LIMIT %s) x ON true "
)
_APPENDED_COLUMNS = "x.chars, " + ", ".join("x." + c[2:] for c in _KEYLESS_MESSAGES.split(", "))
_APPENDED_WIDTH = len(_APPENDED_COLUMNS.split(", "))

# `window_unread_orphans`: the open tool rows of the range (schema version 13), and the
# results in it whose call is before its start, which lie within the thread's tool_span
# rows of that start (none is looked for past MAX_TOOL_SPAN: the build reads it all).
_UNREAD_ORPHANS = """
SELECT t.tool_span,
       (SELECT coalesce(string_agg(int8send(u.id), ''::bytea ORDER BY u.sequence), ''::bytea)
        FROM (SELECT o.id, o.sequence FROM tool_open o
              WHERE o.tenant = t.tenant AND o.context_id = t.context_id
                AND o.sequence >= %(from)s AND o.sequence < %(before)s
              UNION
              SELECT m.id, m.sequence FROM messages m
              WHERE m.tenant = t.tenant AND m.context_id = t.context_id
                AND m.sequence >= %(from)s AND m.sequence < %(before)s
                AND m.sequence <= %(from)s + t.tool_span AND t.tool_span <= %(max_span)s
                AND m.role = 4 AND NOT m.is_summary AND m.group_id >= 0
                AND m.group_id <> m.id AND m.group_start < %(from)s) u)
FROM threads t WHERE t.tenant = %(tenant)s AND t.context_id = %(context)s
"""
# The farthest a result may lie after its call for `window_unread_orphans` to answer:
# past it, finding the results whose call is before a range costs a scan of that many rows.
MAX_TOOL_SPAN = 4_096

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
    # The page sizes (first_page, held) of this replica's last `window_bounds` read.
    _bounds_shape: tuple[int, int] | None = None
    # Runs of threads' ids this replica read, by (tenant, context_id): see `_page_ids`.
    _id_runs: dict[tuple[str, int], IdRun]
    _messages: MessageCache  # messages builds loaded, by thread (message_cache.py)
    # The windows `window_bounds` read, by (tenant, context_id): the thread row's version
    # it read them under and the run of the window's lower bound that selects the same
    # messages of that state (see `build_token`).
    _windows_seen: dict[tuple[str, int], WindowSeen]
    # The ref and summary's last id of each thread's last `window_bounds` call, by key:
    # what `_send_planned` sends the next build's bounds for.
    _bounds_guess: dict[ContextKey, tuple[ContextRef, int]]
    # The connections that prepared `_read_in_one`'s statement (in a pipeline, so that
    # its Parse went with its first run, not in a round trip of its own).
    _one_prepared: weakref.WeakSet[Conn]
    # Threads this replica appended to since its last build of them, by key, each with
    # how many plain messages those appends added, or more than APPENDED_ROWS once one
    # was not plain (see `_appended_here`).
    _moved_here: dict[ContextKey, int]
    # `build_token` names a state once this replica's reads saw it (ContextBuilder).
    tokens_after_reads = True

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
            SELECT {_SELECT_MESSAGES}
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
                f"SELECT {_SELECT_MESSAGES} FROM threads t JOIN messages m "
                "ON m.tenant = t.tenant AND m.context_id + 0 = t.context_id "  # by id alone
                "WHERE t.tenant = %s AND t.agent = %s AND t.scope = %s AND t.thread = %s "
                "AND m.id = ANY(%s) ORDER BY m.create_time_us, m.id",
                [key.tenant, key.agent, key.scope, key.thread, list(ids)],
            ).fetchall()
        return [message_from_row(r) for r in rows]

    # ----------------------------------------------------------------- what a build reads

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
            n = len(row) - _APPENDED_WIDTH
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
        return StatusArgs(
            key.tenant,
            key.agent,
            key.scope,
            reads.now_us,
            reads.status_entries,
            agent_window,
            reads.status_threads,
        )

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
        # afresh at each run, about 0.02 ms: it caches statements of 4 KB at most).
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
        self._send_status(
            conn,
            StatusArgs(
                key.tenant,
                key.agent,
                key.scope,
                reads.now_us,
                reads.status_entries,
                agent_window,
                reads.status_threads,
            ),
        )
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
        cursor = conn.execute(_BOUNDS, params, binary=True)
        match = (ref, window, summary_last, reads.first_page, reads.held)
        self._local.bounds = (match, cursor, tags)

    def _hot_build(self, reads: BuildReads, guess: ContextRef) -> bool:
        """Whether the build `reads` announces is likely one its reads sent ahead answer
        whole (so that `_send_planned` ends its snapshot with them): its builder keeps a
        window of the thread, and this replica saw the thread's window (read or extended
        it) at the ref it last read. A wrong guess costs the build a second snapshot
        (`SnapshotMoved`), never a wrong answer: the snapshot ends, and no read is made
        outside it."""
        return reads.kept and (_tenant(guess), guess.context_id) in self._windows_seen

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
                    for send, column in _NARROW_COLUMNS
                )
                + " FROM messages m "
                f"WHERE tenant = %s AND context_id = %s AND {predicate} AND NOT is_summary",
                [_tenant(context), context.context_id, *params],
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
                _WINDOW_MESSAGES.format(predicate=predicate),
                [
                    " ".join(held),
                    _tenant(context),
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
                row = conn.execute(_BOUNDS, params, binary=True).fetchone()
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
        page = _page_table(row[18:26]) if first_page else None
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
        self._windows_seen[(_tenant(context), context.context_id)] = WindowSeen(
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
        seen = self._windows_seen.get((_tenant(context), context.context_id))
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
            _APPENDED, [key.tenant, ref.context_id, after, APPENDED_ROWS + 1], binary=True
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
                    _APPENDED,
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
        seen = self._windows_seen.get((_tenant(context), context.context_id))
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
        """`_BOUNDS`'s parameters, and the cached messages whose tags they send."""
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
        cursor = conn.execute(_BOUNDS, params, binary=True)
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

    def window_page(
        self,
        context: ContextRef,
        from_sequence: int,
        before_sequence: int,
        limit: int,
        ids_only: bool = False,
    ) -> pa.Table:
        """Newest first by the primary key, at most `limit` rows, encoded as
        `window_columns` encodes them (one row of binary arrays, no object per row)."""
        if ids_only:
            ids = self._page_ids(context, from_sequence, before_sequence, limit)
            return pa.table({"id": pa.array(ids)})
        params = [_tenant(context), context.context_id, from_sequence, before_sequence, limit]
        with self._reading() as conn:
            row = first(conn, _PAGE, params)
        assert row is not None
        return _page_table(row)

    def _page_ids(
        self, context: ContextRef, from_sequence: int, before_sequence: int, limit: int
    ) -> npt.NDArray[np.int64]:
        """`window_page`'s ids alone (the held ids of what a build leaves out, up to
        10,000 of them), through this replica's cache of runs of a thread's ids: a run
        read once (every non-summary message between two sequences) stays true while
        its messages are stored, and a window `window_bounds` answered has none deleted
        inside it, so only the part after the run (what was appended since) is read."""
        if before_sequence >= _OPEN_END:  # no end to the range: nothing to keep
            return self._read_page_ids(context, from_sequence, before_sequence, limit)[1]
        key = (_tenant(context), context.context_id)
        run = self._id_runs.get(key)
        below = run is not None and run.low > from_sequence
        if run is not None and below and run.low <= before_sequence <= run.high:
            have = run.count_in(run.low, before_sequence)
            if have < limit:  # the newest `limit` reach below the run: read only those
                older = self._extend_run_down(context, key, run, from_sequence, limit - have)
                return np.concatenate([older, run.newest(run.low, before_sequence, have)])
        if run is not None and below and run.count_in(run.low, before_sequence) < limit:
            run = None  # the newest `limit` reach below the run
        if run is not None and before_sequence <= run.high:
            return run.newest(from_sequence, before_sequence, limit)
        low = from_sequence if run is None else max(from_sequence, run.high)
        seqs, ids, ordinals = self._read_page_ids(context, low, before_sequence, limit)
        # What was read is every message of [`low`, before) when fewer than `limit`
        # came, else of [its oldest's sequence, before).
        covered = low if len(ids) < limit else int(seqs[0])
        if run is not None and covered <= run.high and len(ids) < limit:
            run = run.extended(seqs, ids, ordinals, before_sequence)
        else:
            run = IdRun(covered, before_sequence, seqs, ids, ordinals)
        if len(self._id_runs) >= ID_RUN_THREADS and key not in self._id_runs:
            self._id_runs.clear()
        self._id_runs[key] = run
        return run.newest(from_sequence, before_sequence, limit)

    def _extend_run_down(
        self,
        context: ContextRef,
        key: tuple[str, int],
        run: IdRun,
        from_sequence: int,
        missing: int,
    ) -> npt.NDArray[np.int64]:
        """The newest `missing` ids of [`from_sequence`, the run's start), read: the run
        grows down by them (unless that would pass ID_RUN_SIZE: then it is left as it
        was), instead of being read again whole."""
        seqs, ids, ordinals = self._read_page_ids(context, from_sequence, run.low, missing)
        covered = from_sequence if len(ids) < missing else int(seqs[0])
        if len(ids) + len(run.ids) <= ID_RUN_SIZE:
            self._id_runs[key] = IdRun(
                covered,
                run.high,
                np.concatenate([seqs, run.sequences]),
                np.concatenate([ids, run.ids]),
                np.concatenate([ordinals, run.ordinals]),
            )
        return ids

    def _read_page_ids(
        self, context: ContextRef, from_sequence: int, before_sequence: int, limit: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Sequences, ids and ordinals (-1: none stored) of the newest `limit` messages of
        the range, ascending."""
        params = [_tenant(context), context.context_id, from_sequence, before_sequence, limit]
        with self._reading() as conn:
            row = first(conn, _PAGE_IDS, params)
        assert row is not None
        ids, seqs, ordinals = (
            np.frombuffer(bytes(v), ">i8")[::-1].astype(np.int64) for v in row[:3]
        )
        return seqs, ids, ordinals

    def window_ordinal(self, context: ContextRef, message_id: int) -> int | None:
        """One index lookup, or none when this replica's run of the thread's ids (see
        `_page_ids`) spans the id: ids grow along a thread, so when the run does not
        hold it, no message of it has that id (a thread written in turns with others);
        when it does, the run holds its ordinal too (written with the message, never
        changed after: only the migration that added the column filled it in)."""
        run = self._id_runs.get((_tenant(context), context.context_id))
        if run is not None and len(run.ids) and run.ids[0] <= message_id <= run.ids[-1]:
            at = int(np.searchsorted(run.ids, message_id))
            if int(run.ids[at]) != message_id:
                return None
            if int(run.ordinals[at]) >= 0:
                return int(run.ordinals[at])
        with self._reading() as conn:
            row = first(  # by (tenant, id) alone: no plan may look for it along the thread
                conn,
                "SELECT context_id, ordinal FROM messages WHERE tenant = %s AND id = %s "
                "AND NOT is_summary",
                [_tenant(context), message_id],
            )
        if row is None or row[0] != context.context_id or row[1] is None:
            return None
        return int(row[1])

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
                _UNREAD_ORPHANS,
                {
                    "tenant": _tenant(context),
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
                f"SELECT {_SELECT_MESSAGES} FROM messages m JOIN threads t "
                "ON t.tenant = m.tenant AND t.context_id = m.context_id "
                "WHERE m.tenant = %s AND m.id = %s AND m.context_id + 0 = %s",  # by id alone
                [_tenant(context), context.latest_summary_id, context.context_id],
            )
        return message_from_row(row) if row else None


_OPEN_END = 2**61
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


def _ref_sql(appended: bool) -> str:
    """`context_ref`'s statement: the thread's row, its latest summary and its agent's
    row version, and with `appended` the rows appended after a sequence (parameters:
    that sequence twice and a row limit, then the thread's key)."""
    columns, join = (", " + _APPENDED_COLUMNS, _APPENDED_JOIN) if appended else ("", "")
    return (
        "SELECT t.context_id, t.last_clear_us, t.latest_summary_id, "
        f"({AGENT_VERSION_OF_THREAD}), t.xmin::text || ':' || t.ctid::text, "
        "t.rewrites, t.last_sequence, t.message_count, t.min_source_time_us IS NULL, "
        f"{_SELECT_MESSAGES}{columns} "
        # By (tenant, id) alone (`+ 0` keeps the thread's key out of the index
        # condition): a plan along the thread's primary key scanned all of it.
        "FROM threads t LEFT JOIN messages m ON m.tenant = t.tenant "
        f"AND m.context_id + 0 = t.context_id AND m.id = t.latest_summary_id {join}"
        "WHERE t.tenant = %s AND t.agent = %s AND t.scope = %s AND t.thread = %s"
    )


_REF_SQL = {False: _ref_sql(False), True: _ref_sql(True)}
# Its columns: the thread's nine, a message's, and the appended rows'.
_REF_WIDTH = {
    False: 9 + len(_SELECT_MESSAGES.split(", ")),
    True: 9 + len(_SELECT_MESSAGES.split(", ")) + _APPENDED_WIDTH,
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


def window_after(window: WindowSpec) -> int:
    """The commit time a window's messages are after, in a thread with no source_time."""
    return max(window.clear_after_us, window.age_after_us)


# Threads whose run of ids a replica keeps (each at most about HELD_DROPPED_IDS ids and
# their sequences, 160 KB); past this many, the cache starts over.
ID_RUN_THREADS = 256


@dataclass(frozen=True, slots=True)
class IdRun:
    """Every non-summary message of a thread with `low <= sequence < high`: sequences,
    ids and ordinals (-1 where none is stored), ascending (see
    `MessagesMixin._page_ids`)."""

    low: int
    high: int
    sequences: npt.NDArray[np.int64]
    ids: npt.NDArray[np.int64]
    ordinals: npt.NDArray[np.int64]

    def count_in(self, low: int, high: int) -> int:
        a, b = np.searchsorted(self.sequences, [low, high])
        return int(b - a)

    def newest(self, low: int, high: int, limit: int) -> npt.NDArray[np.int64]:
        """The ids of the newest `limit` messages with low <= sequence < high (the run
        must hold them: it covers [low, high), or `limit` of them within it)."""
        a, b = (int(i) for i in np.searchsorted(self.sequences, [low, high]))
        return self.ids[max(a, b - limit) : b]

    def extended(
        self,
        sequences: npt.NDArray[np.int64],
        ids: npt.NDArray[np.int64],
        ordinals: npt.NDArray[np.int64],
        high: int,
    ) -> IdRun:
        """This run and every message from its end up to `high` (`sequences`, `ids`,
        `ordinals`), keeping at most the newest ID_RUN_SIZE."""
        seqs = np.concatenate([self.sequences, sequences])
        every = np.concatenate([self.ids, ids])
        ordinals = np.concatenate([self.ordinals, ordinals])
        if len(seqs) > ID_RUN_SIZE:
            cut = len(seqs) - ID_RUN_SIZE
            return IdRun(int(seqs[cut]), high, seqs[cut:], every[cut:], ordinals[cut:])
        return IdRun(self.low, high, seqs, every, ordinals)


# The most ids a run holds (a build asks at most HELD_DROPPED_IDS, with some to spare as
# the thread grows).
ID_RUN_SIZE = 16_384


def _tenant(context: ContextRef) -> str:
    assert context.key is not None, "a PostgreSQL ContextRef carries its key"
    return context.key.tenant


def _page_table(row: Sequence[Any]) -> pa.Table:
    """A page's binary arrays (see `_PAGE`) as the Arrow table `window_page` returns.
    They come newest first, the order the rows are read in along the primary key, so
    PostgreSQL aggregates them without a sort; each column is reversed here."""
    ids, roles, tokens, chars, groups, sequences, ordinals, tools = (bytes(v) for v in row)
    return pa.table(
        {
            "id": pa.array(np.frombuffer(ids, ">i8")[::-1].astype(np.int64)),
            "role": pa.array(np.frombuffer(roles, ">i2")[::-1].astype(np.uint8)),
            "token_count": pa.array(np.frombuffer(tokens, ">i4")[::-1].astype(np.uint64)),
            "chars": pa.array(np.frombuffer(chars, ">i4")[::-1].astype(np.uint64)),
            "group_id": pa.array(np.frombuffer(groups, ">i8")[::-1].astype(np.int64)),
            "sequence": pa.array(np.frombuffer(sequences, ">i8")[::-1].astype(np.int64)),
            "ordinal": pa.array(np.frombuffer(ordinals, ">i8")[::-1].astype(np.int64)),
            "tools_total": pa.array(np.frombuffer(tools, ">i8")[::-1].astype(np.int64)),
        }
    )
